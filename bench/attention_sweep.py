"""Decode attention launch sweep on one GPU: KV splits x (heads per program, keys per step,
warps, pipeline stages) at batch >= 32. Used to set ``kernels.attention_tl`` autotune configs and
``default_splits``; every row is a median time against the bytes floor. ``--ws`` sweeps the
warp-specialized kernel's launches instead (keys per ring stage, stages, producer /
consumer registers), CUDA-graph replays.

    python -m bench.attention_sweep [--batches 64,128] [--kv bf16,fp8,packed] [--quick] [--ws]
"""

from __future__ import annotations

import argparse
import itertools

from bench.common import record, write
from bench.kernels_attention import (
    TOP,
    H,
    W,
    _attn_bytes,
    _attn_inputs,
    bench_us,
    ceilings,
    rotating,
    triton_attention,
)
from kernels import attention_tl as attn_tl

# (BLOCK_H, BLOCK_N, num_warps, num_stages)
LAUNCHES = [
    (64, 16, 8, 4), (64, 32, 8, 3), (64, 32, 8, 4), (64, 16, 8, 3), (64, 64, 8, 3),
    (64, 32, 8, 2), (32, 32, 8, 3), (32, 32, 8, 4), (32, 16, 4, 4), (16, 32, 4, 4),
    (16, 64, 4, 3), (16, 16, 4, 4), (16, 32, 4, 3), (16, 32, 4, 2),
]  # fmt: skip
QUICK = [(c.kwargs["BLOCK_H"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
         for c in attn_tl._attn_configs()]  # fmt: skip
# warp-specialized: (block_n, stages, p_regs, c_regs); 3 * 168 - p - c registers go to
# consumer 0, the default partition
WS_LAUNCHES = [(32, 2, 96, 208), (32, 3, 96, 208), (16, 4, 96, 208), (32, 2, 112, 200)]


def ws_sweep(batches: list[int], kvs: list[str], splits: list[int]) -> None:
    from bench.kernels_attention import _attn_flops, graph_us

    ceil = ceilings()
    bw, fl = ceil["copy_GBps"] * 1e9, ceil["bf16_TFLOPs"] * 1e12
    recs, lines = [], [f"ceilings {ceil}"]
    for kv, b in itertools.product(kvs, batches):
        nbytes = _attn_bytes(b, kv)
        floor = max(nbytes / bw, _attn_flops(b) / fl) * 1e6
        nxt = rotating(lambda i, b=b, kv=kv: _attn_inputs(b, kv, i), nbytes * 4)
        for s, (bn, st, pr, cr) in itertools.product(splits, WS_LAUNCHES):
            launch = {"block_n": bn, "stages": st, "p_regs": pr, "c_regs": cr}

            def run(nxt=nxt, s=s, launch=launch):
                triton_attention(nxt(), "ws", splits=s, launch=launch)

            try:
                us = graph_us(run)
            except Exception as e:  # shared memory / registers
                lines.append(f"{b:>5} {kv:>6} S={s} {launch} failed: {type(e).__name__}: {e}"[:200])
                continue
            params = {"batch": b, "kv": kv, "splits": s, "launch": launch}
            recs.append(record("attention.decode.ws_launch", us, "us", params, floor))
            lines.append(f"{b:>5} {kv:>6} S={s} {bn:>3} {st} {pr:>3} {cr:>3} {us:8.1f} us "
                         f"{us / floor:6.2f}x floor {nbytes / us / 1e3:6.0f} GB/s")  # fmt: skip
    print("wrote", write("attention_sweep", recs))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ws", action="store_true", help="sweep the warp-specialized kernel")
    args = ap.parse_args()
    if args.ws:
        ws_sweep([int(x) for x in args.batches.split(",")], args.kv.split(","),
                 [int(x) for x in args.splits.split(",")])  # fmt: skip
        return
    ceil = ceilings()
    bw = ceil["copy_GBps"] * 1e9
    recs = []
    lines = [f"{'batch':>5} {'kv':>5} {'S':>2} {'BH':>3} {'BN':>4} {'w':>2} {'st':>2} "
             f"{'us':>8} {'x floor':>8} {'GB/s':>7}"]  # fmt: skip
    for kv in args.kv.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            nbytes = _attn_bytes(b, kv)
            nxt = rotating(lambda i, b=b, kv=kv: _attn_inputs(b, kv, i), nbytes * 4)
            floor = nbytes / bw * 1e6
            best = None
            for s, cfg in itertools.product(
                (int(x) for x in args.splits.split(",")), QUICK if args.quick else LAUNCHES
            ):
                bh, bn, w, st = cfg
                launch = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": w, "num_stages": st}

                def run(nxt=nxt, s=s, launch=launch):
                    triton_attention(nxt(), "tl", splits=s, launch=launch)

                try:
                    us = bench_us(run)
                except Exception as e:  # out of shared memory / registers for this shape
                    lines.append(f"{b:>5} {kv:>5} {s:>2} {cfg} failed: {type(e).__name__}")
                    continue
                params = {"batch": b, "kv": kv, "splits": s, "launch": launch, "heads": H,
                          "keys": W + TOP}  # fmt: skip
                recs.append(record("attention.decode.launch", us, "us", params, floor))
                lines.append(f"{b:>5} {kv:>5} {s:>2} {bh:>3} {bn:>4} {w:>2} {st:>2} "
                             f"{us:8.1f} {us / floor:8.2f} {nbytes / us / 1e3:7.0f}")  # fmt: skip
                if best is None or us < best[0]:
                    best = (us, s, cfg)
            lines.append(f"  best batch {b} {kv}: {best}")
    print("wrote", write("attention_sweep", recs))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
