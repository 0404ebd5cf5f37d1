"""Dense GEMMs: the LM head, the plain (bf16 / fp16) projections at decode sizes, and the fp8
dense projections.

``linear_f32``: bf16 x bf16 -> fp32 for the LM head, ``y = x @ w^T`` with fp32 accumulation
and an fp32 result, reading ``w`` as stored (no fp32 copy of a 129280 x 5120 head per step);
bf16 products are exact in fp32, so this computes what the reference's fp32 head computes
from bf16 weights and activations, up to the order of the sums.

``dense_linear``: ``nn.Linear``'s product; up to :data:`GEMV_MAX_ROWS` rows on CUDA one
launch of a split-K kernel that streams the weight once (``_gemv_kernel``: the weights as
the MMA's A, the K splits summed by the last program of each row block), else cuBLAS.

``fp8_linear``: ``x @ dequant(W)^T`` over the checkpoint's e4m3 weights and block scales --
at decode sizes a Gluon kernel planned once per weight (:func:`fp8_decode_plan`): on sm_90
from :data:`WG_MIN_TOKENS` rows the wgmma kernel (``kernels.dense_wgmma``), else the
``mma.sync`` decode kernel (``kernels.moe_decode``); larger calls take the one-group
MegaMoE GEMM.

``fp8_act_linear``: the release's fp8 GEMM, ``round(x) @ dequant(W)^T`` with x rounded to
fp8 in per-token groups (``kernels.fp8_act``): from :data:`FP8_MMA_MIN_ROWS` rows the
activations are quantized once and multiplied on the fp8 tensor cores (the one-group MegaMoE
GEMM with per-group activation scales), below it the rounded activations go through
``fp8_linear``'s kernels, whose products are exact too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import dense_wgmma as dw
from kernels import moe_decode as md
from kernels.dispatch import capability, op, sm_count, split_counters
from kernels.fp8_act import act_quant_triton, act_round_triton
from kernels.invariant import _split_sum_cast, linear, rows_gemm
from kernels.moe_grouped import _dot_dtype, _moe_gemm, _scale_arg, _scale_launch
from kernels.moe_tiles import _gemm_tiles, _num_sms
from kernels.quant import dequantize_fp8_block, is_e8m0, round_fp8_act


def linear_f32_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K], ``w`` [N, K] -> fp32 [M, N]."""
    return linear(x.float(), w.float())


@triton.jit
def _f32out_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, swn, sym, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * sxm + k[None, :],
                    mask=(m < M)[:, None] & km[None, :], other=0.0)  # fmt: skip
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * swn + k[:, None],
                    mask=(n < N)[None, :] & km[:, None], other=0.0)  # fmt: skip
        if F32_DOT:  # the interpreter multiplies bf16 storage wrongly: widen there
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + m[:, None].to(tl.int64) * sym + n[None, :], acc,
             mask=(m < M)[:, None] & (n < N)[None, :])  # fmt: skip


def linear_f32_triton(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Triton :func:`linear_f32_ref` for bf16 / fp16 ``x`` and ``w`` (contiguous rows)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype:
        raise ValueError(f"x [M, K] and w [N, K] of one dtype: {tuple(x.shape)} {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need contiguous rows")
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if M == 0:
        return y
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    BM = 16 if interp else max(16, min(128, triton.next_power_of_2(M)))
    BN, BK = (16, 16) if interp else (128, 64)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM))
    _f32out_kernel[grid](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BM=BM, BN=BN,
                         BK=BK, F32_DOT=interp, num_warps=4 if BM <= 64 else 8,
                         num_stages=4)  # fmt: skip
    return y


