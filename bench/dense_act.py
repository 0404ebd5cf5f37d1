"""The dense projections of one layer, bf16 against the release's fp8 activations
(``dense_act``), at flash-rank shapes from 1 to 8192 tokens, in one process.

    python -m bench.dense_act [--tokens 1,8,64,...] [--arch v41,v4] [--out DIR] [--launch]

Per architecture, the projections every layer runs, as the engine stacks them (V4.1-Flash:
32 x 32 weight blocks, activation groups of 32; V4-Flash: 128 x 128, groups of 128):
[wq_a | wkv], wq_b, wo_b, the shared expert's [W1 | W3] and W2 (wo_a, a grouped einsum, and
the indexer's wq_b, on index layers only, are left out). Variants, each timed as one CUDA
graph of all the projections and checked against its torch reference first:

    bf16          cuBLAS on bf16 copies of the weights (``dense_act: bf16``, the default)
    fp8w          the fp8 weight kernels on unrounded activations (``experimental.packed_dense``)
    fp8act        ``dense_act: fp8`` as the dispatch runs it (``kernels.linear.fp8_act_linear``)
    fp8act.round  rounded activations through the fp8 weight kernels, at every size
    fp8act.mma    quantized activations, e4m3 x e4m3 with per-group promotion, at every size
    quant         the activation quantizer alone (``kernels.fp8_act.act_quant``)

Peers in the same records: cuBLAS bf16 for every variant, and for V4 (1 x 128 activations,
128 x 128 weights, the recipe cuBLAS implements on sm_90) ``torch._scaled_mm`` with blockwise
fp32 scales on the same quantized activations plus our quantizer. Floors: the larger of the
bytes (weights as the variant holds them, activations in, outputs out) at the measured copy
rate and the FLOPs at the measured fp8 (bf16 for ``bf16``) matmul rate. ``--launch`` also
sweeps the fp8 MMA kernel's tiles at each size (``kernels.linear.fp8_act_launch``'s choices
and alternatives).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import triton.testing

from bench.common import machine, record, write

# [N, K] of one layer's dense projections (stacked as the engine runs them), weight block
ARCHS = {
    "v41": (((1280 + 512, 5120), (64 * 512, 1280), (5120, 8 * 1024), (2 * 2304, 5120),
             (5120, 2304)), (32, 32)),
    "v4": (((1024 + 512, 4096), (64 * 512, 1024), (4096, 8 * 1024), (2 * 2048, 4096),
            (4096, 2048)), (128, 128)),
}  # fmt: skip
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
VARIANTS = ("bf16", "fp8w", "fp8act", "fp8act.round", "fp8act.mma", "quant")


def _us(fn: Callable[[], object]) -> float:
    """Median µs of ``fn`` replayed in a CUDA graph (as the engine's steps run)."""
    fn()
    torch.cuda.synchronize()
    return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def ceilings() -> dict[str, float]:
    """Copy rate (B/s) and bf16 / fp8 matmul rates (FLOP/s) of this GPU, measured now."""
    a = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    bw = 2 * a.numel() / (1e-3 * triton.testing.do_bench(lambda: b.copy_(a), rep=100,
                                                          return_mode="median"))  # fmt: skip
    m = torch.randn(8192, 8192, device="cuda").bfloat16()
    bf16 = 2 * 8192**3 / (_us(lambda: m @ m) * 1e-6)
    f8, one = m.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
    fp8 = 2 * 8192**3 / (_us(lambda: torch._scaled_mm(f8, f8.t(), one, one,
                                                       out_dtype=torch.bfloat16)) * 1e-6)
    return {"copy_bw_Bps": bw, "bf16_flops": bf16, "fp8_flops": fp8}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class Layer:
    """One layer's projections of ``arch``: e4m3 weights with e8m0 blocks (and their decode
    plans, as ``Fp8Linear.prepare`` makes them) and bf16 copies."""

    def __init__(self, arch: str, device: str, g: torch.Generator) -> None:
        from kernels.linear import fp8_decode_plan
        from kernels.quant import dequantize_fp8_block, quantize_fp8_block

        self.shapes, self.block = ARCHS[arch]
        self.group = self.block[1]
        self.w = [quantize_fp8_block(torch.randn(n, k, device=device, generator=g) / k**0.5,
                                     self.block) for n, k in self.shapes]  # fmt: skip
        self.bf = [dequantize_fp8_block(q, s, self.block, torch.bfloat16) for q, s in self.w]
        self.plans = [fp8_decode_plan(q, s, self.block) if q.is_cuda else None
                      for q, s in self.w]  # fmt: skip

    def inputs(self, t: int, g: torch.Generator) -> list[torch.Tensor]:
        dev = self.w[0][0].device
        return [torch.randn(t, k, device=dev, generator=g).bfloat16() for _, k in self.shapes]

    def calls(self, variant: str, xs: list[torch.Tensor],
              launch: tuple | None = None) -> list[Callable[[], torch.Tensor]]:  # fmt: skip
        """One call per projection computing ``variant``."""
        from kernels.fp8_act import act_quant_triton
        from kernels.linear import fp8_act_linear_triton, fp8_linear_triton

        b, grp = self.block, self.group
        out = []
        for x, (q, s), w, p in zip(xs, self.w, self.bf, self.plans, strict=True):
            if variant == "bf16":
                out.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            elif variant == "fp8w":
                out.append(lambda x=x, q=q, s=s, p=p: fp8_linear_triton(x, q, s, b, p))
            elif variant == "quant":
                out.append(lambda x=x: act_quant_triton(x, grp)[0])
            else:
                mma = {"fp8act": None, "fp8act.round": False, "fp8act.mma": True}[variant]
                out.append(lambda x=x, q=q, s=s, p=p, mma=mma: fp8_act_linear_triton(
                    x, q, s, b, grp, p, mma=mma, launch=launch))  # fmt: skip
        return out

    def error(self, variant: str, xs: list[torch.Tensor]) -> float:
        """The largest relative error of ``variant``'s projections against their references
        (fp32 products; the fp8 activations rounded by the torch reference)."""
        from kernels.linear import fp8_act_linear_ref, fp8_linear_ref
        from kernels.quant import quantize_fp8_act

        errs = []
        for call, x, (q, s) in zip(self.calls(variant, xs), xs, self.w, strict=True):
            if variant == "quant":
                ref = quantize_fp8_act(x, self.group)[0]
                errs.append(float(not torch.equal(call().view(torch.uint8),
                                                  ref.view(torch.uint8))))  # fmt: skip
            elif variant in ("bf16", "fp8w"):
                errs.append(_rel(call(), fp8_linear_ref(x.float(), q, s, self.block)))
            else:
                errs.append(_rel(call(), fp8_act_linear_ref(x.float(), q, s, self.block,
                                                            self.group)))  # fmt: skip
        return max(errs)

    def bytes_flops(self, variant: str, t: int) -> tuple[float, float]:
        """(bytes moved, FLOPs) of ``variant`` at ``t`` tokens: the weights as the variant
        reads them (bf16, or e4m3 + e8m0 blocks), bf16 activations in and outputs out (the
        quantizer: bf16 in, e4m3 + scales out)."""
        b0, b1 = self.block
        if variant == "quant":
            return sum(t * k * (3 + 1 / self.group) for _, k in self.shapes), 0.0
        w = sum((2 if variant == "bf16" else 1 + 1 / (b0 * b1)) * n * k for n, k in self.shapes)
        io = sum(2 * t * (n + k) for n, k in self.shapes)
        return w + io, sum(2.0 * t * n * k for n, k in self.shapes)

    def scaled_mm_peer(self, xs: list[torch.Tensor]) -> Callable[[], object] | None:
        """``torch._scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales (fp32; the
        activations' outer-dim major, M padded to a multiple of 4) on our quantizer's
        output, when this torch and GPU take it (V4's blocks only), else None."""
        if self.block != (128, 128):
            return None
        from kernels.fp8_act import act_quant_triton
        from kernels.quant import e8m0_to_float

        ws = [(q, e8m0_to_float(s).t()) for q, s in self.w]

        def run() -> list[torch.Tensor]:
            outs = []
            for x, (q, sw) in zip(xs, ws, strict=True):
                xq, sa = act_quant_triton(x, 128)
                pad = -xq.shape[0] % 4
                if pad:
                    xq = torch.cat((xq, xq.new_zeros(pad, xq.shape[1])))
                    sa = torch.cat((sa, sa[:1].expand(pad, -1)))
                sa = e8m0_to_float(sa).t().contiguous().t()
                y = torch._scaled_mm(xq, q.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)
                outs.append(y[: x.shape[0]])
            return outs

        try:
            got = run()
        except (RuntimeError, ValueError) as e:  # this torch / GPU has no such recipe
            print(f"  torch._scaled_mm blockwise: not run ({str(e).splitlines()[0][:120]})")
            return None
        from kernels.linear import fp8_act_linear_ref

        err = max(_rel(y, fp8_act_linear_ref(x.float(), q, s, self.block, 128))
                  for y, x, (q, s) in zip(got, xs, self.w, strict=True))  # fmt: skip
        if err > 1e-2:
            print(f"  torch._scaled_mm blockwise: error {err:.1e} against the reference, skipped")
            return None
        return run


def launches(t: int) -> list[tuple[int, int, int, int, int, int]]:
    """Alternatives to ``fp8_act_launch`` for the sweep: (BM, BN, BK, split, warps, stages)."""
    if t <= 64:
        bm = next(b for b in (16, 32, 64) if t <= b)
        return [(bm, bn, 128, sp, 4, st) for bn in (32, 64, 128) for sp in (1, 2, 4)
                for st in (3, 4)]  # fmt: skip
    return [(bm, bn, 128, 1, w, st) for bm in (64, 128) for bn in (64, 128, 256)
            for w in (4, 8) for st in (3, 4) if not (bm == 128 and bn == 256 and st == 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--arch", default="v41,v4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--launch", action="store_true", help="sweep the fp8 MMA kernel's tiles")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the json")
    args = ap.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    ceil = ceilings()
    print({k: f"{v:.3e}" for k, v in ceil.items()}, flush=True)
    recs: list[dict] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for arch in args.arch.split(","):
            layer = Layer(arch, "cuda", g)
            for t in tokens:
                xs = layer.inputs(t, g)
                bf16_us = None
                for v in variants:
                    err = layer.error(v, xs)
                    calls = layer.calls(v, xs)
                    us = _us(lambda calls=calls: [c() for c in calls])
                    byt, flops = layer.bytes_flops(v, t)
                    peak = ceil["bf16_flops"] if v == "bf16" else ceil["fp8_flops"]
                    floor = 1e6 * max(byt / ceil["copy_bw_Bps"], flops / peak)
                    if v == "bf16":
                        bf16_us = us
                    peer = {"name": "cublas_bf16", "value": bf16_us} if bf16_us else None
                    recs.append(record(f"dense_act.{v}", us, "us",
                                       {"arch": arch, "tokens": t, "block": list(layer.block),
                                        "group": layer.group, "err": err,
                                        "tflops": flops / us * 1e-6 if flops else None},
                                       floor, peer))  # fmt: skip
                    print(f"{arch} T={t:<5} {v:>13} {us:9.1f} us  floor {floor:8.1f}  "
                          f"x{us / floor:5.2f}  err {err:.1e}", flush=True)  # fmt: skip
                peer_run = layer.scaled_mm_peer(xs)
                if peer_run is not None:
                    us = _us(peer_run)
                    byt, flops = layer.bytes_flops("fp8act", t)
                    floor = 1e6 * max(byt / ceil["copy_bw_Bps"], flops / ceil["fp8_flops"])
                    recs.append(record("dense_act.scaled_mm_blockwise", us, "us",
                                       {"arch": arch, "tokens": t, "block": [128, 128],
                                        "group": 128, "with_quantizer": True}, floor,
                                       {"name": "cublas_bf16", "value": bf16_us}))  # fmt: skip
                    print(f"{arch} T={t:<5} {'scaled_mm':>13} {us:9.1f} us  floor {floor:8.1f}"
                          f"  x{us / floor:5.2f}", flush=True)  # fmt: skip
                if args.launch:
                    for lt in launches(t):
                        calls = layer.calls("fp8act.mma", xs, launch=lt)
                        try:
                            us = _us(lambda calls=calls: [c() for c in calls])
                        except Exception as e:  # noqa: BLE001 -- a tile the GPU cannot hold
                            print(f"{arch} T={t:<5} launch {lt}: {type(e).__name__}")
                            continue
                        recs.append(record("dense_act.fp8act.mma.launch", us, "us",
                                           {"arch": arch, "tokens": t, "launch": list(lt)}))
                        print(f"{arch} T={t:<5} launch {lt} {us:9.1f} us", flush=True)
                del xs
                torch.cuda.empty_cache()
    print("wrote", write("dense_act", recs, args.out, info={**machine(), **ceil}))


if __name__ == "__main__":
    main()
