"""Manifold-constrained hyper-connections: the fused Triton Mega-mHC (references:
``kernels.mhc_ref``).

From the flattened streams ``v`` [T, n*d]: ``m = (fn @ v) * rsqrt(mean(v^2) + eps)``;
``pre = sigmoid(m[:n]*s0 + b) + hc_eps``, ``post = 2*sigmoid(m[n:2n]*s1 + b)``,
``comb = sinkhorn(m[2n:]*s2 + b)`` ([n, n], rows = input streams, columns = outputs).

Fused forms (no host sync):
``hc_pre``: ``_hc_mix_partial`` (split over d: the mixing dot and sum of squares of the
streams, fp32) then ``_hc_finish`` (one program per token: pre/post/comb with Sinkhorn on the
n x n in registers, collapse ``sum_j p_j X_j`` and its RMSNorm). ``hc_post_pre`` (V4.1
single-pass shape): the same with the post update ``X' = post (x) out + comb^T X`` computed
and stored by the first kernel, which mixes X' on the fly. ``p`` is the computed ``pre``
(V4) or the previous sublayer's ``pre_in`` (V4.1 one-step-late pre). At a few tokens both
run as one launch (``_hc_mix_finish``: programs per (token, d-split), the token's last one
to count itself in runs the finish), else as those two launches (:func:`_finish_form`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op, sm_count, split_counters
from kernels.mhc_ref import hc_expand_ref, hc_post_pre_ref, hc_pre_ref

FINISH_TILE_MAX = 32768  # most stream values (n x next power of 2 of d) one-tile holds
FUSED_MAX_TOKENS = 4  # the one-launch form up to this many tokens (each reads all of fn)
FIXED_SPLITS = 32  # d splits of the mix in the deterministic mode (fewer when d is short)


@triton.jit
def _hc_mix_partial(
    x_ptr, sxt, sxj, fn_ptr, sfn, mp_ptr, sq_ptr, sps,
    out_ptr, sot, post_ptr, comb_ptr, xn_ptr, snt, snj,
    T, D, d_per_split,
    N: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, HAS_POST: tl.constexpr,
    PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Partial ``m[t] = fn . v`` and ``sum v^2`` over a d-range of every stream.

    With HAS_POST, the streams are ``X'_k = post_k out + sum_j comb[j,k] X_j``, stored
    (rounded to X's dtype) and mixed as stored."""
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    tmask = t < T
    t64 = t.to(tl.int64)
    jn = tl.arange(0, N)
    w = tl.arange(0, WP)
    m = tl.zeros((BT, WP), tl.float32)
    sq = tl.zeros((BT,), tl.float32)
    d_lo = pid_s * d_per_split
    for d0 in range(d_lo, tl.minimum(d_lo + d_per_split, D), BD):
        dd = d0 + tl.arange(0, BD)
        dmask = tmask[:, None] & (dd[None, :] < D)
        if HAS_POST:
            m3 = tmask[:, None, None] & (dd[None, None, :] < D)
            x3 = tl.load(x_ptr + t64[:, None, None] * sxt + jn[None, :, None] * sxj
                         + dd[None, None, :], mask=m3, other=0.0).to(tl.float32)  # fmt: skip
            o = tl.load(out_ptr + t64[:, None] * sot + dd[None, :], mask=dmask, other=0.0)
            o = o.to(tl.float32)
        for k in tl.static_range(N):
            if HAS_POST:
                ck = tl.load(comb_ptr + t64[:, None] * N * N + jn[None, :] * N + k,
                             mask=tmask[:, None], other=0.0)  # fmt: skip
                pk = tl.load(post_ptr + t64 * N + k, mask=tmask, other=0.0)
                xk = pk[:, None] * o + tl.sum(ck[:, :, None] * x3, axis=1)
                xk = xk.to(xn_ptr.dtype.element_ty)
                tl.store(xn_ptr + t64[:, None] * snt + k * snj + dd[None, :], xk, mask=dmask)
                xk = xk.to(tl.float32)
            else:
                xk = tl.load(x_ptr + t64[:, None] * sxt + k * sxj + dd[None, :], mask=dmask,
                             other=0.0).to(tl.float32)  # fmt: skip
            sq += tl.sum(xk * xk, axis=1)
            f = tl.load(fn_ptr + w[None, :] * sfn + k * D + dd[:, None],
                        mask=(w[None, :] < W) & (dd[:, None] < D), other=0.0)  # fmt: skip
            m = tl.dot(xk, f, m, input_precision=PREC)
    tl.store(mp_ptr + pid_s * sps * WP + t64[:, None] * WP + w[None, :], m, mask=tmask[:, None])
    tl.store(sq_ptr + pid_s * sps + t64, sq, mask=tmask)


