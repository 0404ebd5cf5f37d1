"""Batch-invariant GEMMs: the products over token rows in the deterministic mode
(``EngineConfig.deterministic``; ``kernels.dispatch.batch_invariant``).

A GEMM library picks its algorithm by the row count M: MKL on the CPU (a GEMV at M = 1, other
blockings from 16 rows; measured with torch 2.13), cuBLAS on CUDA (tiles and split-K by
shape), so one token's row of ``x @ w^T`` changes bits with the number of other rows. Inside
the mode, :func:`linear` computes every row the same way whatever M is:

    CPU    rows in tiles of ROW_TILE (the last one padded with zeros), one GEMM call of
           exactly [ROW_TILE, K] per tile: every row sees the same call; a row's result
           does not depend on its place in the tile (tests/unit/test_deterministic.py)
    CUDA   one Triton kernel of fixed tiles (BM x BN x BK, :data:`TILES` by dtype) and a K
           split fixed by N, K and the GPU's SM count, never by M; the splits are summed in
           split order

Outside the mode it is ``torch.nn.functional.linear``. Every op of the step, what its default
path does and what the mode does (``default -> mode``):

    projections, LM head, mHC mix, gate GEMM, dense and shared experts, DSpark heads
        MKL / cuBLAS by M; ``dense_linear``: a split-K kernel up to 16 rows; ``linear_f32``:
        tile height by M  ->  :func:`linear`
    attention's grouped output (``wo_a``)
        one einsum (a bmm over groups, M = T)  ->  :func:`grouped_linear`
    routed experts, reference (CPU; CUDA with unpacked experts)
        one GEMM per expert over the rows routed to it  ->  :func:`linear` per expert; the
        combine adds a token's experts in id order (invariant)
    routed experts, MegaMoE kernels (CUDA)
        tiles, K splits, fp16 / bf16 MMA and the Gluon decode kernels by rows per expert
        ->  fixed tiles, one K split, bf16 MMA (``kernels.moe``)
    mHC (CUDA)
        one or two launches, d splits by token count  ->  two launches, d splits by d
        (``kernels.mhc``)
    sparse attention (CUDA)
        Gluon or portable kernel, KV splits by the grid's fill  ->  the portable kernel, splits
        by key count (``kernels.attention``)
    indexer scores (CUDA)
        tiles autotuned per key-count bucket  ->  one fixed config (``kernels.indexer``)
    paged indexer scores (CUDA)
        decode steps: the token kernel, key chunks per token by the grid's fill; other steps:
        the token-blocks kernel  ->  the token kernel at every step (a token's row is
        computed alike in a decode step and in a prefill chunk), one fixed tile, chunks by
        key count (``kernels.indexer_token``)
    sigmoid, SiLU, softplus (CPU)
        vector code, scalar code in the tail  ->  :func:`pointwise`
    sums over mHC's streams (the collapse, DSpark's taps); V4's head-mix norm (CUDA)
        torch reductions, configured by the number of outputs  ->  :func:`stream_sum` /
        :func:`stream_mean` (one stream at a time), :func:`row_mean` (:func:`rows_gemm`)
    attention, paged indexer (CPU)
        invariant: per-token products (a batch over tokens), each token's own keys
    norms, RoPE, SwiGLU (CUDA), KV rounding, fp8 activation rounding (``dense_act``),
    compressor pooling, Engram, softmax, sampling
        invariant: one row (or group) per program, reductions along the row
    top-k, candidate blocks, gate top-k, argmax
        invariant: selections, exact in any order

tests/unit/test_deterministic.py checks the CPU rows (the ops and the engine), tests/gpu/
test_deterministic_cuda.py the CUDA ones.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels.dispatch import invariant_mode, sm_count

ROW_TILE = 16  # CPU: rows per GEMM call in the mode
POINTWISE_TILE = 4096  # CPU: values per element-wise call in the mode (under torch's grain)
# CUDA: the fixed tiles (BM, BN, BK) of _rows_gemm by operand dtype: 16-bit operands on the
# tensor cores; fp32 ones (exact products, CUDA cores: the LM head and compressors the loader
# keeps in fp32) in 16-row tiles, since a decode step's one row pays for the whole tile
TILES = {torch.bfloat16: (64, 128, 64), torch.float16: (64, 128, 64),
         torch.float32: (16, 64, 32)}  # fmt: skip
_INTERPRET_TILES = (16, 16, 16)  # under TRITON_INTERPRET=1 (numpy is slow at 64 x 128)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` for ``x`` [..., K] and ``w`` [N, K] of one dtype, in x's dtype (fp32
    accumulation), as ``torch.nn.functional.linear``; inside the mode batch-invariant (module
    doc): each row's bits depend on that row and ``w`` only."""
    if not invariant_mode():
        return torch.nn.functional.linear(x, w)
    if x.is_cuda:
        return rows_gemm(x, w, x.dtype)
    return _cpu_tiles(x, w)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn``; inside the mode on the CPU over a flat copy of
    ``x`` padded to whole tiles of :data:`POINTWISE_TILE` values, one call per tile. torch's
    CPU loops run vector code over a tensor and scalar code over its tail (and over each
    thread's share, split at offsets set by the size), and for sigmoid, SiLU, softplus and
    exp2 the two differ in the last bit (torch 2.13): which values fall in a tail depends on
    the tensor's size, so on the other rows of a batch. In whole tiles below torch's
    parallel grain, none does. (exp, log, sin, cos, tanh, sqrt, rsqrt and the arithmetic
    agree in both: they need no tiles.)"""
    n = x.numel()
    if not invariant_mode() or x.is_cuda or n == 0:
        return fn(x)
    flat = torch.cat((x.reshape(-1), x.new_zeros((-n) % POINTWISE_TILE)))
    return torch.cat([fn(t) for t in flat.split(POINTWISE_TILE)])[:n].view(x.shape)


def stream_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(1)`` of ``x`` [T, n, d] (mHC's streams); in the mode added left to right, one
    stream at a time (a CUDA reduction over a short middle dimension may split it across
    threads as the number of outputs asks)."""
    if not invariant_mode():
        return x.sum(1)
    acc = x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + x[:, j]
    return acc


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(1)`` in fp32 of ``x`` [T, n, d] (:func:`stream_sum` over n in the mode)."""
    if not invariant_mode():
        return x.float().mean(dim=1)
    return stream_sum(x.float()) / x.shape[1]


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1, keepdim=True)`` of ``x`` [R, K]; in the mode on CUDA a GEMM with a column
    of ones (:func:`rows_gemm`: CUDA's reduction may split a long row across blocks when there
    are few rows). (The CPU's reduction along a row is per row.)"""
    if not invariant_mode() or not x.is_cuda:
        return x.mean(-1, keepdim=True)
    ones = torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device)
    return rows_gemm(x, ones, torch.float32) / x.shape[-1]


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y[t, g] = x[t, g] @ w[g]^T`` for ``x`` [T, G, I] and ``w`` [G, O, I] -> [T, G, O]
    (attention's grouped low-rank output): one einsum, or one :func:`linear` per group in
    the mode."""
    if not invariant_mode():
        return torch.einsum("tgi,goi->tgo", x, w)
    return torch.stack([linear(x[:, g], w[g]) for g in range(w.shape[0])], dim=1)


def _cpu_tiles(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`linear` on the CPU in the mode: ROW_TILE rows per GEMM call."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    pad = (-m) % ROW_TILE
    if pad or not x2.is_contiguous():
        x2 = torch.cat((x2, x2.new_zeros(pad, k))) if pad else x2.contiguous()
    parts = [torch.nn.functional.linear(t, w) for t in x2.split(ROW_TILE)]
    y = torch.cat(parts)[:m] if parts else x2.new_empty(0, w.shape[0])
    return y.reshape(*x.shape[:-1], w.shape[0])


MAX_SPLIT = 8  # K splits of rows_gemm at most


def rows_split(n: int, k: int, sms: int, bn: int, bk: int) -> int:
    """K splits of :func:`rows_gemm` for an [N, K] weight: about one program per SM at one
    row tile (a decode step streams the weight once over the whole GPU), each split keeping
    at least four K blocks, at most :data:`MAX_SPLIT`; a function of N, K and the GPU, never
    of the rows. The price is paid at prefill, where every row's fp32 partials are written
    and summed ``split`` times (docs/performance.md, Deterministic mode)."""
    blocks = triton.cdiv(n, bn)
    return max(1, min(k // (4 * bk), MAX_SPLIT, round(sms / blocks)))


@triton.jit
def _split_sum_cast(y_ptr, sys, out_ptr, n_elem, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = sum_s y[s]`` over the first ``n_elem`` values of each split (in split order,
    fp32), rounded to out's dtype: the split-K reduction and the cast in one launch."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n_elem
    acc = tl.load(y_ptr + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(y_ptr + s * sys + i, mask=m, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rows_gemm(x_ptr, w_ptr, y_ptr, M, N, K, k_per, sxm, swn, sys, sym,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
               F32_DOT: tl.constexpr):  # fmt: skip
    """One (row tile, N block, K split): ``y[split] = x[rows, k-range] @ w[n, k-range]^T``
    in fp32 (the tile, N block and K range fixed by the launch, never by M)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    m = pid_m * BM + tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    k_lo = pid_k * k_per
    for k0 in range(k_lo, k_lo + k_per, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * sxm + k[None, :],
                    mask=(m < M)[:, None] & km[None, :], other=0.0)  # fmt: skip
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * swn + k[:, None],
                    mask=(n < N)[None, :] & km[:, None], other=0.0)  # fmt: skip
        if F32_DOT:  # the interpreter multiplies bf16 storage wrongly: widen there
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    out = y_ptr + pid_k.to(tl.int64) * sys + m[:, None].to(tl.int64) * sym + n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & (n < N)[None, :])


