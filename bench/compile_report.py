"""Compile Triton kernels for sm_90 on a machine without a GPU and report registers, spills
and shared memory (ptxas bundled with Triton), so that launch shapes can be checked before
spending device time.

    python -m bench.compile_report moe|moe-all|moe-rows|moe-decode|dense-wg|attention|attention-ws|
        indexer|topk [DUMP_DIR]

Besides registers/stack/smem/MMA counts each line gives ``async`` (TTGIR
``ttg.async_copy_global_to_local`` ops: loads the software pipeliner made cp.async), ``LDGSTS``
(their SASS instructions), TMA loads, and ``loop LDL/STL`` (local-memory ops inside the MMA
loop: spills on the hot path) and ``loop instrs`` (SASS instructions of the longest loop holding
MMAs: one iteration of the main loop). With DUMP_DIR every variant's TTGIR is written there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


DUMP_DIR = sys.argv[2] if len(sys.argv) > 2 else None


def _mma_loops(sass: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The SASS instructions (address, text) and the address spans of loops holding MMAs."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    spans = []
    for addr, op in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            if any(lo <= a <= addr and re.search(r"\b[HQ]G?MMA\b", o) for a, o in ins):
                spans.append((lo, addr))
    return ins, spans


def _loop_local_ops(sass: str) -> int:
    """LDL/STL inside the loops that hold MMA instructions: register spills on the hot path
    (``stack`` also counts frames such as sin/cos range reduction outside the loop)."""
    ins, spans = _mma_loops(sass)
    return sum(1 for a, o in ins if re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", o)
               and any(lo <= a <= hi for lo, hi in spans))  # fmt: skip


def _loop_len(sass: str) -> int:
    """Instructions in the longest loop holding MMAs (the main loop's body, per iteration)."""
    ins, spans = _mma_loops(sass)
    return max((sum(1 for a, _ in ins if lo <= a <= hi) for lo, hi in spans), default=0)


def compile_one(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int,
                stages: int, name: str = "", aligned: tuple[str, ...] = ()) -> str:  # fmt: skip
    """One line: registers, spill bytes, shared memory, async copies of ``fn`` at these constants.

    ``aligned`` names the arguments the JIT would mark divisible by 16 (pointers from the
    caching allocator, strides and sizes that are multiples of 16): without that hint a row
    gather's address is not known to be 16-byte aligned, its load is too narrow for cp.async
    and the pipeliner leaves it alone, which a real launch would not."""
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k, res, sass = _compiled(src, {"num_warps": warps, "num_stages": stages})
    ttgir = k.asm["ttgir"]
    if DUMP_DIR and name:
        os.makedirs(DUMP_DIR, exist_ok=True)
        with open(os.path.join(DUMP_DIR, re.sub(r"[^\w.=-]+", "_", name) + ".ttgir"), "w") as f:
            f.write(ttgir)
    n_async = ttgir.count("ttg.async_copy_global_to_local")
    n_tma = ttgir.count("async_tma_copy_global_to_local") + ttgir.count("async_tma_gather")
    n_ldgsts = len(re.findall(r"\bLDGSTS\b", sass))
    n_utma = len(re.findall(r"\bUTMALDG\b", sass))
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, _, local = use.groups() if use else ("?",) * 4
    mma = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "HMMA", "QGMMA")}
    loop_ldst = _loop_local_ops(sass)
    loop_n = _loop_len(sass)
    mma_s = " ".join(f"{op}={n}" for op, n in mma.items() if n)
    return (f"regs {regs} stack {stack} local {local} smem {k.metadata.shared} {mma_s} "
            f"async {n_async} LDGSTS {n_ldgsts} tma {n_tma} UTMALDG {n_utma} "
            f"loop LDL/STL {loop_ldst} loop instrs {loop_n}")  # fmt: skip


