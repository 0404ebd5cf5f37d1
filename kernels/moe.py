"""Routed experts with the clamped SwiGLU (torch reference).

``y_e = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))``; ``out = sum_k w_k y_{e_k}``.
"""

from __future__ import annotations

import torch


def swiglu_clamp(h1: torch.Tensor, h3: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(h1, limit)) * clamp(h3, -limit, limit)`` (limit <= 0 disables the clamp)."""
    if limit > 0:
        h1 = h1.clamp(max=limit)
        h3 = h3.clamp(-limit, limit)
    return torch.nn.functional.silu(h1) * h3


def moe_experts_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    w3: list[torch.Tensor],
    limit: float,
) -> torch.Tensor:
    """``x`` [T, d], ``ids``/``weights`` [T, k]; per-expert weights w1/w3 [I, d], w2 [d, I].

    Experts absent from ``w1`` (None) are not local to this rank and contribute nothing.
    """
    out = torch.zeros(
        x.shape[0], w2[0].shape[0] if w2 else x.shape[1], dtype=torch.float32, device=x.device
    )
    flat_ids = ids.reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    flat_w = weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        if w1[e] is None:
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        t = tok[sel]
        xe = x[t]
        h = swiglu_clamp(xe @ w1[e].t(), xe @ w3[e].t(), limit)
        y = (h @ w2[e].t()).float() * flat_w[sel].unsqueeze(-1)
        out.index_add_(0, t, y)
    return out.to(x.dtype)


moe_experts = moe_experts_ref
