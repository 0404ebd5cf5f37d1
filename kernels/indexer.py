"""Lightning indexer scores: torch references and Triton kernels.

``score(t, c) = sum_h w[t, h] * relu(q[t, h] . k[c])`` over visible compressed entries
``c < visible[t]``; the entries kept are the top-k of each row (``kernels.topk``).

Triton design (``indexer_scores_triton``): grid (entry blocks, token programs). A program
keeps one key tile [Di, BLOCK_C] and loops over its token blocks; BLOCK_T tokens x Hi heads
form the M side of one ``tl.dot`` (64 rows), then ReLU, head weights, and a head sum give
[BLOCK_T, BLOCK_C] scores. Entry blocks that no token of the block can see are written as
-inf without a dot. The paged form reads every token's own sequence's keys in place from
the key pool through the block table; ``entry_rows`` maps selected entries to pool rows.
Its decode steps (one token per sequence) and the deterministic mode take the token kernel
instead (``kernels.indexer_token``: grid (token, key chunk), each chunk's keys streamed once
with the token's heads on the other side of the dot).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.dispatch import op, sm_count
from kernels.indexer_token import FIXED_LAUNCH, token_scores
from kernels.kv_quant import e2m1_to_f32
from kernels.topk import topk_triton

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
    launch: dict[str, int] | None = None,
) -> torch.Tensor:
    """Triton ``indexer_scores_ref``: ``q`` [T, H, D] and ``k`` [C, D] in one dtype (fp32, bf16,
    fp16), ``w`` [T, H], ``visible`` [T] int -> fp32 [T, C] (into ``out`` if given);
    ``launch`` (BLOCK_C, num_warps, num_stages) bypasses the autotuner."""
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

    kernel = _scores_kernel if launch is None else _scores_kernel.fn
    kernel[grid](
        q, k, w, visible.contiguous(), out, T, C, HI, DI, triton.next_power_of_2(T),
        triton.next_power_of_2(C),
        q.stride(0), q.stride(1), k.stride(0), w.stride(0), out.stride(0),
        HP=HP, DP=DP, BLOCK_T=bt, F32_DOT=q.dtype == torch.float32 or not q.is_cuda,
        **(launch or {}),
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
    launch: dict[str, int] | None = None,
    kernel: str = "auto",
    dequant: str | None = None,
) -> torch.Tensor:
    """Triton :func:`indexer_scores_paged_ref` (``seq_start`` [B]: first token of each
    sequence, for the token blocks). ``kernel``: "token" (``kernels.indexer_token``: one
    token a program row, key chunks over the grid), "blocks" (token blocks x entry tiles,
    keys read once per block), "auto": token when every sequence has one token (T == B: a
    decode step), else blocks. ``launch`` as in :func:`indexer_scores_triton` (the token
    kernel: also a split by the key count alone); ``dequant``: the token kernel's."""
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
    if kernel not in ("auto", "token", "blocks"):
        raise ValueError(f"kernel must be 'auto', 'token' or 'blocks', got {kernel!r}")
    if out is None:
        out = torch.empty((T, num_cols), device=q.device, dtype=torch.float32)
    elif out.shape != (T, num_cols) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be fp32 [T, C] with a contiguous last dim: {tuple(out.shape)}")
    if T == 0 or num_cols == 0:
        return out
    if kernel == "token" or (kernel == "auto" and seq_start.numel() == T):
        return token_scores(q, keys, key_scale, w, visible, token_seq, block_table, ratio,
                            block_size, out, launch=launch, dequant=dequant)  # fmt: skip
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

    kernel = _paged_scores_kernel if launch is None else _paged_scores_kernel.fn
    kernel[grid](
        q, keys, ks, w, visible.contiguous(), token_seq.contiguous(), tb, table, out, T,
        num_cols, HI, DI, triton.next_power_of_2(num_cols), q.stride(0), q.stride(1),
        keys.stride(0), ks.stride(0), w.stride(0), table.stride(0), out.stride(0),
        RATIO=ratio, P=block_size, HP=HP, DP=DP, BLOCK_T=bt, MXFP4=mx,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, **(launch or {}),
    )  # fmt: skip
    return out


def indexer_topk_triton(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor, topk: int
) -> torch.Tensor:
    """Scores then top-k: [T, min(topk, C)] ascending entry ids, -1 where not visible."""
    return topk_triton(indexer_scores_triton(q, k, w, visible), topk)


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


# The deterministic mode's one launch shape of the scores kernels (one of the autotuner's):
# the autotuner picks per key-count bucket, and the tile shapes the dot and the head sum
INVARIANT_LAUNCH = ({"BLOCK_C": 16, "num_warps": 4} if _INTERPRET
                    else {"BLOCK_C": 64, "num_warps": 4, "num_stages": 2})  # fmt: skip

indexer_scores = op(indexer_scores_ref, indexer_scores_triton,
                    invariant=functools.partial(indexer_scores_triton,
                                                launch=INVARIANT_LAUNCH))  # fmt: skip
entry_rows = op(entry_rows_ref, entry_rows_triton, when=_entry_rows_supported)
# The mode's paged scores: the token kernel at every step (decode and prefill alike, so a
# token's bits never depend on its step's other sequences), one tile, a split by key count
_paged_invariant = functools.partial(indexer_scores_paged_triton, kernel="token",
                                     launch=FIXED_LAUNCH)  # fmt: skip
indexer_scores_paged = op(
    indexer_scores_paged_ref, indexer_scores_paged_triton, invariant=_paged_invariant
)
