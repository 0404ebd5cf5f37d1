"""KV compressors: V4.1 CSA2 (non-overlapping, ratio 1 or 2) and V4 CSA/HCA (gated windows).

All compressor math is fp32. Compressors return *unrotated, normalized* entries; the
attention layer applies RoPE at each entry's first position ``w * ratio``.
"""

from __future__ import annotations

import torch
from torch import nn

from app.model.layers import Linear, RMSNorm


class Compressor41(nn.Module):
    """V4.1: ratio 1 ``norm(wkv x)``; ratio 2 ``norm(sum softmax_pair(wgate x) * wkv x)``."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(hidden, dim)
        if ratio > 1:
            self.wgate = Linear(hidden, dim)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [L, hidden] of one sequence from position 0 -> [L // ratio, dim]."""
        if self.ratio == 1:
            return self.norm(self.wkv(x.float()))
        n = x.shape[0] // self.ratio * self.ratio
        v = self.wkv(x[:n].float()).unflatten(0, (n // self.ratio, self.ratio))
        g = self.wgate(x[:n].float()).unflatten(0, (n // self.ratio, self.ratio))
        return self.norm((v * g.softmax(dim=1)).sum(dim=1))


class CompressorV4(nn.Module):
    """V4 gated-window compressor.

    HCA (``overlap=False``): entry w = softmax over the m tokens of window w (per channel)
    of ``wgate x + ape[t mod m]`` weighting ``wkv x``.
    CSA (``overlap=True``): projections are 2*dim wide, ``[Ca | Cb]``; entry w softmaxes over
    2m slots = Ca of window w-1 and Cb of window w (window -1 has gate -inf).
    """

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, width)
        self.wgate = Linear(hidden, width)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [L, hidden] of one sequence from position 0 -> [L // ratio, dim]."""
        m = self.ratio
        n_win = x.shape[0] // m
        width = self.ape.shape[1]
        v = self.wkv(x[: n_win * m].float()).view(n_win, m, width)
        g = self.wgate(x[: n_win * m].float()).view(n_win, m, width) + self.ape.float()
        if not self.overlap:
            return self.norm((v * g.softmax(dim=1)).sum(dim=1))
        d = self.dim
        kv = v.new_zeros(n_win, 2 * m, d)
        gate = g.new_full((n_win, 2 * m, d), float("-inf"))
        kv[:, m:], gate[:, m:] = v[..., d:], g[..., d:]
        if n_win > 1:
            kv[1:, :m], gate[1:, :m] = v[:-1, :, :d], g[:-1, :, :d]
        return self.norm((kv * gate.softmax(dim=1)).sum(dim=1))
