"""MoE decode on one GPU: the Gluon decode GEMMs (``kernels.moe_decode``) against the
portable Fathom paths and torch's grouped GEMMs, in one run.

    python -m bench.moe_decode [--tokens 1,8,64,512] [--stages 3,4] [--out DIR]

V4.1-Flash rank shapes (d 5120, I 2304, top-6), 48 of 384 experts local (an EP8 rank at
decode), random fp4 experts with e8m0 scales over four binades (the fixture of
``bench.moe_prefill``). CUDA-graph replays with rotating inputs (cold L2), median µs.
Every Fathom row is the whole layer (align, activation conversion, both GEMMs, split-K
reduce, combine), checked against the fp32 torch reference before it is timed:

- ``gluon``: fp4 pairs through ``kernels.moe_decode`` (the layer's decode path; up to
  ``kernels.moe.FUSED_SLOTS`` token slots two launches: W13 lays out its own tiles, W2
  combines)
- ``tl.pairs``: fp4 pairs through ``_moe_gemm`` (what experts without exact row
  references take)
- ``tl.fp8_rows``: the same weights re-encoded as e4m3 rows (twice the bytes)
- ``tl.pairs.release_act``: ``tl.pairs`` with x and H rounded as the release rounds them
  (``expert_act: fp8``, groups of 32: bf16 MMA, no decode kernels), checked against the
  reference with the same rounding
- ``gluon.gemms``: the two decode GEMM launches alone, on pre-aligned inputs
- peer ``torch._scaled_grouped_mm`` rowwise on the fp8 rows copy (its two GEMM launches
  only; inputs sorted, padded and quantized outside the timed call)

floor = the touched local experts' fp4 bytes (codes + e8m0 scales) / measured copy rate.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch

from bench.common import machine, record, write
from bench.kernels_moe import _rotating, _us, ceilings
from bench.moe_prefill import _experts, _grouped_peers, _inputs
from kernels import moe_decode
from kernels.moe import moe_fp4_triton, moe_fp8_rows_triton
from kernels.moe_align import _align
from kernels.moe_ref import moe_fp4_ref
from kernels.moe_tiles import _local_load, rows_per_expert

D, INTER, E_LOCAL, E_ALL, TOPK, LIMIT = 5120, 2304, 48, 384, 6, 10.0
FP4_BYTES = 3 * INTER * D * (0.5 + 1 / 32)  # one expert: W1, W3, W2 codes + e8m0 scales


def _gemms_only(ex: dict[str, Any], refs: tuple, sets: list, **launch: Any) -> Callable:
    """The two decode GEMM launches on inputs aligned and converted outside the timed call
    (with K splits, W13's last CTA of each tile sums them, as in the layer)."""
    from kernels.dispatch import split_counters

    prepared = []
    for x, ids, _ in sets:
        t = x.shape[0]
        n_slots = t * TOPK
        per = rows_per_expert(n_slots, E_LOCAL, E_ALL)
        bt = 8 if per <= 4 else 16 if per <= 12 else 32
        rows, _, tile_e = _align(ids, E_LOCAL, 0, bt)
        _, touched = _local_load(n_slots, E_LOCAL, E_ALL)
        tiles = touched + n_slots * E_LOCAL / E_ALL / bt
        br = launch.get("br", moe_decode.BR)
        s1 = moe_decode.pick_split(tiles, INTER, D, 132, br)
        s2 = moe_decode.pick_split(tiles, D // 2, INTER, 132, br)
        xa = (x.float() * 0.0625).half()
        h = torch.empty(rows.numel(), INTER, dtype=torch.float16, device=x.device)
        part = torch.empty(s1, rows.numel(), 2 * INTER, device=x.device)
        y = torch.empty(s2, rows.numel(), D, device=x.device)
        cnt = split_counters(tile_e.numel() * (INTER // br), x.device)
        lk = dict(launch)
        if not lk.get("stages"):
            lk["stages"] = moe_decode.pick_stages(bt, tiles)
        prepared.append((xa, rows, tile_e, h, part, y, cnt, bt, s1, s2, n_slots, lk))

    def run(p: tuple) -> None:
        xa, rows, tile_e, h, part, y, cnt, bt, s1, s2, n_slots, lk = p
        kw = dict(bt=bt, **lk)
        if s1 == 1:
            moe_decode.launch(xa, rows, tile_e, ex["r13"], ex["q13"], refs[0], h, n_slots,
                              TOPK, INTER, D, 1, LIMIT, True, True, **kw)  # fmt: skip
        else:
            moe_decode.launch(xa, rows, tile_e, ex["r13"], ex["q13"], refs[0], part, n_slots,
                              TOPK, INTER, D, s1, LIMIT, True, False, fin=h, counters=cnt,
                              **kw)  # fmt: skip
        moe_decode.launch(h, rows, tile_e, ex["r2"], ex["q2"], refs[1], y, n_slots, TOPK,
                          D // 2, INTER, s2, LIMIT, False, False, **kw)  # fmt: skip

    return _rotating(run, prepared)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--stages", default="0",
                    help="ring depths of the gluon GEMMs-only rows (0: the layer's pick)")
    ap.add_argument("--sweep-form", default="", help="tokens at which to time the GEMMs in "
                    "each grid order (tiles_last) x 2 / 3 slots and stop")  # fmt: skip
    ap.add_argument("--sweep", default="", help="tokens at which to sweep the gluon GEMMs' "
                    "launch (rows per CTA x stages x register cap) and stop")  # fmt: skip
    ap.add_argument("--sweep-br", default="64,128")
    ap.add_argument("--sweep-stages", default="2,3,4")
    ap.add_argument("--sweep-maxnreg", default="none,80")
    ap.add_argument("--out", default=None, help="directory for moe_decode.json")
    args = ap.parse_args()
    ceil = ceilings()
    bw = ceil["copy_bw_Bps"]
    print(machine())
    print(f"copy {bw / 1e12:.2f} TB/s  bf16 {ceil['bf16_flops'] / 1e12:.0f} TF  "
          f"fp8 {ceil['fp8_flops'] / 1e12:.0f} TF", flush=True)  # fmt: skip
    recs: list[dict] = [record(f"ceiling.{k}", v, k.split("_")[-1]) for k, v in ceil.items()]
    ex = _experts()
    (r13, ok13), (r2, ok2) = moe_decode.row_refs(ex["q13"]), moe_decode.row_refs(ex["q2"])
    assert ok13 and ok2
    refs = (r13, r2)
    rows = ex["rows"]
    if args.sweep_form:
        for t in (int(v) for v in args.sweep_form.split(",")):
            sets = _inputs(t, False)
            touched = sum(len(torch.unique(s[1][s[1] < E_LOCAL])) for s in sets) / len(sets)
            floor = touched * FP4_BYTES / bw * 1e6
            for st, last in itertools.product((2, 3), (False, True)):
                us = _us(_gemms_only(ex, refs, sets, stages=st, tiles_last=last))
                par = {"tokens": t, "stages": st, "tiles_last": last}
                recs.append(record("moe.decode.gluon.gemms.form", us, "us", par, floor))
                print(f"form T={t:4d} stages={st} tiles_last={last:d}: {us:8.1f} us  "
                      f"x floor {us / floor:5.2f}", flush=True)  # fmt: skip
        print("->", write("moe_decode", recs, args.out))
        return
    if args.sweep:
        for t in (int(v) for v in args.sweep.split(",")):
            sets = _inputs(t, False)
            touched = sum(len(torch.unique(s[1][s[1] < E_LOCAL])) for s in sets) / len(sets)
            floor = touched * FP4_BYTES / bw * 1e6
            grid = itertools.product(*([int(v) if v != "none" else None for v in g.split(",")]
                                       for g in (args.sweep_br, args.sweep_stages,
                                                 args.sweep_maxnreg)))  # fmt: skip
            for br, st, nreg in grid:
                try:
                    us = _us(_gemms_only(ex, refs, sets, br=br, stages=st, maxnreg=nreg))
                except Exception as e:  # e.g. out of shared memory or registers
                    print(f"sweep T={t} br={br} st={st} maxnreg={nreg}: {type(e).__name__}")
                    continue
                print(f"sweep T={t:4d} br={br:3d} st={st} maxnreg={nreg}: {us:8.1f} us  "
                      f"x floor {us / floor:5.2f}", flush=True)  # fmt: skip
        return
    lines = []
    for t in (int(v) for v in args.tokens.split(",")):
        sets = _inputs(t, False)
        touched = sum(len(torch.unique(s[1][s[1] < E_LOCAL])) for s in sets) / len(sets)
        floor = touched * FP4_BYTES / bw * 1e6

        def gl_(s: tuple) -> torch.Tensor:
            return moe_fp4_triton(s[0], s[1], s[2], ex["r13"], ex["q13"], ex["r2"], ex["q2"],
                                  LIMIT, n_experts=E_ALL, pairs=True, row_refs=refs)  # fmt: skip

        def tlp(s: tuple) -> torch.Tensor:
            return moe_fp4_triton(s[0], s[1], s[2], ex["r13"], ex["q13"], ex["r2"], ex["q2"],
                                  LIMIT, n_experts=E_ALL, pairs=True)  # fmt: skip

        def rws(s: tuple) -> torch.Tensor:
            return moe_fp8_rows_triton(s[0], s[1], s[2], rows["w13"], rows["s13"], rows["w2"],
                                       rows["s2"], LIMIT, n_experts=E_ALL)  # fmt: skip

        def rel(s: tuple) -> torch.Tensor:  # expert_act: fp8
            return moe_fp4_triton(s[0], s[1], s[2], ex["r13"], ex["q13"], ex["r2"], ex["q2"],
                                  LIMIT, n_experts=E_ALL, pairs=True, act_group=32)  # fmt: skip

        s0 = sets[0]
        refs_ = {g: moe_fp4_ref(s0[0].float(), s0[1], s0[2], ex["p13"], ex["q13"], ex["p2"],
                                ex["q2"], LIMIT, act_group=g) for g in (0, 32)}  # fmt: skip
        timed: dict[str, float] = {}
        for name, fn, g in (("moe.decode.gluon", gl_, 0), ("moe.decode.tl.pairs", tlp, 0),
                            ("moe.decode.tl.fp8_rows", rws, 0),
                            ("moe.decode.tl.pairs.release_act", rel, 32)):  # fmt: skip
            ref = refs_[g]
            out = fn(s0).float()
            err = float((out - ref).norm() / ref.norm())
            if not err < 1e-2:
                raise AssertionError(f"{name} T={t}: error {err:.2e} against the reference")
            us = _us(_rotating(fn, sets))
            timed[name] = us
            par = {"tokens": t, "experts_touched": touched, "rel_err": err,
                   "weight_GBps": touched * FP4_BYTES / us / 1e3}
            recs.append(record(name, us, "us", par, floor))
            lines.append(f"{name:28s} T={t:4d} {us:8.1f} us  x floor {us / floor:5.2f}  "
                         f"err {err:.1e}")  # fmt: skip
        for st in (int(v) for v in args.stages.split(",")):
            us = _us(_gemms_only(ex, refs, sets, stages=st))
            par = {"tokens": t, "stages": st, "experts_touched": touched}
            recs.append(record("moe.decode.gluon.gemms", us, "us", par, floor))
            label = "moe.decode.gluon.gemms " + (f"st{st}" if st else "pick")
            lines.append(f"{label:28s} T={t:4d} {us:8.1f} us  x floor {us / floor:5.2f}")
        prepared, scaled, _ = _grouped_peers(sets, ex)
        us = _us(_rotating(lambda p, f=scaled: f(p, True), prepared))
        par = {"tokens": t, "note": "two GEMM launches only, on the fp8 rows copy"}
        recs.append(record("moe.decode.peer.scaled_grouped_mm", us, "us", par, floor))
        lines.append(f"{'peer _scaled_grouped_mm':28s} T={t:4d} {us:8.1f} us  "
                     f"x floor {us / floor:5.2f}  (GEMMs only, 2x bytes)")  # fmt: skip
        gain = timed["moe.decode.tl.pairs"] / timed["moe.decode.gluon"]
        lines.append(f"{'':28s} T={t:4d} floor {floor:6.1f} us ({touched:.1f} experts), "
                     f"gluon vs tl.pairs {gain:.2f}x")  # fmt: skip
        print("\n".join(lines[-8:]), flush=True)
        path = write("moe_decode", recs, args.out)
    print("\n".join(lines))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
