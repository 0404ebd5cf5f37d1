"""Routed experts with the clamped SwiGLU: torch references and the Triton MegaMoE.

``y_e = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))``; ``out = sum_k w_k y_{e_k}``.

Triton path (``moe_fp8_triton`` / ``moe_fp4_triton``), no host sync (CUDA-graph safe):

1. align (torch, on device): the T*k (token, slot) pairs sorted by local expert into tiles of
   BM rows, each tile one expert; e.g. BM=2, slot experts [1,0,1] ->
   sorted slots [1,-,0,2] (``-`` = padding), tile experts [0,1]; non-local experts dropped.
2. ``_moe_gemm`` gated: ``[W1|W3] x`` for each tile, weights dequantized in registers
   (fp8 blocks or packed fp4), bf16 MMA with fp32 accumulation, clamped SwiGLU in the
   epilogue -> H [rows, I] bf16; with split-K (small batches) fp32 partials + ``_swiglu_reduce``.
3. ``_moe_gemm`` plain: ``W2 h`` -> Y [split, rows, d] fp32.
4. ``_moe_combine``: ``out[t] = sum_j w[t,j] * sum_s Y[s, row(t,j)]`` in a fixed order
   (deterministic; no atomics).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.quant_ref import dequant_fp4, dequant_fp8_blocks, is_e8m0


def swiglu_clamp(h1: torch.Tensor, h3: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(h1, limit)) * clamp(h3, -limit, limit)`` (limit <= 0 disables the clamp)."""
    if limit > 0:
        h1 = h1.clamp(max=limit)
        h3 = h3.clamp(-limit, limit)
    return torch.nn.functional.silu(h1) * h3


def moe_experts_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    w3: list[torch.Tensor],
    limit: float,
) -> torch.Tensor:
    """``x`` [T, d], ``ids``/``weights`` [T, k]; per-expert weights w1/w3 [I, d], w2 [d, I].

    Experts absent from ``w1`` (None) are not local to this rank and contribute nothing.
    """
    out = torch.zeros(
        x.shape[0], w2[0].shape[0] if w2 else x.shape[1], dtype=torch.float32, device=x.device
    )
    flat_ids = ids.reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    flat_w = weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        if w1[e] is None:
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        t = tok[sel]
        xe = x[t]
        h = swiglu_clamp(xe @ w1[e].t(), xe @ w3[e].t(), limit)
        y = (h @ w2[e].t()).float() * flat_w[sel].unsqueeze(-1)
        out.index_add_(0, t, y)
    return out.to(x.dtype)


moe_experts = moe_experts_ref


def _stacked_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    offset: int,
) -> torch.Tensor:
    n_exp = max(int(ids.max()) + 1, offset + w13.shape[0])
    inter = w13.shape[1] // 2
    w1: list = [None] * n_exp
    w3: list = [None] * n_exp
    w2s: list = [None] * n_exp
    for i in range(w13.shape[0]):
        w1[offset + i], w3[offset + i] = w13[i, :inter], w13[i, inter:]
        w2s[offset + i] = w2[i]
    w2s = [w if w is not None else w2[0] for w in w2s]  # only shapes are read for non-local
    return moe_experts_ref(x, ids, weights, w1, w2s, w3, limit)


def moe_fp8_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    block: tuple[int, int],
    limit: float,
    local_expert_offset: int = 0,
) -> torch.Tensor:
    """Dequantize stacked fp8 experts (``w13`` [E, 2I, d] = W1|W3, ``w2`` [E, d, I]) to
    ``x.dtype`` and run :func:`moe_experts_ref`; expert ``offset + i`` is ``w13[i]``."""
    w13f = dequant_fp8_blocks(w13, s13, block, x.dtype)
    w2f = dequant_fp8_blocks(w2, s2, block, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset)


def moe_fp4_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
) -> torch.Tensor:
    """Packed fp4 experts (``w13`` [E, 2I, d/2] int8 + [E, 2I, d/32] scales, ``w2``
    [E, d, I/2] + [E, d, I/32]) dequantized to ``x.dtype``, then :func:`moe_experts_ref`."""
    w13f = dequant_fp4(w13, s13, x.dtype)
    w2f = dequant_fp4(w2, s2, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset)


# ---- Triton ---------------------------------------------------------------------------


