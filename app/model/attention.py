"""Attention for every layer mode over the paged cache, all sequences of a step at once.

Per query token t the key set is the window ``{t-W+1..t}`` of this layer's own latent KV plus
compressed entries: the top-k selected ones (V4 CSA, V4.1 Full/Reindex/Reuse) or every visible
one (V4 HCA, ``w < (t+1)//ratio``). The kernel reads two key sources in place:

    source 1  window rows: the layer's ring (decode) or the step pool [new KV | stored rows]
    source 2  compressed entries: the KV-owning layer's paged pool, rows via the block table

Writes go through scatter rows computed once per step (``app.model.attn_meta``): window KV
into the ring, completed compressor groups into the entry / index-key pools, projections of
not-yet-complete groups into the tail ring. No Python loop over sequences, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from app.model.attn_meta import StepMeta
from app.model.compressor import Compressor, Compressor41, CompressorV4
from app.model.config import LayerMode, LayerSpec, ModelConfig
from app.model.forward_batch import ForwardBatch
from app.model.indexer import Indexer, candidate_blocks
from app.model.kv_store import KVRows
from app.model.layers import Linear, RMSNorm, StackingModule, stacked_projection
from app.model.rope import Rotary, apply_rope
from kernels.attention import sparse_attention
from kernels.indexer import indexer_scores_paged
from kernels.invariant import grouped_linear
from kernels.kv_quant import kv_qdq
from kernels.norm import norm_rope, norm_rope_pair, rms_norm_ref
from kernels.topk import topk


@dataclass
class CompressedState:
    """Selection state of one step shared across layers, keyed by the computing layer id:
    ``topk`` [T, k] selected pool rows (-1 empty), ``cand`` [T, C] V4.1 candidate masks."""

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    cand: dict[int, torch.Tensor] = field(default_factory=dict)

    def subset(self, keep: torch.Tensor) -> CompressedState:
        """The state of the rows ``keep`` (decoder replay)."""
        return CompressedState(
            {k: v[keep] for k, v in self.topk.items()}, {k: v[keep] for k, v in self.cand.items()}
        )


class Attention(StackingModule):
    """MLA-style single-latent attention with sink, partial RoPE, grouped low-rank output."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, kv_quant: bool = False):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        # Round KV like the released V4.1 cache formats (fp8 window, nvfp4 compressed,
        # mxfp4 index q/k); off = exact arithmetic. The batched step stores the packed
        # formats (the cache allocates them), the reference rounds in place.
        self.kv_quant = kv_quant and cfg.is_v41
        H, D, d = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.n_heads, self.head_dim, self.window = H, D, cfg.sliding_window
        self.wq_a = Linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D)
        self.wkv = Linear(d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.rotary = Rotary(cfg, compressed=spec.compressed)
        if spec.owns_compressor:
            if cfg.is_v41:
                self.compressor = Compressor41(d, D, spec.ratio, cfg.rms_norm_eps)
            else:
                overlap = spec.mode is LayerMode.CSA
                self.compressor = CompressorV4(d, D, spec.ratio, overlap, cfg.rms_norm_eps)
        if spec.computes_topk:
            self.indexer = Indexer(cfg, owns_keys=spec.owns_index_keys)

    # ---- shared pieces (the reference forward uses them too) ----------------------------
    def qkv(self, x: torch.Tensor, angles: torch.Tensor):
        """-> (q [T, H, D] rotated, c_q [T, q_lora], kv [T, D] rotated latent): the
        reference's sequence of ops (the batched step fuses them: :meth:`qkv_fused`)."""
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(T, H, D)
        if not self.cfg.is_v41:
            q = rms_norm_ref(q, None, self.cfg.rms_norm_eps)
        q = apply_rope(q, angles)
        kv = apply_rope(self.kv_norm(self.wkv(x)), angles)
        return q, c_q, kv

    def qkv_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """:meth:`qkv` with wq_a and wkv as one GEMM over their stacked weights (both read
        ``x``; :meth:`stack_projections`), the two norms of its output's halves (and kv's
        RoPE) as one kernel (``kernels.norm.norm_rope_pair``), and q's norm + RoPE as one."""
        T, H, D = x.shape[0], self.n_heads, self.head_dim
        stack = stacked_projection(self, "_qkv_a", (self.wq_a, self.wkv))
        qn, kvn = self.q_norm, self.kv_norm
        if stack is not None:  # both norms (and kv's RoPE) in one launch over the halves
            c_q, kv = norm_rope_pair(stack(x), self.wq_a.out_features, qn.weight, qn.eps,
                                     kvn.weight, kvn.eps, cos, sin)  # fmt: skip
        else:
            c_q = norm_rope(self.wq_a(x), qn.weight, qn.eps)
            kv = norm_rope(self.wkv(x), kvn.weight, kvn.eps, cos, sin)
        eps = None if self.cfg.is_v41 else self.cfg.rms_norm_eps  # V4: weightless head norm
        q = norm_rope(self.wq_b(c_q).view(T, H, D), None, eps, cos, sin)
        return q, c_q, kv

    def stack_projections(self) -> bool:
        """Stack wq_a and wkv (:func:`~app.model.layers.stacked_projection`; made once, again
        after a weight is replaced) -> whether they run as one GEMM (fp8 ones whose scale
        blocks straddle the seam do not)."""
        return stacked_projection(self, "_qkv_a", (self.wq_a, self.wkv)) is not None

    def qdq(self, x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
        """Round like the released format when ``kv_quant`` (else the identity)."""
        return kv_qdq(x, fmt, block) if self.kv_quant else x

    def project(self, o: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: group g of heads -> wo_a[g] -> concat -> wo_b."""
        g = self.cfg.o_groups
        grouped = o.reshape(o.shape[0], g, -1)
        w = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)
        y = grouped_linear(grouped.to(w.dtype), w).flatten(1)
        return self.wo_b(y)

    # ---- the batched step -----------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, meta: StepMeta, state: CompressedState
    ) -> torch.Tensor:
        """``x`` [T, hidden] (normed sublayer input) -> [T, hidden]."""
        angles = meta.angles(self.rotary)
        cos, sin = meta.cos_sin(self.rotary)
        q, c_q, kv = self.qkv_fused(x, cos, sin)
        win, idx = self._window(kv, batch, meta)
        extra = {}
        if self.spec.compressed:
            rows = self._compressed(x, c_q, (cos, sin), batch, meta, state)
            pool = batch.kv.entries[self.spec.kv_source]
            extra = dict(kv2=pool.data, kv2_scale=pool.scale, idx2=rows)
        out = sparse_attention(
            q, win.data, idx, self.attn_sink, self.head_dim**-0.5,
            kv_scale=win.scale, inv_rope_angles=angles, **extra,
        )  # fmt: skip
        return self.project(out)

    def _window(
        self, kv: torch.Tensor, batch: ForwardBatch, meta: StepMeta
    ) -> tuple[KVRows, torch.Tensor]:
        """Store the step's window KV in the ring; the window key source and its rows [T, W]."""
        ring = batch.kv.window[self.spec.layer_id]
        w = meta.window()
        if meta.direct:
            ring.write(w.write, kv)
            return ring, w.rows
        data, scale = ring.encode(kv)
        stored = ring.take(w.stored)  # before the write: the chunk may overwrite these rows
        ring.put(w.write, data, scale)
        return KVRows(data, scale, ring.fmt, ring.dim).cat(stored), w.rows

    def _compressed(
        self,
        x: torch.Tensor,
        c_q: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        meta: StepMeta,
        state: CompressedState,
    ) -> torch.Tensor:
        """Selected compressed pool rows [T, k] (-1 empty) of every token (``angles``: the
        step's (cos, sin))."""
        spec = self.spec
        if spec.owns_compressor:
            self._emit(x, batch, meta)
        if spec.computes_topk:
            rows = self._select(x, c_q, angles, batch, meta, state)
            state.topk[spec.layer_id] = rows
            return rows
        if spec.mode is LayerMode.HCA:
            return meta.all_visible_rows(spec.ratio)
        return state.topk[spec.index_source]

    def _pool(self, comp: Compressor, name: str, x: torch.Tensor, batch, meta) -> torch.Tensor:
        """Project the step's tokens, pool every candidate group of the step (projections of
        earlier positions from the tail ring) and store this step's projections in the ring.
        -> unrotated entries [G, D] fp32 (rows of invalid candidates are garbage)."""
        key = (self.spec.layer_id, name)
        rows = batch.kv.tail_rows(key) if key in batch.kv.tails else 0
        grp = meta.groups(comp.ratio, comp.span, rows)
        v, g = comp.project(x, meta.pos)
        V, Gt = v[grp.new_idx], g[grp.new_idx]
        if rows:
            tkv, tgate = batch.kv.tails[key]
            new = grp.from_new.unsqueeze(-1)
            V = torch.where(new, V, tkv[grp.tail_idx])
            Gt = torch.where(new, Gt, tgate[grp.tail_idx])
            tkv.index_copy_(0, grp.tail_write, v.float())  # after the gather
            tgate.index_copy_(0, grp.tail_write, g.float())
        return comp.pool(V, Gt, grp.first)

    def _emit(self, x: torch.Tensor, batch: ForwardBatch, meta: StepMeta) -> None:
        """Compressed entries (and index keys) of every group that completes in this step and
        is not cached yet, written to the pools (the rest to the trash block)."""
        spec, r, pools = self.spec, self.spec.ratio, batch.kv
        key = (spec.layer_id, "kv")
        rows = pools.tail_rows(key) if key in pools.tails else 0
        grp = meta.groups(r, self.compressor.span, rows)
        latent = self._pool(self.compressor, "kv", x, batch, meta)
        v4_keys = None
        if spec.owns_index_keys and not self.cfg.is_v41:
            v4_keys = self._pool(self.indexer.compressor, "idx", x, batch, meta)
        cos, sin = meta.group_cos_sin(self.rotary, r, self.compressor.span, rows)
        entries = norm_rope(latent, None, None, cos, sin).to(x.dtype)
        pools.entries[spec.layer_id].write(grp.dest, entries)
        if spec.owns_index_keys:
            ix = self.indexer  # V4.1: index keys from the unrotated latent
            if v4_keys is None:
                keys = norm_rope(ix.wk(latent.to(x.dtype)), ix.k_norm.weight, ix.k_norm.eps,
                                 cos, sin)  # fmt: skip
            else:
                keys = norm_rope(v4_keys, None, None, cos, sin)
            pools.keys[spec.layer_id].write(grp.dest, keys.to(x.dtype))

    def _select(
        self,
        x: torch.Tensor,
        c_q: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        meta: StepMeta,
        state: CompressedState,
    ) -> torch.Tensor:
        """Top-k compressed pool rows [T, k] (V4 CSA, V4.1 Full/Reindex)."""
        spec, cfg, r = self.spec, self.cfg, self.spec.ratio
        keys = batch.kv.keys[spec.kv_source]
        cos, sin = angles

        def rope(t: torch.Tensor, _angles) -> torch.Tensor:
            return norm_rope(t, None, None, cos, sin)

        q, w = self.indexer.queries(x, c_q, angles, rope)
        q = self.qdq(q, "mxfp4", 32)
        visible = meta.visible(r)
        scores = indexer_scores_paged(
            q.contiguous(), keys.data, keys.scale, w.contiguous(), visible, batch.token_seq,
            batch.block_table, r, batch.kv.block_size, meta.num_entries(r),
            seq_start=batch.seq_start, blocks=meta.scores_blocks(q.shape[1]),
        )  # fmt: skip
        if spec.is_candidate_source:
            cand = candidate_blocks(
                scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size
            )
            state.cand[spec.layer_id] = cand
        elif spec.uses_candidates:
            scores = scores.masked_fill(~state.cand[cfg.candidate_source_layer_id], float("-inf"))
        return meta.entry_rows(topk(scores, cfg.index_topk), r)
