"""Compressor pooling: gated softmax pool over a group's tokens, RMSNorm, optional RoPE.

``kv``/``gate`` [E, span, width] hold the projections of the ``span`` tokens entry e needs
(see ``app.model.compressor``). Per channel, entry e is ``sum_s softmax_s(gate) * kv``:

- V4.1 ratio 1 (span 1): no gate, the projection itself; ratio 2: softmax over the pair.
- V4 HCA (span = ratio): softmax over the window's tokens.
- V4 CSA (``overlap``, span = 2*ratio, width = 2*dim): slots ``[0, ratio)`` take channels
  ``[:dim]`` (window w-1's Ca half), slots ``[ratio, 2*ratio)`` channels ``[dim:]`` (window
  w's Cb half); ``first[e]`` (w = 0) masks the missing window with gate -inf.

Then ``RMSNorm(norm_w)``; with ``angles`` [E, R/2] RoPE on the last R channels (the model
rotates at ``w*ratio``); with ``out``/``out_rows`` the rows are written into a (paged) pool.

Triton (``compress_pool_triton``): grid cdiv(E, BLOCK_E); a program streams the span slots of
BLOCK_E entries as [BLOCK_E, dim] tiles (contiguous channel rows) with an online softmax per
channel, then normalizes, rotates, casts and scatters: one pass over kv/gate, one write.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op
from kernels.indexer import _pool_rows, entry_rows_ref
from kernels.rope import rope_pairs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _check(kv, gate, first, norm_w, *, overlap, ratio, dim) -> None:
    E, span, width = kv.shape
    want = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
    if (span, width) != want or norm_w.shape != (dim,):
        raise ValueError(f"kv [E, span, width] {tuple(kv.shape)} != [E, {want[0]}, {want[1]}]")
    if gate is None and span != 1:
        raise ValueError("gate may be omitted only for span 1 (V4.1 ratio 1)")
    if gate is not None and gate.shape != kv.shape:
        raise ValueError(f"gate {tuple(gate.shape)} != kv {tuple(kv.shape)}")
    if overlap and (first is None or first.shape != (E,)):
        raise ValueError("overlapping windows need first [E]")


def compress_pool_ref(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    first: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    *,
    overlap: bool,
    ratio: int,
    dim: int,
    angles: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pooled, normalized (and rotated) entries [E, dim] in fp32 (fp64 for fp64 inputs); with
    ``out`` [rows, dim], writes ``out[out_rows]`` (rows < 0 skipped) and returns ``out``."""
    _check(kv, gate, first, norm_w, overlap=overlap, ratio=ratio, dim=dim)
    v = _wide(kv)
    if gate is None or v.shape[1] == 1:
        pooled = v[:, 0]
    else:
        g = _wide(gate).to(v.dtype)
        if overlap:
            m, d = ratio, dim
            v = torch.cat((v[:, :m, :d], v[:, m:, d:]), dim=1)
            g = torch.cat((g[:, :m, :d], g[:, m:, d:]), dim=1)
            dead = torch.zeros_like(g, dtype=torch.bool)
            dead[:, :m] = first.view(-1, 1, 1)
            g = g.masked_fill(dead, float("-inf"))
            v = v.masked_fill(dead, 0.0)
        pooled = (v * g.softmax(dim=1)).sum(dim=1)
    y = _wide(norm_w).to(v.dtype) * pooled * torch.rsqrt(pooled.square().mean(-1, True) + eps)
    if angles is not None:
        from kernels.rope import apply_rope_ref

        y = apply_rope_ref(y, angles.to(y.dtype))
    if out is None:
        return y
    rows = torch.arange(y.shape[0], device=y.device) if out_rows is None else out_rows
    keep = rows >= 0
    out[rows[keep]] = y[keep].to(out.dtype)
    return out


def _pool_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_E": 2}, num_warps=4)]
    return [
        triton.Config({"BLOCK_E": be}, num_warps=w)
        for be, w in ((1, 4), (2, 4), (4, 4), (8, 8), (2, 8), (4, 8), (16, 8))
    ]


