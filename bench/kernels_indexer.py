"""The lightning indexer's paged scores at decode (one token per sequence): the token kernel
(``kernels.indexer_token``, both dequantizations of its mxfp4 keys) against the token-blocks
kernel it replaces at decode, timed in the same process, at the flash rank's shapes (index
heads x dim and the index layers' compress ratios from configs/models/flash-rank, mxfp4 +
e8m0-per-32 keys: 68 B an entry at dim 128, 64-position blocks in a shuffled block table).

    python -m bench.kernels_indexer [--quick] [--batches 1,8,64,256] [--contexts 4096,32768]
        [--ratios 1,2]
    TRITON_INTERPRET=1 python -m bench.kernels_indexer --smoke     # CPU: tiny shapes, no file

Each point: median µs of CUDA-graph replays (the engine captures its decode step), inputs
rotating inside the graph over sets whose keys together exceed 2x L2 (each set its own block
table into one shared pool), every sequence seeing its whole context. Floor: the larger of the
bytes one call must move (every visible key's 68 B + its block-table id, q, w, the fp32 score
rows written) at the copy bandwidth measured in this run, and the dot's FLOPs at the measured
bf16 matmul rate. Peer: the token-blocks kernel in the same run. Each variant is checked
against the token-blocks kernel's scores (and the torch reference where it fits) before it
is timed. ``kernels.indexer_decode.step`` sums a decode step's index layers (V4.1-Flash: 3 of
ratio 2, 5 of ratio 1), the share the B = 256 profile at 32K put at 9.1 ms on an H100.
Writes ``bench/results/kernels_indexer.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import machine, record, write
from bench.kernels_attention import ceilings, rec
from kernels import indexer as ix

CONFIG = Path(__file__).resolve().parents[1] / "configs/models/flash-rank/config.json"
P = 64  # positions per block (the engine's auto block size for ratios 1 and 2)
L2_BYTES = 50e6  # H100: 50 MB
PEER = "token-blocks kernel (the previous decode path), this run"
VARIANTS = (("blocks", None), ("token", "bits"), ("token", "dot_scaled"))


def flash_indexer() -> tuple[int, int, list[int]]:
    """(index heads, index dim, compress ratio of each index layer) of the flash rank."""
    cfg = json.loads(CONFIG.read_text())["text_config"]
    ratios = [cfg["compress_ratios"][i] for i in cfg["index_source_layer_ids"]]
    return cfg["index_n_heads"], cfg["index_head_dim"], ratios


def entry_bytes(dim: int) -> int:
    """One mxfp4 key: dim/2 code bytes + dim/32 e8m0 scales."""
    return dim // 2 + dim // 32


def call_bytes(B: int, C: int, ratio: int, heads: int, dim: int) -> float:
    """Bytes one decode call must move: every visible key and its block's table id, q (bf16),
    w, visible and sequence ids in, the fp32 score rows out."""
    blocks = math.ceil(C * ratio / P)
    return B * (C * entry_bytes(dim) + blocks * 8 + heads * dim * 2 + heads * 4 + 16 + C * 4)


def make_sets(B: int, ctx: int, ratio: int, heads: int, dim: int, n_sets: int,
              device: str, seed: int = 0) -> list[dict[str, Any]]:  # fmt: skip
    """``n_sets`` decode calls of B sequences at context ``ctx``, their block tables disjoint
    shuffles of one pool of random mxfp4 keys (every code, scales 2^-7 .. 2^3); bf16 queries
    (fp32 on the CPU, whose interpreter has no bf16 dot)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    nb = ctx // P
    per = P // ratio
    n_blocks = n_sets * B * nb + 1
    codes = torch.randint(0, 256, (n_blocks * per, dim // 2), generator=g, device=device,
                          dtype=torch.uint8)  # fmt: skip
    scale = torch.randint(120, 131, (n_blocks * per, dim // 32), generator=g, device=device,
                          dtype=torch.uint8)  # fmt: skip
    order = torch.randperm(n_blocks, generator=g, device=device)
    C = nb * per
    seq = torch.arange(B, device=device)
    sets = []
    for i in range(n_sets):
        table = order[i * B * nb : (i + 1) * B * nb].view(B, nb)
        s = {
            "q": torch.randn(B, heads, dim, generator=g, device=device).to(dtype),
            "w": torch.randn(B, heads, generator=g, device=device),
            "vis": torch.full((B,), C, dtype=torch.int64, device=device),
            "table": table, "seq": seq, "C": C, "ratio": ratio, "keys": codes, "scale": scale,
            "out": torch.empty(B, C, device=device),
        }  # fmt: skip
        s["blocks"] = ix.scores_token_blocks(seq, seq, heads)
        sets.append(s)
    return sets


def call(s: dict[str, Any], kernel: str, dequant: str | None) -> torch.Tensor:
    """One decode call of the paged scores on set ``s`` (into its ``out``)."""
    return ix.indexer_scores_paged_triton(
        s["q"], s["keys"], s["scale"], s["w"], s["vis"], s["seq"], s["table"], s["ratio"], P,
        s["C"], seq_start=s["seq"], blocks=s["blocks"], out=s["out"], kernel=kernel,
        dequant=dequant,
    )  # fmt: skip


def reference(s: dict[str, Any]) -> torch.Tensor:
    return ix.indexer_scores_paged_ref(s["q"].float(), s["keys"], s["scale"], s["w"], s["vis"],
                                       s["seq"], s["table"], s["ratio"], P, s["C"])  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    d = (a[fin].double() - b[fin].double()).norm() / b[fin].double().norm().clamp_min(1e-30)
    return float(d)


def graph_us(fn: Callable[[], Any]) -> float:
    """Median µs of CUDA-graph replays of ``fn``."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")


def cpu_us(fn: Callable[[], Any], reps: int = 2) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def n_sets_for(key_bytes: float, free_bytes: float) -> int:
    """Sets whose keys together exceed 2x L2, within a quarter of the free memory."""
    want = max(1, math.ceil(2 * L2_BYTES / key_bytes))
    return max(1, min(want, 512, int(free_bytes / 4 / key_bytes)))


def sweep(batches: list[int], contexts: list[int], ratios: list[int],
          ceil: dict[str, float] | None, smoke: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    heads, dim, _ = flash_indexer()
    device = "cpu" if smoke else "cuda"
    timer = cpu_us if smoke else graph_us
    recs = []
    for B, ctx, r in itertools.product(batches, contexts, ratios):
        C = ctx // P * (P // r)
        nbytes = call_bytes(B, C, r, heads, dim)
        floor = None
        if ceil:
            flops = 2.0 * B * heads * dim * C
            floor = max(nbytes / ceil["copy_GBps"] / 1e3, flops / ceil["bf16_TFLOPs"] / 1e6)
        free = torch.cuda.mem_get_info()[0] if not smoke else 1e9
        sets = make_sets(B, ctx, r, heads, dim, n_sets_for(B * C * entry_bytes(dim), free),
                         device)  # fmt: skip
        first = sets[0]
        base = call(first, "blocks", None).clone()
        want = reference(first) if B * C * dim * 4 <= (1 << 28) else None
        point = {"batch": B, "context": ctx, "ratio": r, "entries": C, "heads": heads,
                 "dim": dim, "block_size": P, "sets": len(sets), "bytes": nbytes}  # fmt: skip
        times: dict[str, float | None] = {}
        for kernel, dequant in VARIANTS:
            name = kernel if dequant is None else f"{kernel}/{dequant}"
            params = {**point, "kernel": kernel, "dequant": dequant}
            if smoke and dequant == "dot_scaled":
                continue  # the interpreter has no tl.dot_scaled
            try:
                got = call(first, kernel, dequant).clone()
                it = itertools.cycle(sets)
                us = timer(lambda it=it, k=kernel, d=dequant: call(next(it), k, d))
            except Exception as e:  # a variant that does not compile here is recorded as such
                params["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                recs.append(rec("kernels.indexer_decode", None, "us", params, floor))
                times[name] = None
                continue
            params["rel_diff_vs_blocks"] = rel(got, base)
            if want is not None:
                params["rel_err_vs_reference"] = rel(got, want)
            params["GBps"] = nbytes / us / 1e3
            times[name] = us
            peer = None
            if kernel != "blocks" and times.get("blocks"):
                peer = {"name": PEER, "value": times["blocks"], "ratio": times["blocks"] / us}
            recs.append(record("kernels.indexer_decode", us, "us", params, floor, peer))
        del sets
    return recs


def step_records(recs: list[dict[str, Any]], ratios_of_layers: list[int]) -> list[dict]:
    """Per (batch, context, variant): the sum over a decode step's index layers."""
    out = []
    keyed: dict[tuple, dict[int, dict]] = {}
    for r in recs:
        p = r["params"]
        if r["name"] == "kernels.indexer_decode" and r["value"] is not None:
            keyed.setdefault((p["batch"], p["context"], p["kernel"], p["dequant"]), {})[
                p["ratio"]] = r  # fmt: skip
    for (B, ctx, kernel, dequant), by_ratio in keyed.items():
        if not all(x in by_ratio for x in ratios_of_layers):
            continue
        us = sum(by_ratio[x]["value"] for x in ratios_of_layers)
        floors = [by_ratio[x]["floor"] for x in ratios_of_layers]
        floor = sum(floors) if all(f is not None for f in floors) else None
        params = {"batch": B, "context": ctx, "kernel": kernel, "dequant": dequant,
                  "layer_ratios": ratios_of_layers}  # fmt: skip
        peer = None
        if kernel != "blocks" and (B, ctx, "blocks", None) in keyed:
            base = keyed[(B, ctx, "blocks", None)]
            if all(x in base for x in ratios_of_layers):
                b_us = sum(base[x]["value"] for x in ratios_of_layers)
                peer = {"name": PEER, "value": b_us, "ratio": b_us / us}
        out.append(record("kernels.indexer_decode.step", us, "us", params, floor, peer))
    return out


def table(recs: list[dict[str, Any]]) -> str:
    lines = [f"{'name':28} {'B':>4} {'ctx':>6} {'r':>2} {'variant':18} {'us':>9} {'floor':>8} "
             f"{'x floor':>7} {'x peer':>7}  note"]  # fmt: skip
    for r in recs:
        p = r["params"]
        if "batch" not in p:
            continue
        variant = p["kernel"] + (f"/{p['dequant']}" if p["dequant"] else "")
        us = f"{r['value']:9.1f}" if r["value"] is not None else f"{'-':>9}"
        floor = f"{r['floor']:8.1f}" if r["floor"] else f"{'-':>8}"
        ratio = f"{r['ratio_to_floor']:7.2f}" if r["ratio_to_floor"] else f"{'-':>7}"
        peer = f"{r['peer']['ratio']:7.2f}" if r["peer"] else f"{'-':>7}"
        note = p.get("error", "")
        if "rel_diff_vs_blocks" in p:
            note = f"diff={p['rel_diff_vs_blocks']:.1e}"
            if "rel_err_vs_reference" in p:
                note += f" err={p['rel_err_vs_reference']:.1e}"
        lines.append(f"{r['name']:28} {p['batch']:>4} {p['context']:>6} {p.get('ratio', ''):>2} "
                     f"{variant:18} {us} {floor} {ratio} {peer}  {note}")  # fmt: skip
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="B 1, 64, 256 at 32K, ratio 1")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1: tiny shapes, checks, no file")  # fmt: skip
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64, 256])
    ap.add_argument("--contexts", type=_ints, default=[4096, 32768])
    ap.add_argument("--ratios", type=_ints, default=None,
                    help="compress ratios (default: the flash rank's index layers')")  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    _, _, layer_ratios = flash_indexer()
    ratios = args.ratios or sorted(set(layer_ratios))
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels in the interpreter: TRITON_INTERPRET=1")
        recs = sweep([1, 3], [2 * P], ratios, None, smoke=True)
        recs += step_records(recs, layer_ratios)
        print(table(recs))
        bad = [r for r in recs if r["params"].get("rel_err_vs_reference", 0) > 1e-5]
        if bad:
            raise SystemExit(f"{len(bad)} variant(s) off the reference")
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke on the CPU)")
    ceil = ceilings()
    print(f"ceilings: {ceil}")
    recs = [rec(f"ceiling.{k}", v, k.split("_")[1], {}, None) for k, v in ceil.items()]
    if args.quick:
        runs = sweep([1, 64, 256], [32768], [1], ceil)
    else:
        runs = sweep(args.batches, args.contexts, ratios, ceil)
    recs += runs + step_records(runs, layer_ratios)
    path = write("kernels_indexer", recs)
    info = machine()
    print(f"{info.get('gpu')} torch {info['torch']} triton {info.get('triton')}")
    print(table(recs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
