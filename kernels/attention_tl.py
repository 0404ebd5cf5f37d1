"""The portable sparse attention kernel (Triton): the contract of
``kernels.attention.sparse_attention_ref``, every dtype, head count and D (a power of two).

One program per (token, block of heads, KV split). All heads of a token share its key rows,
so a program holding BLOCK_H heads gathers each KV row once for all of them (decode bytes ~
K rows x D x dtype per token, not per head):

    grid = (T, cdiv(H, BLOCK_H), SPLITS)
    q tile [BLOCK_H, D] loaded once; per BLOCK_N rows: ids -> gather [BLOCK_N, D] (fp8: x 2^e
    per 32 channels) -> S = q k^T (fp32) -> online softmax (exp2, sink seeds m and l) -> O += P k

With SPLITS > 1 (few tokens, long key lists) each split writes (m, l) and its unnormalized O
in fp32 for ``kernels.attention``'s combine kernel; with one split the output's inverse RoPE
is fused into the epilogue. The CPU interpreter tests run this kernel; on sm_90 the dispatch
takes the warp-specialized one (``kernels.attention_ws``) where it applies.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import sm_count
from kernels.kv_quant import e2m1_to_f32
from kernels.rope import rope_angles, rope_pairs

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def default_splits(T: int, H: int, K: int, device: torch.device) -> int:
    """KV splits: only when (token, 32-head) programs fill under half the SMs; >= 128 keys each."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    programs = T * triton.cdiv(H, 32)
    if 2 * programs > sms:
        return 1
    return max(1, min(triton.cdiv(sms, programs), K // 128))


def launch_tl(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
               scale, D, R, fmt, e8, fmt2, e82, launch):  # fmt: skip
    """The portable kernel over (T, H / BLOCK_H, S) (autotuned unless ``launch``)."""

    def grid(meta):
        return (T, triton.cdiv(H, meta["BLOCK_H"]), S)

    np2 = triton.next_power_of_2
    kernel = _sparse_attn_kernel if launch is None else _sparse_attn_kernel.fn
    kernel[grid](
        q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml,
        T, H, K, K2, S, np2(T), np2(K), np2(K2) if K2 else 0, scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), sc.stride(0), idx.stride(0),
        kv2.stride(0), sc2.stride(0), max(idx2.stride(0), 1),
        ang.stride(0), out.stride(0), out.stride(1),
        D=D, R=R, FMT=fmt, SC_E8=e8, FMT2=fmt2, SC2_E8=e82, ROPE=R > 0,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, SPLIT_PAIRS=fmt2 == 2,
        **(launch or {}),
    )  # fmt: skip
