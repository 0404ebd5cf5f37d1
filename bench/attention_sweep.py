"""Decode attention launch sweep on one GPU: KV splits x (heads per program, keys per step,
warps, pipeline stages) at batch >= 32. Used to set ``kernels.attention`` autotune configs and
``default_splits``; every row is a median time against the bytes floor.

    python -m bench.attention_sweep [--batches 64,128] [--kv bf16,fp8] [--quick]
"""

from __future__ import annotations

import argparse
import itertools

from bench.common import record, write
from bench.kernels_attention import (
    TOP,
    D,
    H,
    W,
    _attn_bytes,
    _attn_inputs,
    bench_us,
    ceilings,
    rotating,
)
from kernels import attention as attn

# (BLOCK_H, BLOCK_N, num_warps, num_stages)
LAUNCHES = [
    (64, 16, 8, 4), (64, 32, 8, 3), (64, 32, 8, 4), (64, 16, 8, 3), (64, 64, 8, 3),
    (64, 32, 8, 2), (32, 32, 8, 3), (32, 32, 8, 4), (32, 16, 4, 4), (16, 32, 4, 4),
    (16, 64, 4, 3), (16, 16, 4, 4), (16, 32, 4, 3), (16, 32, 4, 2),
]  # fmt: skip
QUICK = [(c.kwargs["BLOCK_H"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
         for c in attn._attn_configs()]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
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
                    q, kvt, idx, sink, ang, scale = nxt()
                    attn.sparse_attention_triton(
                        q, kvt, idx, sink, D**-0.5, inv_rope_angles=ang, kv_scale=scale,
                        splits=s, launch=launch,
                    )  # fmt: skip

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
