"""Rotary embedding op: torch reference (a Triton kernel joins it with the attention kernels)."""

from __future__ import annotations

import torch


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
