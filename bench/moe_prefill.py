"""MoE prefill on one GPU: the checkpoint's fp4 experts in the layouts Fathom can hold them
in, against torch's grouped GEMMs on the same weight bytes, timed in one process.

    python -m bench.moe_prefill [--tokens 4096] [--sweep PATH,...] [--quick]

V4.1-Flash rank shapes (d 5120, expert width 2304, top-6, 48 local experts), routing either
all on the 48 local experts (a rank's dispatched prefill tokens, ~512 rows per expert) or
48 of 384. CUDA-graph replay (``do_bench_cudagraph``), inputs rotating inside the graph.
Every Fathom row is the whole MoE (align, activation quantization, both GEMMs, combine).

Layouts and paths (``kernels.moe``):
- ``fp4.pairs.bf16``: the engine's default layout (fp4 pairs, dequantized in registers,
  bf16 MMA);
- ``fp8_rows.*``: the fp4 experts re-encoded exactly as e4m3 with one scale per row
  (``kernels.moe_formats.fp4_to_fp8_rows``, ``expert_layout: fp8_rows``); bf16 activations,
  or fp8 activations with one scale per row (``act_fp8.rowwise``, ``moe_prefill_act: fp8``:
  both scales after the loop, the fp8 MMAs accumulate in place);
- ``fp4.pairs.release_act``: the default layout with x and H rounded as the release rounds
  them (``expert_act: fp8``, groups of 32; bf16 MMA), its accuracy against the reference
  with the same rounding.

Peers in the same run, GEMM launches only (inputs already sorted by expert and quantized,
which favours them): ``torch._scaled_grouped_mm`` (rowwise fp8: per-token activation scales,
the rows layout's per-row weight scales, the same e4m3 bytes; with and without fast
accumulation) and ``torch._grouped_mm`` on bf16 copies of the weights. Ceilings measured in
the same run: copy bandwidth, fp8 and bf16 dense matmul (``torch._scaled_mm`` / ``@`` at
8192^3). Accuracy: each path's output against the fp32 expert loop with bf16 activations on
the first 256 tokens. Writes
``bench/results/moe_prefill.json``.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from bench.common import machine, record, write
from bench.kernels_moe import _rotating, _us, ceilings
from kernels.moe import moe_fp4_triton, moe_fp8_rows_triton
from kernels.moe_formats import fp4_to_fp8_rows, fp4_to_pairs
from kernels.moe_ref import moe_experts_ref, swiglu_clamp
from kernels.moe_tiles import GemmTiles, MoeTiles
from kernels.quant import dequantize_fp4

D, INTER, E_LOCAL, E_ALL, TOPK, LIMIT = 5120, 2304, 48, 384, 6, 10.0
DEV = "cuda"


def _experts() -> dict[str, Any]:
    """Random fp4 experts (e8m0 per 32 columns over four binades, as a real row's spread),
    their pairs and fp8-rows layouts, and bf16 copies."""
    g = torch.Generator(device=DEV).manual_seed(0)

    def fp4(r: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.randint(-128, 128, (E_LOCAL, r, c // 2), device=DEV, generator=g)
        s = torch.randint(119, 123, (E_LOCAL, r, c // 32), device=DEV, generator=g)
        return p.to(torch.int8), s.to(torch.uint8)

    p13, q13 = fp4(2 * INTER, D)
    p2, q2 = fp4(D, INTER)
    ex: dict[str, Any] = {"p13": p13, "q13": q13, "p2": p2, "q2": q2}
    ex["r13"], ex["r2"] = fp4_to_pairs(p13), fp4_to_pairs(p2)
    rows = {}
    for name, p, q in (("13", p13, q13), ("2", p2, q2)):
        w8, sc, exact = zip(*(fp4_to_fp8_rows(p[e], q[e]) for e in range(E_LOCAL)), strict=True)
        rows[f"w{name}"], rows[f"s{name}"] = torch.stack(w8), torch.stack(sc)
        rows[f"exact{name}"] = float(torch.stack(exact).float().mean())
    ex["rows"] = rows
    ex["bf13"] = torch.stack(
        [dequantize_fp4(p13[e], q13[e], torch.bfloat16) for e in range(E_LOCAL)]
    )
    ex["bf2"] = torch.stack([dequantize_fp4(p2[e], q2[e], torch.bfloat16) for e in range(E_LOCAL)])
    return ex


def _inputs(t: int, all_local: bool, n: int = 3) -> list[tuple[torch.Tensor, ...]]:
    n_all = E_LOCAL if all_local else E_ALL
    torch.manual_seed(t + all_local)
    sets = []
    for _ in range(n):
        ids = torch.rand(t, n_all, device=DEV).argsort(-1)[:, :TOPK]
        sets.append(
            (torch.randn(t, D, device=DEV).bfloat16(), ids, torch.rand(t, TOPK, device=DEV))
        )
    return sets


def _rowwise_fp8(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = a.float().abs().amax(-1).clamp_min(1e-12) / 448.0
    return (a.float() / s[:, None]).to(torch.float8_e4m3fn), s


def _grouped_peers(sets: list, ex: dict[str, Any]) -> tuple[list, Callable, Callable]:
    """torch's grouped GEMMs (W13 then W2) over one input set's local rows sorted by expert,
    each group padded to 16 rows; activations and H prepared outside the timed call."""
    rows = ex["rows"]
    w13t, w2t = rows["w13"].transpose(1, 2), rows["w2"].transpose(1, 2)  # column-major B
    b13t, b2t = ex["bf13"].transpose(1, 2), ex["bf2"].transpose(1, 2)
    prepared = []
    for x, ids, _ in sets:
        flat = ids.reshape(-1)
        keep = flat < E_LOCAL
        order = torch.argsort(flat[keep], stable=True)
        tok = (torch.nonzero(keep).squeeze(1) // TOPK)[order]
        counts = torch.bincount(flat[keep], minlength=E_LOCAL)
        padded = (counts + 15) // 16 * 16
        starts = torch.cumsum(padded, 0) - padded
        src = torch.full((int(padded.sum()),), -1, device=DEV, dtype=torch.long)
        pos = torch.cat(
            [starts[e] + torch.arange(int(counts[e]), device=DEV) for e in range(E_LOCAL)]
        )
        src[pos] = tok
        xa = torch.where((src >= 0)[:, None], x[src.clamp_min(0)], 0)
        offs = torch.cumsum(padded, 0).to(torch.int32)
        a8, sa = _rowwise_fp8(xa)
        h = swiglu_clamp(*(xa @ ex["bf13"][0].t()).chunk(2, -1), LIMIT)  # H-shaped activations
        h8, sh = _rowwise_fp8(h)
        prepared.append((a8, sa, h8, sh, offs, xa, h.bfloat16()))

    def scaled(p: tuple, fast: bool = False) -> torch.Tensor:
        a8, sa, h8, sh, offs = p[:5]
        kw = {"offs": offs, "out_dtype": torch.bfloat16, "use_fast_accum": fast}
        torch._scaled_grouped_mm(a8, w13t, sa, rows["s13"], **kw)
        return torch._scaled_grouped_mm(h8, w2t, sh, rows["s2"], **kw)

    def bf16(p: tuple) -> torch.Tensor:
        offs, xa, h = p[4], p[5], p[6]
        torch._grouped_mm(xa, b13t, offs=offs)
        return torch._grouped_mm(h, b2t, offs=offs)

    return prepared, scaled, bf16


def _paths(ex: dict[str, Any], n_all: int) -> dict[str, Callable[..., torch.Tensor]]:
    rows = ex["rows"]
    r = (rows["w13"], rows["s13"], rows["w2"], rows["s2"])

    def fp4p(s: tuple, **kw: Any) -> torch.Tensor:
        return moe_fp4_triton(
            s[0],
            s[1],
            s[2],
            ex["r13"],
            ex["q13"],
            ex["r2"],
            ex["q2"],
            LIMIT,
            n_experts=n_all,
            pairs=True,
            **kw,
        )

    def rows_(s: tuple, **kw: Any) -> torch.Tensor:
        return moe_fp8_rows_triton(s[0], s[1], s[2], *r, LIMIT, n_experts=n_all, **kw)

    return {
        "moe.prefill.fp4.pairs.bf16": fp4p,
        "moe.prefill.fp8_rows.bf16": rows_,
        "moe.prefill.fp8_rows.act_fp8.rowwise": lambda s, **kw: rows_(s, act_fp8=True, **kw),
        "moe.prefill.fp4.pairs.release_act": lambda s, **kw: fp4p(s, act_group=32, **kw),
    }


def _accuracy(fn: Callable[..., torch.Tensor], s: tuple, ex: dict[str, Any], n: int = 256,
              act_group: int = 0) -> float:  # fmt: skip
    """||out - ref|| / ||ref|| on the first ``n`` tokens; ref: the fp32 expert loop over the
    fp4 experts' exact values with bf16 activations (``act_group``: rounded as the release
    rounds them)."""
    x, ids, w = s[0][:n].contiguous(), s[1][:n].contiguous(), s[2][:n].contiguous()
    f13, f2 = ex["bf13"].float(), ex["bf2"].float()
    n_pad = E_ALL
    w1 = [f13[e, :INTER] for e in range(E_LOCAL)] + [None] * (n_pad - E_LOCAL)
    w3 = [f13[e, INTER:] for e in range(E_LOCAL)] + [None] * (n_pad - E_LOCAL)
    w2 = [f2[e] for e in range(E_LOCAL)] + [f2[0]] * (n_pad - E_LOCAL)
    ref = moe_experts_ref(x.float(), ids, w, w1, w2, w3, LIMIT, act_group=act_group)
    out = fn((x, ids, w)).float()
    return float((out - ref).norm() / ref.norm())


TILES = [  # (bm, W13 bn, W2 bn, bk, warps, stages) for the fp8-rows paths
    (64, 64, 128, 128, 4, 3),
    (64, 128, 128, 128, 4, 3),
    (128, 64, 128, 128, 8, 3),
    (128, 128, 128, 128, 8, 3),
    (128, 128, 256, 128, 8, 3),
    (128, 64, 64, 128, 4, 3),
    (128, 128, 128, 64, 8, 4),
    (64, 128, 256, 128, 8, 3),
    (128, 128, 128, 128, 8, 4),
    (128, 128, 256, 128, 8, 4),
    (64, 128, 128, 128, 4, 4),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="4096", help="comma-separated token counts")
    ap.add_argument(
        "--sweep",
        default="",
        help="comma-separated fp8-rows paths to tile-sweep "
        "(e.g. moe.prefill.fp8_rows.act_fp8.rowwise)",
    )
    ap.add_argument("--quick", action="store_true", help="all-local routing only")
    args = ap.parse_args()
    ceil = ceilings()
    print(machine())
    bw, f8, bf = ceil["copy_bw_Bps"], ceil["fp8_flops"], ceil["bf16_flops"]
    print(f"copy {bw / 1e12:.2f} TB/s  bf16 {bf / 1e12:.0f} TF  fp8 {f8 / 1e12:.0f} TF", flush=True)
    recs: list[dict] = [record(f"ceiling.{k}", v, k.split("_")[-1]) for k, v in ceil.items()]
    ex = _experts()
    rows = ex["rows"]
    rows_bytes = sum(rows[k].numel() * rows[k].element_size() for k in ("w13", "s13", "w2", "s2"))
    fp4_bytes = sum(ex[k].numel() for k in ("p13", "q13", "p2", "q2"))
    print(
        f"fp8 rows exact: W13 {rows['exact13']:.4f}  W2 {rows['exact2']:.4f} of rows; "
        f"{rows_bytes / 1e9:.2f} GB vs fp4 {fp4_bytes / 1e9:.2f} GB",
        flush=True,
    )
    recs.append(record("moe.prefill.fp8_rows.bytes", rows_bytes, "B", {"fp4_bytes": fp4_bytes}))
    recs.append(
        record("moe.prefill.fp8_rows.exact_rows", min(rows["exact13"], rows["exact2"]), "frac")
    )
    routings = [True] if args.quick else [True, False]
    for t in [int(v) for v in args.tokens.split(",")]:
        for all_local in routings:
            n_all = E_LOCAL if all_local else E_ALL
            sets = _inputs(t, all_local)
            local = sum(int((s[1] < E_LOCAL).sum()) for s in sets) / len(sets)
            flops = local * 6 * INTER * D
            where = "all_local" if all_local else f"{E_LOCAL}_of_{E_ALL}"
            paths = _paths(ex, n_all)
            prepared, scaled, bf16_mm = _grouped_peers(sets, ex)
            peer_us = {}
            for pname, pfn in (
                ("torch._scaled_grouped_mm.rowwise", scaled),
                (
                    "torch._scaled_grouped_mm.rowwise.fast_accum",
                    functools.partial(scaled, fast=True),
                ),
                ("torch._grouped_mm.bf16", bf16_mm),
            ):
                try:
                    peer_us[pname] = _us(_rotating(pfn, prepared))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{pname}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                val = peer_us[pname]
                recs.append(
                    record(
                        f"moe.prefill.peer.{pname}",
                        val,
                        "us",
                        {
                            "tokens": t,
                            "routing": where,
                            "gemm_only": True,
                            "tflops": flops / (val * 1e-6) / 1e12,
                            "fp8_peak_frac": flops / (val * 1e-6) / f8,
                        },
                        flops / f8 * 1e6,
                    )
                )
                print(
                    f"{pname:44s} T={t} {where:10s} {val:9.1f} us  "
                    f"{flops / (val * 1e-6) / 1e12:6.1f} TF ({flops / (val * 1e-6) / f8:.0%} fp8)",
                    flush=True,
                )
            best_peer = min(peer_us.values()) if peer_us else None
            for name, fn in paths.items():
                val = _us(_rotating(lambda s, fn=fn: fn(s), sets))
                # the 32x32-block fp8 experts are other (random) weights: no shared reference
                err = (float("nan") if "blocks32" in name else
                       _accuracy(fn, sets[0], ex, act_group=32 if "release_act" in name else 0))
                tf = flops / (val * 1e-6)
                params = {
                    "tokens": t,
                    "routing": where,
                    "local_slots": local,
                    "tflops": tf / 1e12,
                    "fp8_peak_frac": tf / f8,
                    "bf16_peak_frac": tf / bf,
                    "rel_err_vs_bf16_activations": err,
                }
                peer = (
                    {"name": min(peer_us, key=peer_us.get), "value": best_peer}
                    if best_peer
                    else None
                )
                recs.append(record(name, val, "us", params, flops / f8 * 1e6, peer))
                print(
                    f"{name:44s} T={t} {where:10s} {val:9.1f} us  {tf / 1e12:6.1f} TF "
                    f"({tf / f8:.0%} fp8)  err {err:.2e}",
                    flush=True,
                )
            if args.sweep:
                for name in args.sweep.split(","):
                    for bm, bn1, bn2, bk, w, st in TILES:
                        tiles = MoeTiles(
                            bm, GemmTiles(bn1, bk, 1, w, st), GemmTiles(bn2, bk, 1, w, st)
                        )
                        try:
                            val = _us(
                                _rotating(
                                    lambda s, fn=paths[name], tl_=tiles: fn(s, tiles=tl_), sets
                                )
                            )
                        except Exception as e:  # noqa: BLE001 - resources exceeded
                            print(f"  {tiles}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                            continue
                        frac = flops / (val * 1e-6) / f8
                        print(
                            f"  tiles {name[12:]:26s} T={t} {where:10s} bm={bm} "
                            f"up=({bn1},{bk},w{w},st{st}) down=({bn2}) {val:9.1f} us ({frac:.0%})",
                            flush=True,
                        )
            path = write("moe_prefill", recs)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
