"""Deterministic top-k over score rows (the index layers' selection of compressed entries):
the torch reference and the Triton kernels, behind one op (``topk``).

Top-k picks the highest scores, ties broken by the lower index; picks scoring -inf are -1.
Triton paths, by row width (:func:`topk_triton`):
- rows up to 16384: radix select in registers. A program maps scores to order-preserving
  int32 keys, finds the k-th key with four 8-bit histogram passes, keeps every key above it
  plus the lowest-index ties, and compacts them in index order (a cumsum).
- Longer rows (256K candidates at 1M context) when rows x tiles of 2048-4096 scores fit one
  program per SM: ``kernels.topk_grid``, an exact radix select in one launch (programs meet
  at grid barriers between its phases; real-valued rows end after two levels, at a bucket
  holding every key of the k-th's 16-bit prefix).
- Otherwise, and under the interpreter: (1) every 2048-chunk adds a 256-bin histogram
  of its keys' top byte to the row's (integer atomics), then (2) of the second byte of the keys
  in the top-byte bin holding the k-th largest; (3) each chunk appends its scores whose 16-bit
  prefix is >= the prefix holding the k-th largest to the row's list (k + that prefix's ties);
  (4) list entries are ranked in parallel by a unique 64-bit key (score, then lower id:
  deterministic ties), the k best land in rank order, and (5) are sorted by id. A list longer
  than its capacity (massive ties) sends the row to the chunked radix path: chunks keep their
  own top-k (a superset of the row's), survivors are selected again until one chunk remains.
  (256-bin histograms: ``tl.histogram``'s cost grows with bins per lane; 2048 bins made the
  one-level histogram the slowest launch.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op, sm_count
from kernels.topk_grid import grid_topk, grid_topk_plan

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def topk_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, min(k, C)] of the top scores, ascending; picks scoring -inf become -1.

    Ties go to the lower index (stable descending sort). Example: scores [[1, 3, 3, -inf]],
    k=3 -> [[0, 1, 2]]; k=4 -> [[0, 1, 2, -1]] (the -inf slot is invalid).
    """
    kk = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
    picked = scores.gather(-1, order)
    order = torch.where(picked > float("-inf"), order, torch.full_like(order, scores.shape[-1]))
    order = order.sort(dim=-1).values
    return torch.where(order == scores.shape[-1], torch.full_like(order, -1), order)


_ONE_CHUNK = 16384  # largest row one program selects from (registers: 16K keys + ids)
_CHUNK = 8192  # chunk of a longer row (>= 4 * k rounded up, so each pass shrinks the row)


