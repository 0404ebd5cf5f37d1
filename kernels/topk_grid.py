"""Exact top-k of long rows in one launch: a radix select whose programs meet at grid barriers.

Row ``r`` of ``scores`` [T, C] is split into ``G`` contiguous spans, one program each. The
programs run up to five phases, with a grid barrier (an integer counter, atomics at GPU
scope) between two phases, so the whole select is one launch and one memset:

- phases 0-3: a 256-bin histogram of one byte of the order keys (most significant first) of
  the span's finite-or-+inf scores whose higher bytes equal the prefix found so far, added to
  the row's histogram of that level (integer atomics). After the barrier every program reads
  the level's histogram and derives the same next byte of ``tau``, the k-th largest key, and
  ``need``, how many keys equal to ``tau`` belong to the top-k. Each level also stores, per
  program, its keys above the prefix and its own histogram cumulated from the top: with the
  level's byte known, any program reads off every program's count above tau and at tau (two
  loads each), so no counting phase and barrier are needed. When the bin found holds exactly
  the keys still needed (the usual case at level 2 for real-valued scores: a 24-bit prefix
  rarely holds two), every key of it is a pick and the later levels are skipped;
- phase 4: each program sums the counts of the programs before it and writes its picks' ids at
  their final positions: ascending ids, because spans are in id order and a cumsum orders the
  picks within one. Ties at ``tau`` go to the lower ids (the first ``need`` in id order).
  When a span is one tile, the program loads its scores once for all phases.

Exact for any ties (no candidate list, no capacity), -inf never picked (its slots are -1).
The barrier needs every program of the grid resident at once: ``grid_topk`` sizes the grid to
at most one program per SM. Under the interpreter (programs run one after another) the phases
are launched one by one instead (``fused=False``), the same code without the barriers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LEVELS = 4  # bytes of a 32-bit key
_HIST = _LEVELS * 256
_BARS = 8  # one arrival counter per barrier (4 used)
_PHASES = 5  # four histogram levels, then the write
_BLOCK = 2048  # scores per tile (a span is a whole number of tiles)
_MAX_G = 1024  # programs per row (the count arrays' block)


@triton.jit
def _order_key(v):
    """Order-preserving int32 key of fp32 scores (-0 -> +0; negatives' 31 low bits flipped)."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _grid_sync(bar_ptr, n):
    """Wait until ``n`` programs have arrived at this barrier (its own counter)."""
    tl.debug_barrier()  # the program's earlier atomics and stores are issued
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < n:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _next_byte(hist_ptr, level, tau_u, need, stop):
    """Level ``level``'s byte of tau (the bin holding the need-th largest key of the prefix)
    and the keys of that bin still needed. With fewer than ``need`` keys: bin 0. ``stop``
    becomes ``level`` when that bin holds exactly the keys still needed (all of them are
    picks: the select ends here); a select already stopped is returned unchanged."""
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + level * 256 + bins, volatile=True)
    at_least = tl.cumsum(hist, 0, reverse=True)  # keys in the prefix with digit >= bin
    b = tl.max(tl.where(at_least >= need, bins, 0))
    left = need - tl.sum(tl.where(bins > b, hist, 0))
    live = stop < 0
    exact = live & (tl.sum(tl.where(bins == b, hist, 0)) == left)
    return (
        tl.where(live, tau_u | (b << (24 - 8 * level)), tau_u),
        tl.where(live, left, need),
        tl.where(exact, level, stop),
    )


@triton.jit
def _tile(s_ptr, lo, t0, C, BLOCK: tl.constexpr):
    """Tile ``[lo + t0, +BLOCK)`` -> (ids, usable: finite or +inf and in the row, keys as
    int32 bits that order like uint32)."""
    j = lo + t0 + tl.arange(0, BLOCK)
    v = tl.load(s_ptr + j, mask=j < C, other=float("-inf"))
    return j, v > float("-inf"), _order_key(v) ^ -2147483648


