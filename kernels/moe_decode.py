"""Decode GEMMs over stored low-precision weights (Gluon, sm_89+; tuned on sm_90): the MoE's
fp4 experts in the pairs layout, and the dense fp8 projections (e4m3 + e8m0 blocks).

At decode a local expert sees a few token rows (1-16), so its GEMM is a weight stream: every
fp4 byte is read once, converted, and multiplied by a handful of activation columns.
``kernels.moe_grouped._moe_gemm`` (``tl``) takes the tokens as the MMA's M and the weights as
B: its converted weight tile goes through Triton's operand shuffles, and each 32-column scale
goes on an fp32 partial. This kernel swaps the operands (weights = A, M = weight rows; tokens =
B, N = 8, 16 or 32, ``mma.sync`` m16n8k16 in fp16) and permutes K inside each KB-column block
so that every thread's share of the A fragments is KB/4 contiguous bytes of a row:

    logical k = 16 s + 8 h + 2 t + b   <->   stored column (KB/4) t + 4 s + 2 h + b

(t = lane % 4, s = k16 step, h, b bits of the fragment). The same permutation on the
activation columns keeps the product exact (a sum over K in another order). A thread's
KB/4 stored columns lie in one 32-column scale group, so the scale goes on the weights in
fp16 (one multiply per two values) and the MMAs accumulate in place over all of K:

    W = code x 2^(c - 127)             (e2m1 code, e8m0 scale code c per 32 columns)
      = [code x 2^-6] x 2^(6 + c - R)  x 2^(R - 127)

code x 2^-6 is the e4m3 re-encoding of the code (bit moves) and its fp16 ``cvt`` (exact);
R = (largest c of the row) - 9 (``row_refs``) keeps every product code x 2^(c - R) inside
fp16 exactly when the row's scales span at most 32 binades (checked on the host); the
activations are fp16 x 2^-4 (the F16 path's convention), so the accumulator is scaled by
2^(R - 127 + 4) once per row after the K loop.

Per CTA: BR weight rows (16 per warp per repetition; a byte holds a row of each of the two
row sets: W1 and W3 rows, or W2's rows n and n + N) x BT token rows of one expert x one K
split. A ring of 2-3 shared-memory slots takes the stored bytes, the token rows'
activations and the rows' scale words by cp.async; each thread reads its fragment bytes as
16-byte loads. The
epilogue writes the same outputs as ``_moe_gemm``: H (clamped SwiGLU, fp16 x 2^-4) when one
split covers K, else fp32 partials [split, rows, 2N]; W2's Y [split, rows, 2N].

**Dense fp8** (``FP8``; :func:`launch_dense`): one row set of e4m3 bytes [N, K] with e8m0
codes per (SB_N rows, 32 columns) (``kernels.linear.fp8_decode_plan`` widens 128-column
blocks to 32). A byte is its value, so the conversion is the e4m3 ``cvt`` and the same
re-basing with no 2^-6: W = e4m3 x 2^(c - R) x 2^(R - 127), R = (largest c of the row's
block) - HEAD_FP8, exact in fp16 while a block's codes span at most SPREAD_FP8 binades. The
activations are the model's bf16 / fp16, converted to fp16 x 2^-4 in the kernel.

Gluon does not run under the interpreter: ``tests/gpu`` checks this kernel against the
torch reference and the ``tl`` kernel; the CPU tests check the K permutation and the scale
re-basing (``row_refs`` and ``tests.support.decode_gemm``'s emulation), which are what this
kernel adds.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.runtime.jit import constexpr_function

from kernels.moe_decode_fused import (
    WARPS,
    _arrived_last,
    _combine_last,
    _idle_tile,
    _last_sums,
    _local_slots,
    _route_tile,
    _store_rows,
)

KB = 128  # K columns per block (a ring slot); a thread's quarter is one 32-column scale group
BR = 64  # weight rows per CTA (16 per warp); a byte holds one row of each of the two row sets
STAGES = 2  # ring slots (pick_stages): one block in flight while the other is multiplied
SPREAD = 32  # binades a row's scales may span for the fp16 products to be exact
HEAD = 9  # R = max c - HEAD: the largest product code x 2^(c - R) is 6 x 2^9
# fp8 weights: the largest product e4m3 x 2^(c - R) is 448 x 2^6 < 65504; the smallest nonzero
# one, 2^-9 x 2^(c - R), stays a multiple of fp16's 2^-24 while c - R >= -15
# (6 is one binade conservative: 448 x 2^7 fits too; kept as measured on the H200)
HEAD_FP8 = 6
SPREAD_FP8 = 21

# fp4 -> e4m3 x 2^-6, four bytes (eight codes) at a time (the low nibbles -> $0, the high
# nibbles -> $1): the code's magnitude bits e1 e0 m land on e4m3's low exponent bits and top
# mantissa bit (e = 0 lands on the e4m3 subnormal of the same value), the sign on bit 7. Both
# MoE GEMM kernels use it (``kernels.moe_grouped`` wraps it for tl).
FP4_TO_E4M3_PTX = """{
.reg .b32 a, u;
and.b32 a, $2, 0x07070707;  shl.b32 a, a, 2;
and.b32 u, $2, 0x08080808;  shl.b32 u, u, 4;  or.b32 $0, a, u;
shr.b32 a, $2, 2;  and.b32 a, a, 0x1C1C1C1C;
and.b32 u, $2, 0x80808080;  or.b32 $1, a, u;
}"""
_PAIRS_E4M3 = gl.constexpr(FP4_TO_E4M3_PTX)


def row_refs(scales: torch.Tensor, head: int = HEAD, spread: int = SPREAD
             ) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """Per-row reference exponents R = max(c) - ``head`` of e8m0 scale codes [E, rows,
    groups] (int32 [E, rows]) and whether the kernel is exact on them: every row's codes span
    at most ``spread`` binades (the fp16 products) and its largest is at least head - 3 (the
    fp32 row factor 2^(R - 123) stays a normal number). Defaults: the fp4 pairs."""
    c = scales.view(torch.uint8).to(torch.int32)
    hi, lo = c.amax(-1), c.amin(-1)
    ok = bool(((hi - lo) <= spread).all()) and bool((hi >= head - 3).all())
    return (hi - head).contiguous(), ok


def tile_count(n_slots: int, n_local: int, bm: int) -> int:
    """The most BM-row expert tiles ``n_slots`` token slots over ``n_local`` experts can
    need (the graph-static grids of the align launch and of the routing in W13)."""
    return min(n_slots, -(-n_slots // bm) + n_local)


@constexpr_function
def _tile_layout(R, KB, rows, warps=4):
    """Register layout of a stored tile [R, KB] (weight bytes, or fp16 activations): thread
    (g, t) of a warp holds the KB/4 contiguous stored columns of quarter t, which are all its
    fragment values of the K block. ``rows`` "w": rows g and g + 8 of each 16-row block,
    ``warps`` split the rows into 16-row blocks repeated every 16 x warps (the A rows of the
    mma.sync layout, and of the wgmma's register operand: ``kernels.dense_wgmma``); "x":
    token rows g (+ 8 per repetition) and every warp holds the whole tile (B)."""
    q = KB // 4
    reg = [[0, 1 << i] for i in range(q.bit_length() - 1)]
    n_w = warps.bit_length() - 1
    if rows == "w":
        reg += [[8, 0]] + [[16 * warps << i, 0]
                           for i in range((R // (16 * warps)).bit_length() - 1)]  # fmt: skip
        wb = [[16 << i, 0] for i in range(n_w)]
    else:
        reg += [[8 << i, 0] for i in range((R // 8).bit_length() - 1)]
        wb = [[0, 0]] * n_w
    return gl.DistributedLinearLayout(
        reg_bases=reg, lane_bases=[[0, q], [0, 2 * q], [1, 0], [2, 0], [4, 0]],
        warp_bases=wb, block_bases=[], shape=[R, KB],
    )  # fmt: skip


@constexpr_function
def _quarters_layout(R, KB, rows, warps=4):
    """:func:`_tile_layout` viewed as [R, 4, KB/4] (the quarter t as its own dimension)."""
    lay = _tile_layout(R, KB, rows, warps)
    q = KB // 4

    def split(b):
        return [b[0], b[1] // q, b[1] % q]

    return gl.DistributedLinearLayout(
        reg_bases=[split(b) for b in lay.reg_bases],
        lane_bases=[split(b) for b in lay.lane_bases],
        warp_bases=[split(b) for b in lay.warp_bases], block_bases=[], shape=[R, 4, q],
    )  # fmt: skip


@gluon.jit
def _fragments(v, R: gl.constexpr, KB: gl.constexpr):
    """[R, KB] in stored column order -> [R, KB] in logical MMA order (a relabelling of each
    thread's registers: no data moves)."""
    v = gl.reshape(v, [R, 4, KB // 16, 2, 2])
    v = gl.permute(v, [0, 2, 3, 1, 4])
    return gl.reshape(v, [R, KB])


@gluon.jit
def _issue(w_slot, x_slot, s_slot, w_rows, a_rows, amask, s_rows, k, K, BR: gl.constexpr,
           BT: gl.constexpr, KB: gl.constexpr):  # fmt: skip
    """cp.async the weight bytes [BR, KB], the token rows' activations [BT, KB] and the rows'
    scale words (four e8m0 codes: the block's 32-column groups; lo rows then hi rows) of the
    K block at ``k`` into one ring slot (at or past K: masked, zero-filled)."""
    wl: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // KB, KB // 16], [WARPS, 1], [1, 0])
    cw = k + gl.arange(0, KB, layout=gl.SliceLayout(0, wl))
    async_copy.async_copy_global_to_shared(
        w_slot, gl.convert_layout(w_rows, gl.SliceLayout(1, wl))[:, None] + cw[None, :],
        mask=(cw < K)[None, :],
    )  # fmt: skip
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // KB, KB // 8], [WARPS, 1], [1, 0])
    cx = k + gl.arange(0, KB, layout=gl.SliceLayout(0, xl))
    ar = gl.convert_layout(a_rows, gl.SliceLayout(1, xl))
    am = gl.convert_layout(amask, gl.SliceLayout(1, xl))
    async_copy.async_copy_global_to_shared(
        x_slot, ar[:, None] + cx[None, :], mask=am[:, None] & (cx < K)[None, :]
    )
    async_copy.async_copy_global_to_shared(s_slot, s_rows + k // KB,
                                           mask=gl.full(s_rows.shape, k, gl.int32,
                                                        s_rows.type.layout) < K)  # fmt: skip
    async_copy.commit_group()


@gluon.jit
def _mult(words, ref, layout: gl.constexpr, OFF: gl.constexpr):
    """fp16 2^(OFF + c - R) [BR, 4] for each row and column quarter t of a K block: c = byte t
    of the row's scale word (group t of the block), R = the row's reference ``ref``; OFF = 6
    undoes the fp4 codes' e4m3 re-encoding (x 2^-6), 0 for fp8 weights."""
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, layout))
    c = (words[:, None] >> (8 * t)[None, :]) & 0xFF
    bits = (c + (OFF + 127) - ref[:, None]) << 23
    return bits.to(gl.float32, bitcast=True).to(gl.float16)


@gluon.jit
def _moe_dec_kernel(
    a_ptr, sam, rows_ptr, tile_e_ptr, w_ptr, swe, swn, s_ptr, sse, ssn, r_ptr, sre,
    out_ptr, sos, som, n_slots, topk, N, K, k_per_split, limit, cnt_ptr, fin_ptr, sfm,
    ids_ptr, route_off, n_local, inv_ptr, wt_ptr, y_out_ptr, syo, n_tok,
    A_GATHER: gl.constexpr, FUSE_SWIGLU: gl.constexpr, HAS_LIMIT: gl.constexpr,
    BR: gl.constexpr, BT: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr,
    FP8: gl.constexpr = False, SB_N: gl.constexpr = 1, TILES_LAST: gl.constexpr = True,
    REDUCE: gl.constexpr = False, ROUTE: gl.constexpr = False, COMBINE: gl.constexpr = False,
    S_P2: gl.constexpr = 1, TOPK: gl.constexpr = 1, T_P2: gl.constexpr = 1,
    NB_P2: gl.constexpr = 1,
):  # fmt: skip
    """One (token tile, BR weight rows, K split). fp4 pairs (default): activations fp16 x 2^-4;
    ``FP8``: one row set of e4m3 rows whose scale row is ``r // SB_N``, activations bf16 / fp16
    as the model holds them, converted here to fp16 x 2^-4 (exact for normalized activations:
    it overflows from |x| ~ 1e6 and drops low bits below ~2^-13), no gather, no SwiGLU. The
    scale ring still copies a second half of words that FP8 never reads. ``TILES_LAST``: the
    grid is (row blocks, splits, token tiles), so the CTAs of one token tile run together and
    the idle tiles past the last expert's (``tile_e`` -1: the graph-static grid holds the most
    tiles a call can need) are scheduled after every working CTA; else (token tiles, row
    blocks, splits). ``REDUCE`` (with K splits): the split-K sum in the epilogue -- each CTA
    stores its fp32 partial and counts itself in at its (tile, row block) counter (``cnt_ptr``,
    zero between launches); the last to arrive sums the partials in split order and sets the
    counter back to zero. ``FP8``: it writes the sum to ``fin_ptr`` in its dtype (as
    ``kernels.linear._split_sum_cast``); W13 (fp4 pairs): the clamped SwiGLU of the two sums as
    fp16 x 2^-4 H (as ``kernels.moe_align._swiglu_reduce``). ``ROUTE`` (W13): the tile's expert
    and rows come from the router's ids (``moe_decode_fused._route_tile``), the activations are
    the model's rows; ``COMBINE`` (W2): the last CTA of each row block combines the partials
    into the layer's output (``moe_decode_fused._combine_last``)."""
    if TILES_LAST:
        pid_n, pid_k, pid_m = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    else:
        pid_m, pid_n, pid_k = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    tl_: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pos = pid_m * BT + gl.arange(0, BT, layout=tl_)
    if ROUTE:  # the tile's expert and token rows from the router's ids (no align launch)
        first = (pid_n == 0) & (pid_k == 0)
        n_loc = _local_slots(ids_ptr, n_slots, route_off, n_local, S_P2)
        if pid_m >= n_loc:  # more tiles than local slots: idle, before the routing
            if first:
                _idle_tile(rows_ptr, tile_e_ptr, inv_ptr, pid_m, n_slots, S_P2, BT)
            return
        e, slot = _route_tile(ids_ptr, n_slots, route_off, n_local, pid_m, rows_ptr, tile_e_ptr,
                              inv_ptr, first, S_P2, NB_P2, BT, tl_)  # fmt: skip
    else:
        e = gl.load(tile_e_ptr + pid_m)
        slot = gl.load(rows_ptr + pos)
    if e < 0:
        if COMBINE and pid_m == 0 and pid_k == 0:  # no tile is active: the layer's out is 0
            zl: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [WARPS, 1], [1, 0])
            z = gl.zeros([T_P2, BR], gl.float32, zl)
            _store_rows(y_out_ptr, syo, n_tok, pid_n * BR, N, z, z)
        return
    e = e.to(gl.int64)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])  # fmt: skip
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    dot_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    wl: gl.constexpr = _tile_layout(BR, KB, "w")
    wq: gl.constexpr = _quarters_layout(BR, KB, "w")
    xl: gl.constexpr = _tile_layout(BT, KB, "x")
    ql: gl.constexpr = gl.SliceLayout(2, wq)  # [BR, 4]: one scale group per thread and row
    rl: gl.constexpr = gl.SliceLayout(1, ql)

    # token rows of this tile (pad rows: slot n_slots, masked)
    amask = slot < n_slots
    arow = (slot // topk) if A_GATHER else pos
    a_rows = a_ptr + arow.to(gl.int64) * sam

    n0 = pid_n * BR
    cl: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    w_rows = w_ptr + e * swe + (n0 + gl.arange(0, BR, layout=cl)).to(gl.int64) * swn
    r = n0 + gl.arange(0, BR, layout=rl)
    sl: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    sr = n0 + gl.arange(0, 2 * BR, layout=sl)
    if FP8:  # one row set: the ring's second half repeats the first (never read)
        s_rows = s_ptr + e * sse + ((n0 + (sr - n0) % BR) // SB_N).to(gl.int64) * ssn
    else:
        s_rows = s_ptr + e * sse + gl.where(sr < n0 + BR, sr, sr - BR + N).to(gl.int64) * ssn
    ref_lo = gl.load(r_ptr + e * sre + r)
    if not FP8:
        ref_hi = gl.load(r_ptr + e * sre + N + r)

    w_bufs = gl.allocate_shared_memory(
        gl.uint8, [STAGES, BR, KB], gl.SwizzledSharedLayout(16, 1, KB // 16, [1, 0]))
    x_bufs = gl.allocate_shared_memory(
        a_ptr.dtype.element_ty, [STAGES, BT, KB], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    s_bufs = gl.allocate_shared_memory(
        gl.int32, [STAGES, 2 * BR], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    k_lo = pid_k * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    n_it = gl.cdiv(k_hi - k_lo, KB)
    for j in gl.static_range(STAGES - 1):
        _issue(w_bufs.index(j), x_bufs.index(j), s_bufs.index(j), w_rows, a_rows, amask,
               s_rows, k_lo + j * KB, k_hi, BR, BT, KB)  # fmt: skip
    acc_lo = gl.zeros([BR, BT], gl.float32, mma)
    acc_hi = gl.zeros([BR, BT], gl.float32, mma)
    for i in range(n_it):
        async_copy.wait_group(STAGES - 2)  # block i has landed (this thread's copies)
        gl.thread_barrier()  # ... everyone's, and slot (i - 1) % STAGES is free again
        nxt = (i + STAGES - 1) % STAGES
        _issue(w_bufs.index(nxt), x_bufs.index(nxt), s_bufs.index(nxt), w_rows, a_rows, amask,
               s_rows, k_lo + (i + STAGES - 1) * KB, k_hi, BR, BT, KB)  # fmt: skip
        cur = i % STAGES
        words = s_bufs.index(cur)
        q = gl.convert_layout(gl.reshape(w_bufs.index(cur).load(wl), [BR, 4, KB // 4]), wq,
                              assert_trivial=True)  # fmt: skip
        xv = x_bufs.index(cur).load(xl)
        if FP8 or ROUTE:  # the model's activations -> fp16 x 2^-4
            xv = (xv.to(gl.float32) * 0.0625).to(gl.float16)
        xb = gl.convert_layout(gl.permute(_fragments(xv, BT, KB), [1, 0]), dot_b, True)
        if FP8:
            m_lo = _mult(words.slice(0, BR).load(rl), ref_lo, ql, 0)
            w_lo = q.to(gl.float8e4nv, bitcast=True).to(gl.float16) * gl.expand_dims(m_lo, 2)
            w_lo = gl.convert_layout(_fragments(gl.reshape(w_lo, [BR, KB]), BR, KB), dot_a, True)
            acc_lo = mma_v2(w_lo, xb, acc_lo)
        else:
            lo8, hi8 = gl.inline_asm_elementwise(
                _PAIRS_E4M3, "=r,=r,r", [q], dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True,
                pack=4,
            )  # fmt: skip
            m_lo = _mult(words.slice(0, BR).load(rl), ref_lo, ql, 6)
            m_hi = _mult(words.slice(BR, BR).load(rl), ref_hi, ql, 6)
            w_lo = lo8.to(gl.float16) * gl.expand_dims(m_lo, 2)
            w_hi = hi8.to(gl.float16) * gl.expand_dims(m_hi, 2)
            w_lo = gl.convert_layout(_fragments(gl.reshape(w_lo, [BR, KB]), BR, KB), dot_a,
                                     True)  # fmt: skip
            w_hi = gl.convert_layout(_fragments(gl.reshape(w_hi, [BR, KB]), BR, KB), dot_a,
                                     True)  # fmt: skip
            acc_lo = mma_v2(w_lo, xb, acc_lo)
            acc_hi = mma_v2(w_hi, xb, acc_hi)
    async_copy.wait_group(0)

    # rows x tokens -> out[token row, column]; the row factor 2^(R - 127 + 4)
    rm = n0 + gl.arange(0, BR, layout=gl.SliceLayout(1, mma))
    f_lo = ((gl.load(r_ptr + e * sre + rm) + 4) << 23).to(gl.float32, bitcast=True)
    acc_lo = acc_lo * f_lo[:, None]
    tp = pid_m * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
    o_ptrs = out_ptr + pid_k * sos + tp.to(gl.int64)[None, :] * som + rm[:, None]
    if FP8:
        gl.store(o_ptrs, acc_lo.to(out_ptr.dtype.element_ty))
        if REDUCE:
            _last_sums(o_ptrs - pid_k * sos, sos, fin_ptr + tp.to(gl.int64)[None, :] * sfm
                       + rm[:, None], cnt_ptr + pid_m * (N // BR) + pid_n,
                       gl.num_programs(1 if TILES_LAST else 2), None)  # fmt: skip
    elif FUSE_SWIGLU:
        f_hi = ((gl.load(r_ptr + e * sre + N + rm) + 4) << 23).to(gl.float32, bitcast=True)
        acc_hi = acc_hi * f_hi[:, None]
        if HAS_LIMIT:
            acc_lo = gl.minimum(acc_lo, limit)
            acc_hi = gl.minimum(gl.maximum(acc_hi, -limit), limit)
        h = acc_lo / (1.0 + gl.exp(-acc_lo)) * acc_hi
        gl.store(o_ptrs, (h * 0.0625).to(gl.float16))
    else:
        f_hi = ((gl.load(r_ptr + e * sre + N + rm) + 4) << 23).to(gl.float32, bitcast=True)
        acc_hi = acc_hi * f_hi[:, None]
        gl.store(o_ptrs, acc_lo.to(out_ptr.dtype.element_ty))
        gl.store(o_ptrs + N, acc_hi.to(out_ptr.dtype.element_ty))
        if COMBINE:  # W2: the last CTA of the row block (all tiles, all splits) combines
            tl2: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            ti = gl.arange(0, S_P2, layout=tl2)
            te = gl.load(tile_e_ptr + ti, mask=ti < gl.num_programs(2), other=-1)
            n_active = gl.sum((te >= 0).to(gl.int32), axis=0)
            _combine_last(out_ptr, sos, som, inv_ptr, wt_ptr, y_out_ptr, syo, n_tok, n0, N,
                          cnt_ptr + pid_n, n_active * gl.num_programs(1), gl.num_programs(1),
                          TOPK, T_P2, BR)  # fmt: skip
        if REDUCE:  # W13: the last CTA of the tile's row block sums both halves -> H
            c_ptr = cnt_ptr + pid_m * (N // BR) + pid_n
            n_split = gl.num_programs(1 if TILES_LAST else 2)
            if _arrived_last(c_ptr, n_split):
                p_ptrs = o_ptrs - pid_k * sos
                h1 = gl.zeros([BR, BT], gl.float32, mma)
                h3 = gl.zeros([BR, BT], gl.float32, mma)
                for k in range(n_split):
                    h1 += gl.load(p_ptrs + k * sos, cache_modifier=".cg")
                    h3 += gl.load(p_ptrs + k * sos + N, cache_modifier=".cg")
                if HAS_LIMIT:
                    h1 = gl.minimum(h1, limit)
                    h3 = gl.minimum(gl.maximum(h3, -limit), limit)
                h = h1 * (1 / (1 + gl.exp(-h1))) * h3
                f_ptrs = fin_ptr + tp.to(gl.int64)[None, :] * sfm + rm[:, None]
                gl.store(f_ptrs, (h * 0.0625).to(gl.float16))
                gl.store(c_ptr, 0)


def pick_stages(bt: int, tiles: float) -> int:
    """Ring slots: 2, or 3 for many 8-row tiles. H200 sweep (``bench.moe_decode --sweep``,
    the two GEMMs, 48 of 384 experts local): 1 / 8 / 512 tokens 18.2 / 42.8 / 317 us with 2
    slots against 19.2 / 44.2 / 331 with 3 (4 and 5 slower still); 64 tokens (8-row tiles,
    ~36 of them) 186 us with 3 against 194 with 2."""
    return 3 if bt == 8 and tiles >= 16 else 2


def pick_split(tiles: float, n: int, k: int, sms: int, br: int = BR) -> int:
    """K splits of one GEMM: enough CTAs for about two waves of four per SM over the expected
    active tiles (x n / br row blocks), each split keeping at least four K blocks."""
    blocks = max(1.0, tiles) * (n // br)
    return max(1, min(k // KB // 4, math.ceil(2 * 4 * sms / blocks)))


def launch(a: torch.Tensor, rows: torch.Tensor, tile_e: torch.Tensor, w: torch.Tensor,
           s: torch.Tensor, ref: torch.Tensor, out: torch.Tensor, n_slots: int, topk: int,
           n: int, k: int, split: int, limit: float, gather: bool, fuse_swiglu: bool,
           bt: int, br: int = BR, kb: int = KB, stages: int = STAGES,
           maxnreg: int | None = None, tiles_last: bool = True, fin: torch.Tensor | None = None,
           counters: torch.Tensor | None = None,
           route: tuple[torch.Tensor, int, int, torch.Tensor] | None = None,
           combine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
           ) -> None:  # fmt: skip
    """One GEMM: ``a`` fp16 [rows, K] (x 2^-4), ``w`` pairs bytes [E, N, K] (row n: rows n
    and n + N of the row sets), ``s`` e8m0 codes [E, 2N, K/32] (uint8; read as one int32
    word per row and K block), ``ref`` int32 [E, 2N] (:func:`row_refs`), ``out`` as
    ``_moe_gemm`` writes it. K a multiple of KB = 128, N of BR. ``tiles_last``: the grid's
    order (``_moe_dec_kernel``'s ``TILES_LAST``). H200 (``bench.moe_decode --sweep-form``,
    the two GEMMs): on, 8 / 64 / 512 tokens 40.1 / 183.7 / 317.2 us against
    43.1 / 188.8 / 327.9 off, each at its ring depth. With ``fin`` (fp16 H [rows, N]) and
    ``counters`` (int32, zero, at least tiles x N / br) a W13 launch with K splits also sums
    them and writes H (``REDUCE``).

    ``route`` = (ids [T, topk] global expert ids, offset, local experts, inv int32 [T * topk]):
    the kernel lays out its tiles from the router's ids itself (``ROUTE``: ``rows`` and
    ``tile_e`` are then written, with ``inv``, by each tile's first CTA for the launches
    after it) and reads ``a`` as the model's bf16 / fp16 rows. ``combine`` = (inv,
    weights fp32 [T, topk], out [T, 2N]) on a W2 launch with ``counters`` (zero, N / br):
    ``out`` in the combine's order, by the last CTA of each row block (``COMBINE``)."""
    if kb != 128 or k % kb or n % br:
        raise ValueError(f"decode GEMM: K={k} must be a multiple of 128 and N={n} of {br}")
    reduce = fin is not None and split > 1
    if reduce and (counters is None or counters.numel() < tile_e.numel() * (n // br)
                   or fuse_swiglu or not gather or fin.dtype != torch.float16
                   or fin.stride(1) != 1):  # fmt: skip
        raise ValueError("decode GEMM: the in-kernel split sum is W13's (gathered rows, no "
                         f"fused SwiGLU), into fp16 fin [rows, N] with "
                         f"{tile_e.numel() * (n // br)} zeroed counters")  # fmt: skip
    s = s.view(torch.uint8).contiguous().view(torch.int32)  # [E, 2N, K/128]
    per = -(-(k // kb) // split) * kb
    tiles = tile_e.numel()
    n_tok = n_slots // max(topk, 1)
    if route is not None:
        ids, off, n_local, inv = route
        if not (gather and reduce and ids.numel() == n_slots
                and a.dtype in (torch.bfloat16, torch.float16)):  # fmt: skip
            raise ValueError("decode GEMM route: W13 with K splits summed in the kernel, on "
                             "the model's bf16 / fp16 rows")  # fmt: skip
        rt = (ids, off, n_local, inv)
    else:
        rt = (rows, 0, 0, combine[0] if combine is not None else rows)
    if combine is not None:
        _, wt, y_out = combine
        if (gather or fuse_swiglu or out.dtype != torch.float32 or counters is None
                or counters.numel() < n // br or wt.dtype != torch.float32
                or not wt.is_contiguous() or y_out.stride(1) != 1):  # fmt: skip
            raise ValueError("decode GEMM combine: W2 with fp32 partials, fp32 weights and "
                             f"{n // br} zeroed counters")  # fmt: skip
        cb = (wt, y_out, y_out.stride(0), n_tok)
    else:
        cb = (rows, out, 0, n_tok)
    s_p2 = max(2, 1 << (max(n_slots, tiles, 2) - 1).bit_length())
    grid = (n // br, split, tiles) if tiles_last else (tiles, n // br, split)
    _moe_dec_kernel[grid](
        a, a.stride(0), rows, tile_e, w, w.stride(0), w.stride(1), s, s.stride(0), s.stride(1),
        ref, ref.stride(0), out, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        n_slots, topk, n, k, per, limit, counters if reduce or combine is not None else ref,
        fin if reduce else out, fin.stride(0) if reduce else 0, *rt, *cb, A_GATHER=gather,
        FUSE_SWIGLU=fuse_swiglu, HAS_LIMIT=limit > 0, BR=br, BT=bt, KB=kb, STAGES=stages,
        TILES_LAST=tiles_last, REDUCE=reduce, ROUTE=route is not None,
        COMBINE=combine is not None, S_P2=s_p2, TOPK=topk,
        T_P2=max(2, 1 << max(n_tok - 1, 1).bit_length()),
        NB_P2=max(2, 1 << (max(rt[2], 2) - 1).bit_length()),
        num_warps=4, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def fp8_refs(codes: torch.Tensor, b0: int, n: int) -> tuple[torch.Tensor, bool]:
    """Per-row reference exponents of fp8 weights (:data:`HEAD_FP8`) from e8m0 ``codes``
    [ceil(n / b0), groups] (uint8, one per 32 columns): int32 [n], and whether the kernel is
    exact on them (each block row's codes span at most :data:`SPREAD_FP8` binades, and its
    largest keeps the fp32 row factor 2^(R - 123) a normal number)."""
    refs, ok = row_refs(codes, HEAD_FP8, SPREAD_FP8)  # per block row
    return refs.repeat_interleave(b0)[:n].contiguous(), ok


def launch_dense(x: torch.Tensor, w: torch.Tensor, words: torch.Tensor, refs: torch.Tensor,
                 rows: torch.Tensor, tile_e: torch.Tensor, out: torch.Tensor, m: int,
                 split: int, bt: int, b0: int, stages: int = STAGES,
                 fin: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None) -> None:  # fmt: skip
    """One dense fp8 GEMM ``out[s, :m] (+)= x @ W^T``: ``x`` bf16 / fp16 [m, K] (contiguous
    rows), ``w`` e4m3 [N, K], ``words`` int32 [ceil(N / b0), K / 128] (four e8m0 codes per
    128 columns), ``refs`` int32 [N] (:func:`fp8_refs`), ``rows`` / ``tile_e`` the one-group
    row map (0 .. tiles * bt - 1) and tile experts (0), ``out`` [split, tiles * bt, N]: x's
    dtype when ``split`` is 1, else fp32 partials. With ``fin`` [tiles * bt, N] (x's dtype)
    and ``counters`` (int32, zero, at least tiles * N / BR) the launch also sums the splits
    into ``fin`` (``_moe_dec_kernel``'s ``REDUCE``). K a multiple of KB, N of BR."""
    n, k = w.shape
    if k % KB or n % BR or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dense decode GEMM: K={k} (x {KB}), N={n} (x {BR}), x {x.dtype}")
    reduce = fin is not None and split > 1
    if reduce and (counters is None or counters.numel() < tile_e.numel() * (n // BR)
                   or fin.shape != out.shape[1:] or fin.stride(1) != 1):  # fmt: skip
        raise ValueError("dense decode GEMM: the in-kernel split sum needs fin [rows, N] and "
                         f"{tile_e.numel() * (n // BR)} zeroed counters")  # fmt: skip
    per = -(-(k // KB) // split) * KB
    _moe_dec_kernel[(tile_e.numel(), n // BR, split)](
        x, x.stride(0), rows, tile_e, w.view(torch.uint8), 0, w.stride(0), words, 0,
        words.stride(0), refs, 0, out, out.stride(0), out.stride(1), m, 1, n, k, per, 0.0,
        counters if reduce else refs, fin if reduce else out, fin.stride(0) if reduce else 0,
        rows, 0, 0, rows, rows, out, 0, 0, A_GATHER=False,
        FUSE_SWIGLU=False, HAS_LIMIT=False, BR=BR, BT=bt, KB=KB, STAGES=stages, FP8=True,
        SB_N=b0, TILES_LAST=False, REDUCE=reduce, num_warps=4,
    )  # fmt: skip
