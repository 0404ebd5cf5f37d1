"""MoE gate (torch reference): sqrtsoftplus scores, bias-corrected top-k, normalized weights."""

from __future__ import annotations

import torch

from kernels.indexer import topk_ref


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
    s = torch.sqrt(torch.nn.functional.softplus(logits.float()))
    if hash_idx is not None:
        ids = hash_idx.long()
    else:
        sel = s if bias is None else s + bias.float()
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]
    w = s.gather(-1, ids)
    w = w / w.sum(-1, keepdim=True) * route_scale
    return ids, w


moe_gate = moe_gate_ref
__all__ = ["moe_gate", "moe_gate_ref", "topk_ref"]