@triton.jit
def _coeffs(
    t, m_pre, m_post, m_comb, sq, D, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, pin_ptr,
    iters, hc_eps, norm_eps, N: tl.constexpr, HAS_PRE_IN: tl.constexpr,
):  # fmt: skip
    """Token ``t``'s pre [N], post [N] and Sinkhorn's comb [N, N] from its summed mix,
    stored; -> the collapse weights (``pin`` or pre)."""
    a = tl.arange(0, N)
    r = 1.0 / tl.sqrt(sq / (N * D) + norm_eps)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(m_pre * r * s0 + tl.load(base_ptr + a)) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * r * s1 + tl.load(base_ptr + N + a))
    lg = m_comb * r * s2 + tl.load(base_ptr + 2 * N + a[:, None] * N + a[None, :])
    c = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + hc_eps
    c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
        c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
    tl.store(pre_ptr + t * N + a, pre)
    tl.store(post_ptr + t * N + a, post)
    tl.store(comb_ptr + t * N * N + a[:, None] * N + a[None, :], c)
    return tl.load(pin_ptr + t * N + a) if HAS_PRE_IN else pre


@triton.jit
def _finish_one_tile(
    t, x_ptr, sxt, sxj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr, pin_ptr,
    pre_ptr, post_ptr, comb_ptr, y_ptr, syt, D, iters, hc_eps, norm_eps, rms_eps,
    N: tl.constexpr, WP: tl.constexpr, SPLIT: tl.constexpr, HAS_PRE_IN: tl.constexpr,
    BD: tl.constexpr, SPLIT_P: tl.constexpr, CM: tl.constexpr,
):  # fmt: skip
    """The finish of token ``t`` in one round trip to memory (BD >= D). The token's streams
    and the norm weight are loaded once, first, so their latency runs under the Sinkhorn, and
    the SPLIT partial rows come in one [SPLIT_P, WP] load (unrolled per split, their loads
    held ~190 registers and spilled at 16 warps). ``CM``: the cache modifier of the loads of
    what other programs of the same launch wrote (".cg" in the one-launch form)."""
    a = tl.arange(0, N)
    d1 = tl.arange(0, BD)
    x1 = tl.load(x_ptr + t * sxt + a[:, None] * sxj + d1[None, :], mask=d1[None, :] < D,
                 other=0.0, cache_modifier=CM)  # fmt: skip
    nw1 = tl.load(nw_ptr + d1, mask=d1 < D, other=0.0)
    # the SPLIT partial rows in one 2-D load, summed, then picked apart
    sp = tl.arange(0, SPLIT_P)
    wv = tl.arange(0, WP)
    part = tl.load(mp_ptr + sp[:, None].to(tl.int64) * sps * WP + t * WP + wv[None, :],
                   mask=sp[:, None] < SPLIT, other=0.0, cache_modifier=CM)  # fmt: skip
    mv = tl.sum(part, axis=0)
    sq = tl.sum(tl.load(sq_ptr + sp.to(tl.int64) * sps + t, mask=sp < SPLIT, other=0.0,
                        cache_modifier=CM))  # fmt: skip
    m_pre = tl.sum(tl.where(wv[None, :] == a[:, None], mv[None, :], 0.0), axis=1)
    m_post = tl.sum(tl.where(wv[None, :] == N + a[:, None], mv[None, :], 0.0), axis=1)
    ci = 2 * N + a[:, None] * N + a[None, :]
    m_comb = tl.sum(tl.where(wv[None, None, :] == ci[:, :, None], mv[None, None, :], 0.0),
                    axis=2)  # fmt: skip
    p = _coeffs(t, m_pre, m_post, m_comb, sq, D, base_ptr, scale_ptr, pre_ptr, post_ptr,
                comb_ptr, pin_ptr, iters, hc_eps, norm_eps, N, HAS_PRE_IN)  # fmt: skip
    # p as N scalars spread over an [N, 1] built from aranges: the compiler can lay that
    # out as the streams are, instead of moving the [N, BD] streams to p's layout (which
    # took 8-13 KB of stack at 16 warps when p was the mix's own pre)
    pb = tl.zeros((N, 1), tl.float32)
    for j in tl.static_range(N):
        pb = tl.where(a[:, None] == j, tl.sum(tl.where(a == j, p, 0.0), axis=0), pb)
    col = tl.sum(pb * x1.to(tl.float32), axis=0)
    rs = 1.0 / tl.sqrt(tl.sum(col * col) / D + rms_eps)
    y = col * rs * nw1.to(tl.float32)
    tl.store(y_ptr + t * syt + d1, y.to(y_ptr.dtype.element_ty), mask=d1 < D)


