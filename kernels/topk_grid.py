"""Exact top-k of long rows in one launch: a radix select whose programs meet at grid barriers,
ended early at a bucket of candidates.

Row ``r`` of ``scores`` [T, C] is split into ``G`` contiguous spans, one program each. The
programs run up to five phases, with a grid barrier (an integer counter, atomics at GPU
scope) between two phases, so the whole select is one launch (its workspace stays zero-ready
between launches: no memset):

- phases 0-3: a 256-bin histogram of one byte of the order keys (most significant first) of
  the span's finite-or-+inf scores whose higher bytes equal the prefix found so far, added to
  the row's histogram of that level (integer atomics). After the barrier every program reads
  the level's histogram and derives the same next byte of ``tau``, the k-th largest key, and
  ``need``, how many keys equal to ``tau`` belong to the top-k. Each level also stores, per
  program, its keys above the prefix and its own histogram cumulated from the top: with the
  level's byte known, any program reads off every program's count above tau and at tau (two
  loads each), so no counting phase and barrier are needed. When the bin found (from level 1
  on) holds exactly the keys still needed, every key of it is a pick and the later levels
  are skipped;
- buckets (levels 1 and 2): when tau's bin of the level before holds at most ``CAP`` (8192)
  keys, which every program reads off the row histogram, the level also appends each of
  those keys, as one int64 (key, 2^31 - 1 - id), to the bucket of its byte: a slot from a
  per-element atomic on the byte's counter, which is the level's row histogram itself
  (``SUB`` slots a bucket, about C / 256 up to 256; the counter keeps counting past them).
  After the barrier, when tau's bin of this level holds at most ``SUB`` keys, its bucket
  holds every one of them and the select ends there: the write phase ranks the bucket's
  entries (all pairs) and reads off the full key of tau and which ties are picks. Else the
  bucket is ignored and the next level runs as a radix level (falling back is decided from
  the exact counts, so a bucket never ends the select incomplete). For real-valued scores
  this ends the select after level 1 (256K randn, k = 512: ~6000 keys in tau's level-0 bin,
  a few dozen in its 16-bit bin), one barrier and one histogram pass fewer than the radix
  levels alone (those ended at level 2: a 24-bit prefix rarely holds two scores);
- phase 4: each program sums the counts of the programs before it and writes its picks' ids at
  their final positions: ascending ids, because spans are in id order and a cumsum orders the
  picks within one. Ties at ``tau`` go to the lower ids (the first ``need`` in id order).
  When a span is one tile, the program loads its scores once for all phases.

Exact for any ties (a full bucket falls back to the next level; the radix levels need no
capacity), -inf never picked (its slots are -1). The bucket's atomics are bounded by CAP a
row; massive ties at tau put them all on one counter (serialized at the L2: slower, still
exact). The barrier needs every program of the grid resident at once: ``grid_topk`` sizes the
grid to at most one program per SM. Under the interpreter (programs run one after another)
the phases are launched one by one instead (``fused=False``), the same code without the
barriers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import sm_count

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LEVELS = 4  # bytes of a 32-bit key
_HIST = _LEVELS * 256
_BARS = 8  # int64: one arrival counter per barrier (4), the epoch, 3 unused
_PHASES = 5  # four histogram levels, then the write
_BLOCK = 2048  # scores per tile (a span is a whole number of tiles)
_MAX_G = 1024  # programs per row (the count arrays' block)
_CAP = 8192  # a level buckets tau's bin only when it holds at most this many keys (its atomics)
_SUB = 256  # slots per bucket: the most keys a bucket can end the select with
_BJ = 32  # bucket entries compared per step of the rank


@triton.jit
def _order_key(v):
    """Order-preserving int32 key of fp32 scores (-0 -> +0; negatives' 31 low bits flipped)."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _grid_sync(bar_ptr, n):
    """Wait until this barrier's counter reaches ``n`` (every program of the launch has
    arrived); -> whether this program arrived last (it does not wait: the others had)."""
    tl.debug_barrier()  # the program's earlier atomics and stores are issued
    # acq_rel: the last to arrive skips the polls, so its arrival is its acquire too
    old = tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu")
    if old < n - 1:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < n:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    return old == n - 1


@triton.jit
def _next_byte(hist_ptr, level, tau_u, need, stop, short, own, bucketed, CAP, SUB):
    """Level ``level``'s byte of tau (the bin holding the need-th largest key of the prefix;
    bin 0 when the prefix holds fewer keys than needed) and the keys of that bin still
    needed; also how many of this program's keys ``own`` [256] (its level histogram) lie in
    bins above tau's byte. From level 1 on, ``stop`` becomes ``level`` when that bin holds
    exactly the keys still needed (all of them are picks: the select ends here), or when
    the prefix holds fewer keys than needed (every usable key is a pick; ``short`` is set:
    the output has a -1 tail). Level 0 never stops (its per-program counts are not stored);
    when it is short, level 1 is too. A select already stopped is returned unchanged.
    When this level ``bucketed`` the keys of the prefix by their byte and tau's bin holds at
    most ``SUB`` keys, the select ends here too, at the bucket (``pick``: the write phase
    ranks it). ``small``: the select goes on and tau's bin holds at most ``CAP`` keys, so
    the next level may bucket them.

    One int64 sum carries seven counts, so the level costs one scan and one reduction:
    bins up to tau's byte (= byte + 1), bins with exactly need at or above them (> 0: the
    bin is exact), keys above the byte's bin (all programs; this program), whether the
    prefix is short, and whether tau's bin holds at most CAP / SUB keys."""
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + level * 256 + bins, volatile=True)
    at_least = tl.cumsum(hist, 0, reverse=True)  # keys in the prefix with digit >= bin
    ge = (at_least >= need) | (bins == 0)  # true for the bins up to tau's
    at_tau = ge & ((bins == 255) | (at_least - hist < need))  # the last of them
    packed = (
        ge.to(tl.int64)
        | ((at_least == need).to(tl.int64) << 9)
        | (tl.where(ge, 0, hist).to(tl.int64) << 18)
        | (tl.where(ge, 0, own).to(tl.int64) << 39)
        | (((bins == 0) & (at_least < need)).to(tl.int64) << 60)
        | ((at_tau & (hist <= CAP)).to(tl.int64) << 61)
        | ((at_tau & (hist <= SUB)).to(tl.int64) << 62)
    )
    tot = tl.sum(packed, 0)
    b = (tot & 0x1FF).to(tl.int32) - 1
    exact = ((tot >> 9) & 0x1FF) > 0
    above = ((tot >> 18) & 0x1FFFFF).to(tl.int32)
    own_above = ((tot >> 39) & 0x1FFFFF).to(tl.int32)
    few = ((tot >> 60) & 1) > 0
    live = stop < 0
    ends = live & (exact | few) & (level > 0)
    pick = live & bucketed & (((tot >> 62) & 1) > 0) & ~(exact | few)
    return (
        tl.where(live, tau_u | (b << (24 - 8 * level)), tau_u),
        tl.where(live, need - above, need),
        tl.where(ends | pick, level, stop),
        short | (ends & few),
        own_above,
        live & ~(ends | pick) & (((tot >> 61) & 1) > 0),
        pick,
    )


