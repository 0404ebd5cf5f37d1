"""MoE gate: sqrtsoftplus scores, bias-corrected top-k, normalized weights.

Torch reference :func:`moe_gate_ref` (from logits) and MegaGate :func:`moe_gate_triton` (from
``x`` and ``W_gate``): a split-K router GEMM writing fp32 partial logits, then one fused
epilogue kernel (sum partials, sqrtsoftplus, top-k of ``s + bias`` with ties to the lower
expert id or the V4 hash ids, normalize x route scale).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op, sm_count
from kernels.invariant import linear, pointwise


def moe_gate_ref(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    route_scale: float,
    hash_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` [T, E] -> (expert ids [T, k] int64, weights [T, k] fp32).

    ``s = sqrt(softplus(logits))``; ids = top-k of ``s + bias`` (ties: lower id), or
    ``hash_idx`` when given (V4 hash layers); ``w = s[ids] / sum s[ids] * route_scale``.
    """
    s = torch.sqrt(pointwise(torch.nn.functional.softplus, logits.float()))
    if hash_idx is not None:
        ids = hash_idx.long()
    else:
        sel = s if bias is None else s + bias.float()
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(-1, ids)
    w = w / w.sum(-1, keepdim=True) * route_scale
    return ids, w


moe_gate = moe_gate_ref


