"""Decode attention: how the KV split count changes time at batch >= 32 (H200 sweep used to
set ``kernels.attention.default_splits``).

    python -m bench.attention_splits [--batches 32,64,128] [--splits 1,2,4,8] [--kv bf16]
"""

from __future__ import annotations

import argparse

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--splits", default="1,2,4,8")
    ap.add_argument("--kv", default="bf16")
    args = ap.parse_args()
    ceil = ceilings()
    bw = ceil["copy_GBps"] * 1e9
    recs = []
    print(f"{'batch':>5} {'kv':>5} {'splits':>6} {'us':>8} {'x floor':>8} {'GB/s':>7}")
    for kv in args.kv.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            nbytes = _attn_bytes(b, kv)
            nxt = rotating(lambda i, b=b, kv=kv: _attn_inputs(b, kv, i), nbytes * 4)
            floor = nbytes / bw * 1e6
            for s in (int(x) for x in args.splits.split(",")):

                def run(nxt=nxt, s=s):
                    q, kvt, idx, sink, ang, scale = nxt()
                    attn.sparse_attention_triton(
                        q, kvt, idx, sink, D**-0.5, inv_rope_angles=ang, kv_scale=scale, splits=s
                    )

                us = bench_us(run)
                params = {
                    "batch": b,
                    "kv": kv,
                    "splits": s,
                    "heads": H,
                    "keys": W + TOP,
                    "default_splits": attn.default_splits(b, H, W + TOP, torch.device("cuda")),
                }
                recs.append(record("attention.decode.splits", us, "us", params, floor))
                print(f"{b:>5} {kv:>5} {s:>6} {us:8.1f} {us / floor:8.2f} {nbytes / us / 1e3:7.0f}")
    print("wrote", write("attention_splits", recs))


if __name__ == "__main__":
    main()