@triton.jit
def _level_tile(cnt_ptr, bk_ptr, j, ok, u, shift, tau_u, bkt, PREFIX: tl.constexpr,
                BUCKETS: tl.constexpr, SUB: tl.constexpr, EARLY: tl.constexpr):  # fmt: skip
    """The tile's histogram of the byte at ``shift`` over its usable keys (``PREFIX``: those
    whose higher bytes equal tau's so far). ``BUCKETS`` (levels 1 and 2): when ``bkt``, also
    append those keys to the buckets of their byte, counted at ``cnt_ptr`` (the level's row
    histogram). ``EARLY`` (at most 8 keys a thread): the atomics are predicated, not branched
    around, and issued first, so the histogram runs while their slots come back; with more
    keys a thread, the slots held across the histogram would spill (b4096 w8: 32 bytes), so
    the atomics come after it, in a branch."""
    d = (u >> shift) & 0xFF
    m = ok
    if PREFIX:
        m = ok & ((u ^ -2147483648) >> (shift + 8) == (tau_u ^ -2147483648) >> (shift + 8))
    if BUCKETS and EARLY:
        slot = _bucket_slots(cnt_ptr, d, m & bkt)
    h = tl.histogram(tl.where(m, d, 0), 256, mask=m)
    if BUCKETS:
        if EARLY:
            _bucket_store(bk_ptr, j, u, d, m & bkt, slot, SUB)
        elif bkt:
            _bucket_store(bk_ptr, j, u, d, m, _bucket_slots(cnt_ptr, d, m), SUB)
    return h


