"""Lightning indexer scores and deterministic top-k: torch references and Triton kernels.

``score(t, c) = sum_h w[t, h] * relu(q[t, h] . k[c])`` over visible compressed entries
``c < visible[t]``; top-k picks the highest scores, ties broken by the lower index.

Triton designs:
- ``indexer_scores_triton``: grid (entry blocks, token programs). A program keeps one key tile
  [Di, BLOCK_C] and loops over its token blocks; BLOCK_T tokens x Hi heads form the M side of one
  ``tl.dot`` (64 rows), then ReLU, head weights, and a head sum give [BLOCK_T, BLOCK_C] scores.
  Entry blocks that no token of the block can see are written as -inf without a dot.
- ``topk_triton``, rows up to 16384: radix select in registers. A program maps scores to
  order-preserving int32 keys, finds the k-th key with four 8-bit histogram passes, keeps every
  key above it plus the lowest-index ties, and compacts them in index order (a cumsum).
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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.dispatch import op, sm_count
from kernels.kv_quant import e2m1_to_f32
from kernels.topk_grid import grid_topk, grid_topk_plan

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def indexer_scores_ref(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """``q`` [T, H, D], ``k`` [C, D], ``w`` [T, H], ``visible`` [T] -> fp32 [T, C] (-inf masked).

    (fp64 inputs give an fp64 result: the tests' reference.)"""
    s = torch.einsum("thd,cd->thc", _wide(q), _wide(k)).relu()
    s = (s * _wide(w).unsqueeze(-1)).sum(dim=1)
    cols = torch.arange(k.shape[0], device=k.device)
    return s.masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))


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


def _entry_rows(block_table: torch.Tensor, ratio: int, block_size: int, C: int) -> torch.Tensor:
    """[B, C] pool rows of entries 0..C-1 of each sequence (entry w: first position w*r)."""
    w = torch.arange(C, device=block_table.device)
    blk = block_table[:, torch.div(w * ratio, block_size, rounding_mode="floor")]
    off = torch.div(w * ratio % block_size, ratio, rounding_mode="floor")
    return blk * (block_size // ratio) + off


def _keys_float(keys: torch.Tensor, key_scale: torch.Tensor | None, rows: torch.Tensor):
    if key_scale is None:
        return _wide(keys[rows])
    from kernels.kv_quant import kv_unpack

    flat = rows.reshape(-1)
    out = kv_unpack(keys[flat], key_scale[flat], "mxfp4", torch.float32)
    return out.view(*rows.shape, -1)


def indexer_scores_paged_ref(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    w: torch.Tensor,
    visible: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    block_size: int,
    num_cols: int,
    *,
    seq_start: torch.Tensor | None = None,
    blocks: TokenBlocks | None = None,
) -> torch.Tensor:
    """Scores of every token against its own sequence's index keys, read in place from the
    paged key pool: ``q`` [T, H, D], ``keys`` [N, D] float (or mxfp4 bytes [N, D/2] with
    ``key_scale`` e8m0 [N, D/32]), ``w`` [T, H], ``visible`` [T], ``token_seq`` [T],
    ``block_table`` [B, NB] -> fp32 [T, num_cols] (-inf at columns >= visible).

    Entry w of a sequence lives at row ``table[w*r // P] * (P/r) + (w*r % P) // r``.
    (``seq_start``, the first token of each sequence, is what the Triton kernel's token
    blocks need, and ``blocks`` those blocks made once per step by :func:`scores_token_blocks`;
    the reference maps tokens through ``token_seq``.)"""
    rows = _entry_rows(block_table, ratio, block_size, num_cols)  # [B, C]
    k = _keys_float(keys, key_scale, rows)[token_seq]  # [T, C, D]
    qf = _wide(q).to(k.dtype)
    s = torch.einsum("thd,tcd->thc", qf, k).relu()
    s = (s * _wide(w).to(k.dtype).unsqueeze(-1)).sum(dim=1)
    cols = torch.arange(num_cols, device=q.device)
    return s.float().masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))


# ---- Triton: scores -------------------------------------------------------------------------


def _scores_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_C": 16}, num_warps=4)]
    return [
        triton.Config({"BLOCK_C": bc}, num_warps=w, num_stages=s)
        for bc, w, s in ((64, 4, 2), (128, 4, 2), (128, 8, 2), (256, 8, 1))
    ]


