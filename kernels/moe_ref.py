"""Routed experts with the clamped SwiGLU, in torch: the references of the MegaMoE kernels.

``y_e = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))``; ``out = sum_k w_k y_{e_k}``, over
per-expert weights (:func:`moe_experts_ref`) or the stacked fp8 / fp4 / fp8-rows experts the
kernels read, dequantized here (:func:`moe_fp8_ref`, :func:`moe_fp4_ref`,
:func:`moe_fp8_rows_ref`).
"""

from __future__ import annotations

import torch

from kernels.invariant import linear, pointwise
from kernels.moe_formats import fp4_from_pairs
from kernels.quant import dequantize_fp4, dequantize_fp8_block, round_fp8_act


def swiglu_clamp(h1: torch.Tensor, h3: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(h1, limit)) * clamp(h3, -limit, limit)`` (limit <= 0 disables the clamp)."""
    if limit > 0:
        h1 = h1.clamp(max=limit)
        h3 = h3.clamp(-limit, limit)
    return pointwise(torch.nn.functional.silu, h1) * h3


def moe_experts_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    w3: list[torch.Tensor],
    limit: float,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 0,
) -> torch.Tensor:
    """``x`` [T, d], ``ids``/``weights`` [T, k]; per-expert weights w1/w3 [I, d], w2 [d, I]
    -> [T, d] in ``out_dtype`` (default ``x.dtype``; the sum over experts is fp32).

    Experts absent from ``w1`` (None) are not local to this rank and contribute nothing;
    neither does id -1 (an empty slot).
    ``act_fp8``: both GEMMs' activations rounded by :func:`fake_quant_act`, one scale per
    row (h after a bf16 round trip, as the kernels store it). ``act_group``: rounded as the
    release rounds them instead (``kernels.quant.round_fp8_act``, groups of that many
    columns), h after the routing weight, which the release applies before W2 (and so rounds
    the product; without rounding the weight goes on W2's output, the same sum).
    """
    out = torch.zeros(
        x.shape[0], w2[0].shape[0] if w2 else x.shape[1], dtype=torch.float32, device=x.device
    )
    flat_ids = ids.reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    flat_w = weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        if e < 0 or w1[e] is None:  # -1: an empty slot (EP padding rows)
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        t = tok[sel]
        xe = fake_quant_act(x[t]) if act_fp8 else x[t]
        if act_group:
            xe = round_fp8_act(xe, act_group)
        h = swiglu_clamp(linear(xe, w1[e]), linear(xe, w3[e]), limit)
        if act_fp8:
            h = fake_quant_act(h.to(torch.bfloat16).to(h.dtype))
        if act_group:
            h = round_fp8_act(h * flat_w[sel].unsqueeze(-1).to(h.dtype), act_group)
            y = linear(h, w2[e]).float()
        else:
            y = linear(h, w2[e]).float() * flat_w[sel].unsqueeze(-1)
        out.index_add_(0, t, y)
    return out.to(out_dtype or x.dtype)


moe_experts = moe_experts_ref


def fake_quant_act(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` [..., K] like the kernels' fp8 activations: one scale per row, scale =
    amax / 448 (fp32), values rounded to e4m3; returns dequantized values."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.to(x.dtype)


def _stacked_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    offset: int,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 0,
) -> torch.Tensor:
    n_exp = max(int(ids.max()) + 1, offset + w13.shape[0])
    inter = w13.shape[1] // 2
    w1: list = [None] * n_exp
    w3: list = [None] * n_exp
    w2s: list = [None] * n_exp
    for i in range(w13.shape[0]):
        w1[offset + i], w3[offset + i] = w13[i, :inter], w13[i, inter:]
        w2s[offset + i] = w2[i]
    w2s = [w if w is not None else w2[0] for w in w2s]  # only shapes are read for non-local
    return moe_experts_ref(x, ids, weights, w1, w2s, w3, limit, act_fp8, out_dtype, act_group)


def moe_fp8_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    block: tuple[int, int],
    limit: float,
    local_expert_offset: int = 0,
    out_dtype: torch.dtype | None = None,
    act_group: int = 0,
) -> torch.Tensor:
    """Dequantize stacked fp8 experts (``w13`` [E, 2I, d] = W1|W3, ``w2`` [E, d, I]) to
    ``x.dtype`` and run :func:`moe_experts_ref` (``act_group`` as there); expert
    ``offset + i`` is ``w13[i]``."""
    w13f = dequantize_fp8_block(w13, s13, block, x.dtype)
    w2f = dequantize_fp8_block(w2, s2, block, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset,
                        out_dtype=out_dtype, act_group=act_group)


def moe_fp8_rows_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 0,
) -> torch.Tensor:
    """Experts in the *fp8 rows* layout (``moe_formats.fp4_to_fp8_rows``): e4m3 ``w13``
    [E, 2I, d] and ``w2`` [E, d, I], one fp32 scale per row (``s13`` [E, 2I], ``s2``
    [E, d]), dequantized to ``x.dtype``; ``act_fp8`` rounds the activations with one scale
    per row, ``act_group`` as the release does (:func:`moe_experts_ref`)."""
    w13f = (w13.float() * s13.float().unsqueeze(-1)).to(x.dtype)
    w2f = (w2.float() * s2.float().unsqueeze(-1)).to(x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset, act_fp8,
                        out_dtype, act_group)


def moe_fp4_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    pairs: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 0,
) -> torch.Tensor:
    """Packed fp4 experts (``w13`` [E, 2I, d/2] int8 + [E, 2I, d/32] scales, ``w2``
    [E, d, I/2] + [E, d, I/32]) dequantized to ``x.dtype``, then :func:`moe_experts_ref`
    (``act_group`` as there). ``pairs``: the weights are in the ``moe_formats.fp4_to_pairs``
    layout (unpacked here first)."""
    if pairs:
        w13, w2 = fp4_from_pairs(w13), fp4_from_pairs(w2)
    w13f = dequantize_fp4(w13, s13, x.dtype)
    w2f = dequantize_fp4(w2, s2, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset,
                        out_dtype=out_dtype, act_group=act_group)
