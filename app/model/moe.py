"""Mixture of experts: gate (sqrtsoftplus, bias or hash selection), routed + shared experts.

Routed experts are held either as per-expert dequantized :class:`Expert` s (``experts.E.w1``,
checkpoint names) or, for fp8 / fp4 checkpoints, as one :class:`PackedExperts` per layer: the
checkpoint's bytes stacked for the MegaMoE kernels (``kernels.moe.moe_fp8`` / ``moe_fp4``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from app.model.ep import EPGroup, ExpertPlacement, ExpertShard, ep_moe, pair_slots
from app.model.layers import Linear, StackingModule, stack_problem, stacked_projection
from kernels.gate import moe_gate_fused
from kernels.moe import moe_fp4, moe_fp8, moe_fp8_rows
from kernels.moe_decode import row_refs
from kernels.moe_formats import fp4_from_pairs, fp4_to_fp8_rows, fp4_to_pairs
from kernels.moe_ref import moe_experts
from kernels.moe_tiles import rows_per_expert
from kernels.quant import is_e8m0
from kernels.swiglu import swiglu_halves

PackedFormat = Literal["fp8", "fp4"]
Fp4Layout = Literal["mx", "pairs", "fp8_rows"]
FP4_LAYOUTS: tuple[str, ...] = ("mx", "pairs", "fp8_rows")
PREFILL_ROWS = 96  # rows per local expert above which a step counts as prefill (128-row tiles)
FP4_GROUP = 32  # packed fp4: one e8m0 scale per 32 values of a row (what the kernels read)
_KERNEL_ALIGN = 32  # the MegaMoE kernels tile d and I in multiples of 32


class Gate(nn.Module):
    """Router: ``weight`` [E, d] (fp32 logits); ``bias`` [E] selection bias, or ``tid2eid``
    [vocab, k] for V4 hash layers; V4.1 ``bias_vl`` [E] for image tokens."""

    def __init__(
        self,
        d: int,
        n_experts: int,
        k: int,
        route_scale: float,
        *,
        hash_vocab: int = 0,
        has_bias_vl: bool = False,
    ):
        super().__init__()
        self.k, self.route_scale = k, route_scale
        self.weight = nn.Parameter(torch.empty(n_experts, d, dtype=torch.float32))
        if hash_vocab:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, k, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        if has_bias_vl:
            self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [T, k], weights [T, k] fp32)."""
        hash_idx = self.tid2eid[token_ids] if self.bias is None else None
        return moe_gate_fused(x, self.weight, self.bias, self.k, self.route_scale, hash_idx)