# Tuned per power-of-two bucket of C and T (both change every engine step).
@triton.autotune(configs=_scores_configs(), key=["C_BUCKET", "T_BUCKET", "HP", "DP"])
@triton.jit(do_not_specialize=["T", "T_BUCKET", "C", "C_BUCKET"])
def _scores_kernel(
    q_ptr, k_ptr, w_ptr, vis_ptr, out_ptr, T, C, HI, DI, T_BUCKET, C_BUCKET,
    s_qt, s_qh, s_k, s_wt, s_ot,
    HP: tl.constexpr, DP: tl.constexpr, BLOCK_T: tl.constexpr, F32_DOT: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    c0 = tl.program_id(0) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    dd = tl.arange(0, DP)
    dot_t: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if F32_DOT else "tf32"
    kmask = (c[None, :] < C) & (dd[:, None] < DI)
    kt = tl.load(k_ptr + c[None, :] * s_k + dd[:, None], mask=kmask, other=0.0).to(dot_t)
    # Rows r of the dot are (token t0 + r // HP, head r % HP): [2 tokens x 32 heads] -> 64 rows.
    r = tl.arange(0, BLOCK_T * HP)
    hr = r % HP
    tb = tl.arange(0, BLOCK_T)
    for t0 in range(tl.program_id(1) * BLOCK_T, T, tl.num_programs(1) * BLOCK_T):
        vis = tl.load(vis_ptr + t0 + tb, mask=t0 + tb < T, other=0)
        res = tl.full([BLOCK_T, BLOCK_C], float("-inf"), tl.float32)
        if c0 < tl.max(vis):
            tr = t0 + r // HP
            rmask = (tr < T) & (hr < HI)
            qp = q_ptr + tr[:, None] * s_qt + hr[:, None] * s_qh + dd[None, :]
            qt = tl.load(qp, mask=rmask[:, None] & (dd[None, :] < DI), other=0.0).to(dot_t)
            wr = tl.load(w_ptr + tr * s_wt + hr, mask=rmask, other=0.0).to(tl.float32)
            s = tl.maximum(tl.dot(qt, kt, input_precision=prec), 0.0) * wr[:, None]
            s = tl.sum(tl.reshape(s, (BLOCK_T, HP, BLOCK_C)), axis=1)
            res = tl.where(c[None, :] < vis[:, None], s, float("-inf"))
        optrs = out_ptr + (t0 + tb)[:, None] * s_ot + c[None, :]
        tl.store(optrs, res, mask=((t0 + tb)[:, None] < T) & (c[None, :] < C))


@triton.autotune(configs=_scores_configs(), key=["C_BUCKET", "HP", "DP", "MXFP4"])
@triton.jit(do_not_specialize=["T", "C", "C_BUCKET"])
def _paged_scores_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, vis_ptr, seq_ptr, tb_ptr, bt_ptr, out_ptr, T, C, HI, DI,
    C_BUCKET, s_qt, s_qh, s_k, s_ks, s_wt, s_bt, s_ot,
    RATIO: tl.constexpr, P: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    BLOCK_T: tl.constexpr, MXFP4: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """One program: entry columns [c0, c0 + BLOCK_C) x up to BLOCK_T tokens of one sequence
    (a token block starting at ``tb[pid1]``, -1 = padding). Keys are read through the block
    table; [BLOCK_T tokens x HP heads] form the M side of one dot."""
    c0 = tl.program_id(0) * BLOCK_C
    t0 = tl.load(tb_ptr + tl.program_id(1))
    if t0 >= 0:
        seq = tl.load(seq_ptr + t0)
        tb = t0 + tl.arange(0, BLOCK_T)
        tin = tb < T
        tmask = tin & (tl.load(seq_ptr + tb, mask=tin, other=-1) == seq)
        vis = tl.load(vis_ptr + tb, mask=tmask, other=0)
        c = c0 + tl.arange(0, BLOCK_C)
        res = tl.full([BLOCK_T, BLOCK_C], float("-inf"), tl.float32)
        if c0 < tl.max(vis):
            dot_t: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
            prec: tl.constexpr = "ieee" if F32_DOT else "tf32"
            cmask = c < C
            blk = tl.load(bt_ptr + seq * s_bt + (c * RATIO) // P, mask=cmask, other=0)
            rows = blk.to(tl.int64) * (P // RATIO) + ((c * RATIO) % P) // RATIO
            dd = tl.arange(0, DP)
            if MXFP4:
                jj = tl.arange(0, DP // 2)
                b = tl.load(k_ptr + rows[:, None] * s_k + jj[None, :],
                            mask=cmask[:, None] & (jj[None, :] < DI // 2), other=0)  # fmt: skip
                b = b.to(tl.int32)
                k = tl.reshape(tl.join(e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4)), (BLOCK_C, DP))
                g = tl.arange(0, DP // 32)
                sc = tl.load(ks_ptr + rows[:, None] * s_ks + g[None, :],
                             mask=cmask[:, None] & (g[None, :] < DI // 32), other=127)  # fmt: skip
                sc = tl.exp2(sc.to(tl.float32) - 127.0)
                k = tl.reshape(tl.reshape(k, (BLOCK_C, DP // 32, 32)) * sc[:, :, None],
                               (BLOCK_C, DP))  # fmt: skip
                kt = tl.trans(k).to(dot_t)
            else:
                kmask = cmask[None, :] & (dd[:, None] < DI)
                kt = tl.load(k_ptr + rows[None, :] * s_k + dd[:, None], mask=kmask, other=0.0)
                kt = kt.to(dot_t)
            r = tl.arange(0, BLOCK_T * HP)
            hr = r % HP
            tr = t0 + r // HP
            rmask = (hr < HI) & (tr < T)
            qp = q_ptr + tr[:, None] * s_qt + hr[:, None] * s_qh + dd[None, :]
            qt = tl.load(qp, mask=rmask[:, None] & (dd[None, :] < DI), other=0.0).to(dot_t)
            wr = tl.load(w_ptr + tr * s_wt + hr, mask=rmask, other=0.0).to(tl.float32)
            sc2 = tl.maximum(tl.dot(qt, kt, input_precision=prec), 0.0) * wr[:, None]
            sc2 = tl.sum(tl.reshape(sc2, (BLOCK_T, HP, BLOCK_C)), axis=1)
            res = tl.where(c[None, :] < vis[:, None], sc2, float("-inf"))
        optrs = out_ptr + tb[:, None].to(tl.int64) * s_ot + c[None, :]
        tl.store(optrs, res, mask=tmask[:, None] & (c[None, :] < C))




def indexer_scores_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    visible: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``indexer_scores_ref``: ``q`` [T, H, D] and ``k`` [C, D] in one dtype (fp32, bf16,
    fp16), ``w`` [T, H], ``visible`` [T] int -> fp32 [T, C] (into ``out`` if given)."""
    T, HI, DI = q.shape
    C = k.shape[0]
    if k.dim() != 2 or k.shape[1] != DI or w.shape != (T, HI) or visible.shape != (T,):
        raise ValueError(f"bad shapes q{tuple(q.shape)} k{tuple(k.shape)} w{tuple(w.shape)}")
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"q and k need one float dtype, got {q.dtype}, {k.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("q, k and w need a contiguous last dim")
    if DI < 16 and q.is_cuda:
        raise ValueError(f"index head dim {DI} < 16")
    if out is None:
        out = torch.empty((T, C), device=q.device, dtype=torch.float32)
    elif out.shape != (T, C) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [T, C] with a contiguous last dim: {tuple(out.shape)}")
    if T == 0 or C == 0:
        return out
    HP, DP = triton.next_power_of_2(HI), max(16, triton.next_power_of_2(DI))
    bt = max(1, 64 // HP)
    t_blocks = triton.cdiv(T, bt)
    sms = sm_count(q.device) if q.is_cuda else 1

    def grid(meta):
        c_blocks = triton.cdiv(C, meta["BLOCK_C"])
        return (c_blocks, min(t_blocks, max(1, triton.cdiv(4 * sms, c_blocks))))

    _scores_kernel[grid](
        q, k, w, visible.contiguous(), out, T, C, HI, DI, triton.next_power_of_2(T),
        triton.next_power_of_2(C),
        q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(0),
        HP=HP, DP=DP, BLOCK_T=bt, F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
    )  # fmt: skip
    return out


def token_blocks(token_seq: torch.Tensor, seq_start: torch.Tensor, block_t: int) -> torch.Tensor:
    """First token of every block of ``block_t`` consecutive tokens of one sequence, padded
    with -1 to the fixed count ``min(T, T // block_t + B)`` (a cumsum compaction, no sync).
    Example: sequences of 3 and 1 tokens, block 2 -> [0, 2, 3] (+ padding)."""
    T, B = token_seq.numel(), seq_start.numel()
    n = min(T, T // block_t + B)
    t = torch.arange(T, device=token_seq.device)
    first = (t - seq_start[token_seq]) % block_t == 0
    at = torch.where(first, torch.cumsum(first, 0) - 1, n)
    out = torch.full((n + 1,), -1, dtype=torch.int64, device=token_seq.device)
    return out.scatter_(0, at, t)[:n]


def _scores_block_t(n_heads: int) -> int:
    """Tokens per program of :func:`indexer_scores_paged_triton` (``BLOCK_T``) for ``n_heads``
    index heads."""
    return max(1, 64 // max(16, triton.next_power_of_2(n_heads)))


class TokenBlocks(NamedTuple):
    """Token blocks of ``block_t`` tokens (:func:`token_blocks`) made for the scores kernel."""

    block_t: int
    first: torch.Tensor


def scores_token_blocks(token_seq: torch.Tensor, seq_start: torch.Tensor,
                        n_heads: int) -> TokenBlocks:  # fmt: skip
    """The token blocks :func:`indexer_scores_paged_triton` takes for queries of ``n_heads``
    heads (:func:`token_blocks`): the same for every index layer of a step, so a step makes
    them once and passes them as ``blocks`` (ten small launches a layer fewer)."""
    bt = _scores_block_t(n_heads)
    return TokenBlocks(bt, token_blocks(token_seq, seq_start, bt))


def indexer_scores_paged_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    w: torch.Tensor,
    visible: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    block_size: int,
    num_cols: int,
    *,
    seq_start: torch.Tensor,
    blocks: TokenBlocks | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`indexer_scores_paged_ref` (``seq_start`` [B]: first token of each
    sequence, for the token blocks)."""
    T, HI, DI = q.shape
    mx = key_scale is not None
    if w.shape != (T, HI) or visible.shape != (T,) or token_seq.shape != (T,):
        raise ValueError(f"bad shapes q{tuple(q.shape)} w{tuple(w.shape)}")
    if mx and (keys.dtype != torch.uint8 or keys.shape[1] * 2 != DI or DI % 32):
        raise ValueError("mxfp4 keys must be uint8 [N, D/2] with D a multiple of 32")
    if not mx and (keys.dim() != 2 or keys.shape[1] != DI or keys.dtype != q.dtype):
        raise ValueError(f"keys must be [N, {DI}] in q's dtype, got {keys.dtype}")
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("q, keys and w need a contiguous last dim")
    if out is None:
        out = torch.empty((T, num_cols), device=q.device, dtype=torch.float32)
    if T == 0 or num_cols == 0:
        return out
    HP, DP = max(16, triton.next_power_of_2(HI)), max(32, triton.next_power_of_2(DI))
    bt = _scores_block_t(HI)
    if blocks is None:
        tb = token_blocks(token_seq, seq_start, bt)
    elif blocks.block_t != bt:
        raise ValueError(f"token blocks of {blocks.block_t} tokens, the kernel takes {bt} for "
                         f"{HI} heads (scores_token_blocks)")  # fmt: skip
    else:
        tb = blocks.first
    table = block_table.contiguous()
    ks = key_scale if mx else keys

    def grid(meta):
        return (triton.cdiv(num_cols, meta["BLOCK_C"]), tb.numel())

    _paged_scores_kernel[grid](
        q, keys, ks, w, visible.contiguous(), token_seq.contiguous(), tb, table, out, T,
        num_cols, HI, DI, triton.next_power_of_2(num_cols), q.stride(0), q.stride(1),
        keys.stride(0), ks.stride(0), w.stride(0), table.stride(0), out.stride(0),
        RATIO=ratio, P=block_size, HP=HP, DP=DP, BLOCK_T=bt, MXFP4=mx,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
    )  # fmt: skip
    return out


# ---- Triton: top-k --------------------------------------------------------------------------

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


def indexer_topk_triton(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """Scores then top-k: [T, min(topk, C)] ascending entry ids, -1 where not visible."""
    return topk_triton(indexer_scores_triton(q, k, w, visible), topk)


def _topk_supported(scores: torch.Tensor, k: int, **_: object) -> bool:
    """Triton top-k: fp32 rows; beyond one program's 16384 candidates, k up to 4096."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        return False
    kk = min(k, scores.shape[-1])
    return scores.shape[-1] <= _ONE_CHUNK or 4 * triton.next_power_of_2(kk) <= _ONE_CHUNK


# ---- pool rows of selected entries ---------------------------------------------------------


def entry_rows_ref(entries: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                   ratio: int, block_size: int) -> torch.Tensor:  # fmt: skip
    """Pool rows [T, k] of compressed entry ids ``entries`` [T, k] (-1 stays -1) of the
    sequences ``seq`` [T]: entry w of sequence s lives in block ``block_table[s, w*r // P]``
    (a column past the table: its last block) at row ``(w*r % P) // r`` of its P / r."""
    P = block_size
    w = entries.clamp_min(0)
    col = torch.div(w * ratio, P, rounding_mode="floor")
    col = col.clamp_max(block_table.shape[1] - 1)
    blk = block_table[seq.unsqueeze(1).expand_as(col), col]
    rows = blk * (P // ratio) + torch.div(w * ratio % P, ratio, rounding_mode="floor")
    return torch.where(entries >= 0, rows, -1)


@triton.jit
def _pool_rows(table_ptr, s_table, seq, w, NB, mask, RATIO: tl.constexpr, P: tl.constexpr):
    """Pool rows of entries ``w`` (int64; -1 where w < 0) of sequences ``seq`` through the
    block table (:func:`entry_rows_ref`'s arithmetic, for the Triton kernels)."""
    wc = tl.maximum(w, 0)
    col = tl.minimum((wc * RATIO) // P, NB - 1)
    blk = tl.load(table_ptr + seq * s_table + col, mask=mask, other=0).to(tl.int64)
    return tl.where(w >= 0, blk * (P // RATIO) + ((wc * RATIO) % P) // RATIO, -1)


@triton.jit
def _entry_rows_kernel(e_ptr, seq_ptr, bt_ptr, out_ptr, K, NB, s_e, s_bt, s_o,
                       RATIO: tl.constexpr, P: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BK + tl.arange(0, BK)
    m = j < K
    e = tl.load(e_ptr + t * s_e + j, mask=m, other=-1).to(tl.int64)
    s = tl.load(seq_ptr + t).to(tl.int64)
    tl.store(out_ptr + t * s_o + j, _pool_rows(bt_ptr, s_bt, s, e, NB, m, RATIO, P), mask=m)


def entry_rows_triton(entries: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                      ratio: int, block_size: int) -> torch.Tensor:  # fmt: skip
    """Triton :func:`entry_rows_ref` in one launch (the reference's ten small ones) for int64
    block tables."""
    T, K = entries.shape
    out = torch.empty((T, K), dtype=torch.int64, device=entries.device)
    if T == 0 or K == 0:
        return out
    e = entries if entries.stride(-1) == 1 else entries.contiguous()
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    bk = min(1024, triton.next_power_of_2(K))
    _entry_rows_kernel[(T, triton.cdiv(K, bk))](
        e, seq.contiguous(), table, out, K, table.shape[1], e.stride(0), table.stride(0),
        out.stride(0), RATIO=ratio, P=block_size, BK=bk,
    )  # fmt: skip
    return out


def _entry_rows_supported(entries: torch.Tensor, seq: torch.Tensor, block_table: torch.Tensor,
                          *_: object) -> bool:  # fmt: skip
    return (entries.dim() == 2 and block_table.dtype == torch.int64 and seq.dim() == 1
            and block_table.shape[1] > 0 and not entries.is_floating_point())  # fmt: skip


indexer_scores = op(indexer_scores_ref, indexer_scores_triton)
entry_rows = op(entry_rows_ref, entry_rows_triton, when=_entry_rows_supported)
indexer_scores_paged = op(indexer_scores_paged_ref, indexer_scores_paged_triton)
topk = op(topk_ref, topk_triton, when=_topk_supported)
