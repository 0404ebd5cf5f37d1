"""Basic layers whose parameter names match the official checkpoint (``X.weight``)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import fp8_linear
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


class Fp8Linear(nn.Module):
    """``y = x @ dequant(W)^T`` with the checkpoint's bytes: ``weight`` e4m3 [out, in] and
    ``scale`` (e8m0, or fp32) [ceil(out/b0), ceil(in/b1)] per ``block``; the Triton kernel
    streams the fp8 weight (half the bytes of bf16), the CPU reference dequantizes per call.
    The loader puts one in place of a :class:`Linear` when ``packed_dense`` is on."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int],
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.scale, self.block)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fp8 block {self.block}"
