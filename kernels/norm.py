"""RMSNorm op (torch reference): ``w * x * rsqrt(mean(x^2) + eps)`` computed in fp32."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalize the last dim in fp32; ``weight`` None means weightless. Returns x.dtype."""
    v = x.float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        v = weight.float() * v
    return v.to(x.dtype)


rms_norm = rms_norm_ref