@triton.jit
def _bucket_slots(cnt_ptr, d, m):
    """A slot for each of the tile's keys ``m`` in the bucket of its byte ``d``, from the
    byte's counter (the level's row histogram: the counts are the level's histogram too)."""
    return tl.atomic_add(cnt_ptr + d, 1, mask=m, sem="relaxed", scope="gpu")


@triton.jit
def _bucket_store(bk_ptr, j, u, d, m, slot, SUB: tl.constexpr):
    """Store the keys ``m`` at their slots of the bucket of their byte ``d`` while it has room
    (a fuller bucket cannot end the select: nobody reads it). An entry is (key,
    2^31 - 1 - id) in one int64, so entries compare as picks rank: larger key first, then
    lower id."""
    e = ((u ^ -2147483648).to(tl.int64) << 32) | (2147483647 - j).to(tl.int64)
    tl.store(bk_ptr + d * SUB + slot, e, mask=m & (slot < SUB))


@triton.jit
def _bucket_pick(bk_ptr, n, need, lo, SUB: tl.constexpr, BJ: tl.constexpr):
    """The select's end from a bucket of ``n`` <= SUB entries, every key of tau's prefix:
    -> (tau, the full key of the need-th entry in rank order; the bucket's keys above tau
    with ids below ``lo``; its ties at tau below ``lo``; the ties at tau that are picks).
    The rank of an entry is how many entries compare above it: all pairs, BJ entries a step
    and only the steps up to ``n`` (a thread holds one entry and compares it with the step's
    BJ). Plain loads: the barrier before this phase is an acquire, which invalidates the SM's
    L1 (CCTL.IVALL), and a phase launched alone starts after the phase that wrote the
    bucket; the steps then read the bucket from L1, where the first load put it."""
    i = tl.arange(0, SUB)
    ok = i < n
    # all SUB slots, unmasked (past n they are stale): the load need not wait for n's
    e = tl.where(ok, tl.load(bk_ptr + i), -9223372036854775808)
    rank = tl.zeros([SUB], tl.int32)
    for j0 in range(0, n, BJ):
        jj = j0 + tl.arange(0, BJ)
        f = tl.load(bk_ptr + jj, mask=jj < n, other=-9223372036854775808)
        rank += tl.sum((f[:, None] > e[None, :]).to(tl.int32), 0)
    picked = ok & (rank < need)
    last = tl.min(tl.where(picked, e, 9223372036854775807), 0)  # the need-th entry
    tau = (last >> 32).to(tl.int32)
    key = (e >> 32).to(tl.int32)
    first = (2147483647 - (e & 0xFFFFFFFF)).to(tl.int32) < lo  # ids before this span
    gt = ok & (key > tau)
    eq = ok & (key == tau)
    # three counts <= SUB <= 256 in one int32 sum
    cnt = tl.sum((gt & first).to(tl.int32) | ((eq & first).to(tl.int32) << 10)
                 | ((eq & picked).to(tl.int32) << 20), 0)  # fmt: skip
    return tau, cnt & 0x3FF, (cnt >> 10) & 0x3FF, cnt >> 20


