"""Per-kernel GPU time of the multi-launch ops (torch.profiler), so that a miss can be
pinned on the launch that causes it: indexer top-k (prefix histograms -> candidate list ->
ranks -> sort -> fallback), compressor pooling, decode attention, the MoE layer (align,
fp16 input, W13, SwiGLU reduce, W2, combine) at decode sizes.

    python -m bench.kernel_profile [--only topk,compressor,attention,moe] [--plain]

Prints, per case, every kernel's mean device µs over the profiled calls, the sum, and the
CUDA-graph replay time of the whole op (what the engine's captured decode step pays).
Writes bench/results/kernel_profile.json.
"""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import record, write
from bench.kernels_attention import (
    TOP,
    D,
    _attn_inputs,
    _cmp_inputs,
    _idx_inputs,
    graph_us,
    triton_attention,
)
from kernels import compressor as cp
from kernels import indexer as ix
from kernels import topk as tk

CALLS = 20


def kernel_times(fn: Callable[[], Any]) -> dict[str, float]:
    """Mean device µs per call of each kernel ``fn`` launches (warm, CALLS calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    tot: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            tot[ev.name[:60]] += ev.time_range.elapsed_us()
    return {k: v / CALLS for k, v in tot.items()}


PLAIN = False  # --plain: just call each op (for ncu), no profiler, no graphs


def case(name: str, fn: Callable[[], Any], params: dict[str, Any]) -> list[dict[str, Any]]:
    if PLAIN:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return []
    times = kernel_times(fn)
    g = graph_us(fn)
    print(f"\n== {name} {params}: graph replay {g:.1f} us, kernels sum {sum(times.values()):.1f}")
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"   {v:8.2f} us  {k}")
    recs = [record(f"{name}.graph", g, "us", params)]
    recs += [record(f"{name}.kernel", v, "us", {**params, "kernel": k}) for k, v in times.items()]
    return recs


def topk_cases() -> list:
    recs = []
    for T, C in ((1, 262144), (1, 65536), (8, 262144)):
        q, k, w, vis = _idx_inputs(T, C, 0)
        s = ix.indexer_scores_triton(q, k, w, vis)
        out = torch.empty((T, TOP), device=s.device, dtype=torch.int64)
        recs += case("topk", lambda s=s, out=out: tk.topk_triton(s, TOP, out=out),
                     {"batch": T, "candidates": C, "k": TOP})  # fmt: skip
    return recs


def compressor_cases() -> list:
    recs = []
    for (mode, ratio, overlap), E in (
        (("v41_ratio2", 2, False), 4096),
        (("v41_ratio2", 2, False), 16384),
        (("v4_csa4", 4, True), 4096),
    ):
        kv, gate, first, norm_w, ang, pool, rows = _cmp_inputs(E, ratio, overlap, 0)

        def run(a=(kv, gate, first, norm_w, ang, pool, rows), o=overlap, r=ratio):
            cp.compress_pool_triton(*a[:4], 1e-20, angles=a[4], out=a[5], out_rows=a[6],
                                    overlap=o, ratio=r, dim=D)  # fmt: skip

        recs += case("compressor", run, {"mode": mode, "entries": E})
    return recs


def attention_cases() -> list:
    recs = []
    for kv_dtype, B in (("bf16", 64), ("fp8", 64), ("packed", 64), ("bf16", 1)):
        a = _attn_inputs(B, kv_dtype, 0)

        def run(a=a):
            triton_attention(a)

        recs += case("attention", run, {"batch": B, "kv": kv_dtype})
    return recs


def moe_cases() -> list:
    from bench import kernels_moe as km
    from kernels.moe import moe_fp4_triton, moe_fp8_triton
    from kernels.moe_formats import fp4_to_pairs

    w13, s13, w2, s2, p13, q13, p2, q2 = km._experts("cuda")
    r13, r2 = fp4_to_pairs(p13), fp4_to_pairs(p2)
    recs = []
    for fmt, t in itertools.product(("fp4", "fp4p", "fp8"), (64, 1)):
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, km.D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(t, km.E_ALL, device="cuda", generator=g).argsort(-1)[:, : km.TOPK]
        ids[:, 0] = torch.where((ids < km.E_LOCAL).any(-1), ids[:, 0], 0)
        w = torch.rand(t, km.TOPK, device="cuda", generator=g)
        if fmt == "fp8":
            fn = lambda x=x, ids=ids, w=w: moe_fp8_triton(  # noqa: E731
                x, ids, w, w13, s13, w2, s2, (32, 32), 10.0, n_experts=km.E_ALL
            )
        elif fmt == "fp4p":  # the same experts in the pairs layout
            fn = lambda x=x, ids=ids, w=w: moe_fp4_triton(  # noqa: E731
                x, ids, w, r13, q13, r2, q2, 10.0, n_experts=km.E_ALL, pairs=True
            )
        else:
            fn = lambda x=x, ids=ids, w=w: moe_fp4_triton(  # noqa: E731
                x, ids, w, p13, q13, p2, q2, 10.0, n_experts=km.E_ALL
            )
        recs += case("moe", fn, {"experts": fmt, "tokens": t, "local": km.E_LOCAL})
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="topk,compressor,attention")
    ap.add_argument("--plain", action="store_true", help="only call each op (under ncu)")
    args = ap.parse_args()
    global PLAIN
    PLAIN = args.plain
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    cases = {"topk": topk_cases, "compressor": compressor_cases, "attention": attention_cases,
             "moe": moe_cases}  # fmt: skip
    recs = []
    for name in args.only.split(","):
        recs += cases[name]()
    if not PLAIN:
        print(f"wrote {write('kernel_profile', recs)}")


if __name__ == "__main__":
    main()