@triton.jit
def _hc_finish(
    x_ptr, sxt, sxj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr, pin_ptr,
    pre_ptr, post_ptr, comb_ptr, y_ptr, syt, D, iters, hc_eps, norm_eps, rms_eps,
    N: tl.constexpr, WP: tl.constexpr, SPLIT: tl.constexpr, HAS_PRE_IN: tl.constexpr,
    BD: tl.constexpr, ONE_TILE: tl.constexpr, SPLIT_P: tl.constexpr,
):  # fmt: skip
    """One token: pre/post/comb (Sinkhorn in registers), then RMSNorm(sum_j p_j X_j).

    ONE_TILE (BD >= D): :func:`_finish_one_tile`. Otherwise two passes over d (the norm,
    then the output), each a chain of dependent loads."""
    t = tl.program_id(0).to(tl.int64)
    if ONE_TILE:
        _finish_one_tile(t, x_ptr, sxt, sxj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr,
                         pin_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr, syt, D, iters, hc_eps,
                         norm_eps, rms_eps, N, WP, SPLIT, HAS_PRE_IN, BD, SPLIT_P, "")  # fmt: skip
    else:
        _finish_loop(t, x_ptr, sxt, sxj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr,
                     pin_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr, syt, D, iters, hc_eps,
                     norm_eps, rms_eps, N, WP, SPLIT, HAS_PRE_IN, BD)  # fmt: skip