# Tuned per power-of-two bucket of E (E changes every engine step; exact E would re-tune).
@triton.autotune(configs=_pool_configs(), key=["E_BUCKET", "SPAN", "DIM", "ROPE", "HAS_ROWS"])
@triton.jit(do_not_specialize=["E", "E_BUCKET"])
def _pool_kernel(
    kv_ptr, g_ptr, first_ptr, w_ptr, ang_ptr, out_ptr, rows_ptr, E, E_BUCKET, eps,
    s_ke, s_ks, s_ge, s_gs, s_at, s_o,
    SPAN: tl.constexpr, RATIO: tl.constexpr, DIM: tl.constexpr, R: tl.constexpr,
    OVERLAP: tl.constexpr, HAS_GATE: tl.constexpr, ROPE: tl.constexpr, HAS_ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    e64 = e.to(tl.int64)
    d = tl.arange(0, DIM)
    if OVERLAP:
        first = tl.load(first_ptr + e, mask=emask, other=0) != 0
    m = tl.full([BLOCK_E, DIM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_E, DIM], tl.float32)
    acc = tl.zeros([BLOCK_E, DIM], tl.float32)
    # unrolled for short spans (V4.1 ratio 2, V4 CSA): every slot's loads in flight together
    for s in tl.range(0, SPAN, loop_unroll_factor=SPAN if SPAN <= 8 else 1):
        col = d
        if OVERLAP:
            col = d + tl.where(s >= RATIO, DIM, 0)  # Cb half for this window's slots
        v = tl.load(kv_ptr + e64[:, None] * s_ke + s * s_ks + col[None, :],
                    mask=emask[:, None], other=0.0).to(tl.float32)  # fmt: skip
        if HAS_GATE:
            g = tl.load(g_ptr + e64[:, None] * s_ge + s * s_gs + col[None, :],
                        mask=emask[:, None], other=0.0).to(tl.float32)  # fmt: skip
        else:
            g = tl.zeros([BLOCK_E, DIM], tl.float32)
        if OVERLAP:
            dead = first[:, None] & (s < RATIO)
            g = tl.where(dead, float("-inf"), g)
            v = tl.where(dead, 0.0, v)
        m_new = tl.maximum(m, g)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(g - m_safe)
        l_sum = l_sum * alpha + p
        acc = acc * alpha + p * v
        m = m_new
    x = acc / l_sum
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)
    y = tl.load(w_ptr + d).to(tl.float32)[None, :] * x * inv[:, None]
    if ROPE:
        j = tl.arange(0, DIM // 2) - (DIM // 2 - R // 2)
        ang = tl.load(ang_ptr + e64[:, None] * s_at + j[None, :],
                      mask=emask[:, None] & (j[None, :] >= 0), other=0.0)  # fmt: skip
        y = rope_pairs(y, ang, INVERSE=False)
    if HAS_ROWS:
        row = tl.load(rows_ptr + e, mask=emask, other=-1).to(tl.int64)
    else:
        row = tl.where(emask, e64, -1)
    optrs = out_ptr + row[:, None] * s_o + d[None, :]
    tl.store(optrs, y.to(out_ptr.dtype.element_ty), mask=(row >= 0)[:, None])


def compress_pool_triton(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    first: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    *,
    overlap: bool,
    ratio: int,
    dim: int,
    angles: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    launch: dict[str, int] | None = None,
) -> torch.Tensor:
    """Triton ``compress_pool_ref`` (same arguments): fused pool + RMSNorm + RoPE + scatter.
    ``kv``/``gate`` fp32/bf16 with contiguous channels; ``dim`` a power of two;
    ``out`` [rows, dim] (e.g. a paged pool flattened to rows) in any float dtype;
    ``launch`` (BLOCK_E, num_warps) bypasses the autotuner."""
    _check(kv, gate, first, norm_w, overlap=overlap, ratio=ratio, dim=dim)
    E, span, _ = kv.shape
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"dim {dim} must be a power of two >= 16")
    if kv.stride(-1) != 1 or (gate is not None and gate.stride(-1) != 1):
        raise ValueError("kv and gate need contiguous channels")
    R = 0
    if angles is not None:
        R = 2 * angles.shape[-1]
        if angles.shape != (E, R // 2) or dim < R or angles.stride(-1) != 1:
            raise ValueError(f"angles must be [E, <=dim/2], got {tuple(angles.shape)}")
        angles = angles.float()
    if out is None:
        if out_rows is not None:
            raise ValueError("out_rows needs out")
        out = torch.empty((E, dim), device=kv.device, dtype=torch.float32)
    elif out.dim() != 2 or out.shape[1] != dim or out.stride(-1) != 1:
        raise ValueError(f"out must be [rows, {dim}] with contiguous rows, got {tuple(out.shape)}")
    if out_rows is not None and (out_rows.shape != (E,) or out_rows.dtype != torch.int64):
        raise ValueError("out_rows must be int64 [E]")
    if E == 0:
        return out
    g = kv if gate is None else gate
    norm_w = norm_w.float().contiguous()
    first_t = first.contiguous() if overlap else norm_w  # bool loads as int1: no cast launch
    ang = angles if R else norm_w
    rows = out_rows.contiguous() if out_rows is not None else norm_w

    def grid(meta):
        return (triton.cdiv(E, meta["BLOCK_E"]),)

    kernel = _pool_kernel if launch is None else _pool_kernel.fn
    kernel[grid](
        kv, g, first_t, norm_w, ang, out, rows, E, triton.next_power_of_2(E), eps,
        kv.stride(0), kv.stride(1), g.stride(0), g.stride(1), ang.stride(0), out.stride(0),
        SPAN=span, RATIO=ratio, DIM=dim, R=R, OVERLAP=overlap, HAS_GATE=gate is not None,
        ROPE=R > 0, HAS_ROWS=out_rows is not None, **(launch or {}),
    )  # fmt: skip
    return out


# The deterministic mode's one launch shape (the autotuner picks per entry-count bucket, and
# the tile's shape lays out the RMSNorm's sum over the channels)
INVARIANT_LAUNCH = {"BLOCK_E": 2, "num_warps": 4}

compress_pool = op(compress_pool_ref, compress_pool_triton,
                   invariant=functools.partial(compress_pool_triton,
                                               launch=INVARIANT_LAUNCH))  # fmt: skip


# ---- the step's compressor groups -----------------------------------------------------------


def compressor_groups_ref(pos: torch.Tensor, seq: torch.Tensor, a: torch.Tensor, n: torch.Tensor,
                          slot: torch.Tensor, cached_lens: torch.Tensor,
                          block_table: torch.Tensor, ratio: int, span: int, rows: int,
                          block_size: int, trash_block: int, trash_slot: int
                          ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The compressor groups that may complete in one step (``app.model.attn_meta``: one
    ``(ratio, span, tail rows)`` kind). Per token t: ``pos`` position, ``seq`` sequence, ``a``
    / ``n`` / ``slot`` its sequence's chunk start, chunk length and cache slot; per sequence
    ``cached_lens`` and the ``block_table`` [B, NB]. The token ending a group (``(p+1) % r ==
    0``, not cached yet) is its candidate: one per token for r = 1, else ``G = min(T, T//r +
    B)`` candidates compacted in token order (padding: token T, invalid).

    -> (token [G], valid [G], entry [G], dest [G] pool row (the trash block's when invalid),
    first [G] (entry 0), from_new [G, span], new_idx [G, span], tail_idx [G, span], tail_write
    [T]): slot j of a group is position ``p - span + 1 + j``, this step's projection of token
    ``new_idx`` where ``from_new``, else tail-ring row ``tail_idx``; ``tail_write`` is the
    tail-ring row each token's projection goes to (the trash slot's unless it is among its
    chunk's last ``rows``)."""
    dev, T, B, r, P = pos.device, pos.numel(), block_table.shape[0], ratio, block_size
    w_tok = torch.div(pos + 1, r, rounding_mode="floor") - 1
    cached = torch.div(cached_lens[seq], r, rounding_mode="floor")
    ends = ((pos + 1) % r == 0) & (w_tok >= cached)
    if r == 1:
        token = torch.arange(T, device=dev)
        valid = ends
    else:
        G = min(T, T // r + B)
        at = torch.where(ends, torch.cumsum(ends, 0) - 1, G)
        buf = torch.full((G + 1,), T, dtype=torch.int64, device=dev)
        buf.scatter_(0, at, torch.arange(T, device=dev))
        token = buf[:G]
        valid = token < T
        token = token.clamp_max(max(T - 1, 0))
    p = pos[token]
    w = torch.div(p + 1, r, rounding_mode="floor") - 1
    dest = entry_rows_ref(w.unsqueeze(1), seq[token], block_table, r, P).squeeze(1)
    dest = torch.where(valid, dest, trash_block * (P // r))
    q = p.unsqueeze(1) - span + 1 + torch.arange(span, device=dev)  # [G, span] positions
    from_new = q >= a[token].unsqueeze(1)
    new_idx = (token.unsqueeze(1) - (p.unsqueeze(1) - q)).clamp(0, max(T - 1, 0))
    tail_idx = slot[token].unsqueeze(1) * rows + q.clamp_min(0).remainder(max(rows, 1))
    if rows == 0:
        tail_idx = torch.zeros_like(tail_idx)
    last = pos >= a + n - rows
    trash = trash_slot * rows + pos.remainder(max(rows, 1))
    tail_write = torch.where(last, slot * rows + pos.remainder(max(rows, 1)), trash)
    return token, valid, w, dest, w == 0, from_new, new_idx, tail_idx, tail_write


@triton.jit
def _groups_kernel(pos_ptr, seq_ptr, a_ptr, n_ptr, slot_ptr, cached_ptr, table_ptr, s_table,
                   tok_ptr, valid_ptr, entry_ptr, dest_ptr, first_ptr, new_ptr, nidx_ptr,
                   tidx_ptr, twrite_ptr, T, G, NB, rows, trash_block, trash_slot,
                   R: tl.constexpr, P: tl.constexpr, SPAN: tl.constexpr, SPAN_P2: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """One program: (r > 1) the candidates compacted into ``tok_ptr`` in token order, then
    every candidate's rows (``BLOCK_G`` candidates at a time: their [BLOCK_G, span] slots),
    then every token's tail-ring row."""
    rr = tl.maximum(rows, 1)
    if R > 1:  # compaction: padding T everywhere, then each group end at its rank
        for g0 in range(0, G, BLOCK):
            g = g0 + tl.arange(0, BLOCK)
            tl.store(tok_ptr + g, tl.full([BLOCK], 0, tl.int64) + T, mask=g < G)
        tl.debug_barrier()
        base = 0
        for t0 in range(0, T, BLOCK):
            t = t0 + tl.arange(0, BLOCK)
            tm = t < T
            p = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
            s = tl.load(seq_ptr + t, mask=tm, other=0).to(tl.int64)
            cached = tl.load(cached_ptr + s, mask=tm, other=0).to(tl.int64) // R
            ends = tm & ((p + 1) % R == 0) & ((p + 1) // R - 1 >= cached)
            rank = base + tl.cumsum(ends.to(tl.int32), 0) - 1
            tl.store(tok_ptr + rank, t.to(tl.int64), mask=ends & (rank < G))
            base += tl.sum(ends.to(tl.int32), 0)
        tl.debug_barrier()
    j = tl.arange(0, SPAN_P2)
    jm = j < SPAN
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        gm = g < G
        if R > 1:
            tok = tl.load(tok_ptr + g, mask=gm, other=0)
            valid = tok < T
            tok = tl.minimum(tok, tl.maximum(T - 1, 0))
        else:
            tok = g.to(tl.int64)
        p = tl.load(pos_ptr + tok, mask=gm, other=0).to(tl.int64)
        s = tl.load(seq_ptr + tok, mask=gm, other=0).to(tl.int64)
        w = (p + 1) // R - 1
        if R == 1:
            cached = tl.load(cached_ptr + s, mask=gm, other=0).to(tl.int64) // R
            valid = ((p + 1) % R == 0) & (w >= cached)
        dest = _pool_rows(table_ptr, s_table, s, w, NB, gm, R, P)
        dest = tl.where(valid, dest, trash_block * (P // R))
        tl.store(tok_ptr + g, tok, mask=gm)
        tl.store(valid_ptr + g, valid, mask=gm)
        tl.store(entry_ptr + g, w, mask=gm)
        tl.store(dest_ptr + g, dest, mask=gm)
        tl.store(first_ptr + g, w == 0, mask=gm)
        q = p[:, None] - SPAN + 1 + j[None, :]  # [BLOCK, SPAN_P2] positions
        a = tl.load(a_ptr + tok, mask=gm, other=0).to(tl.int64)
        sl = tl.load(slot_ptr + tok, mask=gm, other=0).to(tl.int64)
        m2 = gm[:, None] & jm[None, :]
        o2 = g[:, None].to(tl.int64) * SPAN + j[None, :]
        tl.store(new_ptr + o2, q >= a[:, None], mask=m2)
        nidx = tl.minimum(tl.maximum(tok[:, None] - (p[:, None] - q), 0), tl.maximum(T - 1, 0))
        tl.store(nidx_ptr + o2, nidx, mask=m2)
        tl.store(tidx_ptr + o2, sl[:, None] * rows + tl.maximum(q, 0) % rr, mask=m2)
    for t0 in range(0, T, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tm = t < T
        p = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.int64)
        a = tl.load(a_ptr + t, mask=tm, other=0).to(tl.int64)
        n = tl.load(n_ptr + t, mask=tm, other=0).to(tl.int64)
        sl = tl.load(slot_ptr + t, mask=tm, other=0).to(tl.int64)
        last = p >= a + n - rows
        tw = tl.where(last, sl * rows + p % rr, trash_slot * rows + p % rr)
        tl.store(twrite_ptr + t, tw, mask=tm)


def compressor_groups_triton(pos: torch.Tensor, seq: torch.Tensor, a: torch.Tensor,
                             n: torch.Tensor, slot: torch.Tensor, cached_lens: torch.Tensor,
                             block_table: torch.Tensor, ratio: int, span: int, rows: int,
                             block_size: int, trash_block: int, trash_slot: int
                             ) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Triton :func:`compressor_groups_ref` in one launch (the reference's ~45 small ones)."""
    dev, T, B = pos.device, pos.numel(), block_table.shape[0]
    G = T if ratio == 1 else min(T, T // ratio + B)
    i64 = dict(dtype=torch.int64, device=dev)
    token, entry, dest = (torch.empty(G, **i64) for _ in range(3))
    valid = torch.empty(G, dtype=torch.bool, device=dev)
    first = torch.empty(G, dtype=torch.bool, device=dev)
    from_new = torch.empty((G, span), dtype=torch.bool, device=dev)
    new_idx, tail_idx = torch.empty((G, span), **i64), torch.empty((G, span), **i64)
    tail_write = torch.empty(T, **i64)
    if T == 0:
        return token, valid, entry, dest, first, from_new, new_idx, tail_idx, tail_write
    table = block_table.contiguous()
    block = 16 if _INTERPRET else min(1024, triton.next_power_of_2(max(T, 1)))
    span_p2 = triton.next_power_of_2(span)
    block_g = max(1, min(block, 2048 // span_p2))  # [block_g, span] slot tiles
    _groups_kernel[(1,)](
        pos.contiguous(), seq.contiguous(), a.contiguous(), n.contiguous(), slot.contiguous(),
        cached_lens.contiguous(), table, table.stride(0), token, valid, entry, dest, first,
        from_new, new_idx, tail_idx, tail_write, T, G, table.shape[1], rows, trash_block,
        trash_slot, R=ratio, P=block_size, SPAN=span, SPAN_P2=span_p2, BLOCK=block,
        BLOCK_G=block_g, num_warps=4 if block <= 256 else 8,
    )  # fmt: skip
    return token, valid, entry, dest, first, from_new, new_idx, tail_idx, tail_write


compressor_groups = op(compressor_groups_ref, compressor_groups_triton,
                       when=lambda pos, seq, a, n, slot, cached, table, *_:
                       table.dtype == torch.int64 and table.shape[1] > 0)  # fmt: skip