def _moe_line(fp4: bool, pairs: bool, f16: bool, gated: bool, fuse: bool,
              tile: tuple[int, ...], rows: bool = False, act8: bool = False) -> str:  # fmt: skip
    """One ``_moe_gemm`` variant compiled as a launch specializes it (16-byte divisibility of
    pointers, strides and sizes; e8m0 scales, read as int32 words when BK allows). ``pairs``
    (fp4 in the pairs layout): every tile computes two row sets, W1|W3 or W2's two halves
    of d, so its W2 line covers twice the weights of the other layouts' W2 line. ``rows``:
    fp8 weights in the rows layout (fp32 scale per row), with ``act8`` its fp8 activations
    (one scale per row, pre-quantized)."""
    import kernels.moe_grouped as m

    bm, bn, bk, w, st = tile
    words = bk % 128 == 0 and not rows
    t = {n: "i32" for n in m._moe_gemm.arg_names}
    t.update(rows_ptr="*i32", tile_e_ptr="*i32", sa_ptr="*fp32", limit="fp32",
             w_ptr="*i8" if fp4 else "*fp8e4nv",
             s_ptr="*fp32" if rows else "*i32" if words else "*u8",
             out_ptr=("*fp16" if f16 else "*bf16") if fuse else "*fp32",
             a_ptr="*fp8e4nv" if act8 else "*fp16" if f16 else "*bf16")  # fmt: skip
    consts = dict(A_GATHER=gated, GATED=gated or pairs, FUSE_SWIGLU=fuse, FP4=fp4, PAIRS=pairs,
                  USE_ASM=True, SCALE_E8M0=not rows, SCALE_WORDS=words,
                  SB_N=1 if fp4 or rows else 32, SB_K=0 if rows else 32, HAS_LIMIT=True,
                  CDT=tl.bfloat16, BM=bm, BN=bn, BK=bk, A_FP8=act8, F16=f16,
                  GK=bk if rows else min(32, bk))  # fmt: skip
    aligned = tuple(n for n in m._moe_gemm.arg_names if n.endswith("_ptr")
                    or n in ("sam", "ssa", "swe", "swn", "sse", "ssn", "sos", "som", "N", "K",
                             "k_per_split"))  # fmt: skip
    try:
        rep = compile_one(m._moe_gemm, t, consts, w, st, aligned=aligned,
                          name=f"moe_g{gated:d}_{bm}_{bn}_{bk}_{w}_{st}_r{rows:d}_a{act8:d}")
    except Exception as e:  # report and go on
        rep = f"FAILED {type(e).__name__}: {str(e)[:300]}"
    return (f"{'W13' if gated else 'W2 '} fp4={fp4:d} pairs={pairs:d} rows={rows:d} "
            f"act8={act8:d} f16={f16:d} fuse={fuse:d} BM={bm} BN={bn} BK={bk} w={w} "
            f"st={st}: {rep}")  # fmt: skip


def moe() -> None:
    """The tiles ``pick_tiles`` takes for V4.1-Flash (d 5120, I 2304, 48 of 384 experts local):
    decode at 1 token, prefill at 4096 tokens on the local experts; fp8 / fp4 (MX and pairs
    layouts)."""
    from kernels.moe_tiles import pick_tiles

    def tile(t: int, n_experts: int, gated: bool, pairs: bool) -> tuple[int, ...]:
        p = pick_tiles(t * 6, 48, n_experts, 5120, 2304, 32, 132, pairs=pairs)
        g = p.gate_up if gated else p.down
        return p.bm, g.bn, g.bk, g.warps, g.stages

    layouts = ((False, False), (True, False), (True, True))  # (fp4, pairs)
    for fp4, pairs in layouts:
        for gated in (True, False):
            dec = tile(1, 384, gated, pairs)
            print("decode", _moe_line(fp4, pairs, True, gated, gated, dec))
    for fp4, pairs in layouts:
        for gated in (True, False):
            pre = tile(4096, 48, gated, pairs)
            print("prefill", _moe_line(fp4, pairs, False, gated, gated, pre))


def moe_rows() -> None:
    """The fp8 rows layout (prefill): bf16 activations (fp16 MMA, no promotion) and fp8
    activations with one scale per row, at the tiles ``bench.moe_prefill --sweep`` times."""
    from bench.moe_prefill import TILES

    for bm, bn1, bn2, bk, w, st in TILES:
        for act8 in (True, False):
            for gated, bn in ((True, bn1), (False, bn2)):
                tile = (bm, bn, bk, w, st)  # bf16 activations: fp16 MMA, as the runtime
                print(_moe_line(False, False, not act8, gated, gated, tile, rows=True,
                                act8=act8), flush=True)  # fmt: skip