@triton.jit
def _tile(s_ptr, lo, t0, C, BLOCK: tl.constexpr):
    """Tile ``[lo + t0, +BLOCK)`` -> (ids, usable: finite or +inf and in the row, keys as
    int32 bits that order like uint32)."""
    j = lo + t0 + tl.arange(0, BLOCK)
    v = tl.load(s_ptr + j, mask=j < C, other=float("-inf"))
    return j, v > float("-inf"), _order_key(v) ^ -2147483648


@triton.jit
def _grid_topk_kernel(
    s_ptr, s_row, C, KK, ws_ptr, ws_row, bars_ptr, bars_row, cs_ptr, cs_row, bk_ptr, bk_row,
    out_ptr, s_out, ends_ptr, G, SPAN, P0: tl.constexpr, P1: tl.constexpr, BLOCK: tl.constexpr,
    GP2: tl.constexpr, SINGLE: tl.constexpr, TAIL: tl.constexpr, ZB: tl.constexpr,
    CAP: tl.constexpr, SUB: tl.constexpr, BJ: tl.constexpr, TRACE: tl.constexpr,
    EARLY: tl.constexpr,
):  # fmt: skip
    """Phases [P0, P1) of row ``pid(1)``'s select, span ``pid(0)`` (module docstring).

    ``ws`` row: two halves of histograms [4, 256]; ``bars`` row (int64): barrier counters
    [4], then the epoch e. A launch uses half e % 2 (zero at its start) and zeroes the other
    half for the next launch; barrier i waits for its counter to reach (e + 1) * G (a
    skipped barrier is arrived at anyway, at the end), and the last program at barrier 0
    stores e + 1. So a workspace zeroed once serves any number of fused launches of the
    same rows and G, with no memset in between. ``cs`` row, per level l
    and program: its usable keys above tau's top 8l bits [4, G], then its level-l histogram
    cumulated from the top [4, G, 256] (keys of the 8l-bit prefix with byte l >= bin). From
    the level where the select stopped, the write phase derives every program's counts above
    and at tau without another barrier. ``bk`` row: the buckets [256, SUB] of a level that
    buckets (1 or 2: its histogram row counts their entries, so only the counts need to be
    zero; the entries are never cleared). ``SINGLE``: the span is one tile, loaded once for
    all phases. ``TRACE``: program 0 stores where the select ended at ``ends[row]``."""
    row = tl.program_id(1).to(tl.int64)
    g = tl.program_id(0)
    s_ptr += row * s_row
    bk_ptr += row * bk_row
    bar_ptr = bars_ptr + row * bars_row
    epoch = tl.load(bar_ptr + 4, volatile=True)
    half = (epoch & 1).to(tl.int32)
    hist_ptr = ws_ptr + row * ws_row + half * 1024
    z = g * ZB + tl.arange(0, ZB)  # this program's share of the other half
    tl.store(ws_ptr + row * ws_row + (1 - half) * 1024 + z, tl.zeros([ZB], tl.int32),
             mask=z < 1024)  # fmt: skip
    arrived = (epoch + 1) * G  # every barrier counter's value once all have arrived
    above_ptr = cs_ptr + row * cs_row
    c_ptr = above_ptr + 4 * G
    lo = g * SPAN
    bins = tl.arange(0, 256)
    tau_u = g * 0  # a scalar tensor: the prefix of tau found so far (unsigned-order bits)
    need = KK + g * 0
    stop = g * 0 - 1  # the level where the select ended (-1: not yet; never 0)
    short = g < 0  # fewer usable keys than KK (every one is a pick)
    above = g * 0  # this program's usable keys above tau's prefix so far
    bkt = g < 0  # this level buckets the keys of tau's prefix (the same in every program)
    pick = g < 0  # the select ended at a bucket
    for lv in tl.static_range(min(P0, 4)):  # a phase launched alone: the levels before it
        own = tl.load(c_ptr + (lv * G + g) * 256 + bins)  # cumulated: own keys >= bin
        own = own - tl.load(c_ptr + (lv * G + g) * 256 + bins + 1, mask=bins < 255, other=0)
        tau_u, need, stop, short, own_above, small, pk = _next_byte(
            hist_ptr, lv, tau_u, need, stop, short, own, bkt, CAP, SUB)  # fmt: skip
        above += own_above
        pick |= pk
        bkt = small & (lv < 2)  # levels 1 and 2 may bucket
    if SINGLE:
        j1, ok1, u1 = _tile(s_ptr, lo, 0, C, BLOCK)
    for p in tl.static_range(P0, P1):
        if p < 4:
            if stop < 0:
                shift = 24 - 8 * p
                if SINGLE:  # no loop: a loop would get the histogram hoisted above the atomics
                    h = _level_tile(hist_ptr + p * 256, bk_ptr, j1, ok1, u1, shift, tau_u, bkt,
                                    p > 0, (p > 0) and (p < 3), SUB, EARLY)  # fmt: skip
                else:
                    h = tl.zeros([256], tl.int32)
                    for t0 in range(0, SPAN, BLOCK):
                        j, ok, u = _tile(s_ptr, lo, t0, C, BLOCK)
                        h += _level_tile(hist_ptr + p * 256, bk_ptr, j, ok, u, shift, tau_u, bkt,
                                         p > 0, (p > 0) and (p < 3), SUB, EARLY)  # fmt: skip
                hv = tl.where(bkt, 0, h)  # a bucketing level counted its keys one by one
                # relaxed: the barrier orders them (bar.sync, then one release), as it does
                # the plain stores below; acq_rel cost each thread a fence and a round trip
                tl.atomic_add(hist_ptr + p * 256 + bins, hv, mask=hv > 0, sem="relaxed",
                              scope="gpu")  # fmt: skip
                if (p > 0) or (P1 == P0 + 1):  # level 0 of a fused launch never ends it
                    tl.store(above_ptr + p * G + g, above)
                    tl.store(c_ptr + (p * G + g) * 256 + bins, tl.cumsum(h, 0, reverse=True))
                if p + 1 < P1:
                    last = _grid_sync(bar_ptr + p, arrived)
                    if p == 0:  # noqa: SIM102 (p is static, last is not)
                        if last:  # every program has read the epoch: the next launch's
                            tl.store(bar_ptr + 4, epoch + 1)
                    tau_u, need, stop, short, own_above, small, pk = _next_byte(
                        hist_ptr, p, tau_u, need, stop, short, h, bkt, CAP, SUB)  # fmt: skip
                    above += own_above
                    pick |= pk
                    bkt = small & (p < 2)
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
            bk_gt = g * 0  # ended at a bucket: its keys above tau before the span
            bk_eq = g * 0  # and its ties at tau there
            if pick:  # keys compare in full; the bucket holds every key of tau's prefix
                n_bk = tl.load(hist_ptr + L * 256 + bL, volatile=True)
                tau, bk_gt, bk_eq, need = _bucket_pick(bk_ptr + bL * SUB, n_bk, need, lo, SUB,
                                                       BJ)  # fmt: skip
            shift = tl.where(pick, 0, shift)
            all_gt = a + above_b  # each program's keys above tau('s prefix)
            all_eq = at_b - above_b  # and in tau's prefix
            # picks above tau('s prefix) and ties before the span, in one int64 sum
            before = tl.sum(tl.where(progs < g, all_gt.to(tl.int64) | (all_eq.to(tl.int64) << 32),
                                     0), 0)  # fmt: skip
            gb = (before & 0xFFFFFFFF).to(tl.int32) + bk_gt
            eb = tl.where(pick, bk_eq, (before >> 32).to(tl.int32))
            if TRACE:  # noqa: SIM102 (TRACE is static, g is not)
                if g == 0:
                    tl.store(ends_ptr + row, L + 4 * pick.to(tl.int32))
            if SINGLE:
                _write_tile(out_ptr + row * s_out, j1, ok1, u1, shift, tau, gb, eb, need)
            else:
                for t0 in range(0, SPAN, BLOCK):
                    j, ok, u = _tile(s_ptr, lo, t0, C, BLOCK)
                    gb, eb = _write_tile(out_ptr + row * s_out, j, ok, u, shift, tau, gb, eb,
                                         need)  # fmt: skip
            if (g == G - 1) & short:  # fewer usable scores than KK: -1 past the last pick
                both = tl.sum(tl.where(pm, all_gt.to(tl.int64) | (all_eq.to(tl.int64) << 32),
                                       0), 0)  # fmt: skip
                total = (both & 0xFFFFFFFF).to(tl.int32) + tl.minimum((both >> 32).to(tl.int32),
                                                                       need)  # fmt: skip
                for i0 in range(0, KK, TAIL):
                    i = i0 + tl.arange(0, TAIL)
                    tl.store(out_ptr + row * s_out + i, tl.full([TAIL], -1, tl.int64),
                             mask=(i >= total) & (i < KK))  # fmt: skip
    for p in tl.static_range(P0, min(P1 - 1, 4)):  # barriers an early stop skipped
        if (stop >= 0) & (p > stop):
            tl.atomic_add(bar_ptr + p, 1, sem="relaxed", scope="gpu")