@triton.jit
def _gate_logits(
    x_ptr, sxm, w_ptr, swe, p_ptr, sps, T, E, k_per_split, K,
    CDT: tl.constexpr, PREC: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Partial logits ``P[split, t, e] = x[t, k-range] . W[e, k-range]`` (fp32 accumulate)."""
    pid_t, pid_e, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pid_t * BT + tl.arange(0, BT)
    e = pid_e * BE + tl.arange(0, BE)
    acc = tl.zeros((BT, BE), tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + t[:, None].to(tl.int64) * sxm + kk[None, :], mask=t[:, None] < T)
        b = tl.load(w_ptr + e[None, :].to(tl.int64) * swe + kk[:, None], mask=e[None, :] < E)
        acc = tl.dot(a.to(CDT), b.to(CDT), acc, input_precision=PREC)
    msk = (t[:, None] < T) & (e[None, :] < E)
    tl.store(p_ptr + pid_k * sps + t[:, None] * E + e[None, :], acc, mask=msk)


@triton.jit
def _log1p(y):
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))


@triton.jit
def _gate_topk(
    p_ptr, sps, b_ptr, h_ptr, ids_ptr, w_ptr, T, E, route_scale,
    SPLIT: tl.constexpr, TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HASH: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    """Epilogue: ``s = sqrt(softplus(l))``; top-k of ``s + bias`` (lower id wins ties)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    tmask = t < T
    msk = tmask[:, None] & (e[None, :] < E)
    logit = tl.zeros((BT, BE), tl.float32)
    for s in tl.static_range(SPLIT):
        logit += tl.load(p_ptr + s * sps + t[:, None] * E + e[None, :], mask=msk, other=0.0)
    sp = tl.where(logit > 20.0, logit, _log1p(tl.exp(tl.minimum(logit, 20.0))))
    score = tl.sqrt(sp)
    sel = score
    if HAS_BIAS:
        sel += tl.load(b_ptr + e, mask=e < E, other=0.0)[None, :]
    sel = tl.where(msk, sel, float("-inf"))
    total = tl.zeros((BT,), tl.float32)
    for j in tl.static_range(TOPK):
        if HAS_HASH:
            idx = tl.load(h_ptr + t * TOPK + j, mask=tmask, other=0).to(tl.int32)
        else:
            best = tl.max(sel, axis=1)
            idx = tl.min(tl.where(sel == best[:, None], e[None, :], BE), axis=1)
            sel = tl.where(e[None, :] == idx[:, None], float("-inf"), sel)
        sv = tl.sum(tl.where(e[None, :] == idx[:, None], score, 0.0), axis=1)
        total += sv
        tl.store(ids_ptr + t * TOPK + j, idx.to(tl.int64), mask=tmask)
        tl.store(w_ptr + t * TOPK + j, sv, mask=tmask)
    for j in tl.static_range(TOPK):
        sv = tl.load(w_ptr + t * TOPK + j, mask=tmask, other=0.0)
        tl.store(w_ptr + t * TOPK + j, sv / total * route_scale, mask=tmask)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def moe_gate_triton(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    route_scale: float,
    hash_idx: torch.Tensor | None = None,
    *,
    fixed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MegaGate: ``x`` [T, d], ``w_gate`` [E, d] -> (ids [T, k] int64, weights [T, k] fp32).

    Same result as ``moe_gate_ref(x.float() @ w_gate.float().T, ...)``; ``bias`` [E] fp32
    (or V4.1 ``bias_vl``), ``hash_idx`` [T, k] (V4 ``tid2eid[tokens]``) replaces the top-k.
    ``fixed`` (the deterministic mode): the tiles and K splits of a 64-token call whatever
    the tokens, so a token's logits are summed in one order.
    """
    if x.dim() != 2 or w_gate.dim() != 2 or x.shape[1] != w_gate.shape[1]:
        raise ValueError(
            f"x [T, d] and w_gate [E, d] expected: {tuple(x.shape)} {tuple(w_gate.shape)}"
        )
    if x.stride(1) != 1 or w_gate.stride(1) != 1:
        raise ValueError("x and w_gate need unit stride in d")
    t, d = x.shape
    n_exp = w_gate.shape[0]
    if bias is not None and (bias.shape != (n_exp,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be fp32 [{n_exp}], got {bias.dtype} {tuple(bias.shape)}")
    if hash_idx is not None and tuple(hash_idx.shape) != (t, k):
        raise ValueError(f"hash_idx must be [{t}, {k}], got {tuple(hash_idx.shape)}")
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    weights = torch.empty(t, k, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, weights
    bf16 = x.dtype == w_gate.dtype == torch.bfloat16 and not _interpret()
    cdt, prec = (tl.bfloat16, "tf32") if bf16 else (tl.float32, "ieee")
    bt = 16 if t <= 16 and not fixed else 64
    be = 64 if t <= 64 or fixed else 128
    bk = next(b for b in (128, 64, 32, 16) if d % b == 0)
    sms = sm_count(x.device) if x.is_cuda else 4
    blocks = (1 if fixed else triton.cdiv(t, bt)) * triton.cdiv(n_exp, be)
    split = max(1, min(d // bk, triton.cdiv(2 * sms, blocks)))
    k_per = triton.cdiv(d // bk, split) * bk
    part = torch.empty(split, t, n_exp, dtype=torch.float32, device=x.device)
    _gate_logits[(triton.cdiv(t, bt), triton.cdiv(n_exp, be), split)](
        x, x.stride(0), w_gate, w_gate.stride(0), part, part.stride(0), t, n_exp, k_per, d,
        CDT=cdt, PREC=prec, BT=bt, BE=be, BK=bk,
    )  # fmt: skip
    # one token per program: each of the k rounds is three reductions along a row, and a
    # 4-token, 4-warp program (before) spent ~17 us at 8 tokens on their barriers (H200).
    # Warps: 2 per 512 experts below 8 tokens, 4 from 8 (H200, 384 experts, top-6, graph:
    # 1 / 2 / 4 warps 8.1 / 7.15 / 9.7 us at 1 token, 8.4 / 7.3 / 6.2 at 8, 8.8 / 7.5 / 6.4
    # at 64; outputs equal)
    be = triton.next_power_of_2(n_exp)
    warps = max(1, min(8, be // (128 if t >= 8 or fixed else 256)))
    _gate_topk[(t,)](
        part, part.stride(0), bias if bias is not None else part,
        hash_idx.contiguous() if hash_idx is not None else ids, ids, weights, t, n_exp,
        float(route_scale), SPLIT=split, TOPK=k, HAS_BIAS=bias is not None,
        HAS_HASH=hash_idx is not None, BT=1, BE=be, num_warps=warps,
    )  # fmt: skip
    return ids, weights


def moe_gate_fused_ref(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    route_scale: float,
    hash_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_gate_ref` of the fp32 router GEMM ``x.float() @ w_gate.float().T``."""
    return moe_gate_ref(linear(x.float(), w_gate.float()), bias, k, route_scale, hash_idx)


moe_gate_fused = op(moe_gate_fused_ref, moe_gate_triton,
                    invariant=functools.partial(moe_gate_triton, fixed=True))  # fmt: skip


__all__ = ["moe_gate", "moe_gate_fused", "moe_gate_fused_ref", "moe_gate_ref", "moe_gate_triton"]
