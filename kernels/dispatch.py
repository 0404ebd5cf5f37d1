"""The one dispatch rule of every kernel op: its Triton kernel for CUDA tensors, its torch
reference otherwise (CPU, and CUDA inside :func:`reference_kernels`).

    sparse_attention = op(sparse_attention_ref, sparse_attention_triton)

``when`` narrows the Triton path to the inputs its kernel supports (e.g. top-k row widths);
``device_arg`` names the argument whose device decides (default: the first tensor). The
returned function carries ``.reference`` and ``.triton`` for tests and benchmarks.

Inside :func:`batch_invariant` (the engine's deterministic mode) an op's ``invariant`` entry,
where it has one, takes the place of its Triton entry on CUDA: a kernel whose reduction
order per row never depends on the row count (``kernels.invariant`` says which ops need one
and why the others do not); the references read :func:`invariant_mode` where a GEMM over
rows would otherwise pick its algorithm by the row count.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_state = threading.local()
OPS: dict[str, Callable[..., Any]] = {}  # name -> dispatching function, as op() made them


@contextlib.contextmanager
def reference_kernels(*names: str) -> Iterator[None]:
    """Run ops through their torch reference, on CUDA too (A/B checks, debugging): every op,
    or only those named (their :data:`OPS` names, e.g. ``"sparse_attention"``), which is how
    a mismatch is bisected to one kernel. A name not in :data:`OPS` (a typo, or an op whose
    module is not imported yet) is an error."""
    unknown = sorted(set(names) - set(OPS))
    if unknown:  # a typo would otherwise bisect nothing, silently
        raise ValueError(f"no kernel op named {unknown}; ops: {sorted(OPS)}")
    prev = getattr(_state, "reference", False)
    if not names:
        _state.reference = True
    elif prev is not True:
        _state.reference = frozenset(names) | (prev or frozenset())
    try:
        yield
    finally:
        _state.reference = prev


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Compute every op of this thread batch-invariantly while inside (``on``; False leaves
    the mode as it is): each row's result depends on that row's data only, never on how many
    rows a call has (the engine enters it around its steps in deterministic mode)."""
    prev = getattr(_state, "invariant", False)
    _state.invariant = prev or on
    try:
        yield
    finally:
        _state.invariant = prev


def invariant_mode() -> bool:
    """Whether this thread is inside :func:`batch_invariant`."""
    return getattr(_state, "invariant", False)


def op_name(fn: Callable[..., Any]) -> str:
    """The name :func:`reference_kernels` knows a dispatching function (or reference) by."""
    return getattr(fn, "op_name", None) or fn.__name__.removesuffix("_ref")


def _use_reference(name: str) -> bool:
    ref = getattr(_state, "reference", False)
    return ref is True or (bool(ref) and name in ref)


def sm_count(device: torch.device | int | None) -> int:
    """Streaming multiprocessors of a CUDA device (index None: device 0), for the launch
    heuristics; cached, as they ask at every call."""
    if isinstance(device, torch.device):
        device = device.index
    return _sm_count(device or 0)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(n: int, device: torch.device) -> torch.Tensor:
    """``n`` zeroed int32 counters for a launch whose programs count themselves in and whose
    last one finishes the work (it sets its counter back to zero, so launches in stream
    order share them: the MoE / dense split sums, the one-launch mHC). Kept per device:
    only when made outside a CUDA-graph capture, and never freed (a captured graph may hold
    an outgrown buffer)."""
    kept = _COUNTERS.setdefault(device, [])
    if kept and kept[-1].numel() >= n:
        return kept[-1][:n]
    c = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        kept.append(c)
    return c[:n]


def capability(device: torch.device | int | None) -> tuple[int, int]:
    """Compute capability of a CUDA device (index None: device 0); cached, as the kernel
    choice asks at every call."""
    if isinstance(device, torch.device):
        device = device.index
    return _capability(device or 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _decider(args: tuple, kwargs: dict, device_arg: int | None) -> torch.Tensor | None:
    if device_arg is not None:
        return args[device_arg] if len(args) > device_arg else None
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def op(
    reference: Callable[..., Any],
    triton: Callable[..., Any] | None,
    *,
    when: Callable[..., bool] | None = None,
    device_arg: int | None = None,
    name: str | None = None,
    invariant: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """The dispatching function of one op (the reference's name and docstring), registered in
    :data:`OPS` under ``name`` (default: the reference's name without ``_ref``).
    ``invariant``: the op's CUDA entry inside :func:`batch_invariant` (every input its
    Triton entry would take, and those ``when`` refuses too)."""

    name = name or op_name(reference)

    @functools.wraps(reference)
    def run(*args: Any, **kwargs: Any) -> Any:
        t = _decider(args, kwargs, device_arg)
        if triton is None or t is None or not t.is_cuda or _use_reference(name):
            return reference(*args, **kwargs)
        if invariant is not None and invariant_mode():
            return invariant(*args, **kwargs)
        if when is None or when(*args, **kwargs):
            return triton(*args, **kwargs)
        return reference(*args, **kwargs)

    run.reference, run.triton, run.op_name = reference, triton, name  # type: ignore[attr-defined]
    run.invariant = invariant  # type: ignore[attr-defined]
    if triton is not None:
        OPS.setdefault(name, run)
    return run