class Expert(StackingModule):
    """``W2(silu(min(W1 x, L)) * clamp(W3 x, +-L))``.

    W1 and W3 run as one GEMM over their stacked weights ``[W1; W3]``
    (:func:`~app.model.layers.stacked_projection`: the parameters become views of it, no
    second copy), and one kernel applies the clamped SwiGLU to the two halves: two launches
    where there were six. fp8 projections kept as stored (``packed_dense``) stack the same
    way -- bytes and scale rows -- into one :class:`Fp8Linear` when their scale blocks do not
    straddle the seam; else two GEMMs."""

    def __init__(self, d: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(d, inter), Linear(inter, d), Linear(d, inter)

    @property
    def stackable(self) -> bool:
        """W1 and W3 have one shape and stack (:func:`stack_problem`)."""
        return stack_problem((self.w1, self.w3), same_shape=True) is None

    def stacked_w13(self) -> nn.Module | None:
        """``[W1; W3]`` as one projection (a :class:`Linear`, or :class:`Fp8Linear` for fp8
        parts), None when they do not stack: made once, again only if a weight was replaced
        since."""
        return stacked_projection(self, "_w13", (self.w1, self.w3), same_shape=True)

    def stack_projections(self) -> bool:
        """Stack W1 / W3 now (:func:`~app.model.layers.stack_projections`) -> whether they run
        stacked."""
        return self.stacked_w13() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13 = self.stacked_w13()  # None: fp8 scale blocks straddle the seam, two GEMMs
        h13 = w13(x) if w13 is not None else torch.cat((self.w1(x), self.w3(x)), dim=-1)
        return self.w2(swiglu_halves(h13, self.limit))


def packing_problem(fmt: PackedFormat, d: int, inter: int, block: tuple[int, int]) -> str | None:
    """Why experts of hidden size ``d`` and width ``inter`` cannot run in the MegaMoE kernels
    (same checks as ``moe_fp8_triton`` / ``moe_fp4_triton``), or None when they can.

    fp8: ``block`` (b0, b1) is the weight block, the same for W1, W3 and W2, and b0 must divide
    I (W1 and W3 scale rows are stacked). fp4: ``block`` is (1, columns per scale) = (1, 32).
    """
    if d % _KERNEL_ALIGN or inter % _KERNEL_ALIGN:
        return f"hidden size {d} and expert width {inter} must be multiples of {_KERNEL_ALIGN}"
    if fmt == "fp8" and inter % block[0]:
        return f"expert width {inter} is not a multiple of the fp8 block rows {block[0]}"
    if fmt == "fp4" and block != (1, FP4_GROUP):
        return f"fp4 scales cover {block[1]} columns each, the kernels need {FP4_GROUP}"
    return None


class PackedExperts(nn.Module):
    """One layer's routed experts as stored in the checkpoint, stacked (no dequantized copy).

    Buffers (expert ``offset + i`` is row ``i``; n_local = ``w13.shape[0]``):

        fp8   w13 [n, 2I, d]   e4m3   s13 [n, 2I/b0, d/b1]   (W1 rows, then W3 rows)
              w2  [n, d, I]    e4m3   s2  [n, d/b0, I/b1]
        fp4   w13 [n, 2I, d/2] int8   s13 [n, 2I, d/32]      (even column in the low nibble)
              w2  [n, d, I/2]  int8   s2  [n, d, I/32]

    fp4 weights may be repacked (:meth:`repack`, the loader does it on CUDA) to the *pairs*
    layout of ``kernels.moe_formats.fp4_to_pairs``: w13 [n, I, d], w2 [n, d/2, I], one byte =
    the same column of two rows (W1 and W3; W2's rows r and r + d/2), which the CUDA kernels
    dequantize without shuffles; the scales keep their shapes. Or to the *fp8 rows* layout of
    ``kernels.moe_formats.fp4_to_fp8_rows`` (the prefill layout, twice the bytes): e4m3 w13
    [n, 2I, d] and w2 [n, d, I] with one fp32 scale per row, s13 [n, 2I] and s2 [n, d]; the
    same weights exactly (a layer whose rows are not all exact refuses it). There, with
    ``prefill_act_fp8``, steps of more than ``PREFILL_ROWS`` rows per local expert multiply fp8
    activations (one scale per token row) on the fp8 tensor cores; decode-sized steps keep bf16
    activations. ``layout`` says which.

    Scales are e8m0 (``float8_e8m0fnu``) or fp32. On CUDA the Triton MegaMoE kernels dequantize
    in registers; on CPU the kernels' torch reference dequantizes per call. Experts outside
    ``[offset, offset + n_local)`` contribute nothing (expert parallelism sums over ranks).
    """

    def __init__(
        self,
        w13: torch.Tensor,
        s13: torch.Tensor,
        w2: torch.Tensor,
        s2: torch.Tensor,
        fmt: PackedFormat,
        block: tuple[int, int],
        limit: float,
        local_expert_offset: int = 0,
    ):
        super().__init__()
        if fmt not in ("fp8", "fp4"):
            raise ValueError(f"packed experts are 'fp8' or 'fp4', got {fmt!r}")
        want = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
        if w13.dtype != want or w2.dtype != want:
            raise ValueError(f"{fmt} experts must be {want}, got {w13.dtype} / {w2.dtype}")
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0] or w13.shape[1] % 2:
            raise ValueError(f"stacked experts expected: {tuple(w13.shape)} {tuple(w2.shape)}")
        if local_expert_offset < 0:
            raise ValueError(f"local_expert_offset must be >= 0, got {local_expert_offset}")
        pack = 2 if fmt == "fp4" else 1
        n, inter, d = w13.shape[0], w13.shape[1] // 2, w13.shape[2] * pack
        if tuple(w2.shape) != (n, d, inter // pack):
            raise ValueError(f"w2 {tuple(w2.shape)} does not fit w13 {tuple(w13.shape)}")
        problem = packing_problem(fmt, d, inter, block)
        if problem is not None:
            raise ValueError(problem)
        b0, b1 = block
        want13 = (n, -(-2 * inter // b0), -(-d // b1))
        want2 = (n, -(-d // b0), -(-inter // b1))
        if tuple(s13.shape) != want13 or tuple(s2.shape) != want2:
            raise ValueError(
                f"scales {tuple(s13.shape)} {tuple(s2.shape)}, expected {want13} {want2}"
            )
        self.fmt, self.block, self.limit = fmt, block, limit
        self.hidden = d
        self.layout: Fp4Layout = "mx"
        self.prefill_act_fp8 = False
        self.local_expert_offset = local_expert_offset
        self.register_buffer("w13", w13)
        self.register_buffer("s13", s13)
        self.register_buffer("w2", w2)
        self.register_buffer("s2", s2)
        # per-row reference exponents of the scales (kernels.moe_decode) in the pairs layout,
        # when they make its fp16 products exact: decode steps then run its GEMMs
        self.register_buffer("r13", None, persistent=False)
        self.register_buffer("r2", None, persistent=False)

    @property
    def can_pair(self) -> bool:
        """Whether these experts can take the pairs layout (fp4, d a multiple of 64)."""
        return self.fmt == "fp4" and self.hidden % 64 == 0

    def repack(self, layout: Fp4Layout) -> None:
        """Hold the fp4 weights in ``layout`` ("mx": the checkpoint's; "pairs": the CUDA
        kernels' fast one, which needs d % 64 == 0; "fp8_rows": the prefill layout). mx and
        pairs convert in place, one expert at a time (an expert has the same bytes in both),
        so loading never holds two copies; fp8_rows needs twice the bytes and is one way
        (ValueError, layer unchanged but for pairs -> mx, when a row is not exact)."""
        if self.fmt != "fp4":
            raise ValueError(f"only fp4 experts have layouts, these are {self.fmt}")
        if layout not in FP4_LAYOUTS:
            raise ValueError(f"fp4 layouts are {FP4_LAYOUTS}, got {layout!r}")
        if layout == "pairs" and not self.can_pair:
            raise ValueError(f"the pairs layout needs d % 64 == 0, d = {self.hidden}")
        if layout == self.layout:
            return
        if self.layout == "fp8_rows":
            raise ValueError("the fp8 rows layout does not convert back (reload the layer)")
        if layout == "fp8_rows":
            self._to_fp8_rows()
            return
        conv = fp4_to_pairs if layout == "pairs" else fp4_from_pairs
        for name in ("w13", "w2"):
            w = getattr(self, name).contiguous()
            r, c = w.shape[1:]
            out = w.view(w.shape[0], *((r // 2, 2 * c) if layout == "pairs" else (2 * r, c // 2)))
            for e in range(w.shape[0]):  # conv reads all of expert e before it is overwritten
                out[e] = conv(w[e])
            setattr(self, name, out)
        self.layout = layout
        self.r13 = self.r2 = None
        if layout == "pairs" and is_e8m0(self.s13) and is_e8m0(self.s2):
            (r13, ok13), (r2, ok2) = row_refs(self.s13), row_refs(self.s2)
            if ok13 and ok2:  # else the decode kernel's fp16 products would not be exact
                self.r13, self.r2 = r13, r2

    @property
    def row_refs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode kernel's row references (pairs layout, exact scales), else None."""
        return None if self.r13 is None or self.r2 is None else (self.r13, self.r2)

    def _to_fp8_rows(self) -> None:
        self.repack("mx")
        out: dict[str, torch.Tensor] = {}
        for wn, sn in (("w13", "s13"), ("w2", "s2")):
            w, s = getattr(self, wn), getattr(self, sn)
            q = torch.empty(*w.shape[:2], 2 * w.shape[2], dtype=torch.float8_e4m3fn,
                            device=w.device)  # fmt: skip
            r = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q[e], r[e], exact = fp4_to_fp8_rows(w[e], s[e])
                if not bool(exact.all()):
                    raise ValueError(
                        f"{wn} of local expert {e}: {int((~exact).sum())} rows whose 32-column "
                        "scales span more than 14 binades are not exact in e4m3 with one "
                        "scale per row"
                    )
            out[wn], out[sn] = q, r
        for name, t in out.items():
            setattr(self, name, t)
        self.layout = "fp8_rows"

    @property
    def n_local(self) -> int:
        """Experts held here: global ids ``[local_expert_offset, local_expert_offset + n)``."""
        return self.w13.shape[0]

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        n_experts: int | None = None,
        out_dtype: torch.dtype | None = None,
        act_group: int = 0,
    ) -> torch.Tensor:
        """``x`` [T, d], ``ids`` / ``weights`` [T, k] (global expert ids out of ``n_experts``,
        which sizes the kernels' tiles; default: all local) -> [T, d] in ``out_dtype``
        (default ``x.dtype``); ``act_group``: x and H rounded as the release rounds them
        (:attr:`MoE.act_group`)."""
        x = x.contiguous()
        off = self.local_expert_offset
        kw = {"n_experts": n_experts, "out_dtype": out_dtype, "act_group": act_group}
        if self.fmt == "fp8":
            return moe_fp8(x, ids, weights, self.w13, self.s13, self.w2, self.s2, self.block,
                           self.limit, off, **kw)  # fmt: skip
        if self.layout == "fp8_rows":
            n_all = n_experts or self.n_local
            act8 = self.prefill_act_fp8 and (
                rows_per_expert(ids.numel(), self.n_local, n_all) > PREFILL_ROWS
            )
            return moe_fp8_rows(x, ids, weights, self.w13, self.s13, self.w2, self.s2,
                                self.limit, off, act_fp8=act8, **kw)  # fmt: skip
        return moe_fp4(x, ids, weights, self.w13, self.s13, self.w2, self.s2, self.limit, off,
                       pairs=self.layout == "pairs", row_refs=self.row_refs, **kw)  # fmt: skip

    def extra_repr(self) -> str:
        layout = f", layout={self.layout}" if self.fmt == "fp4" else ""
        if self.layout == "fp8_rows" and self.prefill_act_fp8:
            layout += ", prefill_act_fp8"
        return (f"{self.fmt}{layout}, block={self.block}, n_local={self.n_local}, "
                f"offset={self.local_expert_offset}, limit={self.limit}")  # fmt: skip


class MoE(nn.Module):
    """``sum_k w_k expert_{e_k}(x) + shared(x)``.

    ``experts`` is built as a ModuleList of :class:`Expert`; the loader may swap it for a
    :class:`PackedExperts` (fp8 / fp4 checkpoints), which ``forward`` then runs.

    ``act_group`` (set by the loader under ``expert_act="fp8"``; 0: off): the routed
    experts' activations -- x before W1 / W3 and the SwiGLU output before W2 -- rounded as
    the release rounds a quantized GEMM's input (``kernels.fp8_act``, per token in groups of
    that many columns); the shared expert's are its projections' (``Linear.act_group``).

    Expert parallelism (``shard``: the expert ids this rank holds, in slot order):
    ``experts`` is a ModuleDict keyed by global expert id (the checkpoint's names), or the
    packed experts of those slots; after :meth:`set_ep` the routed part runs
    :func:`app.model.ep.ep_moe` over the gang.
    """

    def __init__(
        self,
        d: int,
        inter: int,
        n_experts: int,
        k: int,
        route_scale: float,
        limit: float,
        *,
        hash_vocab: int = 0,
        has_bias_vl: bool = False,
        shard: ExpertShard | None = None,
    ):
        super().__init__()
        self.limit = limit
        self.gate = Gate(
            d, n_experts, k, route_scale, hash_vocab=hash_vocab, has_bias_vl=has_bias_vl
        )
        self.local_experts = shard.local if shard is not None else None
        self.slot_offset = shard.offset if shard is not None else 0  # packed experts' offset
        self.experts: nn.ModuleList | nn.ModuleDict | PackedExperts
        if shard is None:
            self.experts = nn.ModuleList(Expert(d, inter, limit) for _ in range(n_experts))
        else:
            self.experts = nn.ModuleDict({str(e): Expert(d, inter, limit) for e in shard.local})
        self.shared_experts = Expert(d, inter, limit)
        self.ep: EPGroup | None = None
        self.act_group = 0

    def set_ep(self, placement: ExpertPlacement, group: EPGroup) -> None:
        """Run the routed experts over ``group`` (this layer holds ``placement.local(rank)``)."""
        held = self.local_experts or tuple(range(self.gate.weight.shape[0]))  # None: all
        where = (placement.local(group.rank), placement.offset(group.rank))
        if (held, self.slot_offset) != where:
            raise ValueError(f"this layer holds experts {held}, the placement "
                             f"gives rank {group.rank} {placement.local(group.rank)}")  # fmt: skip
        self.ep, self._placement = group, placement
        self._routes = placement.routes(group.rank, self.gate.weight.device)

    def _local(
        self, rows: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``sum_j w_j expert(row)`` over the slots of ``slots`` [R, k] this rank holds (the
        others contribute nothing) -> [R, d] in ``dtype``."""
        if rows.shape[0] == 0:
            return rows.new_zeros(rows.shape, dtype=dtype)
        if isinstance(self.experts, PackedExperts):  # its offset is this rank's first slot
            return self.experts(rows, slots, w, len(self._placement.slots), dtype,
                                self.act_group)  # fmt: skip
        local = list(self.experts.values())  # slot order; index len(local): not held here
        off, n = self.slot_offset, len(local)
        held = (slots >= off) & (slots < off + n)
        return moe_experts(
            rows, torch.where(held, slots - off, n), w,
            [e.w1.weight for e in local] + [None], [e.w2.weight for e in local] + [None],
            [e.w3.weight for e in local] + [None], self.limit, out_dtype=dtype,
            act_group=self.act_group,
        )  # fmt: skip

    def _ep_routed(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert self.ep is not None
        slots = pair_slots(ids, self._routes)
        per = self._placement.slots_per_rank
        return ep_moe(x, slots, w, per, self.ep, self._local)

    def idle(self, x: torch.Tensor) -> None:
        """This layer's exchange with no tokens of its own (an idle rank of a gang serves
        the others' tokens); ``x`` gives dtype and device."""
        k = self.gate.k
        empty = torch.zeros(0, k, dtype=torch.int64, device=x.device)
        self._ep_routed(x.new_zeros(0, x.shape[-1]), empty, empty.float())

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x, token_ids)
        if self.ep is not None:
            return self._ep_routed(x, ids, w) + self.shared_experts(x)
        if isinstance(self.experts, PackedExperts):
            n_experts = self.gate.weight.shape[0]
            routed = self.experts(x, ids, w, n_experts, act_group=self.act_group)
            return routed + self.shared_experts(x)
        routed = moe_experts(
            x, ids, w,
            [e.w1.weight for e in self.experts],
            [e.w2.weight for e in self.experts],
            [e.w3.weight for e in self.experts],
            self.limit, act_group=self.act_group,
        )  # fmt: skip
        return routed + self.shared_experts(x)