@triton.jit
def _finish_loop(
    t, x_ptr, sxt, sxj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr, pin_ptr,
    pre_ptr, post_ptr, comb_ptr, y_ptr, syt, D, iters, hc_eps, norm_eps, rms_eps,
    N: tl.constexpr, WP: tl.constexpr, SPLIT: tl.constexpr, HAS_PRE_IN: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """The finish of token ``t`` in two passes over d (the norm, then the output)."""
    a = tl.arange(0, N)
    m_pre = tl.zeros((N,), tl.float32)
    m_post = tl.zeros((N,), tl.float32)
    m_comb = tl.zeros((N, N), tl.float32)
    sq = 0.0
    for s in tl.static_range(SPLIT):
        row = mp_ptr + s * sps * WP + t * WP
        m_pre += tl.load(row + a)
        m_post += tl.load(row + N + a)
        m_comb += tl.load(row + 2 * N + a[:, None] * N + a[None, :])
        sq += tl.load(sq_ptr + s * sps + t)
    p = _coeffs(t, m_pre, m_post, m_comb, sq, D, base_ptr, scale_ptr, pre_ptr, post_ptr,
                comb_ptr, pin_ptr, iters, hc_eps, norm_eps, N, HAS_PRE_IN)  # fmt: skip
    csq = tl.zeros((BD,), tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        xs = tl.load(x_ptr + t * sxt + a[:, None] * sxj + dd[None, :], mask=dd[None, :] < D,
                     other=0.0).to(tl.float32)  # fmt: skip
        col = tl.sum(p[:, None] * xs, axis=0)
        csq += col * col
    rs = 1.0 / tl.sqrt(tl.sum(csq) / D + rms_eps)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        xs = tl.load(x_ptr + t * sxt + a[:, None] * sxj + dd[None, :], mask=dd[None, :] < D,
                     other=0.0).to(tl.float32)  # fmt: skip
        nw = tl.load(nw_ptr + dd, mask=dd < D, other=0.0).to(tl.float32)
        y = tl.sum(p[:, None] * xs, axis=0) * rs * nw
        tl.store(y_ptr + t * syt + dd, y.to(y_ptr.dtype.element_ty), mask=dd < D)


@triton.jit
def _hc_mix_finish(
    x_ptr, sxt, sxj, fn_ptr, sfn, mp_ptr, sq_ptr, sps, out_ptr, sot, post_ptr, comb_ptr,
    xn_ptr, snt, snj, cnt_ptr, base_ptr, scale_ptr, nw_ptr, pin_ptr,
    pre2_ptr, post2_ptr, comb2_ptr, y_ptr, syt, D, d_per_split, iters, hc_eps, norm_eps,
    rms_eps, N: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, HAS_POST: tl.constexpr,
    HAS_PRE_IN: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr, BD: tl.constexpr,
    BDF: tl.constexpr,
):  # fmt: skip
    """The one-launch form, program (token, d-split): the split's partial mix and sum of
    squares (of ``X'`` with HAS_POST, stored as in ``_hc_mix_partial``) in fp32, then a count
    at the token's counter; the token's last program (counter back to zero) runs
    :func:`_finish_one_tile` on the streams ``xn`` (X' with HAS_POST, else X: ``x`` itself)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    jn = tl.arange(0, N)
    w = tl.arange(0, WP)
    m = tl.zeros((WP,), tl.float32)
    sq = tl.zeros((BD,), tl.float32)
    d_lo = s * d_per_split
    for d0 in range(d_lo, tl.minimum(d_lo + d_per_split, D), BD):
        dd = d0 + tl.arange(0, BD)
        m2 = (jn[:, None] < N) & (dd[None, :] < D)
        xs = tl.load(x_ptr + t * sxt + jn[:, None] * sxj + dd[None, :], mask=m2,
                     other=0.0).to(tl.float32)  # fmt: skip
        if HAS_POST:  # X'[k] = post_k out + sum_j comb[j, k] X[j], rounded as stored
            o = tl.load(out_ptr + t * sot + dd, mask=dd < D, other=0.0).to(tl.float32)
            c = tl.load(comb_ptr + t * N * N + jn[:, None] * N + jn[None, :])
            p = tl.load(post_ptr + t * N + jn)
            xs = p[:, None] * o[None, :] + tl.sum(c[:, :, None] * xs[:, None, :], axis=0)
            xs = xs.to(xn_ptr.dtype.element_ty)
            tl.store(xn_ptr + t * snt + jn[:, None] * snj + dd[None, :], xs, mask=m2)
            xs = xs.to(tl.float32)
        sq += tl.sum(xs * xs, axis=0)
        f = tl.load(fn_ptr + w[:, None, None] * sfn + jn[None, :, None] * D + dd[None, None, :],
                    mask=(w[:, None, None] < W) & m2[None, :, :], other=0.0)  # fmt: skip
        m += tl.sum(tl.sum(f * xs[None, :, :], axis=2), axis=1)
    tl.store(mp_ptr + s * sps * WP + t * WP + w, m)
    tl.store(sq_ptr + s * sps + t, tl.sum(sq, axis=0))
    tl.debug_barrier()  # every thread's stores are issued before the count
    old = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
    if old == SPLIT - 1:  # the token's last program: the others' partials (and X') are in
        tl.store(cnt_ptr + t, 0)
        tl.debug_barrier()
        _finish_one_tile(t, xn_ptr, snt, snj, mp_ptr, sq_ptr, sps, base_ptr, scale_ptr, nw_ptr,
                         pin_ptr, pre2_ptr, post2_ptr, comb2_ptr, y_ptr, syt, D, iters, hc_eps,
                         norm_eps, rms_eps, N, WP, SPLIT, HAS_PRE_IN, BDF, SPLIT_P,
                         ".cg")  # fmt: skip


@triton.jit
def _hc_post(
    out_ptr, sot, x_ptr, sxt, sxj, post_ptr, comb_ptr, xn_ptr, snt, snj, D,
    N: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """``X'[t, k] = post[t, k] out[t] + sum_j comb[t, j, k] X[t, j]``."""
    t, pid_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    a = tl.arange(0, N)
    dd = pid_d * BD + tl.arange(0, BD)
    msk = dd[None, :] < D
    xs = tl.load(x_ptr + t * sxt + a[:, None] * sxj + dd[None, :], mask=msk, other=0.0)
    o = tl.load(out_ptr + t * sot + dd, mask=dd < D, other=0.0).to(tl.float32)
    c = tl.load(comb_ptr + t * N * N + a[:, None] * N + a[None, :])
    mixed = tl.sum(c[:, :, None] * xs.to(tl.float32)[:, None, :], axis=0)
    y = tl.load(post_ptr + t * N + a)[:, None] * o[None, :] + mixed
    tl.store(xn_ptr + t * snt + a[:, None] * snj + dd[None, :], y.to(xn_ptr.dtype.element_ty),
             mask=msk)  # fmt: skip


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_streams(x: torch.Tensor, fn: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be [T, n, d] with unit stride in d, got {tuple(x.shape)}")
    t, n, d = x.shape
    if n & (n - 1) or tuple(fn.shape) != (n * (n + 2), n * d) or not fn.is_contiguous():
        raise ValueError(f"fn must be contiguous [{n * (n + 2)}, {n * d}] (n a power of 2)")
    return t, n, d


def _mix_and_finish(
    src: torch.Tensor,
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    pre_in: torch.Tensor | None,
    post_args: tuple | None,
    fixed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the split-d mix (reading ``src``; writing ``x`` when ``post_args``) and the
    finish: one launch (:func:`_finish_form` "fused") or two. ``fixed`` (the deterministic
    mode): always the two-launch "loop" form with :data:`FIXED_SPLITS` d splits at most (a
    function of d alone), so a token's sums never depend on how many tokens the call has."""
    t, n, d = x.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    sms = sm_count(dev) if x.is_cuda else 4
    form = "loop" if fixed else _finish_form(t, n, d, sms)
    wp = triton.next_power_of_2(n * (n + 2))
    out, post, comb = post_args if post_args is not None else (x, x, x)
    pre, post2, comb2 = (
        torch.empty(t, n, **f32),
        torch.empty(t, n, **f32),
        torch.empty(t, n, n, **f32),
    )
    y = torch.empty(t, d, dtype=x.dtype, device=dev)
    pin = pre_in.float().contiguous() if pre_in is not None else pre
    base32, scale32, nw = base.float().contiguous(), scale.float().contiguous(), norm_w.contiguous()
    bd = min(64, triton.next_power_of_2(d))  # the mix's columns per step
    chunks = triton.cdiv(d, bd)
    if form == "fused":
        # one wave: at 16 warps (the finish's tile) a program takes a whole SM's registers
        per = triton.cdiv(chunks, max(1, min(chunks, sms // t)))
        split = triton.cdiv(chunks, per)  # every program has columns to mix
        mp = torch.empty(split, t, wp, **f32)
        sq = torch.empty(split, t, **f32)
        bdf = triton.next_power_of_2(d)
        _hc_mix_finish[(t, split)](
            src, src.stride(0), src.stride(1), fn, fn.stride(0), mp, sq, t,
            out, out.stride(0), post, comb, x, x.stride(0), x.stride(1),
            split_counters(t, dev), base32, scale32, nw, pin,
            pre, post2, comb2, y, y.stride(0), d, per * bd, iters, hc_eps, norm_eps, rms_eps,
            N=n, W=n * (n + 2), WP=wp, HAS_POST=post_args is not None,
            HAS_PRE_IN=pre_in is not None, SPLIT=split, SPLIT_P=triton.next_power_of_2(split),
            BD=bd, BDF=bdf, num_warps=max(4, min(16, n * bdf // 1024)),
        )  # fmt: skip
        return y, post2, comb2, pre
    bt = 16
    if fixed:
        split = min(chunks, FIXED_SPLITS)
    else:
        split = max(1, min(chunks, triton.cdiv(2 * sms, triton.cdiv(t, bt))))
    d_per = triton.cdiv(chunks, split) * bd
    mp = torch.empty(split, t, wp, **f32)
    sq = torch.empty(split, t, **f32)
    _hc_mix_partial[(triton.cdiv(t, bt), split)](
        src, src.stride(0), src.stride(1), fn, fn.stride(0), mp, sq, t,
        out, out.stride(0), post, comb, x, x.stride(0), x.stride(1), t, d, d_per,
        N=n, W=n * (n + 2), WP=wp, HAS_POST=post_args is not None,
        PREC="ieee" if _interpret() else "tf32x3", BT=bt, BD=bd,
    )  # fmt: skip
    one_tile = form == "tile"
    bd = triton.next_power_of_2(d) if one_tile else min(1024, triton.next_power_of_2(d))
    _hc_finish[(t,)](
        x, x.stride(0), x.stride(1), mp, sq, t, base32, scale32, nw,
        pin, pre, post2, comb2,
        y, y.stride(0), d, iters, hc_eps, norm_eps, rms_eps,
        N=n, WP=wp, SPLIT=split, HAS_PRE_IN=pre_in is not None, BD=bd, ONE_TILE=one_tile,
        SPLIT_P=triton.next_power_of_2(split),
        num_warps=max(4, min(16, n * bd // 1024)) if one_tile else 4,
    )  # fmt: skip
    return y, post2, comb2, pre


def _finish_form(t: int, n: int, d: int, sms: int) -> str:
    """The form of a call, by shape: "loop" (two launches, two passes over d) unless the
    one-tile finish fits (a decode wave: t <= SMs, n x next_pow2(d) <= FINISH_TILE_MAX);
    then "fused" (one launch) up to FUSED_MAX_TOKENS tokens, else "tile" (two launches, the
    finish loading the token's streams once).

    "tile" against "loop", H200 (``bench/decode_plumbing.py``, the pre + finish pair,
    graph): 11.1 / 11.3 / 17.4 us at 1 / 8 / 64 tokens against 15.1 / 17.4 / 23.8 us; the
    flash rank's decode step 12.18 against 12.80 ms at batch 1 and 29.31 against 30.29 ms at
    64 (32K context). The tile holds the token's n x d streams in registers (up to 16
    warps), so it applies to a decode wave only (4 x 8192 at 16 warps is ~64 registers of
    streams per thread). "fused" is one launch of (token, d-split) programs, the token's
    last one finishing (docs/performance.md has its figures); each token reads all of
    ``fn``, so it stays at a few tokens."""
    if n * triton.next_power_of_2(d) > FINISH_TILE_MAX or t > sms:
        return "loop"
    return "fused" if t <= FUSED_MAX_TOKENS else "tile"


def hc_pre_triton(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    pre_in: torch.Tensor | None = None,
    *,
    fixed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused mix + Sinkhorn + collapse + RMSNorm: ``x`` [T, n, d] -> (normed [T, d] x.dtype,
    post [T, n], comb [T, n, n], pre [T, n]) fp32; collapse with ``pre_in`` when given.
    ``fixed``: the launch form of the deterministic mode (:func:`_mix_and_finish`)."""
    t, n, d = _check_streams(x, fn)
    if t == 0:
        return hc_pre_ref(x, fn, base, scale, norm_w, iters, hc_eps, norm_eps, rms_eps, pre_in)
    return _mix_and_finish(x, x, fn, base, scale, norm_w, iters, hc_eps, norm_eps, rms_eps,
                           pre_in, None, fixed)  # fmt: skip


def hc_post_triton(
    out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``X'_k = post_k out + sum_j comb[j, k] X_j``: -> [T, n, d] in out.dtype."""
    if x.dim() != 3 or x.stride(2) != 1 or out.shape != (x.shape[0], x.shape[2]):
        raise ValueError(
            f"out [T, d] and x [T, n, d] expected: {tuple(out.shape)} {tuple(x.shape)}"
        )
    t, n, d = x.shape
    x_new = torch.empty(t, n, d, dtype=out.dtype, device=x.device)
    bd = min(256, triton.next_power_of_2(d))
    if t:
        _hc_post[(t, triton.cdiv(d, bd))](
            out, out.stride(0), x, x.stride(0), x.stride(1), post.float().contiguous(),
            comb.float().contiguous(), x_new, x_new.stride(0), x_new.stride(1), d, N=n, BD=bd,
        )  # fmt: skip
    return x_new


def hc_post_pre_triton(
    out: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    pre_in: torch.Tensor | None = None,
    *,
    fixed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post update of one sublayer fused with the mix + collapse + norm of the next
    (``fixed``: as in :func:`hc_pre_triton`).

    -> (X' [T, n, d] out.dtype, normed [T, d], post', comb', pre')."""
    t, n, d = _check_streams(x, fn)
    if out.shape != (t, d) or out.stride(1) != 1:
        raise ValueError(f"out must be [T, d] with unit stride, got {tuple(out.shape)}")
    if t == 0:
        return hc_post_pre_ref(out, x, post, comb, fn, base, scale, norm_w, iters, hc_eps,
                               norm_eps, rms_eps, pre_in)  # fmt: skip
    x_new = torch.empty(t, n, d, dtype=out.dtype, device=x.device)
    post_args = (out, post.float().contiguous(), comb.float().contiguous())
    res = _mix_and_finish(x, x_new, fn, base, scale, norm_w, iters, hc_eps, norm_eps, rms_eps,
                          pre_in, post_args, fixed)  # fmt: skip
    return (x_new, *res)


hc_pre = op(hc_pre_ref, hc_pre_triton, invariant=functools.partial(hc_pre_triton, fixed=True))
hc_post = op(hc_expand_ref, hc_post_triton, name="hc_post")
hc_post_pre = op(hc_post_pre_ref, hc_post_pre_triton,
                 invariant=functools.partial(hc_post_pre_triton, fixed=True))  # fmt: skip