@triton.jit
def _grid_topk_kernel(
    s_ptr, s_row, C, KK, ws_ptr, ws_row, cs_ptr, cs_row, out_ptr, s_out, G, SPAN,
    P0: tl.constexpr, P1: tl.constexpr, BLOCK: tl.constexpr, GP2: tl.constexpr,
    SINGLE: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Phases [P0, P1) of row ``pid(1)``'s select, span ``pid(0)`` (module docstring).

    ``ws`` row (zeroed): histograms [4, 256], barrier counters [8]. ``cs`` row, per level l
    and program: its usable keys above tau's top 8l bits [4, G], then its level-l histogram
    cumulated from the top [4, G, 256] (keys of the 8l-bit prefix with byte l >= bin). From
    the level where the select stopped, the write phase derives every program's counts above
    and at tau without another barrier. ``SINGLE``: the span is one tile, loaded once for all
    phases."""
    row = tl.program_id(1).to(tl.int64)
    g = tl.program_id(0)
    s_ptr += row * s_row
    hist_ptr = ws_ptr + row * ws_row
    bar_ptr = hist_ptr + 1024
    above_ptr = cs_ptr + row * cs_row
    c_ptr = above_ptr + 4 * G
    lo = g * SPAN
    bins = tl.arange(0, 256)
    tau_u = g * 0  # a scalar tensor: the prefix of tau found so far (unsigned-order bits)
    need = KK + g * 0
    stop = g * 0 - 1  # the level where the select ended (-1: not yet)
    for lv in tl.static_range(min(P0, 4)):  # a phase launched alone: the levels before it
        tau_u, need, stop = _next_byte(hist_ptr, lv, tau_u, need, stop)
    if SINGLE:
        j1, ok1, u1 = _tile(s_ptr, lo, 0, C, BLOCK)
    for p in tl.static_range(P0, P1):
        if p < 4:
            if stop < 0:
                shift = 24 - 8 * p
                h = tl.zeros([256], tl.int32)
                above = g * 0
                for t0 in range(0, SPAN, BLOCK):
                    if SINGLE:
                        ok, u = ok1, u1
                    else:
                        _, ok, u = _tile(s_ptr, lo, t0, C, BLOCK)
                    m = ok
                    if p > 0:
                        hi = (u ^ -2147483648) >> (shift + 8)  # signed order of the prefix
                        hi_tau = (tau_u ^ -2147483648) >> (shift + 8)
                        m = ok & (hi == hi_tau)
                        above += tl.sum((ok & (hi > hi_tau)).to(tl.int32), 0)
                    h += tl.histogram(tl.where(m, (u >> shift) & 0xFF, 0), 256, mask=m)
                tl.atomic_add(hist_ptr + p * 256 + bins, h, mask=h > 0)
                tl.store(above_ptr + p * G + g, above)
                tl.store(c_ptr + (p * G + g) * 256 + bins, tl.cumsum(h, 0, reverse=True))
                if p + 1 < P1:
                    _grid_sync(bar_ptr + p, G)
                    tau_u, need, stop = _next_byte(hist_ptr, p, tau_u, need, stop)
        else:
            L = tl.where(stop < 0, 3, stop)  # keys compare on their top 8(L + 1) bits
            shift = 24 - 8 * L
            tau = (tau_u ^ -2147483648) >> shift
            bL = (tau_u >> shift) & 0xFF
            progs = tl.arange(0, GP2)
            pm = progs < G
            a = tl.load(above_ptr + L * G + progs, mask=pm, other=0, volatile=True)
            cl = c_ptr + (L * G + progs) * 256
            at_b = tl.load(cl + bL, mask=pm, other=0, volatile=True)
            above_b = tl.load(cl + bL + 1, mask=pm & (bL < 255), other=0, volatile=True)
            all_gt = a + above_b  # each program's keys above tau
            all_eq = at_b - above_b  # and equal to it
            gb = tl.sum(tl.where(progs < g, all_gt, 0), 0)  # picks above tau before the span
            eb = tl.sum(tl.where(progs < g, all_eq, 0), 0)  # ties before the span
            for t0 in range(0, SPAN, BLOCK):
                if SINGLE:
                    j, ok, u = j1, ok1, u1
                else:
                    j, ok, u = _tile(s_ptr, lo, t0, C, BLOCK)
                key = (u ^ -2147483648) >> shift
                gt = (ok & (key > tau)).to(tl.int32)
                eq = (ok & (key == tau)).to(tl.int32)
                c_eq = eb + tl.cumsum(eq, 0)  # ties up to and including j, in id order
                take = (gt > 0) | ((eq > 0) & (c_eq <= need))
                pos = gb + tl.cumsum(gt, 0) - gt + tl.minimum(c_eq - eq, need)
                tl.store(out_ptr + row * s_out + pos, j.to(tl.int64), mask=take)
                gb += tl.sum(gt, 0)
                eb += tl.sum(eq, 0)
            if g == G - 1:  # the slots past the last pick (fewer usable scores than KK): -1
                total = tl.sum(all_gt, 0) + tl.minimum(tl.sum(all_eq, 0), need)
                for i0 in range(0, KK, TAIL):
                    i = i0 + tl.arange(0, TAIL)
                    tl.store(out_ptr + row * s_out + i, tl.full([TAIL], -1, tl.int64),
                             mask=(i >= total) & (i < KK))  # fmt: skip


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def grid_programs(T: int, C: int, sms: int, block: int = _BLOCK) -> int:
    """Programs per row: one per ``block`` scores, at most ``sms // T`` (all resident)."""
    return max(1, min(triton.cdiv(C, block), sms // max(T, 1), _MAX_G))


def grid_topk_fits(T: int, sms: int) -> bool:
    """Whether a fused launch can hold every row's programs resident (one per SM at most)."""
    return 1 <= T <= sms


def grid_topk_plan(T: int, C: int, sms: int) -> tuple[int, int] | None:
    """(tile, warps) for the fused launch when every program's span is one tile (measured on
    the H200: with longer spans the coarse path is faster), else None."""
    for block, warps in ((2048, 8), (4096, 8)):
        if T * triton.cdiv(C, block) <= sms:
            return block, warps
    return None


def grid_topk(
    scores: torch.Tensor,
    kk: int,
    out: torch.Tensor,
    *,
    fused: bool | None = None,
    programs: int | None = None,
    block: int = _BLOCK,
    num_warps: int = 8,
    stop: int | None = None,
) -> torch.Tensor:
    """Ascending ids of each row's top-``kk`` scores into ``out`` [T, kk] int64 (-1 for picks
    scoring -inf). ``fused`` (default: on CUDA outside the interpreter): one launch with grid
    barriers, needs ``T <= SMs``; else five launches, one per phase, any T. ``programs`` per row
    defaults to :func:`grid_programs`."""
    T, C = scores.shape
    if fused is None:
        fused = scores.is_cuda and not _INTERPRET
    # the interpreter runs programs one by one: fused only with one program per row
    sms = _sm_count(scores.device) if scores.is_cuda else T
    if fused and not grid_topk_fits(T, sms):
        raise ValueError(f"a fused grid top-k holds at most {sms} rows resident, got {T}")
    G = programs or (grid_programs(T, C, sms, block) if fused else triton.cdiv(C, block))
    if G > _MAX_G or (fused and sms < G * T):
        raise ValueError(f"{G} programs x {T} rows cannot be resident on {sms} SMs")
    span = triton.cdiv(triton.cdiv(C, G), block) * block
    G = triton.cdiv(C, span)
    ws = torch.zeros((T, _HIST + _BARS), device=scores.device, dtype=torch.int32)
    cs = torch.empty((T, 4 * G * 257), device=scores.device, dtype=torch.int32)
    tail = min(1024, triton.next_power_of_2(max(kk, 16)))
    # stop: run phases [0, stop) only (benchmarks timing the phases; the output is garbage)
    phases = [(0, stop or _PHASES)] if fused else [(p, p + 1) for p in range(_PHASES)]
    for p0, p1 in phases:
        _grid_topk_kernel[(G, T)](
            scores, scores.stride(0), C, kk, ws, ws.stride(0), cs, cs.stride(0), out,
            out.stride(0), G, span, P0=p0, P1=p1, BLOCK=block,
            GP2=triton.next_power_of_2(G), SINGLE=span == block, TAIL=tail,
            num_warps=num_warps,
        )  # fmt: skip
    return out
