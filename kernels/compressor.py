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

import os

import torch
import triton
import triton.language as tl

from kernels.attention import rope_pairs
from kernels.dispatch import op

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
) -> torch.Tensor:
    """Triton ``compress_pool_ref`` (same arguments): fused pool + RMSNorm + RoPE + scatter.
    ``kv``/``gate`` fp32/bf16 with contiguous channels; ``dim`` a power of two;
    ``out`` [rows, dim] (e.g. a paged pool flattened to rows) in any float dtype."""
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

    _pool_kernel[grid](
        kv, g, first_t, norm_w, ang, out, rows, E, triton.next_power_of_2(E), eps,
        kv.stride(0), kv.stride(1), g.stride(0), g.stride(1), ang.stride(0), out.stride(0),
        SPAN=span, RATIO=ratio, DIM=dim, R=R, OVERLAP=overlap, HAS_GATE=gate is not None,
        ROPE=R > 0, HAS_ROWS=out_rows is not None,
    )  # fmt: skip
    return out


compress_pool = op(compress_pool_ref, compress_pool_triton)
