"""Basic layers whose parameter names match the official checkpoint (``X.weight``)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import Fp8DecodePlan, fp8_decode_plan, fp8_linear
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
    ``scale`` (e8m0, or fp32) [ceil(out/b0), ceil(in/b1)] per ``block``; the Triton kernels
    stream the fp8 weight (half the bytes of bf16), the CPU reference dequantizes per call.
    The loader puts one in place of a :class:`Linear` when ``packed_dense`` is on.

    On CUDA, :meth:`prepare` (before any CUDA-graph capture: it synchronizes once) makes the
    decode kernel's plan (``kernels.linear.fp8_decode_plan``), which decode-sized calls then
    take; a projection without one (not prepared, or outside the kernel's exact range) keeps
    the MegaMoE GEMM."""

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
        self.plan: Fp8DecodePlan | None = None
        self._planned: tuple[torch.device, int] | None = None  # the weight the plan is for

    def prepare(self) -> bool:
        """Make the decode kernel's plan for the weight as it is now (CUDA) -> whether it
        has one. A plan already made for this weight is kept (graphs captured by another
        runner over the same model read it); call it again after moving the module."""
        w = self.weight
        if self.plan is not None and self._planned == (w.device, w.data_ptr()):
            return True
        if w.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("prepare fp8 projections before a CUDA-graph capture "
                               "(prepare_fp8_linears)")  # fmt: skip
        self.plan = fp8_decode_plan(w, self.scale, self.block) if w.is_cuda else None
        self._planned = (w.device, w.data_ptr())
        return self.plan is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan if self.plan is not None and self.plan.refs.device == x.device else None
        return fp8_linear(x, self.weight, self.scale, self.block, plan)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, fp8 block {self.block}"


def prepare_fp8_linears(model: nn.Module) -> tuple[int, list[str]]:
    """:meth:`Fp8Linear.prepare` every fp8 projection of ``model`` now (before any CUDA-graph
    capture) -> (how many take the decode kernel, the names of CUDA ones that cannot: fp32
    scales, shapes off its grid, or scales spanning more binades than it holds exactly).
    Projections stacked into one (``stacked_into``: the shared expert's W1 / W3, whose
    weights are views of it) count as that one, under the first one's name + "+"."""
    planned, refused, seen = 0, [], set()
    for name, m in model.named_modules():
        if not isinstance(m, Fp8Linear):
            continue
        into = m.__dict__.get("stacked_into")
        if into is not None and m.weight.untyped_storage().data_ptr() == \
                into.weight.untyped_storage().data_ptr():  # fmt: skip
            m, name = into, name + "+"
            if id(m) in seen:
                continue
            seen.add(id(m))
        if m.prepare():
            planned += 1
        elif m.weight.is_cuda:
            refused.append(name)
    return planned, refused
