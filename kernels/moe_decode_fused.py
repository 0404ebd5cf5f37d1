"""The parts of the Gluon decode GEMMs (``kernels.moe_decode``) that fold whole launches into
them, each decided on the device, in the CTAs of the GEMM itself:

- the tile routing from the router's ids (W13 of the two-launch MoE layer: what the align
  launch would write, for one tile, in registers: :func:`_route_tile`);
- the combine by the last CTA of W2's row block (:func:`_combine_last`, the combine launch's
  order);
- the split-K sums by the last CTA of a tile's row block (:func:`_last_sums`).

A CTA counts itself in at a counter after its stores (gpu-scope acq_rel atomics,
:func:`_arrived_last`); the last to arrive reads the others' results from L2 and sets the
counter back to zero, so the kept zeroed counters (``kernels.dispatch.split_counters``) serve
every launch in stream order.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

WARPS = gl.constexpr(4)  # warps of every decode GEMM CTA (one warpgroup)


@gluon.jit
def _local_slots(ids_ptr, n_slots, offset, n_local, S: gl.constexpr):
    """How many of the ``n_slots`` router ids fall on a local expert (a bound on the tiles)."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    s = gl.arange(0, S, layout=lay)
    e = gl.load(ids_ptr + s, mask=s < n_slots, other=-1).to(gl.int32) - offset
    return gl.sum(((s < n_slots) & (e >= 0) & (e < n_local)).to(gl.int32), axis=0)


@gluon.jit
def _idle_tile(rows_ptr, tile_e_ptr, inv_ptr, m, n_slots, S: gl.constexpr, BT: gl.constexpr):
    """What the align launch writes for an idle tile ``m`` (expert -1, pad rows); tile 0 is
    idle only when no slot is local: then also the -1 of every slot's row."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    gl.store(tile_e_ptr + m, -1)
    j = gl.arange(0, BT, layout=lay)
    gl.store(rows_ptr + m * BT + j, gl.full([BT], 0, gl.int32, lay) + n_slots)
    s = gl.arange(0, S, layout=lay)
    gl.store(inv_ptr + s, gl.full([S], -1, gl.int32, lay), mask=(s < n_slots) & (m == 0))


@gluon.jit
def _plus(a, b):
    return a + b


@gluon.jit
def _route_tile(ids_ptr, n_slots, offset, n_local, m, rows_ptr, tile_e_ptr, inv_ptr, write,
                S: gl.constexpr, NB: gl.constexpr, BT: gl.constexpr,
                out_l: gl.constexpr):  # fmt: skip
    """``kernels.moe_align._align`` for one tile, in registers: -> (tile ``m``'s local expert, -1
    when idle; its BT token slots, pad = ``n_slots``, in ``out_l``). The same tiles as the
    align launch (local experts in order, ceil(count / BT) tiles each, every slot a row of
    its expert's tiles), with the rows of an expert in slot order: the experts' counts (a
    histogram over ``NB`` >= n_local bins) and their running tile sum give tile m's expert
    and its first rank; a running count of that expert's slots gives each its rank. O(S +
    NB) per CTA. ``write``: also store the tile's expert, rows and its slots' rows
    (``tile_e``, ``rows``, ``inv``; tile 0 also the -1 of the slots no local expert takes),
    as the align launch does, for the launches after this one."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    s = gl.arange(0, S, layout=lay)
    e = gl.load(ids_ptr + s, mask=s < n_slots, other=-1).to(gl.int32) - offset
    loc = (s < n_slots) & (e >= 0) & (e < n_local)
    cnt = gl.histogram(gl.where(loc, e, 0), NB, mask=loc, layout=lay)
    tiles = (cnt + BT - 1) // BT
    end = gl.associative_scan(tiles, 0, _plus)  # tiles of experts 0..b
    em = gl.sum((end <= m).to(gl.int32), axis=0)  # tile m's expert (NB: past the last tile)
    b = gl.arange(0, NB, layout=lay)
    j0 = (m - gl.sum(gl.where(b == em, end - tiles, 0), axis=0)) * BT  # its first rank
    match = (loc & (e == em)).to(gl.int32)
    rank = gl.associative_scan(match, 0, _plus) - match  # among the expert's slots
    mine = (match > 0) & (rank >= j0) & (rank < j0 + BT)
    row = rank - j0
    L: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [WARPS, 1], [1, 0])
    s2 = gl.convert_layout(s, gl.SliceLayout(1, L))
    j = gl.arange(0, BT, layout=gl.SliceLayout(0, L))
    hit = (gl.convert_layout(mine, gl.SliceLayout(1, L))[:, None]
           & (gl.convert_layout(row, gl.SliceLayout(1, L))[:, None] == j[None, :]))  # fmt: skip
    has = gl.sum(hit.to(gl.int32), axis=0)
    slot = gl.where(has > 0, gl.sum(gl.where(hit, s2[:, None], 0), axis=0), n_slots)
    e_tile = gl.where(em < n_local, em, -1)
    if write:
        gl.store(tile_e_ptr + m, e_tile)
        gl.store(rows_ptr + m * BT + j, slot)
        gl.store(inv_ptr + s, m * BT + row, mask=mine)
        gl.store(inv_ptr + s, gl.full([S], -1, gl.int32, lay),
                 mask=(s < n_slots) & ~loc & (m == 0))  # fmt: skip
    return e_tile, gl.convert_layout(slot, out_l)