def rows_gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
              split: int | None = None) -> torch.Tensor:  # fmt: skip
    """The CUDA :func:`linear` of the mode (and the LM head's fp32 one): ``x`` [..., K] @
    ``w`` [N, K]^T -> ``out_dtype``, fixed tiles and ``split`` K splits (default
    :func:`rows_split`), summed in split order (:func:`_split_sum_cast`)."""
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or x.dtype != w.dtype or x.dtype not in TILES:
        raise ValueError(f"x [..., K] and w [N, K] of one dtype of {list(TILES)}: "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(w.shape)} {w.dtype}")  # fmt: skip
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y_shape = (*x.shape[:-1], n)
    if m == 0 or n == 0:
        return torch.empty(y_shape, dtype=out_dtype, device=x.device)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    bm, bn, bk = _INTERPRET_TILES if interp else TILES[x2.dtype]
    sms = sm_count(x.device) if x.is_cuda else 4
    if split is None:
        split = rows_split(n, k, sms, bn, bk)
    k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_per)
    part = torch.empty(split, m, n, device=x.device,
                       dtype=out_dtype if split == 1 else torch.float32)  # fmt: skip
    _rows_gemm[(triton.cdiv(n, bn), triton.cdiv(m, bm), split)](
        x2, w, part, m, n, k, k_per, x2.stride(0), w.stride(0), part.stride(0),
        part.stride(1), BM=bm, BN=bn, BK=bk,
        PREC="ieee" if x2.dtype == torch.float32 else "tf32",
        F32_DOT=interp, num_warps=4, num_stages=3,
    )  # fmt: skip
    if split == 1:
        return part[0].view(y_shape)
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    _split_sum_cast[(triton.cdiv(m * n, 1024),)](part, part.stride(0), y, m * n, SPLIT=split,
                                                 BLOCK=1024)  # fmt: skip
    return y.view(y_shape)
