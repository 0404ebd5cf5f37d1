"""The small per-layer ops of a decode step at V4.1-Flash rank shapes, one by one, as the
engine's graph-captured step runs them: mHC (post of one sublayer + mix, collapse and norm of
the next, V4.1 form), the router (gate GEMM + top-k, over the EP group's 8 x T tokens), the
window-KV write (fp8 pack + store into the ring) and the shared expert (W1/W3, SwiGLU, W2).

    python bench/decode_plumbing.py [--label NAME] [--tokens 1,8,64] [--out DIR]

Run as a file, it imports ``kernels`` / ``app`` from PYTHONPATH first, so the same script
times an older checkout (``PYTHONPATH=/old/tree python bench/decode_plumbing.py --label
before --out DIR``) beside the current one in the same device call; ``--label`` tags the
records, ``DIR/decode_plumbing.json`` holds them (``bench/results`` by default). Each op is
checked against its torch reference before it is timed. Floor: the op's bytes at the
measured copy rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch
import triton

# kernels / app: from PYTHONPATH first (an older tree under test), else this checkout's
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the result writer: always this checkout's bench/common.py, whatever PYTHONPATH holds
_spec = importlib.util.spec_from_file_location(
    "_bench_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

D, N, E, INTER, DIM, RING = 5120, 4, 384, 2304, 512, 4 * 256  # V4.1-Flash rank shapes


def _us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _copy_rate() -> float:
    x = torch.empty(1 << 28, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=100, return_mode="median")
    return 2 * x.numel() * 4 / (ms * 1e-3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def mhc_case(t: int, g: torch.Generator) -> tuple[callable, float, float]:
    from kernels import mhc

    return _mhc_timed(t, g, mhc.hc_post_pre_triton)


def _mhc_timed(t: int, g: torch.Generator, run) -> tuple[callable, float, float]:
    from kernels import mhc_ref

    dev = "cuda"
    x = torch.randn(t, N, D, device=dev, generator=g).bfloat16()
    out = torch.randn(t, D, device=dev, generator=g).bfloat16()
    fn = torch.randn(N * (N + 2), N * D, device=dev, generator=g) / (N * D) ** 0.5
    base = 0.5 * torch.randn(N * (N + 2), device=dev, generator=g)
    scale = 1 + 0.2 * torch.randn(3, device=dev, generator=g)
    nw = 1 + 0.1 * torch.randn(D, device=dev, generator=g)
    post, comb = 2 * torch.rand(t, N, device=dev, generator=g), torch.rand(t, N, N, device=dev)
    pre_in = torch.rand(t, N, device=dev, generator=g) + 0.1
    eps = (20, 1e-6, 1e-6, 1e-6)
    args = (out, x, post, comb, fn, base, scale, nw, *eps, pre_in)
    got = run(*args)
    ref = mhc_ref.hc_post_pre_ref(*args)
    err = max(_rel(got[0], ref[0]), _rel(got[1], ref[1]), _rel(got[3], ref[3]),
              _rel(got[4], ref[4]))  # fmt: skip
    byt = x.numel() * 2 * 2 + out.numel() * 2 + fn.numel() * 4 + t * D * 2
    return (lambda: run(*args)), err, byt


def gate_case(t: int, g: torch.Generator) -> tuple[callable, float, float]:
    from kernels.gate import moe_gate_ref, moe_gate_triton

    tg = 8 * t  # the EP8 group's tokens through this rank's router (bench/flash_rank.py)
    x = torch.randn(tg, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, D, device="cuda", generator=g) / D**0.5).bfloat16()
    bias = 0.1 * torch.randn(E, device="cuda", generator=g)
    ids, wts = moe_gate_triton(x, w, bias, 6, 1.5)
    rids, rw = moe_gate_ref(x.float() @ w.float().t(), bias, 6, 1.5)
    err = float((ids != rids).float().mean().item()) + _rel(wts, rw)
    return (lambda: moe_gate_triton(x, w, bias, 6, 1.5)), err, w.numel() * 2 + x.numel() * 2


def kv_case(t: int, g: torch.Generator) -> tuple[callable, float, float]:
    from app.model.kv_store import KVRows
    from kernels.kv_quant import kv_pack_ref, kv_storage

    data, sc = kv_storage("fp8", RING * 64, DIM, torch.bfloat16, "cuda")
    ring = KVRows(data, sc, "fp8", DIM)
    kv = torch.randn(t, DIM, device="cuda", generator=g).bfloat16()
    rows = torch.randperm(RING * 64, device="cuda", generator=g)[:t]
    ring.write(rows, kv)
    c, s = kv_pack_ref(kv, "fp8")
    ok = torch.equal(data.view(torch.uint8)[rows], c.view(torch.uint8)) and torch.equal(
        sc.view(torch.uint8)[rows], s.view(torch.uint8)
    )
    return (lambda: ring.write(rows, kv)), 0.0 if ok else 1.0, t * DIM * 2 + t * (DIM + 16)


def shared_case(t: int, g: torch.Generator) -> tuple[callable, float, float]:
    from app.model.moe import Expert
    from kernels.moe_ref import swiglu_clamp

    e = Expert(D, INTER, 10.0).cuda().bfloat16()
    for p in e.parameters():
        p.data.normal_(0, D**-0.5, generator=g)
    x = torch.randn(t, D, device="cuda", generator=g).bfloat16()
    e.stack_projections()  # as the runner does before capture
    got = e(x)
    ref = e.w2(swiglu_clamp(e.w1(x), e.w3(x), 10.0))
    return (lambda: e(x)), _rel(got, ref), 3 * INTER * D * 2


# one layer's dense projections at V4.1-Flash shapes [N, K]: wq_a, wq_b, wkv, wo_b and the
# shared expert's stacked W1/W3 and W2 (the grouped wo_a is left out)
DENSE = ((1280, D), (64 * 512, 1280), (512, D), (D, 8 * 1024), (2 * INTER, D), (D, INTER))


def dense_case(t: int, g: torch.Generator, fmt: str) -> tuple[callable, float, float]:
    """The layer's dense projections at t tokens: the checkpoint's e4m3 weights with 32 x 32
    e8m0 blocks through ``fp8_linear``, planned as ``Fp8Linear`` plans them ("fp8_auto": the
    dispatch's kernel), or bf16 through cuBLAS ("bf16", the peer) or the plain projections'
    decode kernel ("bf16_gemv", up to 16 tokens). (None, 0, 0) where that kernel does not
    take t tokens."""
    from kernels.linear import fp8_decode_plan, fp8_linear_ref
    from kernels.linear import fp8_linear_triton as fp8_linear
    from kernels.quant import dequantize_fp8_block, quantize_fp8_block

    x = {k: torch.randn(t, k, device="cuda", generator=g).bfloat16() for _, k in DENSE}
    ws = [quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) / k**0.5, (32, 32))
          for n, k in DENSE]  # fmt: skip
    if fmt.startswith("fp8"):
        plans = [fp8_decode_plan(q, s, (32, 32)) for q, s in ws]
        calls = [(lambda q=q, s=s, k=k, p=p: fp8_linear(x[k], q, s, (32, 32), p))
                 for (q, s), (_, k), p in zip(ws, DENSE, plans, strict=True)]  # fmt: skip
        err = max(_rel(c(), fp8_linear_ref(x[k].float(), q, s, (32, 32)))
                  for c, (q, s), (_, k) in zip(calls, ws, DENSE, strict=True))  # fmt: skip
        byt = sum(n * k + (n // 32) * (k // 32) for n, k in DENSE)
    else:
        wb = [dequantize_fp8_block(q, s, (32, 32)).bfloat16() for q, s in ws]
        if fmt == "bf16_gemv":  # the plain projections' decode kernel (up to 16 rows)
            from kernels.linear import GEMV_MAX_ROWS, dense_linear_triton

            if t > GEMV_MAX_ROWS:
                return None, 0.0, 0.0
            calls = [(lambda w=w, k=k: dense_linear_triton(x[k], w))
                     for w, (_, k) in zip(wb, DENSE, strict=True)]  # fmt: skip
        else:
            calls = [(lambda w=w, k=k: torch.nn.functional.linear(x[k], w))
                     for w, (_, k) in zip(wb, DENSE, strict=True)]  # fmt: skip
        err = max(_rel(c(), x[k].double() @ w.double().T)
                  for c, w, (_, k) in zip(calls, wb, DENSE, strict=True))  # fmt: skip
        byt = sum(2 * n * k for n, k in DENSE)
    byt += sum(t * (k + n) * 2 for n, k in DENSE)

    def run():
        for c in calls:
            c()

    return run, err, byt


CASES = {"mhc": mhc_case, "gate": gate_case, "kv_write": kv_case, "shared_expert": shared_case,
         "dense_fp8_auto": lambda t, g: dense_case(t, g, "fp8_auto"),
         "dense_bf16": lambda t, g: dense_case(t, g, "bf16"),
         "dense_bf16_gemv": lambda t, g: dense_case(t, g, "bf16_gemv")}  # fmt: skip


def dense_sweep(tokens: list[int]) -> list[dict]:
    """The fp8 decode kernel's launch choices over the layer's dense projections (all six in
    one timed call, as ``dense_fp8``): token tile, K-split rule and ring depth. Split rules:
    "moe" = ``moe_decode.pick_split`` (the default), "cap" = at most the splits whose fp32
    partials (written and read) stay within 1/8 of the weight bytes, "one" = no split."""
    import math

    from kernels import moe_decode as md
    from kernels.linear import _fp8_decode, fp8_decode_plan
    from kernels.quant import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) / k**0.5, (32, 32))
          for n, k in DENSE]  # fmt: skip
    plans = [fp8_decode_plan(q, s, (32, 32)) for q, s in ws]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def split_of(rule: str, bt: int, t: int, n: int, k: int) -> int:
        tiles = math.ceil(t / bt)
        moe = md.pick_split(tiles, n, k, sms)
        if rule == "moe":
            return moe
        if rule == "one":
            return 1
        cap = max(1, k // (8 * 8 * tiles * bt))  # split x rows x N x 8 B <= N x K / 8
        return max(1, min(moe, cap))

    recs = []
    for t in tokens:
        x = {k: torch.randn(t, k, device="cuda", generator=g).bfloat16() for _, k in DENSE}
        for bt in (8, 16, 32, 64):
            if bt > max(8, triton.next_power_of_2(t)):
                continue
            for rule in ("moe", "cap", "one"):
                for st in (2, 3):
                    def run(bt=bt, rule=rule, st=st, t=t, x=x):
                        for (q, _), (n, k), p in zip(ws, DENSE, plans, strict=True):
                            _fp8_decode(x[k], q, p, t, n, k, bt, split_of(rule, bt, t, n, k), st)

                    us = _us(run)
                    splits = [split_of(rule, bt, t, n, k) for n, k in DENSE]
                    print(f"dense sweep T={t:<3} bt={bt:2d} split={rule:4s} {splits} stages={st}"
                          f" {us:7.2f} us", flush=True)  # fmt: skip
                    recs.append({"op": "dense_sweep", "tokens": t, "bt": bt, "rule": rule,
                                 "splits": splits, "stages": st, "us": us})  # fmt: skip
    return recs


def wg_sweep(tokens: list[int]) -> list[dict]:
    """The wgmma kernel's launch choices, one projection at a time (each of the layer's six
    shapes alone, graph replay): warpgroups per CTA (4 or 8 warps), ring slots (3, 4 and the
    deepest that fits, ``pick_stages``) and K splits ("pick" = ``dense_wgmma.pick_split``,
    "x2" / "half" of it, "one"); cuBLAS bf16 on the same shape beside it (the peer)."""
    from kernels import dense_wgmma as dw
    from kernels.linear import _fp8_wgmma, fp8_decode_plan
    from kernels.quant import dequantize_fp8_block, quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(1)
    ws = [quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) / k**0.5, (32, 32))
          for n, k in DENSE]  # fmt: skip
    plans = [fp8_decode_plan(q, s, (32, 32)) for q, s in ws]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    recs = []
    for t in tokens:
        x = {k: torch.randn(t, k, device="cuda", generator=g).bfloat16() for _, k in DENSE}
        for (q, s), (n, k), p in zip(ws, DENSE, plans, strict=True):
            wb = dequantize_fp8_block(q, s, (32, 32)).bfloat16()
            xk = x[k]
            peer = _us(lambda wb=wb, xk=xk: torch.nn.functional.linear(xk, wb))
            for warps in (4, 8):
                base = dw.pick_split(n, k, sms, 16 * warps)
                rules = {"pick": base, "x2": min(k // dw.KB, 2 * base),
                         "half": max(1, base // 2), "one": 1}  # fmt: skip
                deepest = dw.pick_stages(dw.token_tile(t), 16 * warps)
                for st in sorted({3, 4, deepest}):
                    if st > deepest:
                        continue
                    for rule, split in rules.items():
                        us = _us(lambda xk=xk, q=q, p=p, t=t, n=n, k=k, split=split, st=st,
                                 warps=warps: _fp8_wgmma(xk, q, p, t, n, k, None, split, st,
                                                         warps))  # fmt: skip
                        print(f"wg sweep T={t:<3} {n:>5}x{k:<5} warps={warps} stages={st} "
                              f"split={rule:4s}({split:2d}) {us:7.2f} us  cuBLAS bf16 "
                              f"{peer:7.2f} us", flush=True)  # fmt: skip
                        recs.append({"op": "wg_sweep", "tokens": t, "n": n, "k": k,
                                     "warps": warps, "stages": st, "rule": rule,
                                     "split": split, "us": us, "bf16_us": peer})  # fmt: skip
    return recs


def gemv_sweep(tokens: list[int]) -> list[dict]:
    """The plain projections' decode kernel (``kernels.linear._gemv_kernel``) per V4.1-Flash
    dense shape: rows per program x K block x ring depth x warps x K splits (the heuristic's,
    half and twice), beside cuBLAS on the same shape in the same run."""
    import itertools

    from kernels.linear import dense_linear_triton, gemv_launch

    g = torch.Generator(device="cuda").manual_seed(0)
    rate = _copy_rate()
    recs = []
    for t in tokens:
        for n, k in DENSE:
            x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
            floor = 2 * n * k / rate * 1e6
            cub = _us(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            pick = gemv_launch(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
            print(f"gemv sweep T={t:<3} {n:>5}x{k:<5} cublas {cub:7.2f} us  floor {floor:6.2f}  "
                  f"pick {pick}", flush=True)  # fmt: skip
            recs.append({"op": "gemv_sweep", "tokens": t, "n": n, "k": k, "cublas_us": cub,
                         "floor_us": floor, "pick": pick})  # fmt: skip
            best = None
            for bn, bk, st, warps in itertools.product((64, 128), (128, 256), (3, 4, 6), (4,)):
                for split in sorted({max(1, pick[2] // 2), pick[2], pick[2] * 2}):
                    try:
                        us = _us(lambda x=x, w=w, la=(bn, bk, split, st, warps):
                                 dense_linear_triton(x, w, la))  # fmt: skip
                    except Exception as e:  # out of shared memory / registers
                        print(f"  {bn} {bk} {st} {warps} {split}: {type(e).__name__}")
                        continue
                    recs.append({"op": "gemv_sweep", "tokens": t, "n": n, "k": k, "bn": bn,
                                 "bk": bk, "stages": st, "warps": warps, "split": split,
                                 "us": us})  # fmt: skip
                    if best is None or us < best[0]:
                        best = (us, bn, bk, st, warps, split)
            print(f"gemv sweep T={t:<3} {n:>5}x{k:<5} best {best[0]:7.2f} us (bn {best[1]} "
                  f"bk {best[2]} stages {best[3]} warps {best[4]} split {best[5]}) "
                  f"x floor {best[0] / floor:5.2f}; cublas x floor {cub / floor:5.2f}",
                  flush=True)  # fmt: skip
    return recs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="current")
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--ops", default=",".join(CASES), help="cases to time (comma-separated)")
    ap.add_argument("--sweep-dense", action="store_true",
                    help="time the fp8 decode kernel's launch choices instead")  # fmt: skip
    ap.add_argument("--sweep-wg", action="store_true",
                    help="time the wgmma kernel's launch choices per projection instead")
    ap.add_argument("--sweep-gemv", action="store_true",
                    help="time the plain projections' decode kernel per shape instead")
    ap.add_argument("--out", default=os.environ.get("OUT", str(common.RESULTS)),
                    help="directory for decode_plumbing.json")
    args = ap.parse_args()
    unknown = set(filter(None, args.ops.split(","))) - set(CASES)
    if unknown:
        ap.error(f"unknown --ops {sorted(unknown)}; cases: {', '.join(CASES)}")
    import kernels

    rate = _copy_rate()
    print(f"kernels from {os.path.dirname(kernels.__file__)}; copy {rate / 1e12:.2f} TB/s",
          flush=True)  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    recs = []
    with torch.inference_mode():
        if args.sweep_dense:
            recs += dense_sweep([int(v) for v in args.tokens.split(",")])
            args.ops = ""
        if args.sweep_wg:
            recs += wg_sweep([int(v) for v in args.tokens.split(",")])
            args.ops = ""
        if args.sweep_gemv:
            recs += gemv_sweep([int(v) for v in args.tokens.split(",")])
            args.ops = ""
        for name in filter(None, args.ops.split(",")):
            case = CASES[name]
            for t in (int(v) for v in args.tokens.split(",")):
                fn, err, byt = case(t, g)
                if fn is None:  # the case does not take t tokens
                    continue
                us = _us(fn)
                floor = byt / rate * 1e6
                recs.append({"op": name, "tokens": t, "us": us, "floor_us": floor, "err": err,
                             "label": args.label})  # fmt: skip
                print(f"{args.label:>8} {name:>14} T={t:<3} {us:7.2f} us  floor {floor:6.2f}"
                      f"  x{us / floor:6.1f}  err {err:.1e}", flush=True)  # fmt: skip
    print("wrote", common.write("decode_plumbing", [as_record(r) for r in recs], args.out))


def as_record(row: dict) -> dict:
    """A row as a result record: ``plumbing.<op>`` in µs, the rest of the row in its params;
    a sweep's cuBLAS-only row is ``plumbing.<op>.cublas``, and a row's cuBLAS bf16 time on
    the same shape is its peer."""
    params = {k: v for k, v in row.items() if k not in ("op", "us", "floor_us", "cublas_us",
                                                        "bf16_us")}  # fmt: skip
    if "us" in row:
        name, value = f"plumbing.{row['op']}", row["us"]
    else:
        name, value = f"plumbing.{row['op']}.cublas", row["cublas_us"]
    peer = {"name": "cublas_bf16", "value": row["bf16_us"]} if "bf16_us" in row else None
    return common.record(name, value, "us", params, row.get("floor_us"), peer)


if __name__ == "__main__":
    main()