@gluon.jit
def _combine_last(y_ptr, sys, sym, inv_ptr, wt_ptr, out_ptr, som, n_tok, n0, N, c_ptr,
                  n_arrive, n_split, TOPK: gl.constexpr, TP: gl.constexpr,
                  BR: gl.constexpr):  # fmt: skip
    """``kernels.moe_align._moe_combine`` for W2's row block (columns n0 + [0, BR) and N + those),
    in its order, by the last of ``n_arrive`` CTAs to store their partials ``y``:
    ``out[t, c] = sum_j w[t, j] * sum_s y[s, inv[t * TOPK + j], c]``."""
    if _arrived_last(c_ptr, n_arrive):
        L: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [WARPS, 1], [1, 0])
        t = gl.arange(0, TP, layout=gl.SliceLayout(1, L))
        c = n0 + gl.arange(0, BR, layout=gl.SliceLayout(0, L))
        tm = t < n_tok
        acc_lo = gl.zeros([TP, BR], gl.float32, L)
        acc_hi = gl.zeros([TP, BR], gl.float32, L)
        for j in range(TOPK):  # (a static loop hoists every load: 96-168 registers)
            p = gl.load(inv_ptr + t * TOPK + j, mask=tm, other=-1)
            w = gl.load(wt_ptr + t * TOPK + j, mask=tm, other=0.0)
            msk = (p >= 0)[:, None] & (c < N)[None, :]
            base = y_ptr + p.to(gl.int64)[:, None] * sym + c[None, :]
            part_lo = gl.zeros([TP, BR], gl.float32, L)
            part_hi = gl.zeros([TP, BR], gl.float32, L)
            for k in range(n_split):
                part_lo += gl.load(base + k * sys, mask=msk, other=0.0, cache_modifier=".cg")
                part_hi += gl.load(base + k * sys + N, mask=msk, other=0.0, cache_modifier=".cg")
            acc_lo += w[:, None] * part_lo
            acc_hi += w[:, None] * part_hi
        _store_rows(out_ptr, som, n_tok, n0, N, acc_lo, acc_hi)
        gl.store(c_ptr, 0)


@gluon.jit
def _store_rows(out_ptr, som, n_tok, n0, N, lo, hi):
    """``out[t, n0 + c]`` = lo[t, c] and ``out[t, N + n0 + c]`` = hi[t, c] for t < n_tok."""
    lay: gl.constexpr = lo.type.layout
    t = gl.arange(0, lo.shape[0], layout=gl.SliceLayout(1, lay))
    c = n0 + gl.arange(0, lo.shape[1], layout=gl.SliceLayout(0, lay))
    o = out_ptr + t.to(gl.int64)[:, None] * som + c[None, :]
    om = (t < n_tok)[:, None] & (c < N)[None, :]
    gl.store(o, lo.to(out_ptr.dtype.element_ty), mask=om)
    gl.store(o + N, hi.to(out_ptr.dtype.element_ty), mask=om)


@gluon.jit
def _arrived_last(c_ptr, n_split):
    """Count this CTA in at ``c_ptr`` after its stores; -> whether it arrived last of
    ``n_split`` (then it may read what the others stored; it resets the counter itself)."""
    gl.thread_barrier()
    old = gl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == n_split - 1
    gl.thread_barrier()
    return last


@gluon.jit
def _last_sums(p_ptrs, sps, f_ptrs, c_ptr, n_split, mask):
    """Split-K in the epilogue: after this CTA's partial is stored at ``p_ptrs + k * sps``,
    count the CTA in at ``c_ptr``; the last of ``n_split`` sums the partials in split order
    into ``f_ptrs`` (its dtype) and resets the counter. The barrier puts every thread's
    store before the gpu-scope release of the count (CUDA's threadfence-reduction pattern),
    and the partials are read from L2 (``.cg``): other SMs wrote them. ``mask``: the
    elements stored (None: all)."""
    if _arrived_last(c_ptr, n_split):
        tot = gl.load(p_ptrs, mask=mask, cache_modifier=".cg")
        for k in range(1, n_split):
            tot += gl.load(p_ptrs + k * sps, mask=mask, cache_modifier=".cg")
        gl.store(f_ptrs, tot.to(f_ptrs.dtype.element_ty), mask=mask)
        gl.store(c_ptr, 0)
