"""The clamped SwiGLU of a dense expert whose W1 and W3 run as one GEMM.

``h13`` [T, 2I] holds ``W1 x`` in its first I columns and ``W3 x`` in the last I (the product
with the stacked ``[W1; W3]``); the result is ``silu(min(h1, L)) * clamp(h3, -L, L)`` [T, I]
(``kernels.moe_ref.swiglu_clamp``). The torch form is four elementwise launches; the Triton kernel
is one, which at decode batch sizes is what the shared expert of every layer pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import op
from kernels.moe_ref import swiglu_clamp


def swiglu_halves_ref(h13: torch.Tensor, limit: float) -> torch.Tensor:
    """``h13`` [T, 2I] -> [T, I] in h13's dtype (see the module docstring)."""
    inter = h13.shape[-1] // 2
    return swiglu_clamp(h13[..., :inter], h13[..., inter:], limit)


@triton.jit
def _swiglu_halves(h_ptr, sh, y_ptr, sy, inter, limit, CLAMP: tl.constexpr, BI: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BI + tl.arange(0, BI)
    m = c < inter
    h1 = tl.load(h_ptr + t * sh + c, mask=m, other=0.0)
    h3 = tl.load(h_ptr + t * sh + inter + c, mask=m, other=0.0)
    dt = h1.dtype
    a, b = h1.to(tl.float32), h3.to(tl.float32)
    if CLAMP:  # in fp32, rounded back to the input dtype (as torch's clamp with a scalar)
        a = tl.minimum(a, limit).to(dt).to(tl.float32)
        b = tl.minimum(tl.maximum(b, -limit), limit).to(dt).to(tl.float32)
    s = (a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32)  # torch's silu rounds to the dtype
    tl.store(y_ptr + t * sy + c, (s * b).to(dt), mask=m)


def swiglu_halves_triton(h13: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton :func:`swiglu_halves` (one launch)."""
    if h13.dim() != 2 or h13.shape[1] % 2 or h13.stride(1) != 1:
        raise ValueError(f"h13 must be [T, 2I] with unit stride, got {tuple(h13.shape)}")
    t, inter = h13.shape[0], h13.shape[1] // 2
    y = torch.empty(t, inter, dtype=h13.dtype, device=h13.device)
    if t:
        bi = min(1024, triton.next_power_of_2(inter))
        _swiglu_halves[(t, triton.cdiv(inter, bi))](
            h13, h13.stride(0), y, y.stride(0), inter, float(limit), CLAMP=limit > 0, BI=bi
        )
    return y


swiglu_halves = op(swiglu_halves_ref, swiglu_halves_triton)

__all__ = ["swiglu_halves", "swiglu_halves_ref", "swiglu_halves_triton"]
