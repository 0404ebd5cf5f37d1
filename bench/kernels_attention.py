"""Attention-path kernels on the GPU (PERFORMANCE.md W4): decode sparse attention, indexer
scores + top-k, compressor pooling. Each point: median µs (triton.testing.do_bench), the
roofline floor on ceilings measured in this run, and the torch reference timed beside it.

    python -m bench.kernels_attention [--quick]

Inputs rotate over several copies (together > 2x L2) so that repeated calls don't hit a
warm L2. Writes bench/results/kernels_attention.json and prints a table.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.testing

from bench.common import machine, record, write
from kernels import attention as attn
from kernels import compressor as cp
from kernels import indexer as ix
from kernels import topk as tk
from kernels.kv_quant import pow2_ceil
from kernels.rope import apply_rope_ref

DEV = "cuda"
L2_BYTES = 50e6  # H200: 50 MB
H, D, W, TOP, ROPE = 64, 512, 128, 512, 64
HI, DI = 32, 128


def bench_us(fn: Callable[[], Any], warmup: int = 10, rep: int = 40) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_us(fn: Callable[[], Any], rep: int = 40) -> float:
    """Median µs of CUDA-graph replays of ``fn`` (launch costs gone, as in the engine's
    graph-captured decode step)."""
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def rotating(make: Callable[[int], Any], set_bytes: float) -> Callable[[], Any]:
    """Input sets ``make(i)`` (enough to exceed 2x L2, at most 8) served round-robin."""
    n = max(1, min(8, math.ceil(2 * L2_BYTES / max(set_bytes, 1.0))))
    sets = [make(i) for i in range(n)]
    it = itertools.cycle(sets)
    return lambda: next(it)


def ceilings() -> dict[str, float]:
    x = torch.empty(1 << 28, device=DEV, dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / (bench_us(lambda: y.copy_(x)) * 1e-6)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    flops = 2 * 8192**3 / (bench_us(lambda: a @ b) * 1e-6)
    out = {"copy_GBps": bw / 1e9, "bf16_TFLOPs": flops / 1e12, "fp8_TFLOPs": None}
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=DEV)
        us = bench_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16))
        out["fp8_TFLOPs"] = 2 * 8192**3 / (us * 1e-6) / 1e12
    except (RuntimeError, TypeError):
        pass
    return out


def rec(
    name: str,
    value: float | None,
    unit: str,
    params: dict,
    floor: float | None,
    peer: dict | None = None,
) -> dict:
    """``record`` that tolerates a null value (a failed torch.compile): the floor is kept."""
    r = record(name, value, unit, params, floor if value is not None else None, peer)
    r["floor"] = floor
    return r


def _try_compile(fn: Callable) -> Callable | None:
    try:
        return torch.compile(fn, dynamic=True)
    except Exception:  # any compile failure is recorded as null
        return None


def _time_or_none(fn: Callable[[], Any] | None) -> float | None:
    if fn is None:
        return None
    try:
        return bench_us(fn, warmup=3, rep=20)
    except Exception:  # torch.compile may fail at its first call
        return None


# ---- decode attention ---------------------------------------------------------------------


def _attn_inputs(B: int, kv_dtype: str, seed: int, n_comp: int = 2048) -> dict[str, Any]:
    """B sequences, each with its own window (128 rows) and compressed pool (top-512 of 2048).

    ``kv_dtype``: "bf16" / "fp8" (fp8 e4m3 x fp32 pow2 per 32) / "fp8e8" (fp8 e4m3 x e8m0
    codes per 32: the engine's fp8 row format) rows of one pool, or "packed": the engine's
    V4.1 step (two sources: fp8 + e8m0 window ring, nvfp4 + e4m3 entries)."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, D, device=DEV, generator=g).bfloat16()
    per = W + n_comp
    kv = torch.randn(B * per, D, device=DEV, generator=g)
    base = (torch.arange(B, device=DEV) * per).unsqueeze(1)
    win = base + torch.arange(W, device=DEV)
    comp = base + W + torch.rand(B, n_comp, device=DEV, generator=g).argsort(1)[:, :TOP]
    idx = torch.cat((win, comp.sort(1).values), dim=1)
    sink = torch.randn(H, device=DEV, generator=g)
    ang = torch.rand(B, ROPE // 2, device=DEV, generator=g) * 100
    args = dict(q=q, sink=sink, inv_rope_angles=ang)
    if kv_dtype == "packed":
        rows = kv.view(B, per, D)
        ring, s1 = kv_pack(rows[:, :W].reshape(-1, D), "fp8")
        pool, s2 = kv_pack(rows[:, W:].reshape(-1, D), "nvfp4")
        sel = (comp - base - W) + torch.arange(B, device=DEV).unsqueeze(1) * n_comp
        return {**args, "kv": ring, "kv_scale": s1, "idx": win - base + base // per * W,
                "kv2": pool, "kv2_scale": s2, "idx2": sel.sort(1).values}  # fmt: skip
    if kv_dtype == "fp8e8":
        codes, scale = kv_pack(kv, "fp8")
        return {**args, "kv": codes, "kv_scale": scale, "idx": idx}
    if kv_dtype == "fp8":
        blocks = kv.unflatten(-1, (-1, 32))
        scale = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-4) / 448.0)
        kv = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
        return {**args, "kv": kv, "kv_scale": scale, "idx": idx}
    return {**args, "kv": kv.bfloat16(), "idx": idx}


