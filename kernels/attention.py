"""Sparse single-latent attention with a per-head sink: torch reference and Triton kernel.

Every query token attends to its own list of key rows in a shared KV pool (K = V, one head):
the window ring and the selected compressed entries are both just rows of ``kv``.

Triton design (``sparse_attention_triton``): one program per (token, block of heads, KV split).
All heads of a token share its key rows, so a program holding BLOCK_H heads gathers each KV
row once for all of them (decode bytes ~ K rows x D x dtype per token, not per head):

    grid = (T, cdiv(H, BLOCK_H), SPLITS)
    q tile [BLOCK_H, D] loaded once; per BLOCK_N rows: ids -> gather [BLOCK_N, D] (fp8: x 2^e
    per 32 channels) -> S = q k^T (fp32) -> online softmax (exp2, sink seeds m and l) -> O += P k

With SPLITS > 1 (few tokens, long key lists) each split writes (m, l) in fp32 and its
unnormalized O (fp32 from this kernel, bf16 from the warp-specialized one: ``WS_PARTIALS``),
and ``_combine_kernel`` merges them in fp32. The output's inverse RoPE is fused into the epilogue.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention_ws import HEADS, launch_ws
from kernels.dispatch import capability, op, sm_count
from kernels.kv_quant import e2m1_to_f32

_LOG2E = 1.4426950408889634
# The ws kernel's split partials O (m and l stay fp32): bf16 halves their write and the
# combine's read, and the kernel stores them row-contiguously through its key ring. Each
# split's O is rounded once to bf16 (relative 2^-9) before the fp32 merge, as FlashInfer
# keeps its split-KV partials in the output dtype. H200, batch 64, fp8 rows: 32.3 against
# 38.5 us with fp32 partials (docs/performance.md, fifteenth session).
WS_PARTIALS = torch.bfloat16
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64: lets tests run the reference in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def dequant_kv(kv: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Stored key rows -> float: plain rows pass through (at least fp32); fp8 e4m3 rows times
    their per-32-channel scales (fp32, or e8m0 codes as uint8); nvfp4 rows (uint8, two E2M1
    codes per byte, channel 2j in the low nibble) times their e4m3 scale per 16 channels."""
    if kv_scale is None:
        return _wide(kv)
    if kv.dtype == torch.uint8:  # nvfp4
        from kernels.kv_quant import kv_unpack

        return kv_unpack(kv, kv_scale, "nvfp4", torch.float32)
    if kv_scale.dtype == torch.uint8:  # e8m0 codes
        kv_scale = torch.ldexp(torch.ones(kv_scale.shape, device=kv.device), kv_scale.long() - 127)
    scale = _wide(kv_scale).repeat_interleave(kv.shape[-1] // kv_scale.shape[-1], dim=-1)
    return kv.to(scale.dtype) * scale


def _gather(kv: torch.Tensor, kv_scale: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [T, K] (-1 = any row) of a key source, decoded: [T, K, D]."""
    flat = idx.clamp_min(0).reshape(-1)
    sc = kv_scale[flat] if kv_scale is not None else None
    return dequant_kv(kv[flat], sc).view(*idx.shape, -1)


def sparse_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    inv_rope_angles: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    kv2: torch.Tensor | None = None,
    idx2: torch.Tensor | None = None,
    kv2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D], ``kv`` [N, D], ``idx`` [T, K] int64 rows of ``kv`` (-1 = empty),
    ``sink`` [H] fp32 logits -> out [T, H, D] in q.dtype.

    ``p_i = exp(l_i - m) / (sum_j exp(l_j - m) + exp(sink_h - m))``; fp32 softmax (fp64 for
    fp64 inputs). Optional: ``kv_scale`` dequantizes a stored ``kv`` (:func:`dequant_kv`);
    a second key source ``kv2`` [N2, D] (+ ``kv2_scale``) with its rows ``idx2`` [T, K2]
    (the compressed entries beside the window); ``inv_rope_angles`` [T, R/2] applies
    inverse RoPE to the output's last R channels.
    """
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"bad shapes q{tuple(q.shape)} kv{tuple(kv.shape)} idx{tuple(idx.shape)}")
    keys = _gather(kv, kv_scale, idx)  # [T, K, D]
    valid = idx >= 0
    if kv2 is not None:
        if idx2 is None or idx2.shape[0] != q.shape[0]:
            raise ValueError("a second key source needs idx2 [T, K2]")
        keys2 = _gather(kv2, kv2_scale, idx2)
        dt = torch.promote_types(keys.dtype, keys2.dtype)
        keys = torch.cat((keys.to(dt), keys2.to(dt)), dim=1)
        valid = torch.cat((valid, idx2 >= 0), dim=1)
    qf = _wide(q).to(keys.dtype)
    logits = torch.einsum("thd,tkd->thk", qf, keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.to(keys.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("thk,tkd->thd", probs, keys)
    if inv_rope_angles is not None:
        from kernels.rope import apply_rope_ref

        out = apply_rope_ref(out, inv_rope_angles.to(out.dtype), inverse=True)
    return out.to(q.dtype)


# ---- Triton -------------------------------------------------------------------------------


@triton.jit
def rope_pairs(x, ang, INVERSE: tl.constexpr):
    """Rotate interleaved pairs of ``x`` [M, D] by ``ang`` [M or 1, D/2] (0 = untouched pair)."""
    M: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (M, D // 2, 2)))
    c = tl.cos(ang)
    s = tl.sin(ang)
    if INVERSE:
        s = -s
    return tl.reshape(tl.join(a * c - b * s, a * s + b * c), (M, D))


@triton.jit
def rope_angles(ang_ptr, D: tl.constexpr, R: tl.constexpr):
    """Angles [1, D/2] for the pairs of a D-vector whose last R channels are rotated."""
    j = tl.arange(0, D // 2) - (D // 2 - R // 2)
    return tl.load(ang_ptr + j, mask=j >= 0, other=0.0)[None, :]


@triton.jit
def _block_ids(idx_row, n0, hi, BLOCK_N: tl.constexpr):
    """Key row ids ``idx_row[n0 : n0+BLOCK_N]`` as int64 (-1 past ``hi``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + n, mask=n < hi, other=-1).to(tl.int64)


@triton.jit
def _gather_kv(kv_ptr, sc_ptr, rows, s_kv, s_sc, D: tl.constexpr, FMT: tl.constexpr,
               SC_E8: tl.constexpr, BLOCK_N: tl.constexpr, dot_t: tl.constexpr):  # fmt: skip
    """Key rows ``rows`` (-1 = empty) as [BLOCK_N, D] in ``dot_t`` and the valid mask.

    FMT 0: plain rows; 1: fp8 e4m3 times a scale per 32 channels (fp32, or e8m0 codes when
    SC_E8). (nvfp4 rows go through :func:`_gather_kv_split`.)"""
    valid = rows >= 0
    d = tl.arange(0, D)
    k = tl.load(kv_ptr + rows[:, None] * s_kv + d[None, :], mask=valid[:, None], other=0.0)
    if FMT == 1:
        g = tl.arange(0, D // 32)
        sc = tl.load(sc_ptr + rows[:, None] * s_sc + g[None, :], mask=valid[:, None], other=0)
        if SC_E8:
            sc = tl.exp2(sc.to(tl.float32) - 127.0)
        k = tl.reshape(tl.reshape(k.to(tl.float32), (BLOCK_N, D // 32, 32)) * sc[:, :, None],
                       (BLOCK_N, D))  # fmt: skip
    return k.to(dot_t), valid


@triton.jit
def _attend(q, m_i, l_i, acc, kv_ptr, sc_ptr, idx_row, lo, hi, s_kv, s_sc, scale_log2,
            D: tl.constexpr, FMT: tl.constexpr, SC_E8: tl.constexpr, BLOCK_N: tl.constexpr,
            dot_t: tl.constexpr, prec: tl.constexpr):  # fmt: skip
    """Online-softmax over key columns [lo, hi) of one token's row list of one source."""
    # The ids of block n0 + BLOCK_N are loaded one iteration ahead and carried: the gather's
    # address then comes from a loop argument, not from a load of the same iteration, and the
    # software pipeliner turns it into cp.async copies num_stages - 1 blocks ahead (with the
    # ids loaded in the same iteration it keeps only one block in flight at any num_stages).
    rows = _block_ids(idx_row, lo, hi, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        rows_next = _block_ids(idx_row, n0 + BLOCK_N, hi, BLOCK_N)
        k, valid = _gather_kv(kv_ptr, sc_ptr, rows, s_kv, s_sc, D, FMT, SC_E8, BLOCK_N, dot_t)
        s = tl.dot(q, tl.trans(k), input_precision=prec) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(dot_t), k, acc * alpha[:, None], input_precision=prec)
        m_i = m_new
        rows = rows_next
    return m_i, l_i, acc


@triton.jit
def _gather_kv_split(kv_ptr, sc_ptr, rows, s_kv, s_sc, D: tl.constexpr, FMT: tl.constexpr,
               SC_E8: tl.constexpr, BLOCK_N: tl.constexpr, dot_t: tl.constexpr):  # fmt: skip
    """Key rows ``rows`` (-1 = empty) as their even and odd channels, [BLOCK_N, D/2] each in
    ``dot_t``, and the valid mask. The kernel keeps every D-vector split this way: the two
    nibbles of an fp4 byte are channels 2j and 2j+1 (no interleave), and a RoPE pair is
    (even j, odd j).

    FMT 0: plain rows; 1: fp8 e4m3 times a scale per 32 channels (fp32, or e8m0 codes when
    SC_E8): channels 2j, 2j+1 share scale j // 16; 2: nvfp4, two E2M1 codes per byte times an
    e4m3 scale per 16 channels: byte j's scale is j // 8."""
    valid = rows >= 0
    j = tl.arange(0, D // 2)
    base = kv_ptr + rows[:, None] * s_kv
    if FMT == 2:
        b = tl.load(base + j[None, :], mask=valid[:, None], other=0).to(tl.int32)
        ke, ko = e2m1_to_f32(b & 15), e2m1_to_f32(b >> 4)
        g = tl.arange(0, D // 16)
        sc = tl.load(sc_ptr + rows[:, None] * s_sc + g[None, :], mask=valid[:, None], other=0.0)
        sc = sc.to(tl.float32)[:, :, None]
        ke = tl.reshape(tl.reshape(ke, (BLOCK_N, D // 16, 8)) * sc, (BLOCK_N, D // 2))
        ko = tl.reshape(tl.reshape(ko, (BLOCK_N, D // 16, 8)) * sc, (BLOCK_N, D // 2))
        return ke.to(dot_t), ko.to(dot_t), valid
    d = tl.arange(0, D)
    k = tl.load(base + d[None, :], mask=valid[:, None], other=0.0)  # contiguous: cp.async
    if FMT == 1:
        g = tl.arange(0, D // 32)
        sc = tl.load(sc_ptr + rows[:, None] * s_sc + g[None, :], mask=valid[:, None], other=0)
        if SC_E8:
            sc = tl.exp2(sc.to(tl.float32) - 127.0)
        k = tl.reshape(tl.reshape(k.to(tl.float32), (BLOCK_N, D // 32, 32)) * sc[:, :, None],
                       (BLOCK_N, D))  # fmt: skip
    ke, ko = tl.split(tl.reshape(k.to(dot_t), (BLOCK_N, D // 2, 2)))
    return ke, ko, valid


@triton.jit
def _attend_split(qe, qo, m_i, l_i, acc_e, acc_o, kv_ptr, sc_ptr, idx_row, lo, hi, s_kv, s_sc,
            scale_log2, D: tl.constexpr, FMT: tl.constexpr, SC_E8: tl.constexpr,
            BLOCK_N: tl.constexpr, dot_t: tl.constexpr, prec: tl.constexpr):  # fmt: skip
    """Online-softmax over key columns [lo, hi) of one token's row list of one source."""
    # The ids of block n0 + BLOCK_N are loaded one iteration ahead and carried: the gather's
    # address then comes from a loop argument, not from a load of the same iteration, and the
    # software pipeliner turns it into cp.async copies num_stages - 1 blocks ahead (with the
    # ids loaded in the same iteration it keeps only one block in flight at any num_stages).
    rows = _block_ids(idx_row, lo, hi, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        rows_next = _block_ids(idx_row, n0 + BLOCK_N, hi, BLOCK_N)
        ke, ko, valid = _gather_kv_split(kv_ptr, sc_ptr, rows, s_kv, s_sc, D, FMT, SC_E8,
                                         BLOCK_N, dot_t)  # fmt: skip
        s = tl.dot(qe, tl.trans(ke), input_precision=prec)
        s = tl.dot(qo, tl.trans(ko), s, input_precision=prec) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pt = p.to(dot_t)
        acc_e = tl.dot(pt, ke, acc_e * alpha[:, None], input_precision=prec)
        acc_o = tl.dot(pt, ko, acc_o * alpha[:, None], input_precision=prec)
        m_i = m_new
        rows = rows_next
    return m_i, l_i, acc_e, acc_o


def _attn_configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_H": 16, "BLOCK_N": 16}, num_warps=4)]
    # num_stages >= 3: the KV gather becomes cp.async, num_stages - 1 blocks in flight (sm_90
    # compile, bench.compile_report attention). BLOCK_H 64 (wgmma) pipelines bf16 and fp8 KV;
    # below 64 heads (mma.sync) the fp8 rows stay synchronous loads, only their scales are async.
    # (16, 16, 4, 4) and (16, 32, 4, 3): 66 / 83 KB of shared memory instead of 116 KB, so 3 / 2
    # CTAs per SM -- ncu showed (16, 32, 4, 4) at one 4-warp CTA per SM, latency-bound.
    shapes = ((64, 16, 8, 4), (64, 32, 8, 3), (64, 32, 8, 4), (32, 32, 8, 3), (16, 32, 4, 4),
              (16, 16, 4, 4), (16, 32, 4, 3))  # fmt: skip
    return [
        triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bh, bn, w, s in shapes
    ]


@triton.jit
def _attn_full_body(
    q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr, out_ptr,
    part_ptr, ml_ptr, T, H, K, K2, SPLITS, scale_log2, s_qt, s_qh, s_kv, s_sc, s_it, s_kv2,
    s_sc2, s_it2, s_at, s_ot, s_oh, D: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
    SC_E8: tl.constexpr, FMT2: tl.constexpr, SC2_E8: tl.constexpr, ROPE: tl.constexpr,
    F32_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One (token, head block, split) over full D-channel rows (plain and fp8 keys)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0.0
    )
    dot_t: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if F32_DOT else "tf32"
    q = q.to(dot_t)

    # The sink seeds the running max and (in split 0 only) the denominator: p_sink = 2^(s-m).
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
    l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    # Keys of a token: columns [0, K) of source 1, then [K, K + K2) of source 2; a split
    # takes whole blocks of each source in proportion.
    per = tl.cdiv(tl.cdiv(K, BLOCK_N), SPLITS) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, K)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, kv_ptr, sc_ptr, idx_ptr + t * s_it, lo, hi, s_kv,
                            s_sc, scale_log2, D, FMT, SC_E8, BLOCK_N, dot_t, prec)  # fmt: skip
    per2 = tl.cdiv(tl.cdiv(K2, BLOCK_N), SPLITS) * BLOCK_N
    lo2 = split * per2
    hi2 = tl.minimum(lo2 + per2, K2)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, kv2_ptr, sc2_ptr, idx2_ptr + t * s_it2, lo2, hi2,
                            s_kv2, s_sc2, scale_log2, D, FMT2, SC2_E8, BLOCK_N, dot_t,
                            prec)  # fmt: skip

    if SPLITS == 1:
        o = acc / l_i[:, None]
        if ROPE:
            o = rope_pairs(o, rope_angles(ang_ptr + t * s_at, D, R), INVERSE=True)
        optrs = out_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        row = (split * T + t) * H + heads  # partials [SPLITS, T, H, (D | 2)]
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


@triton.jit
def _attn_split_body(
    q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr, out_ptr,
    part_ptr, ml_ptr, T, H, K, K2, SPLITS, scale_log2, s_qt, s_qh, s_kv, s_sc, s_it, s_kv2,
    s_sc2, s_it2, s_at, s_ot, s_oh, D: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
    SC_E8: tl.constexpr, FMT2: tl.constexpr, SC2_E8: tl.constexpr, ROPE: tl.constexpr,
    F32_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The same with every D-vector split into even and odd channels: an nvfp4 byte's two
    nibbles need no interleave, a RoPE pair is (even j, odd j). Chosen when the compressed
    source is nvfp4 (sm_90: ~half the main-loop instructions of the full-row body there;
    more than the full-row body for plain bf16 rows)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < H
    j = tl.arange(0, D // 2)
    d = tl.arange(0, D)
    qp = q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :]
    dot_t: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if F32_DOT else "tf32"
    q = tl.load(qp, mask=hmask[:, None], other=0.0).to(dot_t)
    qe, qo = tl.split(tl.reshape(q, (BLOCK_H, D // 2, 2)))

    # The sink seeds the running max and (in split 0 only) the denominator: p_sink = 2^(s-m).
    m_i = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634
    l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc_e = tl.zeros([BLOCK_H, D // 2], tl.float32)
    acc_o = tl.zeros([BLOCK_H, D // 2], tl.float32)

    # Keys of a token: columns [0, K) of source 1, then [K, K + K2) of source 2; a split
    # takes whole blocks of each source in proportion.
    per = tl.cdiv(tl.cdiv(K, BLOCK_N), SPLITS) * BLOCK_N
    lo = split * per
    hi = tl.minimum(lo + per, K)
    m_i, l_i, acc_e, acc_o = _attend_split(qe, qo, m_i, l_i, acc_e, acc_o, kv_ptr, sc_ptr,
                                     idx_ptr + t * s_it, lo, hi, s_kv, s_sc, scale_log2, D, FMT,
                                     SC_E8, BLOCK_N, dot_t, prec)  # fmt: skip
    per2 = tl.cdiv(tl.cdiv(K2, BLOCK_N), SPLITS) * BLOCK_N
    lo2 = split * per2
    hi2 = tl.minimum(lo2 + per2, K2)
    m_i, l_i, acc_e, acc_o = _attend_split(qe, qo, m_i, l_i, acc_e, acc_o, kv2_ptr, sc2_ptr,
                                     idx2_ptr + t * s_it2, lo2, hi2, s_kv2, s_sc2, scale_log2, D,
                                     FMT2, SC2_E8, BLOCK_N, dot_t, prec)  # fmt: skip

    if SPLITS == 1:
        oe = acc_e / l_i[:, None]
        oo = acc_o / l_i[:, None]
        if ROPE:  # inverse RoPE on the last R/2 pairs (even j, odd j)
            k = j - (D // 2 - R // 2)
            ang = tl.load(ang_ptr + t * s_at + k, mask=k >= 0, other=0.0)[None, :]
            c, sn = tl.cos(ang), tl.sin(ang)
            oe, oo = oe * c + oo * sn, oo * c - oe * sn
        optrs = out_ptr + t * s_ot + heads[:, None] * s_oh + 2 * j[None, :]
        tl.store(optrs, oe.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(optrs + 1, oo.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        row = (split * T + t) * H + heads  # partials [SPLITS, T, H, (D | 2)]
        pp = part_ptr + row[:, None] * D + 2 * j[None, :]
        tl.store(pp, acc_e, mask=hmask[:, None])
        tl.store(pp + 1, acc_o, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)


# Tuned per power-of-two bucket of T and K (both change every engine step).
@triton.autotune(
    configs=_attn_configs(),
    key=["H", "K_BUCKET", "K2_BUCKET", "SPLITS", "T_BUCKET", "D", "FMT", "FMT2", "ROPE"],
)
@triton.jit(do_not_specialize=["T", "K", "K2", "SPLITS", "T_BUCKET", "K_BUCKET", "K2_BUCKET"])
def _sparse_attn_kernel(
    q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr, out_ptr,
    part_ptr, ml_ptr, T, H, K, K2, SPLITS, T_BUCKET, K_BUCKET, K2_BUCKET, scale_log2,
    s_qt, s_qh, s_kv, s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh,
    D: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr, SC_E8: tl.constexpr,
    FMT2: tl.constexpr, SC2_E8: tl.constexpr, ROPE: tl.constexpr,
    F32_DOT: tl.constexpr, SPLIT_PAIRS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    if SPLIT_PAIRS:
        _attn_split_body(
            q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
            out_ptr, part_ptr, ml_ptr, T, H, K, K2, SPLITS, scale_log2, s_qt, s_qh, s_kv,
            s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, D, R, FMT, SC_E8, FMT2, SC2_E8,
            ROPE, F32_DOT, BLOCK_H, BLOCK_N,
        )  # fmt: skip
    else:
        _attn_full_body(
            q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
            out_ptr, part_ptr, ml_ptr, T, H, K, K2, SPLITS, scale_log2, s_qt, s_qh, s_kv,
            s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, D, R, FMT, SC_E8, FMT2, SC2_E8,
            ROPE, F32_DOT, BLOCK_H, BLOCK_N,
        )  # fmt: skip


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _combine_kernel(
    part_ptr, ml_ptr, ang_ptr, out_ptr, T, H, SPLITS, s_at, s_ot, s_oh,
    D: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s, per (token, head block)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + ((s * T + t) * H + heads) * 2, mask=hmask, other=0.0))
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for s in range(SPLITS):
        row = (s * T + t) * H + heads
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=hmask, other=0.0) - m)
        l_sum += w * tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=1.0)
        part = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
        part = part.to(tl.float32)
        acc += w[:, None] * part
    o = acc / l_sum[:, None]
    if ROPE:
        o = rope_pairs(o, rope_angles(ang_ptr + t * s_at, D, R), INVERSE=True)
    optrs = out_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def default_splits(T: int, H: int, K: int, device: torch.device) -> int:
    """KV splits: only when (token, 32-head) programs fill under half the SMs; >= 128 keys each."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    programs = T * triton.cdiv(H, 32)
    if 2 * programs > sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), K // 128))


_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _source(kv: torch.Tensor, kv_scale: torch.Tensor | None, q: torch.Tensor, D: int, which: str):
    """(format code, scale is e8m0) of one key source, after checking its shapes and dtypes."""
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"{which} must be [N, D] with a contiguous last dim: {tuple(kv.shape)}")
    if kv.dtype == torch.uint8:  # nvfp4
        if kv.shape[1] != D // 2 or kv_scale is None or kv_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"nvfp4 {which} needs [N, D/2] bytes and e4m3 scales per 16")
        if kv_scale.shape != (kv.shape[0], D // 16) or kv_scale.stride(-1) != 1:
            raise ValueError(f"{which} scale must be [N, D/16], got {tuple(kv_scale.shape)}")
        return 2, False
    if kv.shape[1] != D:
        raise ValueError(f"{which} rows have {kv.shape[1]} channels, q has {D}")
    if kv.dtype == torch.float8_e4m3fn:
        if kv_scale is None or kv_scale.shape != (kv.shape[0], D // 32):
            raise ValueError(f"fp8 {which} needs a scale [N, D/32]")
        if kv_scale.dtype not in (torch.float32, torch.uint8) or kv_scale.stride(-1) != 1:
            raise ValueError(f"{which} scale must be fp32 or e8m0 (uint8), contiguous")
        return 1, kv_scale.dtype == torch.uint8
    if kv_scale is not None:
        raise ValueError(f"a scale is given for plain {which} rows ({kv.dtype})")
    if kv.dtype != q.dtype:
        raise TypeError(f"{which} dtype {kv.dtype} must match q dtype {q.dtype}")
    return 0, False


def _launch_tl(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
               scale, D, R, fmt, e8, fmt2, e82, launch):  # fmt: skip
    """The portable kernel over (T, H / BLOCK_H, S) (autotuned unless ``launch``)."""

    def grid(meta):
        return (T, triton.cdiv(H, meta["BLOCK_H"]), S)

    np2 = triton.next_power_of_2
    kernel = _sparse_attn_kernel if launch is None else _sparse_attn_kernel.fn
    kernel[grid](
        q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml,
        T, H, K, K2, S, np2(T), np2(K), np2(K2) if K2 else 0, scale * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), sc.stride(0), idx.stride(0),
        kv2.stride(0), sc2.stride(0), max(idx2.stride(0), 1),
        ang.stride(0), out.stride(0), out.stride(1),
        D=D, R=R, FMT=fmt, SC_E8=e8, FMT2=fmt2, SC2_E8=e82, ROPE=R > 0,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, SPLIT_PAIRS=fmt2 == 2,
        **(launch or {}),
    )  # fmt: skip


_KERNELS = ("auto", "ws", "tl")


def ws_applies(q: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel takes queries ``q`` [T, H, D] (sm_90, bf16,
    D = 512, heads in blocks of 64); it reads every key format."""
    T, H, D = q.shape
    return (
        q.is_cuda
        and not _INTERPRET
        and q.dtype == torch.bfloat16
        and D == 512
        and H % HEADS == 0
        and capability(q.device) == (9, 0)
    )


def ws_splits(T: int, H: int, K: int, device: torch.device) -> int:
    """KV splits of the warp-specialized kernel (one ~190 KB CTA per SM): as many as keep
    (token, 64-head) programs within one wave, with >= 128 keys each."""
    programs = T * triton.cdiv(H, HEADS)
    return max(1, min(sm_count(device) // programs, K // 128))


def sparse_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    inv_rope_angles: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    kv2: torch.Tensor | None = None,
    idx2: torch.Tensor | None = None,
    kv2_scale: torch.Tensor | None = None,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    launch: dict[str, int] | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Triton ``sparse_attention_ref`` (same arguments). Key sources: rows in q.dtype, fp8
    e4m3 with ``kv_scale`` [N, D/32] (fp32 or e8m0 codes), or (second source) nvfp4 bytes
    [N, D/2] with e4m3 scales [N, D/16]; ``splits`` overrides the KV split count
    (``default_splits``); ``out`` [T, H, D] (contiguous last dim) receives the result;
    ``launch`` (BLOCK_H, BLOCK_N, num_warps, num_stages) bypasses the autotuner.

    ``kernel``: "auto" (the dispatch) takes the warp-specialized Hopper kernel
    (``kernels.attention_ws``) wherever it applies (sm_90, bf16 q, D = 512, heads in blocks of
    64, key pools under 2^31 rows) except for plain bf16 rows at under 8 (token, 64-head)
    programs, and the portable kernel elsewhere: at those small plain-row calls it was the
    faster of the two on the H200. "ws" / "tl" name one of the two (benchmarks and tests
    compare them at one shape; "ws" is an error where it cannot run). With "ws", ``launch``
    holds its (block_n, stages, p_regs, c_regs) instead."""
    T, H, D = q.shape
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"bad shapes q{tuple(q.shape)} kv{tuple(kv.shape)} idx{tuple(idx.shape)}")
    if D < 32 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 32")
    if q.dtype not in _Q_DTYPES:
        raise TypeError(f"unsupported q dtype {q.dtype}")
    fmt, e8 = _source(kv, kv_scale, q, D, "kv")
    if fmt == 2:
        raise ValueError("nvfp4 rows are taken as the second key source only")
    if (kv2 is None) != (idx2 is None):
        raise ValueError("kv2 and idx2 go together")
    if kv2 is None:
        kv2, idx2, fmt2, e82 = kv, idx[:, :0], fmt, e8
        kv2_scale = kv_scale
    else:
        fmt2, e82 = _source(kv2, kv2_scale, q, D, "kv2")
        if idx2.dim() != 2 or idx2.shape[0] != T:
            raise ValueError(f"idx2 must be [T, K2], got {tuple(idx2.shape)}")
    for i in (idx, idx2):
        if i.dtype not in (torch.int64, torch.int32) or (i.numel() and i.stride(-1) != 1):
            raise ValueError("idx / idx2 must be int32/int64 with a contiguous last dim")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [H], got {tuple(sink.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dim")
    R = 0
    if inv_rope_angles is not None:
        R = 2 * inv_rope_angles.shape[-1]
        if inv_rope_angles.shape != (T, R // 2) or R > D or inv_rope_angles.stride(-1) != 1:
            raise ValueError(f"inv_rope_angles must be [T, <=D/2], got {inv_rope_angles.shape}")
        inv_rope_angles = inv_rope_angles.float()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, H, D] with a contiguous last dim: {tuple(out.shape)}")
    K, K2 = idx.shape[1], idx2.shape[1]
    if T == 0:
        return out
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
    # (the ws kernel takes row ids as int32)
    ws = ws_applies(q) and max(kv.shape[0], kv2.shape[0]) < 2**31
    if kernel == "ws" and not ws:
        raise ValueError("the warp-specialized kernel needs sm_90, bf16 q, D = 512, "
                         "H % 64 == 0 and key pools under 2^31 rows")  # fmt: skip
    if kernel == "auto":
        ws = ws and not (fmt == 0 and fmt2 == 0 and T * (H // HEADS) < 8)
    else:
        ws = kernel == "ws"
    S = splits or (ws_splits if ws else default_splits)(T, H, K + K2, q.device)
    sink = sink.float().contiguous()
    ang = inv_rope_angles if R else sink  # dummy pointer when unused
    sc = kv_scale if fmt else sink
    sc2 = kv2_scale if fmt2 else sink
    part = ml = out
    if S > 1:
        part = torch.empty((S, T, H, D), device=q.device,
                           dtype=WS_PARTIALS if ws else torch.float32)  # fmt: skip
        ml = torch.empty((S, T, H, 2), device=q.device, dtype=torch.float32)

    if ws:
        strides = (q.stride(0), q.stride(1), kv.stride(0), sc.stride(0), idx.stride(0),
                   kv2.stride(0), sc2.stride(0), max(idx2.stride(0), 1), ang.stride(0),
                   out.stride(0), out.stride(1))  # fmt: skip
        launch_ws(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
                  scale * _LOG2E, strides, D=D, R=R, fmt=fmt, e8=e8, fmt2=fmt2, e82=e82,
                  **(launch or {}))  # fmt: skip
    else:
        _launch_tl(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
                   scale, D, R, fmt, e8, fmt2, e82, launch)  # fmt: skip
    if S > 1:
        bh = 16
        _combine_kernel[(T, triton.cdiv(H, bh))](
            part, ml, ang, out, T, H, S, ang.stride(0), out.stride(0), out.stride(1),
            D=D, R=R, ROPE=R > 0, BLOCK_H=bh, num_warps=4,
        )  # fmt: skip
    return out


sparse_attention = op(sparse_attention_ref, sparse_attention_triton)
