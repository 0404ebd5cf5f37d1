"""W3 / W5 kernel sweeps on one GPU: MegaMoE (fp8, fp4), MegaGate, Mega-mHC, Engram lookup.

``python -m bench.kernels_moe [--quick]``; writes ``bench/results/kernels_moe.json``. Ceilings
(copy bandwidth, bf16 and fp8 matmul) are measured in the same run; every record is a median
time in µs with its roofline floor.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch
import triton.testing

from bench.common import machine, record, write
from kernels import engram, mhc, mhc_ref
from kernels.gate import moe_gate_ref, moe_gate_triton
from kernels.moe import moe_fp4_triton, moe_fp8_triton
from kernels.moe_formats import fp4_to_pairs
from kernels.moe_ref import moe_experts_ref
from kernels.moe_tiles import GemmTiles, MoeTiles, pick_tiles
from kernels.norm import rms_norm_ref
from kernels.quant import dequantize_fp8_block

D, INTER, E_LOCAL, E_ALL, TOPK, N = 5120, 2304, 48, 384, 6, 4


def _us(fn: Callable[[], Any], rep: int = 60, graph: bool = True) -> float:
    """Median µs; inside a CUDA graph (as the engine runs) unless ``graph`` is False."""
    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")) * 1e3
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")) * 1e3


def _rotating(fn: Callable[[Any], Any], inputs: list[Any]) -> Callable[[], Any]:
    it = itertools.cycle(inputs)
    return lambda: fn(next(it))


def ceilings() -> dict[str, float]:
    a = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    bw = 2 * a.numel() / (_us(lambda: b.copy_(a), graph=False) * 1e-6)
    m = torch.randn(8192, 8192, device="cuda").bfloat16()
    bf16 = 2 * 8192**3 / (_us(lambda: m @ m) * 1e-6)
    f8 = m.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    fp8 = (
        2
        * 8192**3
        / (_us(lambda: torch._scaled_mm(f8, f8.t(), one, one, out_dtype=torch.bfloat16)) * 1e-6)
    )
    return {"copy_bw_Bps": bw, "bf16_flops": bf16, "fp8_flops": fp8}


def _experts(dev: str) -> tuple[torch.Tensor, ...]:
    """Random local experts of V4.1-Flash shape: fp8 (32x32 e8m0 blocks) w13, s13, w2, s2,
    then packed fp4 (e8m0 per 32) w13, s13, w2, s2."""
    w13 = (torch.randn(E_LOCAL, 2 * INTER, D, device=dev) * 64).to(torch.float8_e4m3fn)
    s13 = torch.randint(117, 121, (E_LOCAL, 2 * INTER // 32, D // 32), device=dev).byte()
    w2 = (torch.randn(E_LOCAL, D, INTER, device=dev) * 64).to(torch.float8_e4m3fn)
    s2 = torch.randint(117, 121, (E_LOCAL, D // 32, INTER // 32), device=dev).byte()
    p13 = torch.randint(-128, 128, (E_LOCAL, 2 * INTER, D // 2), device=dev, dtype=torch.int8)
    q13 = torch.randint(121, 125, (E_LOCAL, 2 * INTER, D // 32), device=dev).byte()
    p2 = torch.randint(-128, 128, (E_LOCAL, D, INTER // 2), device=dev, dtype=torch.int8)
    q2 = torch.randint(121, 125, (E_LOCAL, D, INTER // 32), device=dev).byte()
    return w13, s13, w2, s2, p13, q13, p2, q2


def moe_sweep(
    tokens: list[int], ceil: dict[str, float], recs: list[dict], all_local: bool = False
) -> list[str]:
    """Routing over 384 experts of which 48 are local (expert parallel, decode), or with
    ``all_local`` every slot on the 48 local experts (a rank's dispatched prefill tokens)."""
    dev = "cuda"
    n_all = E_LOCAL if all_local else E_ALL
    w13, s13, w2, s2, p13, q13, p2, q2 = _experts(dev)
    bf13 = dequantize_fp8_block(w13, s13, (32, 32), torch.bfloat16)
    bf2 = dequantize_fp8_block(w2, s2, (32, 32), torch.bfloat16)
    w1l = [bf13[e, :INTER] for e in range(E_LOCAL)] + [None] * (E_ALL - E_LOCAL)
    w3l = [bf13[e, INTER:] for e in range(E_LOCAL)] + [None] * (E_ALL - E_LOCAL)
    w2l = [bf2[e] for e in range(E_LOCAL)] + [bf2[0]] * (E_ALL - E_LOCAL)
    fp8_bytes = 3 * INTER * D * (1 + 4 / 1024)  # e8m0 scales stored as bytes: 1/1024
    fp4_bytes = 3 * INTER * D * (0.5 + 1 / 32)
    bw, f8 = ceil["copy_bw_Bps"], ceil["fp8_flops"]
    r13, r2 = fp4_to_pairs(p13), fp4_to_pairs(p2)  # the same experts, repacked (load time)
    lines = []
    for t in tokens:
        torch.manual_seed(t)  # the same routing every run: comparable experts touched
        sets = []
        for _ in range(4):
            ids = torch.rand(t, n_all, device=dev).argsort(-1)[:, :TOPK]
            ids[0, 0] = torch.where((ids[0] < E_LOCAL).any(), ids[0, 0], 0)  # >= 1 local
            sets.append(
                (torch.randn(t, D, device=dev).bfloat16(), ids, torch.rand(t, TOPK, device=dev))
            )
        touched = sum(len(torch.unique(s[1][s[1] < E_LOCAL])) for s in sets) / len(sets)
        e_t = E_LOCAL * (1 - (1 - TOPK / n_all) ** t)
        slots = t * TOPK * E_LOCAL / n_all
        flops = slots * 6 * INTER * D

        def fp8(s: tuple, **kw: Any) -> torch.Tensor:
            return moe_fp8_triton(s[0], s[1], s[2], w13, s13, w2, s2, (32, 32), 10.0,
                                  n_experts=n_all, **kw)  # fmt: skip

        def fp4(s: tuple, **kw: Any) -> torch.Tensor:
            return moe_fp4_triton(s[0], s[1], s[2], p13, q13, p2, q2, 10.0, n_experts=n_all, **kw)

        def fp4p(s: tuple, **kw: Any) -> torch.Tensor:  # the same experts, pairs layout
            return moe_fp4_triton(s[0], s[1], s[2], r13, q13, r2, q2, 10.0, n_experts=n_all,
                                  pairs=True, **kw)  # fmt: skip

        variants = (("moe.fp8", fp8, {}, fp8_bytes), ("moe.fp4", fp4, {}, fp4_bytes),
                    ("moe.fp4.pairs", fp4p, {}, fp4_bytes))  # fmt: skip
        tref = _us(
            _rotating(lambda s: moe_experts_ref(s[0], s[1], s[2], w1l, w2l, w3l, 10.0), sets),
            30,
            False,
        )
        for name, fn, kw, wb in variants:
            val = _us(_rotating(lambda s, fn=fn, kw=kw: fn(s, **kw), sets))
            floor = max(touched * wb / bw, flops / f8) * 1e6
            gbps = touched * wb / (val * 1e-6) / 1e9
            params = {
                "tokens": t,
                "routing": "all_local" if all_local else f"{E_LOCAL}_of_{E_ALL}",
                "experts_touched": touched,
                "E_t_formula": e_t,
                "weight_GBps": gbps,
                "tflops": flops / (val * 1e-6) / 1e12,
                "fp8_peak_frac": flops / (val * 1e-6) / f8,
                "speedup_vs_torch_ref": tref / val,
            }
            recs.append(
                record(
                    name,
                    val,
                    "us",
                    params,
                    floor,
                    {"name": "torch bf16 expert loop", "value": tref},
                )
            )
            lines.append(
                f"{name:26s} T={t:5d}{' local' if all_local else ''} {val:9.1f} us  "
                f"floor {floor:8.1f}  "
                f"{gbps:7.0f} GB/s  {params['tflops']:6.1f} TF  ref {tref:9.1f} us"
            )
    return lines


def _tile_choices(t: int, n_all: int, pairs: bool) -> list[MoeTiles]:
    """The heuristic's pick and neighbours (BM, BN, BK, split, warps, stages)."""
    base = pick_tiles(t * TOPK, E_LOCAL, n_all, D, INTER, 32, 132, pairs=pairs)
    out = [base]
    if base.bm <= 32:
        for bn, bk, w, st in ((64, 256, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 8, 3)):
            g1 = GemmTiles(bn, bk, base.gate_up.split, w, st)
            g2 = GemmTiles(bn, bk, base.down.split, w, st)
            out.append(MoeTiles(base.bm, g1, g2))
    else:  # 4-warp tiles leave room for two CTAs per SM (one's MMA under the other's scaling)
        for bm, bn1, bn2, bk, w, st in (
            (64, 128, 128, 64, 4, 4), (128, 64, 128, 128, 8, 3),
            (128, 64, 64, 128, 8, 4), (64, 64, 128, 128, 4, 3),
            (64, 64, 64, 128, 4, 4), (64, 128, 128, 128, 4, 3),
        ):  # fmt: skip
            out.append(MoeTiles(bm, GemmTiles(bn1, bk, 1, w, st), GemmTiles(bn2, bk, 1, w, st)))
    return out


def tile_sweep(cases: list[tuple[int, bool]], formats: tuple[str, ...]) -> None:
    """Time tile choices around the heuristic for (tokens, all_local) cases (fp8, fp4 and fp4
    in the pairs layout); the first row of each format is its pick. Prints each row as it
    is measured."""
    dev = "cuda"
    w13, s13, w2, s2, p13, q13, p2, q2 = _experts(dev)
    r13, r2 = fp4_to_pairs(p13), fp4_to_pairs(p2)
    for t, all_local in cases:
        n_all = E_LOCAL if all_local else E_ALL
        sets = []
        for _ in range(4):
            ids = torch.rand(t, n_all, device=dev).argsort(-1)[:, :TOPK]
            ids[0, 0] = torch.where((ids[0] < E_LOCAL).any(), ids[0, 0], 0)
            sets.append((torch.randn(t, D, device=dev).bfloat16(), ids,
                         torch.rand(t, TOPK, device=dev)))  # fmt: skip
        for name, fn in (
            ("fp8", lambda s, tl_: moe_fp8_triton(s[0], s[1], s[2], w13, s13, w2, s2,
                                                  (32, 32), 10.0, tiles=tl_)),
            ("fp4", lambda s, tl_: moe_fp4_triton(s[0], s[1], s[2], p13, q13, p2, q2, 10.0,
                                                  tiles=tl_)),
            ("fp4p", lambda s, tl_: moe_fp4_triton(s[0], s[1], s[2], r13, q13, r2, q2, 10.0,
                                                   tiles=tl_, pairs=True)),
        ):  # fmt: skip
            if name not in formats:
                continue
            for i, tiles in enumerate(_tile_choices(t, n_all, name == "fp4p")):
                try:
                    us = _us(_rotating(lambda s, fn=fn, tiles=tiles: fn(s, tiles), sets))
                except Exception as e:  # resources exceeded for this tile shape
                    us = float("nan")
                    print(f"  ({type(e).__name__}: {str(e)[:80]})")
                g1, g2 = tiles.gate_up, tiles.down
                print(
                    f"tiles {name:4s} T={t:5d}{' local' if all_local else '      '} "
                    f"{'pick' if i == 0 else '    '} bm={tiles.bm:3d} "
                    f"up=({g1.bn},{g1.bk},s{g1.split},w{g1.warps},st{g1.stages}) "
                    f"down=({g2.bn},{g2.bk},s{g2.split},w{g2.warps},st{g2.stages}) {us:9.1f} us",
                    flush=True,
                )


def gate_sweep(tokens: list[int], ceil: dict[str, float], recs: list[dict]) -> list[str]:
    w = (torch.randn(E_ALL, D, device="cuda") / D**0.5).bfloat16()
    bias = 0.1 * torch.randn(E_ALL, device="cuda")
    lines = []
    for t in tokens:
        xs = [torch.randn(t, D, device="cuda").bfloat16() for _ in range(4)]
        val = _us(_rotating(lambda x: moe_gate_triton(x, w, bias, TOPK, 2.5), xs))
        ref = _us(_rotating(lambda x: moe_gate_ref(x.float() @ w.float().t(), bias, TOPK, 2.5), xs))
        floor = (
            max(
                (w.numel() + t * D) * 2 / ceil["copy_bw_Bps"],
                2 * t * D * E_ALL / ceil["bf16_flops"],
            )
            * 1e6
        )
        recs.append(
            record("moe.gate", val, "us", {"tokens": t}, floor, {"name": "torch", "value": ref})
        )
        lines.append(f"gate       T={t:5d} {val:9.1f} us  floor {floor:8.1f}  torch {ref:8.1f} us")
    return lines


def mhc_sweep(tokens: list[int], ceil: dict[str, float], recs: list[dict]) -> list[str]:
    fn = torch.randn(N * (N + 2), N * D, device="cuda") / (N * D) ** 0.5
    base, scale = 0.5 * torch.randn(24, device="cuda"), torch.ones(3, device="cuda")
    nw = torch.ones(D, device="cuda")
    eps = (20, 1e-6, 1e-6, 1e-6)

    def unfused(x: torch.Tensor) -> torch.Tensor:
        pre, post, comb = mhc_ref.hc_mix_ref(x, fn, base, scale, *eps[:3])
        return rms_norm_ref(mhc_ref.hc_collapse_ref(x, pre), nw, eps[3])

    lines = []
    for t in tokens:
        xs = [torch.randn(t, N, D, device="cuda").bfloat16() for _ in range(4)]
        val = _us(_rotating(lambda x: mhc.hc_pre_triton(x, fn, base, scale, nw, *eps), xs))
        ref = _us(_rotating(unfused, xs))
        floor = (t * (N * D + D) * 2 + fn.numel() * 4) / ceil["copy_bw_Bps"] * 1e6
        recs.append(
            record(
                "mhc.pre",
                val,
                "us",
                {"tokens": t, "speedup": ref / val},
                floor,
                {"name": "unfused torch", "value": ref},
            )
        )
        lines.append(f"mhc.pre    T={t:5d} {val:9.1f} us  floor {floor:8.1f}  torch {ref:8.1f} us")
    return lines


def engram_sweep(tokens: list[int], recs: list[dict]) -> list[str]:
    rows_n = 1 << 20
    host = (torch.randn(rows_n, 256) * 8).to(torch.float8_e4m3fn).pin_memory()
    hscale = torch.randint(118, 122, (rows_n, 8), dtype=torch.uint8).pin_memory()
    dev, dscale = host.cuda(), hscale.cuda()
    lines = []
    for t in tokens:
        rows = [torch.randint(0, rows_n, (t, 24), device="cuda") for _ in range(4)]
        for name, tab, sc in (("device", dev, dscale), ("host_uva", host, hscale)):
            val = _us(
                _rotating(
                    lambda r, tab=tab, sc=sc: engram.engram_gather_triton(
                        tab, r, sc, torch.bfloat16
                    ),
                    rows,
                )
            )
            recs.append(record("engram.lookup", val, "us", {"tokens": t, "table": name}))
            lines.append(f"engram     T={t:5d} {name:9s} {val:9.1f} us")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (< 90 s)")
    ap.add_argument("--tiles", choices=("decode", "prefill", "all"),
                    help="only the MoE tile sweep")  # fmt: skip
    args = ap.parse_args()
    if args.tiles:
        decode = [(1, False), (64, False)]
        prefill = [(4096, True)]  # all local: ~512 rows per expert
        cases = {"decode": decode, "prefill": prefill, "all": decode + prefill}[args.tiles]
        # the MX fp4 layout runs only where the pairs layout cannot (d % 64 != 0)
        tile_sweep(cases, ("fp8", "fp4", "fp4p") if args.tiles == "decode" else ("fp8", "fp4p"))
        return
    ceil = ceilings()
    print(machine())
    print(
        f"copy {ceil['copy_bw_Bps'] / 1e12:.2f} TB/s  bf16 {ceil['bf16_flops'] / 1e12:.0f} TF  "
        f"fp8 {ceil['fp8_flops'] / 1e12:.0f} TF",
        flush=True,
    )
    recs: list[dict] = [record(f"ceiling.{k}", v, k.split("_")[-1]) for k, v in ceil.items()]
    moe_t = [1, 64, 4096] if args.quick else [1, 8, 64, 512, 4096]
    small = [1, 64, 4096]
    sections: list[Callable[[], list[str]]] = [
        lambda: moe_sweep(moe_t, ceil, recs),
        lambda: moe_sweep([4096], ceil, recs, all_local=True),
        lambda: gate_sweep(small, ceil, recs),
        lambda: mhc_sweep(small, ceil, recs),
        lambda: engram_sweep([1, 64] if args.quick else small, recs),
    ]
    for section in sections:  # print and save as we go: a cut-off run keeps what it measured
        print("\n".join(section()), flush=True)
        path = write("kernels_moe", recs)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
