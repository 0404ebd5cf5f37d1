"""Basic layers whose parameter names match the official checkpoint (``X.weight``)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import rms_norm


class Linear(nn.Module):
    """``y = x @ W^T`` with ``weight`` [out, in]; fp8/fp4 checkpoints are dequantized at load."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 ``weight`` (math in fp32, output in the input dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
