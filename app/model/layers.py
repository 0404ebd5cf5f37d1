"""Basic layers whose parameter names match the official checkpoint (``X.weight``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kernels.fp8_act import act_round
from kernels.linear import (
    Fp8DecodePlan,
    dense_linear,
    fp8_act_linear,
    fp8_decode_plan,
    fp8_linear,
)
from kernels.norm import rms_norm


class Linear(nn.Module):
    """``y = x @ W^T`` with ``weight`` [out, in]; fp8/fp4 checkpoints are dequantized at load.

    ``act_group`` (set by the loader under ``dense_act="fp8"`` on the release's fp8
    projections; 0: off): the input is first rounded as the release rounds a quantized
    GEMM's input, to e4m3 in per-token groups of that many columns with power-of-two scales
    (``kernels.fp8_act``); the products with the dequantized weights are then exact."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.act_group = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.act_group:
            x = act_round(x, self.act_group)
        return dense_linear(x, self.weight)

    def extra_repr(self) -> str:
        act = f", fp8 activations in groups of {self.act_group}" if self.act_group else ""
        return f"{self.in_features} -> {self.out_features}{act}"


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
    the MegaMoE GEMM. ``act_group`` as for :class:`Linear`: the release's fp8 GEMM, fp8
    activations times the fp8 weights (``kernels.linear.fp8_act_linear``)."""

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
        self.act_group = 0

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
        if self.act_group:
            return fp8_act_linear(x, self.weight, self.scale, self.block, self.act_group, plan)
        return fp8_linear(x, self.weight, self.scale, self.block, plan)

    def extra_repr(self) -> str:
        act = f", fp8 activations in groups of {self.act_group}" if self.act_group else ""
        return f"{self.in_features} -> {self.out_features}, fp8 block {self.block}{act}"


def stack_problem(parts: Sequence[nn.Module], same_shape: bool = False) -> str | None:
    """Why projections of one input cannot run as one GEMM over their stacked weights, or
    None: plain :class:`Linear` weights, or fp8 ones of one block and scale dtype whose scale
    blocks end at every seam (all but the last part a whole number of blocks tall); one
    input width, dtype and device (and, with ``same_shape``, one output width)."""
    if len(parts) < 2:
        return "fewer than two projections"
    kind = type(parts[0])
    if kind not in (Linear, Fp8Linear) or any(type(p) is not kind for p in parts):
        return "not all plain or all fp8 projections"
    w0 = parts[0].weight
    if any(p.in_features != parts[0].in_features or p.weight.dtype != w0.dtype
           or p.weight.device != w0.device for p in parts):  # fmt: skip
        return "input widths, dtypes or devices differ"
    if same_shape and any(p.weight.shape != w0.shape for p in parts):
        return "output widths differ"
    if any(p.act_group != parts[0].act_group for p in parts):
        return "activation rounding differs"
    if kind is Fp8Linear:
        b, sdt = parts[0].block, parts[0].scale.dtype
        if any(p.block != b or p.scale.dtype != sdt for p in parts):
            return "fp8 blocks or scale dtypes differ"
        if any(p.out_features % b[0] for p in parts[:-1]):
            return f"a scale block of {b[0]} rows straddles a seam"
    return None


def _marks(parts: Sequence[nn.Module]) -> tuple:
    """What a stack was made from: each part, the storage of its weight (and scale) and its
    activation rounding."""
    return tuple((p, p.weight.data_ptr(), p.scale.data_ptr() if isinstance(p, Fp8Linear)
                  else 0, p.act_group) for p in parts)  # fmt: skip


def stacked_projection(owner: nn.Module, key: str, parts: Sequence[nn.Module],
                       same_shape: bool = False) -> nn.Module | None:  # fmt: skip
    """``parts`` (projections of one input) as one projection over their stacked weights (and
    fp8 scale rows), whose output is the parts' outputs side by side; None when they cannot
    stack (:func:`stack_problem`). The parts' weights (and scales) become views of it, so
    there is no second copy; it lives in ``owner``'s stacks under ``key`` (not a submodule:
    the state dict keeps the parts; a :class:`StackingModule` drops its stacks when moved).
    Made once -- a forward only compares pointers -- and again when a part or its weight was
    replaced since (a loader). An fp8 stack on CUDA gets its decode plan here, and
    :func:`prepare_fp8_linears` plans it with its parts. Stack before a CUDA-graph capture
    (:func:`stack_projections`)."""
    stacks = owner.__dict__.setdefault("_stacks", {})
    made = stacks.get(key)
    if made is not None and made[1] == _marks(parts):
        return made[0]
    w0 = parts[0].weight
    if w0.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"stack {type(owner).__name__}'s projections before a CUDA-graph "
                           "capture (stack_projections)")  # fmt: skip
    stack = None
    if stack_problem(parts, same_shape) is None:
        weight = torch.cat([p.weight.data for p in parts])
        if isinstance(parts[0], Fp8Linear):
            stack = Fp8Linear(weight, torch.cat([p.scale for p in parts]), parts[0].block)
        else:
            stack = Linear(w0.shape[1], weight.shape[0], dtype=w0.dtype)
            stack.weight = nn.Parameter(weight, requires_grad=False)
        stack.act_group = parts[0].act_group  # one input, rounded once for every part
        row = srow = 0
        for p in parts:
            n = p.weight.shape[0]
            p.weight.data = stack.weight.data[row : row + n]
            row += n
            if isinstance(p, Fp8Linear):
                p.scale = stack.scale[srow : srow + p.scale.shape[0]]
                srow += p.scale.shape[0]
                p.__dict__["stacked_into"] = stack
        if isinstance(stack, Fp8Linear) and weight.is_cuda:
            stack.prepare()
    stacks[key] = (stack, _marks(parts))
    return stack


class StackingModule(nn.Module):
    """A module whose projections run stacked (:func:`stacked_projection`). Moving or casting
    it (``to``, ``cuda``, ``half``, ...) drops its stacks: the parts get tensors of their own
    and the old stacked storage is freed at once, not at the next forward, which stacks
    again."""

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_stacks", None)
        return super()._apply(fn, recurse)

    def stack_of(self, key: str) -> nn.Module | None:
        """The stack made under ``key`` (None: not made, or the parts do not stack)."""
        made = self.__dict__.get("_stacks", {}).get(key)
        return made[0] if made is not None else None


def stack_projections(model: nn.Module) -> int:
    """Stack, now, the projections every module of ``model`` runs as one GEMM (modules with a
    ``stack_projections()`` method: the dense experts' W1 / W3, attention's wq_a / wkv), on
    the weights' device, rather than at a first forward that may be inside a CUDA-graph
    capture -> how many modules run stacked."""
    return sum(bool(m.stack_projections()) for m in model.modules()
               if hasattr(type(m), "stack_projections"))  # fmt: skip


def prepare_fp8_linears(model: nn.Module) -> tuple[int, list[str]]:
    """:meth:`Fp8Linear.prepare` every fp8 projection of ``model`` now (before any CUDA-graph
    capture) -> (how many take the decode kernel, the names of CUDA ones that cannot: fp32
    scales, shapes off its grid, or scales spanning more binades than it holds exactly).
    Projections stacked into one (``stacked_into``: e.g. attention's wq_a / wkv, whose
    weights are views of it) are planned as parts (a part may still run alone: the drafters'
    wkv) and as the stack, which counts once, under its first part's name + "+"."""
    planned, refused, seen = 0, [], set()
    for name, m in model.named_modules():
        if not isinstance(m, Fp8Linear):
            continue
        todo = [(m, name)]
        into = m.__dict__.get("stacked_into")
        if into is not None and id(into) not in seen and m.weight.untyped_storage().data_ptr() \
                == into.weight.untyped_storage().data_ptr():  # fmt: skip
            seen.add(id(into))
            todo.append((into, name + "+"))
        for lin, what in todo:
            if lin.prepare():
                planned += 1
            elif lin.weight.is_cuda:
                refused.append(what)
    return planned, refused