def _half_operands(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2


def _linear_f32_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The deterministic mode's LM head: ``kernels.invariant.rows_gemm`` to fp32 (bf16 /
    fp16 operands as stored), else the reference (whose GEMM the mode fixes too)."""
    if _half_operands(x, w):
        return rows_gemm(x, w, torch.float32)
    return linear_f32_ref(x, w)


linear_f32 = op(linear_f32_ref, lambda x, w: linear_f32_triton(x.contiguous(), w),
                when=_half_operands, invariant=_linear_f32_invariant)


# ---- bf16 / fp16 dense projections at decode sizes ----------------------------------------
GEMV_MAX_ROWS = 16  # rows up to which a plain projection takes the split-K decode kernel


def dense_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` for ``x`` [..., K] and ``w`` [N, K] of one dtype (``nn.Linear``'s product:
    cuBLAS on CUDA; batch-invariant in the deterministic mode: ``kernels.invariant``)."""
    return linear(x, w)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, k_per, sxm, swn, sym,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                 F32_DOT: tl.constexpr):  # fmt: skip
    """One (BN weight rows, K split): the weights are the MMA's A (so a few token rows fill
    the narrow N = BM side), fp32 accumulation. With SPLIT > 1 each program stores its fp32
    partial [split, BM, N], counts itself in at its row block's counter (zero between
    launches), and the last to arrive sums the partials in split order, writes y and sets
    the counter back to zero: deterministic, one launch."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    nm = n < N
    mm = m < M
    acc = tl.zeros((BN, BM), tl.float32)
    k_lo = pid_k * k_per
    for k0 in range(k_lo, k_lo + k_per, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * swn + k[None, :],
                    mask=nm[:, None] & km[None, :], other=0.0)  # fmt: skip
        x = tl.load(x_ptr + m[None, :] * sxm + k[:, None], mask=mm[None, :] & km[:, None],
                    other=0.0)  # fmt: skip
        if F32_DOT:  # the interpreter multiplies bf16 storage wrongly: widen there
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, x, acc)
    out = y_ptr + m[None, :] * sym + n[:, None]
    om = nm[:, None] & mm[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=om)
    else:
        part = part_ptr + m[None, :] * N + n[:, None]
        tl.store(part + pid_k * BM * N, acc, mask=om)
        tl.debug_barrier()  # every thread's partial is issued before the count
        old = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if old == SPLIT - 1:  # the row block's last program: the others' partials are in
            tot = tl.zeros((BN, BM), tl.float32)
            for s in range(SPLIT):
                tot += tl.load(part + s * BM * N, mask=om, other=0.0, cache_modifier=".cg")
            tl.store(out, tot.to(y_ptr.dtype.element_ty), mask=om)
            tl.store(cnt_ptr + pid_n, 0)


def gemv_launch(n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BN, BK, K splits, ring depth, warps) of :func:`dense_linear_triton`: 64 weight rows
    per program, 128-column blocks in a 4-deep ring, and K splits for about 1.2 programs per
    SM, each split keeping at least four blocks. H200 sweep at 1 token
    (``bench/decode_plumbing.py --sweep-gemv``): each V4.1-Flash shape was fastest with
    80-216 programs; more splits lost (their partials and the serial sum), 2-3x the programs
    by up to 1.7x."""
    bn, bk = 64, 128
    blocks = triton.cdiv(n, bn)
    split = max(1, min(k // (4 * bk), round(1.2 * sms / blocks)))
    return bn, bk, split, 4, 4


def dense_linear_triton(x: torch.Tensor, w: torch.Tensor,
                        launch: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """:func:`dense_linear_ref` at decode sizes (at most :data:`GEMV_MAX_ROWS` rows of ``x``,
    bf16 / fp16, ``w`` with contiguous rows): one launch of ``_gemv_kernel``, at
    :func:`gemv_launch`'s choice or ``launch`` (a benchmark's sweep)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], w.shape[0]
    if m > GEMV_MAX_ROWS or x.dtype != w.dtype or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"decode projection: at most {GEMV_MAX_ROWS} rows of one dtype with "
                         f"w [N, K] in contiguous rows: x {tuple(x.shape)} {x.dtype}, "
                         f"w {tuple(w.shape)} {w.dtype}")  # fmt: skip
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        if launch is None:
            launch = (16, 32, 2, 1, 4) if interp else gemv_launch(n, k, sm_count(x.device))
        bn, bk, split, stages, warps = launch
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        split = triton.cdiv(k, k_per)
        blocks = triton.cdiv(n, bn)
        part = (torch.empty(split, GEMV_MAX_ROWS, n, dtype=torch.float32, device=x.device)
                if split > 1 else y)  # fmt: skip
        cnt = split_counters(blocks, x.device) if split > 1 else y
        _gemv_kernel[(blocks, split)](
            x2, w, y, part, cnt, m, n, k, k_per, x2.stride(0), w.stride(0), y.stride(0),
            BM=GEMV_MAX_ROWS, BN=bn, BK=bk, SPLIT=split, F32_DOT=interp, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def _gemv_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The dispatch's rule: the decode kernel for at most :data:`GEMV_MAX_ROWS` rows of
    bf16 / fp16 (K a multiple of 8, 16-byte aligned weight rows), cuBLAS above."""
    k = x.shape[-1]
    return (x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and w.dim() == 2 and w.shape[1] == k and w.stride(1) == 1 and k % 8 == 0
            and w.stride(0) % 8 == 0 and x.numel() <= GEMV_MAX_ROWS * k)  # fmt: skip


dense_linear = op(dense_linear_ref, dense_linear_triton, when=_gemv_fits,
                  invariant=lambda x, w: rows_gemm(x, w, x.dtype))


# ---- fp8 dense projections with the checkpoint's block scales ----------------------------------
DECODE_MAX_TOKENS = 64  # rows up to which a planned projection takes the mma.sync kernel
WG_MAX_TOKENS = 256  # ... the wgmma kernel (sm_90; two 128-token tiles)
# the wgmma kernel from here on sm_90 (its 32-row token tile; H200, the six V4.1-Flash dense
# projections: 99.4 against the mma.sync kernel's 110.9 us at 32 rows, 92.0 against 76.4 at 8)
WG_MIN_TOKENS = 17
WG_MAX_REF = 190  # its row factor 2^(R - 127) is built as fp32 bits (R + 64) << 23


@dataclass(frozen=True, eq=False)
class Fp8DecodePlan:
    """What the decode kernel (``kernels.moe_decode``, ``FP8``) reads beside the weight, made
    once per weight (:func:`fp8_decode_plan`): ``words`` int32 [ceil(N/b0), K/128], four e8m0
    codes per 128 columns (one per 32); ``refs`` int32 [N], each row's reference exponent;
    ``r_max`` the largest of them (the wgmma kernel's row factor needs <= ``WG_MAX_REF``)."""

    words: torch.Tensor
    refs: torch.Tensor
    b0: int
    r_max: int


def fp8_decode_plan(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> Fp8DecodePlan | None:
    """The decode kernel's plan for ``w`` (e4m3 [N, K]) and its e8m0 ``scale`` per ``block``,
    or None where the kernel does not apply: fp32 scales, K not a multiple of 128 or N of 64,
    column blocks not a multiple of 32, or a block row whose codes span more binades than its
    fp16 products hold exactly (``moe_decode.SPREAD_FP8``). Column blocks wider than 32 are
    widened to one code per 32 columns. Synchronizes with the device once: make it before any
    CUDA-graph capture (``Fp8Linear.prepare``)."""
    n, k = w.shape
    b0, b1 = block
    fits = (is_e8m0(scale) and w.dtype == torch.float8_e4m3fn and w.stride(1) == 1
            and w.stride(0) % 16 == 0 and w.data_ptr() % 16 == 0 and not k % md.KB
            and not n % md.BR and not b1 % 32
            and scale.shape == (-(-n // b0), -(-k // b1)))  # fmt: skip
    if not fits:
        return None
    codes = scale.view(torch.uint8)
    if b1 > 32:
        codes = codes.repeat_interleave(b1 // 32, dim=1)[:, : k // 32]
    refs, exact = md.fp8_refs(codes, b0, n)
    if not exact:
        return None
    return Fp8DecodePlan(codes.contiguous().view(torch.int32), refs, b0, int(refs.max()))


def _decode_kernel_runs(x: torch.Tensor, plan: Fp8DecodePlan, n: int, k: int,
                        b0: int) -> bool:  # fmt: skip
    """Whether the decode kernel takes ``x`` [M, K] with ``plan`` (made for this weight):
    bf16 / fp16 rows on sm_89+ (the e4m3 cvt) that its 16-byte copies can read."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if plan.refs.numel() != n or plan.b0 != b0 or plan.words.shape[1] * 128 != k:
        raise ValueError(f"an fp8 decode plan for another weight: refs {plan.refs.numel()}, "
                         f"block rows {plan.b0}, words {tuple(plan.words.shape)}")  # fmt: skip
    # the kernels' cp.async need aligned rows, which Triton proves from a row stride that is
    # a multiple of 16 (its integer specialization); others compile to 2-byte copies: refused
    aligned = x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0
    return aligned and capability(x.device) >= (8, 9) and x.dtype in (torch.bfloat16,
                                                                       torch.float16)  # fmt: skip


def _wgmma_runs(x: torch.Tensor, plan: Fp8DecodePlan, n: int, m: int) -> bool:
    """Whether the wgmma kernel also takes a call the decode kernel takes: sm_90 (wgmma), at
    most :data:`WG_MAX_TOKENS` rows, ``n`` a multiple of its row tiles (64 weight rows up to
    64 tokens, 128 beyond), row references up to :data:`WG_MAX_REF`."""
    if capability(x.device) != (9, 0) or m > WG_MAX_TOKENS or plan.r_max > WG_MAX_REF:
        return False
    return not n % (16 * dw.pick_launch(dw.token_tile(m))[0])


def fp8_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    plan: Fp8DecodePlan | None = None,
) -> torch.Tensor:
    """``x @ dequant(w)^T`` in ``x.dtype``: ``w`` [N, K] e4m3 with e8m0 (or fp32) ``scale``
    [ceil(N/b0), ceil(K/b1)] per ``block`` (b0, b1) -- what the dequantized model computes.
    ``plan`` (the decode kernel's, :func:`fp8_decode_plan`) does not change the result."""
    return linear(x, dequantize_fp8_block(w, scale, block, x.dtype))


def fp8_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    plan: Fp8DecodePlan | None = None,
) -> torch.Tensor:
    """Triton :func:`fp8_linear_ref`. The dispatch by shape: with a ``plan``, on sm_90 from
    :data:`WG_MIN_TOKENS` to :data:`WG_MAX_TOKENS` rows the wgmma kernel
    (``kernels.dense_wgmma``: the weights in registers, all the rows as the MMA's N; N a
    multiple of 64, of 128 past 64 rows); else up to :data:`DECODE_MAX_TOKENS` rows on sm_89+
    the decode kernel (``kernels.moe_decode``: weights as the MMA's A, each 32-column scale
    re-based onto the fp16 weights, one accumulation over all of K); else (no plan, more
    rows, another GPU) the one-group MegaMoE GEMM (:func:`_fp8_grouped`)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    b0, b1 = block
    if w.shape != (N, K) or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"w must be e4m3 [N, {K}], got {w.dtype} {tuple(w.shape)}")
    if N % 32 or K % 32 or b1 % 32 or scale.shape != (-(-N // b0), -(-K // b1)):
        raise ValueError(f"fp8 linear {N} x {K} with block {block} and scale "
                         f"{tuple(scale.shape)} does not fit the kernel")  # fmt: skip
    if M == 0:
        return x.new_empty(*shape[:-1], N)
    if plan is not None and _decode_kernel_runs(x2, plan, N, K, b0):
        if M >= WG_MIN_TOKENS and _wgmma_runs(x2, plan, N, M):
            return _fp8_wgmma(x2, w, plan, M, N, K).view(*shape[:-1], N)
        if M <= DECODE_MAX_TOKENS:
            return _fp8_decode(x2, w, plan, M, N, K).view(*shape[:-1], N)
    return _fp8_grouped(x2, w, scale, block).view(*shape[:-1], N)


def _fp8_grouped(x2: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """[M, N] in x's dtype through the MegaMoE GEMM (``kernels.moe_grouped._moe_gemm``) with one
    group: weights streamed as e4m3 and multiplied after the in-register conversion, each
    32-column group's fp32 partial times its scale; split-K at decode sizes."""
    M, K = x2.shape
    N = w.shape[0]
    b0, b1 = block
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    n_tiles = -(-M // bm)
    # any K step that is a multiple of 32 works (each 32-column group takes its block's
    # scale); a floor of the block width left K < b1 (V4's 128 blocks, K = 64) with no step
    t = _gemm_tiles(bm, N, K, n_tiles, _num_sms(x2.device), 32, False, False)
    if N % t.bn:
        raise ValueError(f"N = {N} is not a multiple of the tile {t.bn}")
    s, e8 = _scale_arg(scale.unsqueeze(0))
    w3 = w.unsqueeze(0)
    rows, tile_e = _one_group_rows(n_tiles * bm, n_tiles, x2.device)
    # one K split: the kernel's fp32 tile is rounded to x's dtype as it is stored
    y_dt = x2.dtype if t.split == 1 else torch.float32
    y = torch.empty(t.split, n_tiles * bm, N, dtype=y_dt, device=x2.device)
    k_per = -(-(K // t.bk) // t.split) * t.bk
    scale_args, scale_kw = _scale_launch(s, e8, b1, t.bk)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _moe_gemm[(n_tiles, N // t.bn, t.split)](
        x2, x2.stride(0), x2, x2.stride(0), rows, tile_e, w3, w3.stride(0), w3.stride(1),
        *scale_args, y, y.stride(0), y.stride(1), M, 1, N, K, k_per, 0.0, None,
        A_GATHER=False, GATED=False, FUSE_SWIGLU=False, FP4=False, PAIRS=False,
        USE_ASM=not interp, SB_N=b0, SB_K=b1, HAS_LIMIT=False, CDT=_dot_dtype(x2),
        A_FP8=False, F16=False, BM=bm, BN=t.bn, BK=t.bk, num_warps=t.warps,
        num_stages=t.stages, **scale_kw,
    )  # fmt: skip
    return _sum_splits(y, M, N, x2.dtype)


def _fp8_decode(x2: torch.Tensor, w: torch.Tensor, plan: Fp8DecodePlan, M: int, N: int,
                K: int, bt: int | None = None, split: int | None = None,
                stages: int | None = None) -> torch.Tensor:  # fmt: skip
    """[M, N] in x's dtype through ``moe_decode.launch_dense``; with K splits the kernel's
    last CTA of each tile sums them (one launch; H200, the six V4.1-Flash projections at one
    token: 70.4 against 75.0 us with a second launch for the sum). The token tile, K splits
    and ring depth default to the measured choice (a sweep passes its own)."""
    bt = bt or (8 if M <= 8 else 16 if M <= 16 else 32 if M <= 32 else 64)
    tiles = -(-M // bt)
    split = split or md.pick_split(tiles, N, K, sm_count(x2.device))
    stages = stages or md.pick_stages(bt, tiles)
    rows, tile_e = _one_group_rows(tiles * bt, tiles, x2.device)
    y = torch.empty(split, tiles * bt, N, device=x2.device,
                    dtype=x2.dtype if split == 1 else torch.float32)  # fmt: skip
    if split > 1:
        fin = torch.empty(tiles * bt, N, device=x2.device, dtype=x2.dtype)
        cnt = split_counters(tiles * (N // md.BR), x2.device)
        md.launch_dense(x2, w, plan.words, plan.refs, rows, tile_e, y, M, split, bt, plan.b0,
                        stages, fin, cnt)  # fmt: skip
        return fin[:M]
    md.launch_dense(x2, w, plan.words, plan.refs, rows, tile_e, y, M, split, bt, plan.b0,
                    stages)  # fmt: skip
    return _sum_splits(y, M, N, x2.dtype)


def _fp8_wgmma(x2: torch.Tensor, w: torch.Tensor, plan: Fp8DecodePlan, M: int, N: int,
               K: int, bt: int | None = None, split: int | None = None,
               stages: int | None = None, warps: int | None = None) -> torch.Tensor:  # fmt: skip
    """[M, N] in x's dtype through ``dense_wgmma.launch``; K splits summed by a second launch
    (:func:`_sum_splits`: here one CTA per tile summing up to 20 partials of 64 x 64 one after
    another was slower, H200 at 64 tokens 199.5 against 131.2 us for the six V4.1-Flash
    projections). The launch choices default to the measured ones (a sweep passes its own)."""
    bt = bt or dw.token_tile(M)
    warps_, stages_ = dw.pick_launch(bt)
    warps, stages = warps or warps_, stages or stages_
    split = split or dw.pick_split(N, K, sm_count(x2.device), 16 * warps)
    y = torch.empty(split, M, N, device=x2.device,
                    dtype=x2.dtype if split == 1 else torch.float32)  # fmt: skip
    dw.launch(x2, w, plan.words, plan.refs, y, M, split, bt, plan.b0, stages, warps)
    return _sum_splits(y, M, N, x2.dtype)


def _sum_splits(y: torch.Tensor, M: int, N: int, dtype: torch.dtype) -> torch.Tensor:
    """The [M, N] result of a GEMM's K splits ``y`` [split, rows >= M, N]: the first split
    as stored (already ``dtype``) when there is one, else their sum cast in one launch."""
    if y.shape[0] == 1:
        return y[0, :M]
    out = torch.empty(M, N, dtype=dtype, device=y.device)
    _split_sum_cast[(triton.cdiv(M * N, 1024),)](y, y.stride(0), out, M * N, SPLIT=y.shape[0],
                                                 BLOCK=1024)  # fmt: skip
    return out


_ROWS: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _one_group_rows(n_rows: int, n_tiles: int, device: torch.device):
    """The one-group GEMM's row map (0 .. n_rows-1) and tile experts (all 0), as views of
    buffers kept per device: two launches fewer per projection than making them per call.
    Kept only when made outside a CUDA-graph capture (a captured fill runs at replay), and
    never freed: a captured graph may read an outgrown buffer."""
    kept = _ROWS.setdefault(device, [])
    if kept and kept[-1][0].numel() >= n_rows:
        return kept[-1][0][:n_rows], kept[-1][1][:n_tiles]
    size = max(n_rows, 4096)
    rows = torch.arange(size, dtype=torch.int32, device=device)
    tile_e = torch.zeros(size, dtype=torch.int32, device=device)  # n_tiles <= n_rows
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        kept.append((rows, tile_e))
    return rows[:n_rows], tile_e[:n_tiles]


fp8_linear = op(fp8_linear_ref, fp8_linear_triton)


# ---- the release's fp8 GEMM: fp8 activations x fp8 block weights ------------------------------
# rows from which rounded activations go through the fp8 x fp8 GEMM (below: the rounded
# activations through fp8_linear's decode-tuned kernels; bench/dense_act.py times both)
FP8_MMA_MIN_ROWS = 128


def fp8_act_linear_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    group: int,
    plan: Fp8DecodePlan | None = None,
) -> torch.Tensor:
    """``round(x) @ dequant(w)^T`` in ``x.dtype``: x rounded as the release rounds a quantized
    GEMM's input (:func:`~kernels.quant.round_fp8_act`, groups of ``group`` columns), then
    :func:`fp8_linear_ref` -- the release's ``act_quant`` + ``fp8_gemm`` up to the order of the
    fp32 sums (every product is exact on both sides). ``plan`` as there."""
    return fp8_linear_ref(round_fp8_act(x, group), w, scale, block)


def fp8_act_linear_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    group: int,
    plan: Fp8DecodePlan | None = None,
    mma: bool | None = None,
    launch: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Triton :func:`fp8_act_linear_ref`. ``mma`` (None: from :data:`FP8_MMA_MIN_ROWS` rows
    on sm_89+): quantize x (``kernels.fp8_act``) and multiply e4m3 by e4m3 with per-group
    promotion (:func:`_fp8_act_grouped`, ``launch`` as :func:`fp8_act_launch` returns it);
    else round x and take :func:`fp8_linear_triton` (``plan``)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if mma is None:
        mma = m >= FP8_MMA_MIN_ROWS and x.is_cuda and capability(x.device) >= (8, 9)
    if not mma:
        return fp8_linear_triton(act_round_triton(x2, group), w, scale, block,
                                 plan).view(*shape[:-1], w.shape[0])  # fmt: skip
    n, k = w.shape
    b0, b1 = block
    if x2.shape[1] != k or w.dtype != torch.float8_e4m3fn or not is_e8m0(scale):
        raise ValueError(f"w must be e4m3 [N, {x2.shape[1]}] with e8m0 scales, got {w.dtype} "
                         f"{tuple(w.shape)} and {scale.dtype} scales")  # fmt: skip
    if n % 32 or k % 32 or b1 % 32 or group % 32 or scale.shape != (-(-n // b0), -(-k // b1)):
        raise ValueError(f"fp8 linear {n} x {k} with block {block}, activation groups of "
                         f"{group} and scale {tuple(scale.shape)} does not fit the kernel")
    if m == 0:
        return x.new_empty(*shape[:-1], n)
    q, sa = act_quant_triton(x2, group)
    y = _fp8_act_grouped(q, sa, w, scale, block, group, x.dtype, launch)
    return y.view(*shape[:-1], n)


def fp8_act_launch(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, int]:
    """(rows per tile, N tile, K tile, K splits, warps, stages) of :func:`_fp8_act_grouped`:
    128-row tiles from 128 rows (8 warps), else the smallest of 16 / 32 / 64 holding the rows
    with K splits for about two programs per SM; 128-wide N and K tiles where they divide."""
    bm = next((b for b in (16, 32, 64) if m <= b), 128)
    bn = next(b for b in (128, 64, 32) if n % b == 0)
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    tiles = -(-m // bm) * (n // bn)
    split = 1 if bm >= 64 else max(1, min(k // bk // 2, -(-2 * sms // tiles)))
    return bm, bn, bk, split, 8 if bm >= 128 else 4, 3 if bm >= 128 else 4


def _fp8_act_grouped(q: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int], group: int, out_dtype: torch.dtype,
                     launch: tuple[int, int, int, int, int, int] | None = None,
                     ) -> torch.Tensor:  # fmt: skip
    """[M, N] in ``out_dtype``: e4m3 activations ``q`` [M, K] with e8m0 scales ``sa`` [M,
    K/group] times the e4m3 weights through the MegaMoE GEMM with one group (``SA_K``): one fp8
    MMA per group of min(K tile, weight block columns, ``group``) columns, promoted with the
    row's and the weight block's scales."""
    m, k = q.shape
    n = w.shape[0]
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if launch is None:
        launch = ((16, 32, 64 if k % 64 == 0 else 32, 1, 4, 1) if interp
                  else fp8_act_launch(m, n, k, _num_sms(q.device)))  # fmt: skip
    bm, bn, bk, split, warps, stages = launch
    if n % bn or k % bk:
        raise ValueError(f"tiles {bn} x {bk} do not divide N = {n}, K = {k}")
    n_tiles = -(-m // bm)
    s, e8 = _scale_arg(scale.unsqueeze(0))
    w3 = w.unsqueeze(0)
    rows, tile_e = _one_group_rows(n_tiles * bm, n_tiles, q.device)
    y = torch.empty(split, n_tiles * bm, n, device=q.device,
                    dtype=out_dtype if split == 1 else torch.float32)  # fmt: skip
    k_per = -(-(k // bk) // split) * bk
    scale_args, scale_kw = _scale_launch(s, e8, block[1], bk)
    scale_kw["GK"] = min(scale_kw["GK"], group)
    sa8 = sa.view(torch.uint8)
    _moe_gemm[(n_tiles, n // bn, split)](
        q, q.stride(0), sa8, sa8.stride(0), rows, tile_e, w3, w3.stride(0), w3.stride(1),
        *scale_args, y, y.stride(0), y.stride(1), m, 1, n, k, k_per, 0.0, None,
        A_GATHER=False, GATED=False, FUSE_SWIGLU=False, FP4=False, PAIRS=False,
        USE_ASM=not interp, SB_N=block[0], SB_K=block[1], HAS_LIMIT=False, CDT=tl.float32,
        A_FP8=True, F16=False, BM=bm, BN=bn, BK=bk, SA_K=group, num_warps=warps,
        num_stages=stages, **scale_kw,
    )  # fmt: skip
    return _sum_splits(y, m, n, out_dtype)


fp8_act_linear = op(fp8_act_linear_ref, fp8_act_linear_triton)