def _attn_bytes(B: int, kv_dtype: str) -> float:
    """Bytes one decode step must move: the key rows read (+ their ids), q in, out."""
    row = {"bf16": D * 2, "fp8": D + D // 32 * 4, "fp8e8": D + D // 32}
    if kv_dtype == "packed":
        keys = W * (D + D // 32 + 8) + TOP * (D // 2 + D // 16 + 8)
    else:
        keys = (W + TOP) * (row[kv_dtype] + 8)
    return B * (keys + 2 * H * D * 2 + ROPE // 2 * 4)


def _attn_flops(B: int) -> float:
    """QK^T and PV over every selected key: 4 B H K D."""
    return 4.0 * B * H * (W + TOP) * D


def _ref_attention(a: dict[str, Any]) -> torch.Tensor:
    kw = {k: a[k] for k in ("kv_scale", "kv2", "idx2", "kv2_scale") if k in a}
    out = attn.sparse_attention_ref(a["q"], a["kv"], a["idx"], a["sink"], D**-0.5, **kw)
    return apply_rope_ref(out, a["inv_rope_angles"], inverse=True)


def triton_attention(a: dict[str, Any], kernel: str | None = None, **launch: Any) -> torch.Tensor:
    """``sparse_attention_triton`` on one ``_attn_inputs`` set (``launch``: splits, launch)."""
    kw = {k: v for k, v in a.items() if k not in ("q", "kv", "idx", "sink")}
    return attn.sparse_attention_triton(
        a["q"], a["kv"], a["idx"], a["sink"], D**-0.5, kernel=kernel, **launch, **kw
    )


def sweep_attention(ceil: dict[str, float], batches: list[int], compile_at: set[int],
                    kv_dtypes: tuple[str, ...] = ("bf16", "fp8", "fp8e8", "packed"),
                    ) -> list:  # fmt: skip
    """Decode attention per (key format, batch): the warp-specialized kernel ("ws", where it
    applies) and the portable one ("tl") in the same run, the torch reference beside them.
    The floor is the larger of the byte floor (copy rate) and the FLOP floor (bf16 matmul
    rate): at batch 64 they are close, so >= 70% of bandwidth needs ~70% of the MMA peak."""
    recs = []
    bw = ceil["copy_GBps"] * 1e9
    compiled = _try_compile(_ref_attention)
    ws_ok = attn.ws_applies(torch.empty(1, H, D, device=DEV, dtype=torch.bfloat16))
    for kv_dtype, B in itertools.product(kv_dtypes, batches):
        nbytes = _attn_bytes(B, kv_dtype)
        byte_floor = nbytes / bw * 1e6
        flop_floor = _attn_flops(B) / (ceil["bf16_TFLOPs"] * 1e12) * 1e6
        floor = max(byte_floor, flop_floor)
        nxt = rotating(lambda i, B=B, k=kv_dtype: _attn_inputs(B, k, i), nbytes * 4)
        a = nxt()
        eager = _time_or_none(lambda a=a: _ref_attention(a))
        comp = _time_or_none(lambda a=a: compiled(a)) if compiled and B in compile_at else None
        want = _ref_attention({k: (v.double() if k in ("q", "sink") else v)
                               for k, v in a.items()})  # fmt: skip
        peer = {
            "name": "FlashMLA-class decode at 90% of HBM BW (H800 report)",
            "value": byte_floor / 0.9,
        }
        for kernel in ("ws", "tl") if ws_ok else ("tl",):

            def run(nxt=nxt, kernel=kernel):
                triton_attention(nxt(), kernel)

            got = triton_attention(a, kernel)
            err = float((got.double() - want).norm() / want.norm())
            us = bench_us(run)
            us_graph = graph_us(run)  # rotating inputs inside the graph too: a cold L2
            params = {
                "batch": B, "kv": kv_dtype, "kernel": kernel, "heads": H, "dim": D,
                "keys": W + TOP, "bytes": nbytes, "byte_floor_us": byte_floor,
                "flop_floor_us": flop_floor, "rel_err_vs_fp64": err,
                "GBps": nbytes / us_graph / 1e3,
                "TFLOPs": _attn_flops(B) / us_graph / 1e6,
                "speedup_vs_torch_eager": eager / us_graph if eager else None,
            }  # fmt: skip
            recs.append(rec("attention.decode", us, "us", params, floor, peer))
            recs.append(rec("attention.decode.graph", us_graph, "us", params, floor, peer))
        recs.append(rec("attention.decode.torch_eager", eager, "us", {"batch": B, "kv": kv_dtype},
                        floor))  # fmt: skip
        recs.append(rec("attention.decode.torch_compile", comp, "us",
                        {"batch": B, "kv": kv_dtype}, floor))  # fmt: skip
    return recs


# ---- indexer scores + top-k ---------------------------------------------------------------


def _idx_inputs(T: int, C: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(T, HI, DI, device=DEV, generator=g).bfloat16()
    k = torch.randn(C, DI, device=DEV, generator=g).bfloat16()
    w = torch.randn(T, HI, device=DEV, generator=g)
    visible = torch.full((T,), C, device=DEV, dtype=torch.int64)
    return q, k, w, visible


def sweep_indexer(ceil: dict[str, float], batches: list[int], sizes: list[int]) -> list:
    recs = []
    bw, fl = ceil["copy_GBps"] * 1e9, ceil["bf16_TFLOPs"] * 1e12
    for T, C in itertools.product(batches, sizes):
        score_bytes = C * DI * 2 + T * (HI * DI * 2 + HI * 4) + T * C * 4
        nxt = rotating(lambda i, T=T, C=C: _idx_inputs(T, C, i), score_bytes)
        a = nxt()
        s = ix.indexer_scores_triton(*a)
        s_sets = rotating(lambda i, s=s: s.clone(), T * C * 4)
        us_s = bench_us(lambda nxt=nxt: ix.indexer_scores_triton(*nxt()))
        us_k = bench_us(lambda s_sets=s_sets: tk.topk_triton(s_sets(), TOP))
        us_k_graph = graph_us(lambda s_sets=s_sets: tk.topk_triton(s_sets(), TOP))
        us_all = bench_us(lambda nxt=nxt: ix.indexer_topk_triton(*nxt(), TOP))
        eager = _time_or_none(lambda a=a: tk.topk_ref(ix.indexer_scores_ref(*a), TOP))
        flops = 2 * T * HI * DI * C
        f_s = max(score_bytes / bw, flops / fl) * 1e6
        f_k = T * C * 4 / bw * 1e6
        p = {
            "batch": T,
            "candidates": C,
            "heads": HI,
            "dim": DI,
            "k": TOP,
            "keys_shared_by_batch": True,
        }
        recs.append(rec("indexer.scores", us_s, "us", {**p, "TFLOPs": flops / us_s / 1e6}, f_s))
        anchor = {"name": "top-k at 256K candidates, H200 (PERFORMANCE.md)", "value": 15.0}
        recs.append(rec("indexer.topk", us_k, "us", p, f_k, anchor if C == 262144 else None))
        recs.append(rec("indexer.topk.graph", us_k_graph, "us", p, f_k,
                        anchor if C == 262144 else None))  # fmt: skip
        p_all = {**p, "speedup_vs_torch_eager": eager / us_all if eager else None}
        recs.append(rec("indexer.scores_topk", us_all, "us", p_all, f_s + f_k))
        recs.append(rec("indexer.scores_topk.torch_eager", eager, "us", p, f_s + f_k))
    return recs


# ---- compressor ---------------------------------------------------------------------------


def _cmp_inputs(E: int, ratio: int, overlap: bool, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    span, width = (2 * ratio, 2 * D) if overlap else (ratio, D)
    kv = torch.randn(E, span, width, device=DEV, generator=g)
    gate = torch.randn(E, span, width, device=DEV, generator=g)
    first = torch.zeros(E, device=DEV, dtype=torch.bool)
    norm_w = torch.rand(D, device=DEV, generator=g) + 0.5
    ang = torch.rand(E, ROPE // 2, device=DEV, generator=g) * 100
    pool = torch.empty(2 * E, D, device=DEV, dtype=torch.bfloat16)
    rows = torch.randperm(2 * E, device=DEV, generator=g)[:E]
    return kv, gate, first, norm_w, ang, pool, rows


def sweep_compressor(ceil: dict[str, float], sizes: list[int]) -> list:
    recs = []
    bw = ceil["copy_GBps"] * 1e9
    for (name, ratio, overlap), E in itertools.product(
        (("v41_ratio2", 2, False), ("v4_csa4", 4, True)), sizes
    ):
        span = 2 * ratio if overlap else ratio
        nbytes = E * (span * D * 4 * 2 + ROPE // 2 * 4 + 8 + D * 2)  # read kv+gate, write bf16
        kw = {"overlap": overlap, "ratio": ratio, "dim": D}
        nxt = rotating(lambda i, E=E, r=ratio, o=overlap: _cmp_inputs(E, r, o, i), nbytes)
        a = nxt()

        def run(nxt=nxt, kw=kw):
            kv, gate, first, norm_w, ang, pool, rows = nxt()
            cp.compress_pool_triton(
                kv, gate, first, norm_w, 1e-20, angles=ang, out=pool, out_rows=rows, **kw
            )

        us = bench_us(run)
        us_graph = graph_us(run)
        eager = _time_or_none(
            lambda a=a, kw=kw: cp.compress_pool_ref(
                *a[:4], 1e-20, angles=a[4], out=a[5], out_rows=a[6], **kw
            )
        )
        floor = nbytes / bw * 1e6
        params = {
            "mode": name,
            "entries": E,
            "dim": D,
            "GBps": nbytes / us / 1e3,
            "speedup_vs_torch_eager": eager / us if eager else None,
        }
        peer = {"name": "SGLang compressor at 80% of HBM BW", "value": floor / 0.8}
        recs.append(rec("compressor.pool", us, "us", params, floor, peer))
        recs.append(rec("compressor.pool.graph", us_graph, "us",
                        {**params, "GBps": nbytes / us_graph / 1e3}, floor, peer))  # fmt: skip
        recs.append(rec("compressor.pool.torch_eager", eager, "us", params, floor))
    return recs


def _table(recs: list) -> str:
    lines = [f"{'name':34} {'params':58} {'us':>9} {'floor':>8} {'x floor':>7}"]
    for r in recs:
        if r["value"] is None:
            continue
        p = {
            k: v
            for k, v in r["params"].items()
            if k in ("batch", "kv", "kernel", "candidates", "mode", "entries", "splits")
        }
        sp = r["params"].get("speedup_vs_torch_eager")
        extra = f" eager/x={sp:.1f}" if sp else ""
        spc = r["params"].get("speedup_vs_torch_compile")
        extra += f" compile/x={spc:.1f}" if spc else ""
        gb = r["params"].get("GBps")
        extra += f" {gb:.0f}GB/s" if gb and "torch" not in r["name"] else ""
        err = r["params"].get("rel_err_vs_fp64")
        extra += f" err={err:.1e}" if err is not None else ""
        ratio = f"{r['ratio_to_floor']:.2f}" if r["ratio_to_floor"] else "-"
        floor = f"{r['floor']:.1f}" if r["floor"] else "-"
        lines.append(
            f"{r['name']:34} {str(p)[:58]:58} {r['value']:9.1f} {floor:>8} {ratio:>7}{extra}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a subset in well under 90 s")
    ap.add_argument("--only", choices=("attention", "indexer", "compressor"), default=None,
                    help="one op family")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ceil = ceilings()
    print(f"ceilings: {ceil}")
    recs = [rec(f"ceiling.{k}", v, k.split("_")[1], {}, None) for k, v in ceil.items()]
    want = {args.only} if args.only else {"attention", "indexer", "compressor"}
    if "attention" in want:
        batches = [1, 64] if args.quick else [1, 8, 32, 64, 128]
        recs += sweep_attention(ceil, batches, compile_at=set() if args.quick else {8, 64})
    if "indexer" in want:
        recs += (sweep_indexer(ceil, [1], [262144]) if args.quick
                 else sweep_indexer(ceil, [1, 8, 64], [16384, 65536, 262144]))  # fmt: skip
    if "compressor" in want:
        recs += sweep_compressor(ceil, [4096, 16384] if args.quick else [64, 1024, 4096])
    path = write("kernels_attention", recs)
    info = machine()
    print(f"{info.get('gpu')} torch {info['torch']} triton {info.get('triton')}")
    print(_table(recs))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