@triton.jit
def _write_tile(out_row, j, ok, u, shift, tau, gb, eb, need):
    """Store the tile's picks (keys above ``tau``, and ties while fewer than ``need`` came
    before) at their ascending-id positions; -> (gb, eb) counted on past the tile. One scan:
    the tile's counts above and at tau (each <= the tile) share an int32."""
    key = (u ^ -2147483648) >> shift
    gt = (ok & (key > tau)).to(tl.int32)
    eq = (ok & (key == tau)).to(tl.int32)
    both = tl.cumsum(gt | (eq << 16), 0)  # inclusive
    c_gt = both & 0xFFFF
    c_eq = eb + (both >> 16)  # ties up to and including j, in id order
    take = (gt > 0) | ((eq > 0) & (c_eq <= need))
    pos = gb + c_gt - gt + tl.minimum(c_eq - eq, need)
    tl.store(out_row + pos, j.to(tl.int64), mask=take)
    n = tl.sum(gt | (eq << 16), 0)
    return gb + (n & 0xFFFF), eb + (n >> 16)


_PERSISTENT: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(
    device: torch.device, T: int, G: int, persist: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(histogram halves [T, 2 * 1024] int32, barriers + epoch [T, 8] int64). ``persist``:
    rows of the one workspace of (device, G), zeroed once and kept zero-ready by the fused
    launches themselves (no memset per call; see the kernel). It has a row for the most
    rows a fused launch of G programs can hold (one program per SM) and a launch of T rows
    uses the first T; a row's counters advance by G per launch that uses it, whatever T.
    So a device holds one small workspace per G (at most SMs of them, about 6 MB in all on
    an H200), never freed: a captured CUDA graph keeps its pointers. Else (the
    phase-by-phase launches, partial runs, a first call inside a CUDA-graph capture) a
    zeroed one per call. The fused launches of one workspace must run in stream order (the
    engine's one stream)."""
    if persist:
        key = (device, G)
        if key not in _PERSISTENT:
            rows = max(T, sm_count(device) // G if device.type == "cuda" else T)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return _fresh(device, T)
            _PERSISTENT[key] = _fresh(device, rows)
        ws, bars = _PERSISTENT[key]
        if ws.shape[0] >= T:
            return ws[:T], bars[:T]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return _fresh(device, T)
        _PERSISTENT[key] = _fresh(device, T)  # the interpreter: rows grow as launches ask
        return _PERSISTENT[key]
    return _fresh(device, T)


def _fresh(device: torch.device, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros((T, 2 * _HIST), device=device, dtype=torch.int32),
        torch.zeros((T, _BARS), device=device, dtype=torch.int64),
    )




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


def bucket_slots(C: int) -> int:
    """Slots per bucket for rows of ``C`` scores: about C / 256, 16 to 256 (tau's bucket
    rarely holds more than a few dozen keys; a fuller one falls back to the next level). The
    buckets take 256 * slots int64 a row: 8 bytes a score, at most 512 KB a row, so about
    2 MB for a fused launch of 2048-score tiles on 132 SMs, however its rows split them."""
    return max(16, min(_SUB, triton.next_power_of_2(triton.cdiv(C, 256))))


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
    cap: int = _CAP,
    sub: int | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ascending ids of each row's top-``kk`` scores into ``out`` [T, kk] int64 (-1 for picks
    scoring -inf). ``fused`` (default: on CUDA outside the interpreter): one launch with grid
    barriers, needs ``T <= SMs``; else five launches, one per phase, any T. ``programs`` per row
    defaults to :func:`grid_programs`. ``cap`` / ``sub`` (default :func:`bucket_slots`): the
    most keys of tau's bin a level buckets / a bucket ends the select with (any values are
    exact; they only move where the select ends). ``ends`` [T] int32, if given, receives
    where each row's select ended: its last level (1-3), plus 4 when it ended at a bucket."""
    T, C = scores.shape
    if C >= 1 << 21:  # the packed counts of _next_byte hold 21 bits
        raise ValueError(f"rows of at most {(1 << 21) - 1} scores, got {C}")
    sub = sub or bucket_slots(C)
    if not (16 <= sub <= _SUB and sub & (sub - 1) == 0):  # 10-bit counts in _bucket_pick
        raise ValueError(f"bucket slots: a power of two in [16, {_SUB}], got {sub}")
    if fused is None:
        fused = scores.is_cuda and not _INTERPRET
    # the interpreter runs programs one by one: fused only with one program per row
    sms = sm_count(scores.device) if scores.is_cuda else T
    if fused and not grid_topk_fits(T, sms):
        raise ValueError(f"a fused grid top-k holds at most {sms} rows resident, got {T}")
    G = programs or (grid_programs(T, C, sms, block) if fused else triton.cdiv(C, block))
    if G > _MAX_G or (fused and sms < G * T):
        raise ValueError(f"{G} programs x {T} rows cannot be resident on {sms} SMs")
    span = triton.cdiv(triton.cdiv(C, G), block) * block
    G = triton.cdiv(C, span)
    ws, bars = _workspace(scores.device, T, G, persist=fused and stop is None)
    cs = torch.empty((T, 4 * G * 257), device=scores.device, dtype=torch.int32)
    bk = torch.empty((T, 256 * sub), device=scores.device, dtype=torch.int64)
    tail = min(1024, triton.next_power_of_2(max(kk, 16)))
    # stop: run phases [0, stop) only (benchmarks timing the phases; the output is garbage)
    phases = [(0, stop or _PHASES)] if fused else [(p, p + 1) for p in range(_PHASES)]
    for p0, p1 in phases:
        _grid_topk_kernel[(G, T)](
            scores, scores.stride(0), C, kk, ws, ws.stride(0), bars, bars.stride(0), cs,
            cs.stride(0), bk, bk.stride(0), out, out.stride(0), ws if ends is None else ends,
            G, span, P0=p0, P1=p1, BLOCK=block, GP2=triton.next_power_of_2(G),
            SINGLE=span == block, TAIL=tail, ZB=triton.next_power_of_2(triton.cdiv(_HIST, G)),
            CAP=cap, SUB=sub, BJ=min(_BJ, sub), TRACE=ends is not None,
            EARLY=block <= 256 * num_warps, num_warps=num_warps,
        )  # fmt: skip
    return out
