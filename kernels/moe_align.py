"""The launches around the grouped GEMMs of the MoE layer (Triton), no host sync:

- ``_align`` (one program): the T*k (token, slot) pairs grouped by local expert into tiles
  of BM rows, each tile one expert; non-local experts dropped (and, in the same launch,
  x -> fp16 x 2^-4 for the fp16 GEMMs);
- ``_reduce_swiglu``: the W13 GEMM's K-split partials summed, then the clamped SwiGLU;
- ``_combine``: ``out[t] = sum_j w[t,j] * sum_s Y[s, row(t,j)]`` in a fixed order
  (deterministic; no atomics);
- ``_quant_rows``: the fp8 rows layout's fp8 activations, quantized once per launch with
  one scale per row.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import moe_decode
from kernels.moe_grouped import _as_gemm_input, _e4m3_rne, _f16_sixteenth

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _swiglu_reduce(
    p_ptr, sps, spm, h_ptr, shm, tile_e_ptr, N, limit, rows_ptr, rw_ptr, n_slots,
    SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, RG: tl.constexpr = 0,
):  # fmt: skip
    """H = swiglu(sum_s P[s, :, :N], sum_s P[s, :, N:]) for one tile and column block
    (F16: times 2^-4, the fp16 input convention of the next GEMM; RG: times the row's
    routing weight (``rw_ptr`` by slot, ``rows_ptr``), rounded in groups of RG columns,
    ``moe_grouped._as_gemm_input``)."""
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
    if RG > 0:
        slot = tl.load(rows_ptr + pos)
        h = h * tl.load(rw_ptr + slot, mask=slot < n_slots, other=0.0)[:, None]
    tl.store(h_ptr + pos[:, None] * shm + n[None, :],
             _as_gemm_input(h, h_ptr.dtype.element_ty, F16, USE_ASM, RG),
             mask=cmask)  # fmt: skip


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
            part += tl.load(y_ptr + s * sys + p * sym + cols, mask=m, other=0.0).to(tl.float32)
        acc += w * part
    tl.store(out_ptr + t * som + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _moe_align(
    ids_ptr, n_slots, offset, n_local, rows_ptr, inv_ptr, tile_e_ptr, cursor_ptr,
    n_tiles, n_rows, x_ptr, xa_ptr, n_x, BM: tl.constexpr, NB: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CONVERT: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Program 0: count slots per local expert (histogram), lay out BM-row tiles per expert
    (prefix sum), write each tile's expert, pad rows, then place every slot with an atomic
    cursor per expert. Row order inside an expert varies between runs; results do not (rows
    of a matrix product are independent, and the combine reads in slot order).
    ``CONVERT``: programs 1.. also write ``xa = fp16(x * 2^-4)`` (the F16 GEMMs' input),
    BLOCK values each, in the same launch."""
    if CONVERT:
        pid = tl.program_id(0)
        if pid > 0:
            i = (pid - 1) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + i, mask=i < n_x, other=0.0).to(tl.float32)
            tl.store(xa_ptr + i, _f16_sixteenth(v, USE_ASM), mask=i < n_x)
            return
    bins = tl.arange(0, NB)
    counts = tl.zeros((NB,), tl.int32)
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - offset
        local = (s < n_slots) & (e >= 0) & (e < n_local)
        counts += tl.histogram(tl.where(local, e, 0), NB, mask=local)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    first_row = (tile_end - tiles) * BM
    for t0 in range(0, n_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ex = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
        tl.store(tile_e_ptr + t, tl.where(ex < n_local, ex, -1), mask=t < n_tiles)
    for r0 in range(0, n_rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        tl.store(rows_ptr + r, tl.full((BLOCK,), 0, tl.int32) + n_slots, mask=r < n_rows)
    tl.store(cursor_ptr + bins, first_row)
    tl.debug_barrier()
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - offset
        local = (s < n_slots) & (e >= 0) & (e < n_local)
        p = tl.atomic_add(cursor_ptr + tl.where(local, e, 0), 1, mask=local)
        tl.store(rows_ptr + p, s, mask=local)
        tl.store(inv_ptr + s, tl.where(local, p, -1), mask=s < n_slots)


@triton.jit
def _quant_rows_kernel(x_ptr, sx, q_ptr, sq, sc_ptr, K, USE_ASM: tl.constexpr,
                       BK: tl.constexpr):  # fmt: skip
    """One row quantized with one scale over all of it: scale = max(amax, 1e-30) / 448 in fp32,
    values e4m3(x / scale) with ties to even (``moe_ref.fake_quant_act``'s rounding; the
    interpreter stores the e4m3 values in fp32: its fp8 casts misround); a pass for the amax,
    a pass to round."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BK,), tl.float32)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + r * sx + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    sc = tl.maximum(tl.max(amax, axis=0), 1e-30) / 448.0
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + r * sx + c, mask=c < K, other=0.0).to(tl.float32) / sc
        tl.store(q_ptr + r * sq + c, v.to(tl.float8e4nv) if USE_ASM else _e4m3_rne(v),
                 mask=c < K)  # fmt: skip
    tl.store(sc_ptr + r, sc)


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, K] -> (e4m3 values [R, K], fp32 scales [R, 1]): one scale per row (fp32
    values under the interpreter)."""
    r, k = x.shape
    q = torch.empty(r, k, device=x.device,
                    dtype=torch.float32 if _INTERPRET else torch.float8_e4m3fn)  # fmt: skip
    sc = torch.empty(r, 1, device=x.device, dtype=torch.float32)
    if r:
        _quant_rows_kernel[(r,)](x, x.stride(0), q, q.stride(0), sc, k,
                                 USE_ASM=not _INTERPRET, BK=1024)  # fmt: skip
    return q, sc


def _align(
    ids: torch.Tensor,
    n_local: int,
    offset: int,
    bm: int,
    x: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots by tile row [tiles*BM] int32 (pad = T*k), row of each slot [T*k] int32
    (-1 = not local), tile experts [tiles] int32 (-1 = idle)); one launch, no host sync.
    With ``x`` and ``xa`` the same launch writes ``xa = fp16(x * 2^-4)`` (the F16 path's
    activations; one launch fewer per layer).

    e.g. BM=2, slot experts [1,0,1] -> rows [1,-,0,2] (``-`` = pad; 0 and 2 in either
    order), tile experts [0,1]."""
    n_slots = ids.numel()
    n_tiles = moe_decode.tile_count(n_slots, n_local, bm)
    n_rows = n_tiles * bm
    dev = ids.device
    rows = torch.empty(n_rows, dtype=torch.int32, device=dev)
    inv = torch.empty(n_slots, dtype=torch.int32, device=dev)
    tile_e = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    nb = triton.next_power_of_2(n_local + 1)
    cursor = torch.empty(nb, dtype=torch.int32, device=dev)
    convert = x is not None and xa is not None
    n_x = x.numel() if convert else 0
    _moe_align[(1 + triton.cdiv(n_x, 1024),)](
        ids.reshape(-1), n_slots, offset, n_local, rows, inv, tile_e, cursor, n_tiles, n_rows,
        x if convert else ids, xa if convert else ids, n_x, BM=bm, NB=nb, BLOCK=1024,
        BLOCK_T=max(16, 8192 // nb), CONVERT=convert, USE_ASM=not _INTERPRET, num_warps=8,
    )  # fmt: skip
    return rows, inv, tile_e


def _reduce_swiglu(part: torch.Tensor, h: torch.Tensor, tile_e: torch.Tensor, inter: int,
                   limit: float, bm: int, f16: bool, rg: int = 0,
                   rows: torch.Tensor | None = None,
                   rw: torch.Tensor | None = None) -> None:  # fmt: skip
    """H = SwiGLU(sum of the W13 GEMM's K-split partials ``part`` [split, rows, 2I]); ``rg``:
    times the routing weight ``rw`` [slots] of each row's slot (``rows``), rounded in groups
    of that many columns (a divisor of I)."""
    bn = max(64, rg)
    _swiglu_reduce[(tile_e.numel(), triton.cdiv(inter, bn))](
        part, part.stride(0), part.stride(1), h, h.stride(0), tile_e, inter, limit, rows, rw,
        rw.numel() if rw is not None else 0, SPLIT=part.shape[0], HAS_LIMIT=limit > 0, F16=f16,
        USE_ASM=not _INTERPRET, BM=bm, BN=bn, RG=rg,
    )  # fmt: skip


def _y_buffer(x: torch.Tensor, split: int, n_rows: int) -> torch.Tensor:
    """The W2 GEMM's output: bf16 when one K split writes it whole (each expert's output
    rounded once, as the reference's bf16 ``h @ W2^T`` is; the combine still sums in fp32; at
    4096 tokens its fp32 write and read back were ~0.5 GB of traffic), else fp32 partials."""
    dt = torch.bfloat16 if split == 1 and x.dtype == torch.bfloat16 else torch.float32
    return torch.empty(split, n_rows, x.shape[1], dtype=dt, device=x.device)


def _combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out[t] = sum_j w[t, j] * sum_s Y[s, row(t, j)] (fixed order)."""
    t, d = out.shape
    topk = weights.shape[1]
    w = weights.reshape(-1).float().contiguous()
    bd = min(1024, triton.next_power_of_2(d))
    _moe_combine[(t, triton.cdiv(d, bd))](
        y, y.stride(0), y.stride(1), inv, w, out, out.stride(0), d, topk, SPLIT=y.shape[0], BD=bd
    )
    return out