@triton.jit
def _order_key(v):
    """Order-preserving int32 key of fp32 scores (-0 -> +0; negatives' 31 low bits flipped)."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _select_kernel(
    val_ptr, id_ptr, out_val_ptr, out_id_ptr, L, KK, s_v, s_i, s_ov, s_oi, cnt_ptr, cap,
    CHUNK: tl.constexpr, KK_P2: tl.constexpr, HAS_ID: tl.constexpr, FINAL: tl.constexpr,
    ONLY_OVERFLOW: tl.constexpr,
):  # fmt: skip
    """Top-KK of row ``pid(1)``'s chunk ``pid(0)`` (elements ``[pid(0)*CHUNK, +CHUNK)`` of L).

    Intermediate: writes KK (score, id) survivors per chunk in index order (id -1 = padding).
    FINAL: writes the ascending ids, -1 for picks that are padding or score -inf.
    ONLY_OVERFLOW: rows whose coarse candidate list fit (``cnt[row] <= cap``) are skipped.
    """
    row = tl.program_id(1).to(tl.int64)
    if ONLY_OVERFLOW:  # noqa: SIM102 (a constexpr branch: no load when False)
        if tl.load(cnt_ptr + row) <= cap:
            return
    j = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    inb = j < L
    v = tl.load(val_ptr + row * s_v + j, mask=inb, other=float("-inf"))
    ids = tl.load(id_ptr + row * s_i + j, mask=inb, other=-1) if HAS_ID else tl.where(inb, j, -1)
    key = tl.where(ids >= 0, _order_key(v), -2147483648)  # padding sorts below every score

    # Radix select the KK-th largest key tau, 8 bits per pass (top pass: sign bit flipped so
    # that digits order like the keys). need = how many keys equal to tau still to take.
    bins = tl.arange(0, 256)
    need = KK
    tau = 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if p == 0:
            digit = ((key >> 24) & 0xFF) ^ 0x80
            hist = tl.histogram(digit, 256)
        else:
            digit = (key >> shift) & 0xFF
            hist = tl.histogram(digit, 256, mask=((key ^ tau) >> (shift + 8)) == 0)
        at_least = tl.cumsum(hist, 0, reverse=True)  # keys (in prefix) with digit >= bin
        b = tl.max(tl.where(at_least >= need, bins, 0))
        need -= tl.sum(tl.where(bins > b, hist, 0))
        tau = ((b ^ 0x80) << 24) if p == 0 else (tau | (b << shift))
    eq = key == tau
    take = (key > tau) | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= need))
    if FINAL:
        take = take & (ids >= 0) & (v > float("-inf"))
        pos = tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_id_ptr + row * s_oi + pos, ids.to(tl.int64), mask=take)
        n = tl.sum(take.to(tl.int32), 0)
        tail = tl.arange(0, KK_P2)
        tl.store(out_id_ptr + row * s_oi + tail, tl.full([KK_P2], -1, tl.int64),
                 mask=(tail >= n) & (tail < KK))  # fmt: skip
    else:
        pos = tl.program_id(0) * KK + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_val_ptr + row * s_ov + pos, v, mask=take)
        tl.store(out_id_ptr + row * s_oi + pos, ids.to(tl.int32), mask=take)


@triton.jit
def _key16(v):
    """Top 16 bits of the order key as an unsigned digit pair (sign flipped: orders like keys)."""
    return ((_order_key(v) >> 16) & 0xFFFF) ^ 0x8000


@triton.jit
def _bin_of_kth(hist_ptr, need):
    """In a 256-bin histogram: the bin b holding the need-th largest entry, and how many of
    b's entries are still needed (need minus the entries in bins above b). With fewer than
    ``need`` entries in all: bin 0 (everything qualifies)."""
    bins = tl.arange(0, 256)
    hist = tl.load(hist_ptr + bins)
    at_least = tl.cumsum(hist, 0, reverse=True)
    b = tl.max(tl.where(at_least >= need, bins, 0))
    return b, need - tl.sum(tl.where(bins > b, hist, 0))


@triton.jit
def _prefix_hist_kernel(s_ptr, s_row, C, hist_ptr, KK, LEVEL: tl.constexpr,
                        CHUNK: tl.constexpr):  # fmt: skip
    """Row ``pid(1)``, chunk ``pid(0)``: add a 256-bin histogram of one byte of the keys to
    ``hist`` [T, 2, 256] (integer atomics: deterministic). LEVEL 0: the top byte of every
    finite-or-+inf score (-inf is never picked); LEVEL 1: the second byte of the scores whose
    top byte is the level-0 bin that holds the KK-th largest."""
    row = tl.program_id(1).to(tl.int64)
    j = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(s_ptr + row * s_row + j, mask=j < C, other=float("-inf"))
    ok = v > float("-inf")
    k16 = _key16(v)
    if LEVEL == 0:
        dig = k16 >> 8
    else:
        b0, _ = _bin_of_kth(hist_ptr + row * 512, KK)
        ok = ok & ((k16 >> 8) == b0)
        dig = k16 & 0xFF
    h = tl.histogram(tl.where(ok, dig, 0), 256, mask=ok)
    tl.atomic_add(hist_ptr + row * 512 + LEVEL * 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _prefix_gather_kernel(
    s_ptr, s_row, C, hist_ptr, KK, cnt_ptr, lv_ptr, li_ptr, CAP, CHUNK: tl.constexpr,
):  # fmt: skip
    """The 16-bit key prefix p* holding the KK-th largest score (from both histogram levels);
    append every score with prefix >= p* (a superset of the top-KK: KK + the ties of p*'s
    bin) to the row's list [CAP] with its id. ``cnt`` gets the full count, also past CAP
    (then the exact fallback takes the row)."""
    row = tl.program_id(1).to(tl.int64)
    b0, need = _bin_of_kth(hist_ptr + row * 512, KK)
    b1, _ = _bin_of_kth(hist_ptr + row * 512 + 256, need)
    j = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(s_ptr + row * s_row + j, mask=j < C, other=float("-inf"))
    sel = (v > float("-inf")) & (_key16(v) >= ((b0 << 8) | b1))
    base = tl.atomic_add(cnt_ptr + row, tl.sum(sel.to(tl.int32), 0))
    pos = base + tl.cumsum(sel.to(tl.int32), 0) - 1
    keep = sel & (pos < CAP)
    tl.store(lv_ptr + row * CAP + pos, v, mask=keep)
    tl.store(li_ptr + row * CAP + pos, j, mask=keep)


@triton.jit
def _list_key(lv_ptr, li_ptr, e, m):
    """Unique uint64 order key of list entries ``e`` (score key, then the lower id); 0 = none."""
    v = tl.load(lv_ptr + e, mask=m, other=0.0)
    ids = tl.load(li_ptr + e, mask=m, other=0)
    hi = (_order_key(v).to(tl.int64) + 2147483648).to(tl.uint64)
    lo = (4294967295 - ids.to(tl.int64)).to(tl.uint64)
    return tl.where(m, (hi << 32) | lo, 0), ids


@triton.jit
def _list_rank_kernel(
    lv_ptr, li_ptr, cnt_ptr, slot_ptr, KK,
    CAP: tl.constexpr, KK_P2: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr,
):  # fmt: skip
    """Entries ``[pid(0)*BI, +BI)`` of row ``pid(1)``'s list: rank = how many list keys are
    larger (keys are unique, so the ranks are a permutation); the entries ranked < KK write
    their id to ``slot[row, rank]``. Rows whose list overflowed are left to the fallback."""
    row = tl.program_id(1).to(tl.int64)
    n = tl.load(cnt_ptr + row)
    i0 = tl.program_id(0) * BI
    if (n > CAP) | (i0 >= n):
        return
    i = i0 + tl.arange(0, BI)
    key_i, id_i = _list_key(lv_ptr + row * CAP, li_ptr + row * CAP, i, i < n)
    rank = tl.zeros([BI], tl.int32)
    for j0 in range(0, n, BJ):
        j = j0 + tl.arange(0, BJ)
        key_j, _ = _list_key(lv_ptr + row * CAP, li_ptr + row * CAP, j, j < n)
        rank += tl.sum((key_j[None, :] > key_i[:, None]).to(tl.int32), axis=1)
    tl.store(slot_ptr + row * KK_P2 + rank, id_i, mask=(i < n) & (rank < KK))


@triton.jit
def _slot_sort_kernel(slot_ptr, cnt_ptr, out_ptr, s_out, KK, CAP: tl.constexpr,
                      KK_P2: tl.constexpr):  # fmt: skip
    """Row ``pid(0)``: its min(n, KK) picked ids sorted ascending into ``out``, -1 after them."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(cnt_ptr + row)
    if n > CAP:
        return
    taken = tl.minimum(n, KK)
    slot = tl.arange(0, KK_P2)
    big: tl.constexpr = 2147483647
    ids = tl.sort(tl.load(slot_ptr + row * KK_P2 + slot, mask=slot < taken, other=big))
    tl.store(out_ptr + row * s_out + slot, tl.where(slot < taken, ids, -1).to(tl.int64),
             mask=slot < KK)  # fmt: skip


