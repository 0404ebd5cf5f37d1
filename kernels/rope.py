"""Rotary embedding: the torch reference, and the Triton helpers the attention, combine and
compressor kernels rotate with (fused into their epilogues, no op of their own)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def apply_rope_ref(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2*angles.shape[-1]`` channels of ``x``.

    ``x``: [T, D] or [T, H, D]; ``angles``: [T, D_rope/2] (broadcast over heads).
    Computed in fp32 as a complex multiply (the reference's rounding), returned in x.dtype.
    """
    rd = angles.shape[-1] * 2
    pairs = torch.view_as_complex(x[..., -rd:].float().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.polar(torch.ones_like(angles), angles)
    if x.dim() == 3:
        rot = rot.unsqueeze(1)
    if inverse:
        rot = rot.conj()
    out = torch.view_as_real(pairs * rot).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], out), dim=-1)


apply_rope = apply_rope_ref


@triton.jit
def rope_pairs(x, ang, INVERSE: tl.constexpr):
    """Rotate interleaved pairs of ``x`` [M, D] by ``ang`` [M or 1, D/2] (0 = untouched pair)."""
    M: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (M, D // 2, 2)))
    c = tl.cos(ang)
    s = tl.sin(ang)
    if INVERSE:
        s = -s
    return tl.reshape(tl.join(a * c - b * s, a * s + b * c), (M, D))


@triton.jit
def rope_angles(ang_ptr, D: tl.constexpr, R: tl.constexpr):
    """Angles [1, D/2] for the pairs of a D-vector whose last R channels are rotated."""
    j = tl.arange(0, D // 2) - (D // 2 - R // 2)
    return tl.load(ang_ptr + j, mask=j >= 0, other=0.0)[None, :]
