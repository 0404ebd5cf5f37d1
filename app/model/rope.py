"""Partial rotary embedding on interleaved pairs of the last ``rope_dim`` channels, with YaRN.

Vectors are laid out ``[nope | rope]``; pairs are (2i, 2i+1) inside the rope part.
Compressed layers use ``compress_rope_theta`` with frequency-only YaRN (no mscale);
SWA-only layers use ``rope_theta`` without scaling.
"""

from __future__ import annotations

import math

import torch

from app.model.config import ModelConfig, RopeScaling
from kernels.rope import apply_rope

__all__ = ["Rotary", "apply_rope", "rope_frequencies"]


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """fp32 inverse frequencies [dim/2] (YaRN blends ``f/factor`` and ``f`` by a ramp)."""
    # Explicit CPU device: derived tensors stay real when the model is built on "meta".
    exps = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    freqs = 1.0 / (theta**exps)
    if scaling is None:
        return freqs
    orig = scaling.original_max_position_embeddings

    def corr(beta: float) -> float:
        return dim * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(scaling.beta_fast)), 0)
    high = min(math.ceil(corr(scaling.beta_slow)), dim - 1)
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


class Rotary:
    """Angles for one layer type; ``angles(pos)`` -> fp32 [..., dim/2]."""

    def __init__(self, cfg: ModelConfig, compressed: bool) -> None:
        theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
        scaling = cfg.rope_scaling if compressed else None
        self.dim = cfg.qk_rope_head_dim
        self.freqs = rope_frequencies(self.dim, theta, scaling)
        # equal for every layer of one type: a step computes their angles once (StepMeta)
        self.key = (self.dim, theta, repr(scaling))
        self._on: dict[torch.device, torch.Tensor] = {}  # copies per device (made once)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = self._on.get(positions.device)
        if freqs is None:
            freqs = self._on[positions.device] = self.freqs.to(positions.device)
        return positions.to(torch.float32).unsqueeze(-1) * freqs