_PREFIX_CHUNK = 2048  # scores per program of the histogram / gather launches
_RANK_BI, _RANK_BJ = 128, 32


def _topk_coarse(scores: torch.Tensor, kk: int, out: torch.Tensor) -> torch.Tensor:
    """Long rows: two 256-bin prefix histograms -> candidate list -> parallel exact ranks ->
    sorted ids (5 launches + a memset, no host sync). Rows whose list exceeds its capacity
    (massive ties) take the chunked radix path, launched for all rows, skipped by the others."""
    T, C = scores.shape
    kk_p2 = triton.next_power_of_2(kk)
    cap = max(4096, 2 * kk_p2)
    dev = scores.device
    buf = torch.zeros(T * (2 * 256 + 1), device=dev, dtype=torch.int32)  # one memset
    hist, cnt = buf[: T * 512], buf[T * 512 :]
    lv = torch.empty((T, cap), device=dev, dtype=torch.float32)
    li = torch.empty((T, cap), device=dev, dtype=torch.int32)
    slots = torch.empty((T, kk_p2), device=dev, dtype=torch.int32)
    n = triton.cdiv(C, _PREFIX_CHUNK)
    for level in (0, 1):
        _prefix_hist_kernel[(n, T)](scores, scores.stride(0), C, hist, kk, LEVEL=level,
                                    CHUNK=_PREFIX_CHUNK, num_warps=4)  # fmt: skip
    _prefix_gather_kernel[(n, T)](scores, scores.stride(0), C, hist, kk, cnt, lv, li, cap,
                                  CHUNK=_PREFIX_CHUNK, num_warps=4)  # fmt: skip
    _list_rank_kernel[(cap // _RANK_BI, T)](lv, li, cnt, slots, kk, CAP=cap, KK_P2=kk_p2,
                                            BI=_RANK_BI, BJ=_RANK_BJ, num_warps=4)  # fmt: skip
    _slot_sort_kernel[(T,)](slots, cnt, out, out.stride(0), kk, CAP=cap, KK_P2=kk_p2,
                            num_warps=4)  # fmt: skip
    return _topk_chunked(scores, kk, out, overflow=(cnt, cap))


def topk_triton(scores: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``topk_ref``: ``scores`` [T, C] fp32 (+inf counts as a valid score) ->
    int64 [T, min(k, C)] ascending ids, -1 for picks scoring -inf (into ``out`` if given).
    Rows up to 16384 wide: one program each; longer rows: one grid-synchronized launch
    (kernels.topk_grid) when one program per SM covers them, else the coarse-histogram path.
    Needs min(k, C) <= 4096 when C > 16384."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be fp32 [T, C] with a contiguous last dim: {scores.shape}")
    T, C = scores.shape
    kk = min(k, C)
    if out is None:
        out = torch.empty((T, kk), device=scores.device, dtype=torch.int64)
    elif out.shape != (T, kk) or out.dtype != torch.int64 or out.stride(-1) != 1:
        raise ValueError(f"out must be int64 [T, min(k, C)]: {tuple(out.shape)}")
    if T == 0 or kk == 0:
        return out
    if C > _ONE_CHUNK and 4 * triton.next_power_of_2(kk) > _ONE_CHUNK:
        raise ValueError(f"top-{kk} of {C} candidates is beyond the chunked select")
    if C > _ONE_CHUNK:
        plan = None if _INTERPRET else grid_topk_plan(T, C, sm_count(scores.device))
        if plan is not None:  # one launch (kernels.topk_grid)
            return grid_topk(scores, kk, out, block=plan[0], num_warps=plan[1])
        if not _INTERPRET and kk >= 2048 and T <= 8 and C < 1 << 21:  # the grid phases
            # as launches (H200, 256K candidates, k 2048: 78.8 vs 117.7 µs at 8 rows; at 32
            # rows the coarse path is ahead, 241.3 vs 255.6; rows of 2^21+: coarse)
            return grid_topk(scores, kk, out, fused=False)
        return _topk_coarse(scores, kk, out)
    return _topk_chunked(scores, kk, out)


def _topk_chunked(
    scores: torch.Tensor,
    kk: int,
    out: torch.Tensor,
    overflow: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Chunked radix select: each chunk keeps its own top-kk until one program's worth is
    left. With ``overflow`` = (list counts, capacity) only rows whose count exceeds it run."""
    T, C = scores.shape
    kk_p2 = triton.next_power_of_2(kk)
    cnt, cap = overflow if overflow is not None else (scores, 0)
    pred = dict(ONLY_OVERFLOW=overflow is not None)
    vals, ids, L = scores, scores, C
    while L > _ONE_CHUNK:  # shrink: every chunk keeps its own top-kk
        chunk = max(_CHUNK, 4 * kk_p2)
        n = triton.cdiv(L, chunk)
        nv = torch.empty((T, n * kk), device=scores.device, dtype=torch.float32)
        ni = torch.empty((T, n * kk), device=scores.device, dtype=torch.int32)
        _select_kernel[(n, T)](
            vals, ids, nv, ni, L, kk, vals.stride(0), ids.stride(0), nv.stride(0), ni.stride(0),
            cnt, cap, CHUNK=chunk, KK_P2=kk_p2, HAS_ID=ids is not scores, FINAL=False,
            num_warps=16, **pred,
        )  # fmt: skip
        vals, ids, L = nv, ni, n * kk
    chunk = max(16, triton.next_power_of_2(L))
    _select_kernel[(1, T)](
        vals, ids, out, out, L, kk, vals.stride(0), ids.stride(0), 0, out.stride(0), cnt, cap,
        CHUNK=chunk, KK_P2=kk_p2, HAS_ID=ids is not scores, FINAL=True,
        num_warps=16 if chunk >= 8192 else 8 if chunk >= 2048 else 4, **pred,
    )  # fmt: skip
    return out


def _topk_supported(scores: torch.Tensor, k: int, **_: object) -> bool:
    """Triton top-k: fp32 rows; beyond one program's 16384 candidates, k up to 4096."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        return False
    kk = min(k, scores.shape[-1])
    return scores.shape[-1] <= _ONE_CHUNK or 4 * triton.next_power_of_2(kk) <= _ONE_CHUNK


topk = op(topk_ref, topk_triton, when=_topk_supported)