def moe_all() -> None:
    """A wider sweep: every path at several tile shapes, fused and split-K epilogues."""
    # (fp4, pairs layout, fp16 MMA at BM < 64)
    for fp4, pairs, f16 in (
        (False, False, True), (True, False, True), (True, True, True), (False, False, False),
        (True, False, False), (True, True, False),
    ):  # fmt: skip
        for gated, fuse in ((True, True), (True, False), (False, False)):
            for tile in ((16, 64, 256, 4, 3), (16, 64, 128, 4, 4), (16, 32, 128, 4, 4),
                         (128, 128, 128, 8, 3), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3),
                         (64, 128, 64, 4, 4)):  # fmt: skip
                h16 = f16 and tile[0] < 64  # the fp16 MMA path runs at decode tile heights only
                print(_moe_line(fp4, pairs, h16, gated, fuse, tile), flush=True)


def attention(shapes: tuple[tuple[int, int, int, int], ...] | None = None) -> None:
    """The autotune configs of ``kernels.attention_tl`` (or ``shapes``: (BLOCK_H, BLOCK_N,
    num_warps, num_stages) tuples), D 512 with RoPE as in decode: window and compressed rows
    in bf16, and in the released formats (fp8 window + e8m0, nvfp4 entries + e4m3)."""
    import kernels.attention_tl as a

    fn = a._sparse_attn_kernel.fn
    types = {n: "i32" for n in fn.arg_names}
    types.update(q_ptr="*bf16", idx_ptr="*i64", idx2_ptr="*i64", sink_ptr="*fp32",
                 ang_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", ml_ptr="*fp32",
                 scale_log2="fp32")  # fmt: skip
    # What a decode launch specializes (do_not_specialize keeps T, K, SPLITS, buckets generic).
    aligned = tuple(n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("s_") or n == "H")
    if shapes is None:
        shapes = tuple((c.kwargs["BLOCK_H"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                       for c in a._attn_configs())  # fmt: skip
        shapes += ((64, 32, 8, 1),)  # the former default, no pipelining: for comparison
    for packed in (False, True):
        for bh, bn, w, st in shapes:
            t = dict(types)
            if packed:
                t.update(kv_ptr="*fp8e4nv", sc_ptr="*u8", kv2_ptr="*u8", sc2_ptr="*fp8e4nv")
            else:
                t.update(kv_ptr="*bf16", sc_ptr="*fp32", kv2_ptr="*bf16", sc2_ptr="*fp32")
            consts = dict(D=512, R=64, FMT=int(packed), SC_E8=packed, FMT2=2 * packed,
                          SC2_E8=False, ROPE=True, F32_DOT=False, SPLIT_PAIRS=packed,
                          BLOCK_H=bh, BLOCK_N=bn)  # fmt: skip
            name = f"attn_packed{packed:d}_bh{bh}_bn{bn}_w{w}_s{st}"
            try:
                rep = compile_one(fn, t, consts, w, st, name, aligned)
            except Exception as e:
                rep = f"FAILED {type(e).__name__}: {str(e)[:300]}"
            print(f"attention packed={packed:d} BH={bh} BN={bn} w={w} st={st}: {rep}",
                  flush=True)  # fmt: skip


def _compiled(src: Any, options: dict) -> tuple[Any, str, str]:
    """``src`` (a tl or Gluon source) compiled for sm_90: (the kernel, its resource usage as
    cuobjdump reports it, its SASS)."""
    k = triton.compile(src, target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    return k, res, sass


def _gluon_sass(fn: Any, sig: dict, consts: dict, attrs: dict,
                options: dict) -> tuple[Any, str, str]:  # fmt: skip
    """A Gluon kernel compiled for sm_90 (:func:`_compiled`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return _compiled(GluonASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                     options)  # fmt: skip


def attention_ws() -> None:
    """The warp-specialized decode attention (``kernels.attention_ws``, Gluon) at its sweep's
    launches: the engine's packed formats (fp8 + e8m0 window, nvfp4 + e4m3 entries), fp8 with
    fp32 scales, plain bf16; one split and several. Per line: the shared memory against the
    227 KB limit, the partitions' register counts (``setmaxnreg`` values, SASS), and local
    memory ops in the consumers' main loops and in the producer's whole region (the
    epilogue's sin/cos range reduction uses a stack frame too, outside those loops), and
    LDL/STL in the whole kernel."""
    from bench.attention_sweep import WS_LAUNCHES
    from kernels import attention_ws as w

    fn = w._attn_ws_kernel
    base = {n: "i32" for n in fn.arg_names}
    base.update(q_ptr="*bf16", idx_ptr="*i64", idx2_ptr="*i64", sink_ptr="*fp32",
                ang_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", ml_ptr="*fp32",
                scale_log2="fp32")  # fmt: skip
    kinds = {"packed": (1, True, 2, "*fp8e4nv", "*u8", "*u8", "*fp8e4nv"),
             "fp8": (1, False, 1, "*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32"),
             "bf16": (0, False, 0, "*bf16", "*fp32", "*bf16", "*fp32")}  # fmt: skip
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or n.startswith("s_")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    for kind, (f1, e8, f2, kv, sc, kv2, sc2) in kinds.items():
        for (bn, st, pr, cr), split1 in ((c, s1) for c in WS_LAUNCHES for s1 in (True, False)):
            types = dict(base, kv_ptr=kv, sc_ptr=sc, kv2_ptr=kv2, sc2_ptr=sc2)
            consts = dict(D=512, R=64, FMT=f1, SC_E8=e8, FMT2=f2, SC2_E8=False, ROPE=True,
                          SPLIT1=split1, BLOCK_N=bn, STAGES=st, P_REGS=pr, C_REGS=cr)
            sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
            head = (f"attention-ws {kind:6} BN={bn} st={st} regs p/c={pr}/{cr} "
                    f"split1={split1:d}")
            try:
                k, _, sass = _gluon_sass(fn, sig, consts, attrs, {"num_warps": 4, "maxnreg": 168})
            except Exception as e:
                print(f"{head}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            lines = sass.splitlines()
            regs = sorted({int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL[^,;]*?,?\s*"
                                                          r"(0x[0-9a-f]+)", sass)})  # fmt: skip
            prod = next((i for i, ln in enumerate(lines)
                         if f"USETMAXREG.DEALLOC.CTAPOOL {hex(pr)}" in ln), len(lines))  # fmt: skip
            p_local = sum(1 for ln in lines[prod:] if re.search(r"\b(LDL|STL)\b", ln))
            # the consumers' main loops: for each MMA the innermost backward branch around it
            # (warp-specialized code also branches back over whole partitions)
            ins, spans = _mma_loops(sass)
            inner = {min((sp for sp in spans if sp[0] <= a <= sp[1]), key=lambda x: x[1] - x[0])
                     for a, o in ins if re.search(r"\bHGMMA\b", o)}  # fmt: skip
            c_local = sum(1 for a, o in ins if re.match(r"(@!?U?P\w+\s+)?(LDL|STL)\b", o)
                          and any(lo <= a <= hi for lo, hi in inner))  # fmt: skip
            n_local = len(re.findall(r"\b(LDL|STL)\b", sass))
            print(f"{head}: smem {k.metadata.shared} / {w.SMEM_LIMIT} regs {regs} "
                  f"consumer main-loop LDL/STL {c_local} producer LDL/STL {p_local} "
                  f"all LDL/STL {n_local} "
                  f"cp.async {len(re.findall(r'LDGSTS', sass))}", flush=True)  # fmt: skip


def _loop_report(head: str, fn: Any, sig: dict, consts: dict, attrs: dict, warps: int,
                 ops: tuple[str, ...]) -> None:  # fmt: skip
    """Compile one Gluon launch for sm_90 and print ``head``: registers, stack, local memory,
    shared memory, the main loop's SASS instructions and how many of them are each of
    ``ops`` (or the compile error)."""
    try:
        k, res, sass = _gluon_sass(fn, sig, consts, attrs, {"num_warps": warps})
    except Exception as e:
        print(f"{head}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    regs, stack, _, local = use.groups() if use else ("?",) * 4
    ins, spans = _mma_loops(sass)
    lo, hi = max(spans, key=lambda sp: sp[1] - sp[0]) if spans else (0, -1)
    body = [o for a, o in ins if lo <= a <= hi]
    n_op = {op: sum(1 for o in body if re.search(rf"\b{op}\b", o)) for op in ops}
    counts = " ".join(f"{op} {n}" for op, n in n_op.items())
    print(f"{head}: regs {regs} stack {stack} local {local} smem {k.metadata.shared} "
          f"loop instrs {len(body)} {counts}", flush=True)  # fmt: skip


def moe_decode() -> None:
    """The Gluon decode GEMMs (``kernels.moe_decode``) at the launches the layer picks: W13
    (gathered rows, fused SwiGLU -> fp16 H) and W2 (fp32 split-K partials / bf16 Y), 8-, 16-
    and 32-row token tiles, ring depths 2 and 3. Per line: registers, local memory, shared
    memory, and the main loop per K block (one 128-column block of 64 weight rows per CTA):
    SASS instructions, HMMAs, LDS, LDGSTS and the conversion's F2FP / HMUL2 / LOP3."""
    from kernels import moe_decode as md

    fn = md._moe_dec_kernel
    base = {n: "i32" for n in fn.arg_names}
    base.update(a_ptr="*fp16", rows_ptr="*i32", tile_e_ptr="*i32", w_ptr="*i8", s_ptr="*i32",
                r_ptr="*i32", limit="fp32", cnt_ptr="*i32", fin_ptr="*bf16", ids_ptr="*i64",
                inv_ptr="*i32", wt_ptr="*fp32", y_out_ptr="*bf16")  # fmt: skip
    aligned = [n for n in fn.arg_names if n.endswith("_ptr")
               or n in ("sam", "swe", "swn", "sse", "ssn", "sre", "sos", "som", "N", "K",
                        "k_per_split", "sfm")]  # fmt: skip
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # e.g. "W13,W2"
    for name, out, gather, fuse in (("W13", "*fp16", True, True),
                                    ("W13 sum", "*fp32", True, False),
                                    ("W2 split", "*fp32", False, False),
                                    ("W2", "*bf16", False, False), ("fp8", "*bf16", False, False),
                                    ("fp8 split", "*fp32", False, False),
                                    ("fp8 sum", "*fp32", False, False),
                                    ("fp8 b128", "*bf16", False, False)):  # fmt: skip
        if only and name not in only:
            continue
        fp8 = name.startswith("fp8")  # the dense fp8 projections (launch_dense; V4: 128 rows)
        for bt, st in ((8, 2), (8, 3), (16, 2), (32, 2), (64, 2)):
            consts = dict(A_GATHER=gather, FUSE_SWIGLU=fuse, HAS_LIMIT=not fp8, BR=md.BR, BT=bt,
                          KB=md.KB, STAGES=st, FP8=fp8,
                          SB_N=(128 if "b128" in name else 32) if fp8 else 1,
                          TILES_LAST=not fp8, REDUCE=name.endswith("sum"),
                          ROUTE=False, COMBINE=False, S_P2=1, TOPK=1, T_P2=1,
                          NB_P2=1)  # fmt: skip
            types = dict(base, out_ptr=out, **({"a_ptr": "*bf16", "w_ptr": "*u8"} if fp8 else
                                               {"fin_ptr": "*fp16"}))  # fmt: skip
            sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
            _loop_report(f"moe-decode {name:8s} BT={bt:2d} stages={st}", fn, sig, consts, attrs, 4,
                         ("HMMA", "LDS", "LDGSTS", "F2FP", "HMUL2", "LOP3", "BAR"))  # fmt: skip


def dense_wg() -> None:
    """The wgmma kernel for fp8 dense projections (``kernels.dense_wgmma``) at the launches
    ``pick_launch`` takes (16-64-token tiles: one warpgroup, 3 slots; 128: two, 4 slots), one
    split (bf16 store) and several (fp32 partials). Per line: registers, local memory,
    shared memory, and the main loop per K block: SASS instructions, HGMMAs, LDS, LDGSTS and
    the conversion's F2FP / F2F / HMUL2."""
    from kernels import dense_wgmma as dw

    fn = dw._dense_wg_kernel
    base = {n: "i32" for n in fn.arg_names}
    base.update(x_ptr="*bf16", w_ptr="*u8", s_ptr="*i32", r_ptr="*i32")
    aligned = [n for n in fn.arg_names if n.endswith("_ptr")
               or n in ("sxm", "swn", "ssn", "sos", "som", "N", "K", "k_per_split")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    for bt in dw.TOKEN_TILES:
        warps, st = dw.pick_launch(bt)
        for out in ("*bf16", "*fp32"):
            consts = dict(BM=16 * warps, BT=bt, KB=dw.KB, STAGES=st, SB_N=32, WARPS=warps)
            types = dict(base, out_ptr=out)
            sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
            _loop_report(f"dense-wg BT={bt:3d} warps={warps} stages={st} out={out[1:]}", fn,
                         sig, consts, attrs, warps,
                         ("HGMMA", "LDS", "LDGSTS", "F2FP", "F2F", "HMUL2"))  # fmt: skip


def indexer() -> None:
    """The indexer's top-k over long rows when the grid select does not take them
    (``kernels.topk``: prefix histograms -> candidate list -> ranks -> sorted ids)."""
    import kernels.topk as tk

    ptrs = dict(s_ptr="*fp32", hist_ptr="*i32", cnt_ptr="*i32", lv_ptr="*fp32", li_ptr="*i32",
                slot_ptr="*i32", out_ptr="*i64")  # fmt: skip
    cap, kk_p2 = 4096, 512
    cases = (
        (tk._prefix_hist_kernel, dict(LEVEL=0, CHUNK=tk._PREFIX_CHUNK), 4),
        (tk._prefix_hist_kernel, dict(LEVEL=1, CHUNK=tk._PREFIX_CHUNK), 4),
        (tk._prefix_gather_kernel, dict(CHUNK=tk._PREFIX_CHUNK), 4),
        (tk._list_rank_kernel, dict(CAP=cap, KK_P2=kk_p2, BI=tk._RANK_BI, BJ=tk._RANK_BJ), 4),
        (tk._slot_sort_kernel, dict(CAP=cap, KK_P2=kk_p2), 4),
    )
    for fn, consts, w in cases:
        types = {n: ptrs.get(n, "i32") for n in fn.arg_names}
        try:
            rep = compile_one(fn, types, consts, w, 1)
        except Exception as e:
            rep = f"FAILED {type(e).__name__}: {str(e)[:300]}"
        print(f"{fn.__name__} {consts}: {rep}")


def topk() -> None:
    """The one-launch grid top-k (kernels.topk_grid) at the fused shapes the dispatch takes:
    one tile per program (2048 or 4096 scores, 8 warps), 128 programs per row."""
    import kernels.topk_grid as tg

    fn = tg._grid_topk_kernel
    ptrs = dict(s_ptr="*fp32", ws_ptr="*i32", bars_ptr="*i64", cs_ptr="*i32", bk_ptr="*i64",
                out_ptr="*i64", ends_ptr="*i32")  # fmt: skip
    for block, warps in ((2048, 8), (4096, 8)):
        consts = dict(P0=0, P1=tg._PHASES, BLOCK=block, GP2=128, SINGLE=True, TAIL=512,
                      ZB=triton.next_power_of_2(triton.cdiv(tg._HIST, 128)), CAP=tg._CAP,
                      SUB=tg._SUB, BJ=tg._BJ, TRACE=False,
                      EARLY=block <= 256 * warps)  # fmt: skip
        types = {n: ptrs.get(n, "i32") for n in fn.arg_names}
        print(f"_grid_topk_kernel BLOCK={block} w{warps}: "
              f"{compile_one(fn, types, consts, warps, 1, f'grid_topk_b{block}')}")  # fmt: skip


if __name__ == "__main__":
    {"moe": moe, "moe-all": moe_all, "moe-rows": moe_rows, "moe-decode": moe_decode,
     "dense-wg": dense_wg,
     "attention": attention, "attention-ws": attention_ws, "indexer": indexer,
     "topk": topk}[sys.argv[1]]()
