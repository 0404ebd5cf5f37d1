"""bf16 x bf16 -> fp32 GEMM for the LM head: ``y = x @ w^T`` with fp32 accumulation and an
fp32 result, reading ``w`` as stored (no fp32 copy of a 129280 x 5120 head per step).

bf16 products are exact in fp32, so this computes what the reference's fp32 head computes
from bf16 weights and activations, up to the order of the sums.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op


def linear_f32_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K], ``w`` [N, K] -> fp32 [M, N]."""
    return torch.nn.functional.linear(x.float(), w.float())


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


linear_f32 = op(linear_f32_ref, lambda x, w: linear_f32_triton(x.contiguous(), w),
                when=_half_operands)
