"""The aten kernel launches of one decode step's GPU code path, counted on a CPU.

    python -m bench.step_launches [--arch v41|v4] [--dtype bfloat16] [--top 40] [--out DIR]

A graph-replayed decode step at batch 1 is launch-bound (the H200 profile: ~1900 launches,
16% idle), and every aten op the model issues around its Triton kernels (casts, copies,
fills, index arithmetic) is one more launch. This harness runs the tiny checkpoint's decode
step through the engine on the CPU with every kernel op taking its Triton kernel for CPU
tensors too (interpreted: ``TRITON_INTERPRET=1``, set here), and records the aten ops issued
outside the kernels (a ``TorchDispatchMode``; views, allocations and ops inside the
interpreter left out), grouped by their ``app/`` or ``kernels/`` call site, beside the Triton
kernel launches (counted at the interpreter's grid call).

What it is not: a timing; the device's own launches of a CUDA graph (the same ops, captured);
the Gluon kernels (MoE decode GEMMs, warp-specialized attention, wgmma dense: their ``tl``
forms run here, with the same launch count as theirs); host code that branches on a CUDA
device (few: the capture guards). The counts are the tiny model's layers (V4.1: 8, V4: 6);
per-layer sites scale with the layers, per-step ones (the step's metadata) do not.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import kernels.dispatch as dispatch  # noqa: E402
from bench.common import record, write  # noqa: E402

# ops that launch nothing (views, allocations, metadata)
NO_LAUNCH = frozenset((
    "view", "slice", "select", "empty", "as_strided", "_reshape_alias", "unsqueeze", "squeeze",
    "expand", "t", "transpose", "permute", "detach", "alias", "lift_fresh", "empty_strided",
    "unflatten", "split", "split_with_sizes", "unbind", "empty_like", "_local_scalar_dense",
    "is_nonzero", "set_", "diagonal", "lift", "resize_", "scalar_tensor", "_unsafe_view",
    "view_as_real", "view_as_complex", "new_empty", "new_empty_strided", "is_same_size",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "detach_", "is_pinned",
))  # fmt: skip


def _triton_everywhere() -> None:
    """Make every kernel op (made after this call) take its Triton kernel for CPU tensors as
    well, on an sm_90 with 132 SMs as far as the launch heuristics ask."""

    def op(reference, triton, *, when=None, device_arg=None, name=None):
        name = name or dispatch.op_name(reference)

        @functools.wraps(reference)
        def run(*args, **kwargs):
            t = dispatch._decider(args, kwargs, device_arg)
            if (triton is not None and t is not None and not dispatch._use_reference(name)
                    and (when is None or when(*args, **kwargs))):  # fmt: skip
                return triton(*args, **kwargs)
            return reference(*args, **kwargs)

        run.reference, run.triton, run.op_name = reference, triton, name
        if triton is not None:
            dispatch.OPS.setdefault(name, run)
        return run

    if any(m.startswith(("kernels.", "app.")) and m != "kernels.dispatch" for m in sys.modules):
        raise RuntimeError("patch the dispatch before any kernel module is imported")
    dispatch.op = op
    dispatch.sm_count = lambda device: 132
    dispatch.capability = lambda device: (9, 0)


class _Launches(TorchDispatchMode):
    """Records (aten op, call site) of every op that would launch a kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in NO_LAUNCH:
            return out
        if isinstance(out, torch.Tensor) and not name.endswith("_") and any(
            isinstance(a, torch.Tensor) and a.numel()
            and a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            for a in args
        ):  # fmt: skip
            return out  # a view or a no-op cast (``to`` to the same dtype)
        site, f = "?", sys._getframe(1)
        while f is not None:
            path = f.f_code.co_filename
            if "triton/runtime/interpreter" in path:
                return out  # inside an interpreted kernel
            for root in ("/app/", "/kernels/"):
                if site == "?" and root in path:
                    site = f"{root[1:]}{path.split(root, 1)[1]}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        self.log.append((name, site))
        return out


def _count_triton(log: list[str]) -> None:
    """Append every interpreted Triton launch's kernel name to ``log``."""
    from triton.runtime import interpreter

    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        log.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = counted


def count(arch: str, dtype: str) -> tuple[collections.Counter, collections.Counter]:
    """One decode step of the tiny ``arch`` checkpoint: ((aten op, site) -> launches outside
    the kernels, Triton kernel -> launches)."""
    _triton_everywhere()
    kernels: list[str] = []
    from app.config import EngineConfig
    from app.engine.core import EngineCore
    from app.engine.request import EngineRequest, SamplingParams
    from app.model.tiny import make_tiny_checkpoint

    # (on CPU tensors the dispatch takes the portable forms of the Gluon kernels)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp, arch=arch, seed=0)
        eng = EngineCore(EngineConfig.from_options(
            tmp, device="cpu", overlap_schedule=False, max_num_seqs=4, kv_cache_bytes=1 << 26,
            packed_experts="on", dtype=dtype))  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        eng.add_request(EngineRequest("a", tuple(range(3, 40)), params))
        for _ in range(4):  # prefill, then decode steps
            eng.step()
        rec = _Launches()
        _count_triton(kernels)
        with torch.inference_mode(), rec:
            eng.step()
        eng.close()
    return collections.Counter(rec.log), collections.Counter(kernels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="v41", choices=("v41", "v4"))
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (the GPU's: bf16)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None, help="also write DIR/step_launches.json")
    args = ap.parse_args()
    got, triton_launches = count(args.arch, args.dtype)
    total, n_triton = sum(got.values()), sum(triton_launches.values())
    by_fn: collections.Counter = collections.Counter()
    for (_, site), n in got.items():
        by_fn[site.split(":", 1)[0] + " " + site.rsplit(" ", 1)[-1]] += n
    print(f"tiny {args.arch} ({args.dtype}), one decode step, GPU code path on the CPU: "
          f"{total + n_triton} launches = {n_triton} Triton + {total} aten")  # fmt: skip
    print("Triton kernels:", ", ".join(f"{k} {n}" for k, n in triton_launches.most_common()))
    print("by function:")
    for site, n in by_fn.most_common(args.top):
        print(f"  {n:5d}  {site}")
    print("by op and line:")
    for (op, site), n in got.most_common(args.top):
        print(f"  {n:5d}  {op:16s} {site}")
    if args.out:
        recs = [record("step.launches", total + n_triton, "launches", {"arch": args.arch}),
                record("step.aten_launches", total, "launches", {"arch": args.arch})]
        recs += [record("step.aten_launches_at", n, "launches", {"arch": args.arch, "site": s})
                 for s, n in by_fn.items()]  # fmt: skip
        print("wrote", write("step_launches", recs, args.out))


if __name__ == "__main__":
    main()