@triton.jit
def _scale(s_ptrs, SCALE_E8M0: tl.constexpr):
    """Scales as fp32; e8m0 code c -> bits ``c << 23`` = 2^(c-127) (code 0 reads as 0)."""
    raw = tl.load(s_ptrs)
    if SCALE_E8M0:
        return ((raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _e2m1(code):
    """E2M1 code (int32 0..15) -> fp32 built from bits: e=(c>>1)&3, m=c&1, sign bit 3.

    e=0: m * 0.5 (0x3F000000); else 2^(e-1) * (1 + m/2) = exponent e+126, mantissa bit m."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _w_tile_fp8(w_ptr, s_ptr, e, n, k, swe, swn, sse, ssn, ssk, SB_N, SB_K, SCALE_E8M0, CDT):
    """Dequantized [BK, BN] tile of expert ``e`` (rows ``n``, columns ``k``)."""
    w = tl.load(w_ptr + e * swe + n[None, :] * swn + k[:, None]).to(tl.float32)
    s = _scale(
        s_ptr + e * sse + (n // SB_N)[None, :] * ssn + (k // SB_K)[:, None] * ssk, SCALE_E8M0
    )
    return (w * s).to(CDT)


@triton.jit
def _w_tile_fp4(w_ptr, s_ptr, e, n, kh, swe, swn, sse, ssn, ssk, SCALE_E8M0, CDT):
    """Even / odd column [BK/2, BN] tiles of packed fp4 expert ``e`` (``kh`` byte columns)."""
    b = tl.load(w_ptr + e * swe + n[None, :] * swn + kh[:, None]).to(tl.int32) & 0xFF
    s = _scale(s_ptr + e * sse + n[None, :] * ssn + (kh // 16)[:, None] * ssk, SCALE_E8M0)
    return (_e2m1(b & 0xF) * s).to(CDT), (_e2m1(b >> 4) * s).to(CDT)


@triton.jit
def _moe_gemm(
    a_ptr, sam, rows_ptr, tile_e_ptr,
    w_ptr, swe, swn, s_ptr, sse, ssn, ssk,
    out_ptr, sos, som,
    n_slots, topk, N, K, k_per_split, limit,
    A_GATHER: tl.constexpr, GATED: tl.constexpr, FUSE_SWIGLU: tl.constexpr,
    FP4: tl.constexpr, SCALE_E8M0: tl.constexpr, SB_N: tl.constexpr, SB_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, CDT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """One (tile, N block, K split): ``acc = A[tile rows] @ W_e[n, k-range]^T``."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(tile_e_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pos = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(rows_ptr + pos)
    rmask = slot < n_slots
    arow = slot // topk if A_GATHER else pos
    a_base = a_ptr + arow.to(tl.int64)[:, None] * sam
    n = pid_n * BN + tl.arange(0, BN)
    acc1 = tl.zeros((BM, BN), tl.float32)
    acc3 = tl.zeros((BM, BN), tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        if FP4:
            kh = k0 // 2 + tl.arange(0, BK // 2)
            a_ev = tl.load(a_base + 2 * kh[None, :], mask=rmask[:, None], other=0.0).to(CDT)
            a_od = tl.load(a_base + 2 * kh[None, :] + 1, mask=rmask[:, None], other=0.0).to(CDT)
            w_ev, w_od = _w_tile_fp4(w_ptr, s_ptr, e, n, kh, swe, swn, sse, ssn, ssk,
                                     SCALE_E8M0, CDT)  # fmt: skip
            acc1 = tl.dot(a_od, w_od, tl.dot(a_ev, w_ev, acc1))
            if GATED:
                w_ev, w_od = _w_tile_fp4(w_ptr, s_ptr, e, n + N, kh, swe, swn, sse, ssn, ssk,
                                         SCALE_E8M0, CDT)  # fmt: skip
                acc3 = tl.dot(a_od, w_od, tl.dot(a_ev, w_ev, acc3))
        else:
            k = k0 + tl.arange(0, BK)
            a = tl.load(a_base + k[None, :], mask=rmask[:, None], other=0.0).to(CDT)
            w = _w_tile_fp8(w_ptr, s_ptr, e, n, k, swe, swn, sse, ssn, ssk, SB_N, SB_K,
                            SCALE_E8M0, CDT)  # fmt: skip
            acc1 = tl.dot(a, w, acc1)
            if GATED:
                w = _w_tile_fp8(w_ptr, s_ptr, e, n + N, k, swe, swn, sse, ssn, ssk, SB_N, SB_K,
                                SCALE_E8M0, CDT)  # fmt: skip
                acc3 = tl.dot(a, w, acc3)
    o_ptrs = out_ptr + pid_k * sos + pos.to(tl.int64)[:, None] * som + n[None, :]
    if FUSE_SWIGLU:
        if HAS_LIMIT:
            acc1 = tl.minimum(acc1, limit)
            acc3 = tl.minimum(tl.maximum(acc3, -limit), limit)
        h = acc1 * tl.sigmoid(acc1) * acc3
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc1)
        if GATED:
            tl.store(o_ptrs + N, acc3)


@triton.jit
def _swiglu_reduce(
    p_ptr, sps, spm, h_ptr, shm, tile_e_ptr, N, limit,
    SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """H = swiglu(sum_s P[s, :, :N], sum_s P[s, :, N:]) for one tile and column block."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(tile_e_ptr + pid_m) < 0:
        return
    pos = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    cmask = n[None, :] < N
    ptrs = p_ptr + pos[:, None] * spm + n[None, :]
    h1 = tl.zeros((BM, BN), tl.float32)
    h3 = tl.zeros((BM, BN), tl.float32)
    for s in tl.static_range(SPLIT):
        h1 += tl.load(ptrs + s * sps, mask=cmask, other=0.0)
        h3 += tl.load(ptrs + s * sps + N, mask=cmask, other=0.0)
    if HAS_LIMIT:
        h1 = tl.minimum(h1, limit)
        h3 = tl.minimum(tl.maximum(h3, -limit), limit)
    h = h1 * tl.sigmoid(h1) * h3
    tl.store(h_ptr + pos[:, None] * shm + n[None, :], h.to(h_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _moe_combine(
    y_ptr, sys, sym, inv_ptr, w_ptr, out_ptr, som, D, topk,
    SPLIT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """``out[t, cols] = sum_j w[t, j] * sum_s Y[s, inv[t*k+j], cols]`` (fixed order)."""
    t, pid_d = tl.program_id(0), tl.program_id(1)
    cols = pid_d * BD + tl.arange(0, BD)
    cmask = cols < D
    acc = tl.zeros((BD,), tl.float32)
    for j in range(topk):
        slot = t * topk + j
        p = tl.load(inv_ptr + slot).to(tl.int64)
        w = tl.load(w_ptr + slot)
        m = cmask & (p >= 0)
        part = tl.zeros((BD,), tl.float32)
        for s in tl.static_range(SPLIT):
            part += tl.load(y_ptr + s * sys + p * sym + cols, mask=m, other=0.0)
        acc += w * part
    tl.store(out_ptr + t * som + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


def _dot_dtype() -> tl.dtype:
    """bf16 MMA operands; fp32 under the interpreter (it computes bf16 dots wrongly)."""
    return tl.float32 if os.environ.get("TRITON_INTERPRET", "0") == "1" else tl.bfloat16


def _align(
    ids: torch.Tensor, n_local: int, offset: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted slots [tiles*BM] int32 (pad = T*k), inverse [T*k] int32 (-1 = not local),
    tile experts [tiles] int32 (-1 = idle)); all on device, no host sync."""
    dev = ids.device
    flat = ids.reshape(-1).long() - offset
    n_slots = flat.numel()
    local = (flat >= 0) & (flat < n_local)
    e = torch.where(local, flat, torch.full_like(flat, n_local))  # bucket n_local = dropped
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, e, torch.ones_like(e))
    is_local = torch.arange(n_local + 1, device=dev) < n_local
    tiles = (counts + bm - 1) // bm * is_local  # no tiles for the dropped bucket
    tile_end = torch.cumsum(tiles, 0)
    first_row = (tile_end - tiles) * bm
    order = torch.argsort(e, stable=True)
    se = e[order]
    rank = torch.arange(n_slots, device=dev) - (torch.cumsum(counts, 0) - counts)[se]
    n_tiles = min(n_slots, -(-n_slots // bm) + n_local)
    dump = n_tiles * bm
    dest = torch.where(se < n_local, first_row[se] + rank, torch.full_like(rank, dump))
    sorted_slots = torch.full((dump + 1,), n_slots, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    inv = torch.empty(n_slots, dtype=torch.int32, device=dev)
    inv.scatter_(0, order, torch.where(dest < dump, dest, -1).to(torch.int32))
    tile_e = torch.searchsorted(tile_end, torch.arange(n_tiles, device=dev), right=True)
    tile_e = torch.where(tile_e < n_local, tile_e, -1).to(torch.int32)
    return sorted_slots[:dump], inv, tile_e


def _num_sms(dev: torch.device) -> int:
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 4


def _pick(n_slots: int, n_local: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, split_k) heuristics: small tiles + split-K at decode sizes."""
    per_expert = n_slots / max(1, min(n_local, n_slots))
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    bn = next(b for b in (128, 64, 32, 16) if n % b == 0 and (bm >= 64 or b <= 64))
    bk = next(b for b in (128, 64, 32) if k % b == 0)
    blocks = min(n_local, n_slots) * (n // bn)
    split = max(1, min(k // bk // 4, -(-4 * sms // blocks))) if bm == 16 else 1
    return bm, bn, bk, split


def _check_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [T, d], got {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids/weights must be [T, k]: {tuple(ids.shape)} {tuple(weights.shape)}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"stacked experts expected: {tuple(w13.shape)} {tuple(w2.shape)}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("expert weights must be contiguous")


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if is_e8m0(s):
        return s.view(torch.uint8).contiguous(), True
    if s.dtype != torch.float32:
        raise ValueError(f"scales must be e8m0 or fp32, got {s.dtype}")
    return s.contiguous(), False


def _moe_run(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    inter: int,
    fp4: bool,
    block: tuple[int, int],
    limit: float,
    offset: int,
    block_m: int | None,
    split_k: int | None,
) -> torch.Tensor:
    t, d = x.shape
    topk = ids.shape[1]
    n_local, n_slots = w13.shape[0], t * topk
    out = torch.empty_like(x)
    if n_slots == 0:
        return out
    sms = _num_sms(x.device)
    bm, bn1, bk1, split1 = _pick(n_slots, n_local, inter, d, sms)
    _, bn2, bk2, split2 = _pick(n_slots, n_local, d, inter, sms)
    bm = block_m or bm
    if split_k is not None:
        split1 = split2 = split_k
    rows, inv, tile_e = _align(ids, n_local, offset, bm)
    n_tiles, n_rows = tile_e.numel(), rows.numel()
    s13, e8_13 = _scale_arg(s13)
    s2, e8_2 = _scale_arg(s2)
    common = dict(
        HAS_LIMIT=limit > 0, CDT=_dot_dtype(), FP4=fp4, SB_N=block[0], SB_K=block[1], BM=bm
    )
    h = torch.empty(n_rows, inter, dtype=torch.bfloat16, device=x.device)
    k1 = -(-(d // bk1) // split1) * bk1
    gate_args = (x, x.stride(0), rows, tile_e, w13, w13.stride(0), w13.stride(1))
    gate_args += (s13, s13.stride(0), s13.stride(1), s13.stride(-1))
    grid1 = (n_tiles, inter // bn1, split1)
    if split1 == 1:
        _moe_gemm[grid1](*gate_args, h, 0, h.stride(0), n_slots, topk, inter, d, k1, limit,
                         A_GATHER=True, GATED=True, FUSE_SWIGLU=True, SCALE_E8M0=e8_13,
                         BN=bn1, BK=bk1, **common)  # fmt: skip
    else:
        part = torch.empty(split1, n_rows, 2 * inter, dtype=torch.float32, device=x.device)
        _moe_gemm[grid1](*gate_args, part, part.stride(0), part.stride(1), n_slots, topk, inter,
                         d, k1, limit, A_GATHER=True, GATED=True, FUSE_SWIGLU=False,
                         SCALE_E8M0=e8_13, BN=bn1, BK=bk1, **common)  # fmt: skip
        _swiglu_reduce[(n_tiles, triton.cdiv(inter, 64))](
            part, part.stride(0), part.stride(1), h, h.stride(0), tile_e, inter, limit,
            SPLIT=split1, HAS_LIMIT=limit > 0, BM=bm, BN=64,
        )  # fmt: skip
    y = torch.empty(split2, n_rows, d, dtype=torch.float32, device=x.device)
    k2 = -(-(inter // bk2) // split2) * bk2
    _moe_gemm[(n_tiles, d // bn2, split2)](
        h, h.stride(0), rows, tile_e, w2, w2.stride(0), w2.stride(1),
        s2, s2.stride(0), s2.stride(1), s2.stride(-1), y, y.stride(0), y.stride(1),
        n_slots, topk, d, inter, k2, limit, A_GATHER=False, GATED=False, FUSE_SWIGLU=False,
        SCALE_E8M0=e8_2, BN=bn2, BK=bk2, **common,
    )  # fmt: skip
    w = weights.reshape(-1).float().contiguous()
    bd = min(1024, triton.next_power_of_2(d))
    _moe_combine[(t, triton.cdiv(d, bd))](
        y, y.stride(0), y.stride(1), inv, w, out, out.stride(0), d, topk, SPLIT=split2, BD=bd
    )
    return out


def moe_fp8_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    block: tuple[int, int],
    limit: float,
    local_expert_offset: int = 0,
    block_m: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """MegaMoE over fp8 e4m3 block-scaled experts: ``w13`` [E, 2I, d] (W1 rows then W3 rows),
    ``s13`` [E, 2I/b0, d/b1], ``w2`` [E, d, I], ``s2`` [E, d/b0, I/b1] (e8m0 or fp32).

    ``x`` [T, d] bf16/fp32, ``ids``/``weights`` [T, k]; returns [T, d] in x.dtype.
    """
    _check_experts(x, ids, weights, w13, w2)
    inter = w13.shape[1] // 2
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 e4m3 experts expected, got {w13.dtype} / {w2.dtype}")
    if w13.shape[2] != x.shape[1] or tuple(w2.shape[1:]) != (x.shape[1], inter):
        raise ValueError(f"expert shapes {tuple(w13.shape)} {tuple(w2.shape)} vs d={x.shape[1]}")
    if inter % block[0] or x.shape[1] % 32 or inter % 32:
        raise ValueError(f"I={inter} must divide by block {block} and d, I by 32")
    b0, b1 = block
    want13 = (w13.shape[0], -(-2 * inter // b0), -(-x.shape[1] // b1))
    want2 = (w2.shape[0], -(-x.shape[1] // b0), -(-inter // b1))
    if tuple(s13.shape) != want13 or tuple(s2.shape) != want2:
        raise ValueError(f"scales {tuple(s13.shape)} {tuple(s2.shape)}, want {want13} {want2}")
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, False, block, limit,
                    local_expert_offset, block_m, split_k)  # fmt: skip


def moe_fp4_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    block_m: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """MegaMoE over packed fp4 experts, dequantized in-kernel: ``w13`` int8 [E, 2I, d/2]
    (W1 rows then W3 rows, even column in the low nibble), ``s13`` e8m0 [E, 2I, d/32],
    ``w2`` int8 [E, d, I/2], ``s2`` [E, d, I/32]. Split-K fills the GPU at 1-64 tokens."""
    _check_experts(x, ids, weights, w13, w2)
    inter = w13.shape[1] // 2
    d = x.shape[1]
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        raise ValueError(f"packed fp4 (int8) experts expected, got {w13.dtype} / {w2.dtype}")
    if w13.shape[2] * 2 != d or tuple(w2.shape[1:]) != (d, inter // 2):
        raise ValueError(f"expert shapes {tuple(w13.shape)} {tuple(w2.shape)} vs d={d}")
    if d % 32 or inter % 32:
        raise ValueError(f"d={d} and I={inter} must divide by 32")
    if tuple(s13.shape) != (w13.shape[0], 2 * inter, d // 32) or tuple(s2.shape) != (
        w2.shape[0],
        d,
        inter // 32,
    ):
        raise ValueError(f"fp4 scales {tuple(s13.shape)} {tuple(s2.shape)} do not fit")
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, True, (1, 32), limit,
                    local_expert_offset, block_m, split_k)  # fmt: skip


def moe_fp8(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`moe_fp8_triton` on CUDA tensors, else :func:`moe_fp8_ref` (same arguments)."""
    return (moe_fp8_triton if x.is_cuda else moe_fp8_ref)(x, *args, **kwargs)


def moe_fp4(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """:func:`moe_fp4_triton` on CUDA tensors, else :func:`moe_fp4_ref` (same arguments)."""
    return (moe_fp4_triton if x.is_cuda else moe_fp4_ref)(x, *args, **kwargs)
