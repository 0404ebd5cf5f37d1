"""Top-k of long indexer rows on the GPU: the one-launch grid select against the previous
coarse-histogram path and torch's own top-k, timed in the same process.

    python -m bench.kernels_topk [--rows 1,8,32] [--cols 65536,262144] [--k 512,2048]
        [--inputs randn,ties]

CUDA-graph replay (``do_bench_cudagraph``) with the inputs rotating inside the graph (cold
L2), as the engine's captured decode step pays. Every path is checked exact against
``topk_ref`` before it is timed. The fused grid paths also say where each row's select ended
(``ends``: last level, +4 at a bucket), and ``radix only (cap 1)`` times the same launch with
the buckets off (the levels alone, as before them), in the same run. Inputs: ``randn`` (a
-inf tail of 1/8), ``ties`` (integers 0..49: ~C/50 ties at tau, too many for a bucket, whose
atomics then share one counter: the fallback's cost). Peer: ``torch.topk`` (values + ids,
unsorted) followed by an id sort, the same contract (ascending ids). Floor: one read of the
scores at the measured copy bandwidth (the select itself is latency-bound at these sizes).
Writes ``bench/results/kernels_topk.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import triton
import triton.language as tl

from bench.common import record, write
from bench.kernels_attention import bench_us, graph_us, rotating
from kernels import topk as tk
from kernels import topk_grid as tg

DEV = "cuda"


def _copy_bw() -> float:
    x = torch.empty(1 << 28, device=DEV, dtype=torch.float32)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (bench_us(lambda: y.copy_(x)) * 1e-6)


def _scores(T: int, C: int, i: int, kind: str = "randn") -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(1000 * T + i)
    if kind == "ties":
        return torch.randint(0, 50, (T, C), device=DEV, generator=g).float()
    s = torch.randn(T, C, device=DEV, generator=g)
    s[:, C - C // 8 :] = float("-inf")  # the not-yet-visible tail of a row
    return s


def _torch_topk(s: torch.Tensor, k: int) -> torch.Tensor:
    v, i = torch.topk(s, k, dim=-1, sorted=False)
    i = torch.where(v > float("-inf"), i, s.shape[-1]).sort(dim=-1).values
    return torch.where(i == s.shape[-1], -1, i)


def _paths(T: int, k: int, s_cols) -> dict[str, Any]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def coarse(s):
        out = torch.empty((s.shape[0], k), device=DEV, dtype=torch.int64)
        return tk._topk_coarse(s, k, out)

    def grid(block: int, warps: int, fused: bool = True, stop=None, cap: int = tg._CAP):
        def run(s, ends=None):
            out = torch.empty((s.shape[0], k), device=DEV, dtype=torch.int64)
            return tg.grid_topk(s, k, out, fused=fused, block=block, num_warps=warps, stop=stop,
                                cap=cap, ends=ends)  # fmt: skip

        return run

    paths: dict[str, Any] = {
        "coarse (previous)": coarse,
        "torch.topk + sort": lambda s: _torch_topk(s, k),
    }
    paths["dispatch (topk_triton)"] = lambda s: tk.topk_triton(s, k)
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16)):
        if T * triton.cdiv(s_cols(), block) <= sms:
            paths[f"grid fused b{block} w{warps}"] = grid(block, warps)
    if T * triton.cdiv(s_cols(), 2048) <= sms:
        paths["grid fused b2048 w8 radix only (cap 1)"] = grid(2048, 8, cap=1)
        for stop in range(1, 5):  # the first phases alone (no valid output: timing only)
            paths[f"phases [0, {stop}) only"] = grid(2048, 8, stop=stop)
    paths["grid split b2048 w8"] = grid(2048, 8, fused=False)
    return paths


@triton.jit
def _barriers_kernel(bar_ptr, G, N: tl.constexpr):
    for p in tl.static_range(N):
        tg._grid_sync(bar_ptr + p, G)


def barrier_us(programs: int, n: int = 4) -> float:
    """Graph-replayed time of a launch of ``programs`` that only meet at ``n`` grid barriers
    (the floor of the fused select's synchronization)."""

    def run():
        bars = torch.zeros(8, device=DEV, dtype=torch.int64)
        _barriers_kernel[(programs,)](bars, programs, N=n, num_warps=8)

    return graph_us(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--cols", default="65536,262144")
    ap.add_argument("--k", default="512,2048")
    ap.add_argument("--inputs", default="randn", help="randn and/or ties")
    args = ap.parse_args()
    bw = _copy_bw()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    recs = []
    rows = []
    for kind in args.inputs.split(","):
        for C in map(int, args.cols.split(",")):
            for T in map(int, args.rows.split(",")):
                for k in map(int, args.k.split(",")):
                    nxt = rotating(lambda i, T=T, C=C, kind=kind: _scores(T, C, i, kind),
                                   T * C * 4)  # fmt: skip
                    s0 = nxt()
                    ref = tk.topk_ref(s0, k)
                    floor = T * C * 4 / bw * 1e6
                    for name, fn in _paths(T, k, lambda C=C: C).items():
                        ok, ends = None, None
                        if name.startswith("grid fused"):
                            where = torch.full((T,), -1, device=DEV, dtype=torch.int32)
                            ok = torch.equal(fn(s0, ends=where), ref)
                            ends = sorted(set(where.tolist()))
                        elif not name.startswith("phases"):
                            ok = torch.equal(fn(s0), ref)
                        us = graph_us(lambda fn=fn, nxt=nxt: fn(nxt()))
                        p = {"rows": T, "candidates": C, "k": k, "inputs": kind, "path": name,
                             "exact": ok, "ends": ends}  # fmt: skip
                        recs.append(record("indexer.topk.graph", us, "us", p, floor))
                        rows.append((kind, C, T, k, name, us, floor, ok, ends))
    for n in (0, 1, 4):
        for programs in (32, 64, 128):
            us = barrier_us(programs, n)
            recs.append(record("grid_barrier.graph", us, "us", {"programs": programs, "n": n}))
            print(f"launch of {programs} programs with {n} grid barriers: {us:.2f} us")
    write("kernels_topk", recs)
    print(f"{'inputs':<6} {'C':>7} {'T':>3} {'k':>5}  {'path':<38} {'graph us':>9} {'floor':>6}"
          "  exact  ends")  # fmt: skip
    for kind, C, T, k, name, us, floor, ok, ends in rows:
        print(f"{kind:<6} {C:>7} {T:>3} {k:>5}  {name:<38} {us:>9.1f} {floor:>6.2f}  {ok}"
              f"  {ends if ends is not None else ''}")  # fmt: skip


if __name__ == "__main__":
    main()
