"""Lightning indexer scores and deterministic top-k (torch reference).

``score(t, c) = sum_h w[t, h] * relu(q[t, h] . k[c])`` over visible compressed entries
``c < visible[t]``; top-k picks the highest scores, ties broken by the lower index.
"""

from __future__ import annotations

import torch


def indexer_scores_ref(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """``q`` [T, H, D], ``k`` [C, D], ``w`` [T, H], ``visible`` [T] -> fp32 [T, C] (-inf masked)."""
    s = torch.einsum("thd,cd->thc", q.float(), k.float()).relu()
    s = (s * w.float().unsqueeze(-1)).sum(dim=1)
    cols = torch.arange(k.shape[0], device=k.device)
    return s.masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))


def topk_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, min(k, C)] of the top scores, ascending; picks scoring -inf become -1.

    Ties go to the lower index (stable descending sort). Example: scores [[1, 3, 3, -inf]],
    k=3 -> [[0, 1, 2]]; k=4 -> [[0, 1, 2, -1]] (the -inf slot is invalid).
    """
    kk = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kk]
    picked = scores.gather(-1, order)
    order = torch.where(picked > float("-inf"), order, torch.full_like(order, scores.shape[-1]))
    order = order.sort(dim=-1).values
    return torch.where(order == scores.shape[-1], torch.full_like(order, -1), order)


indexer_scores = indexer_scores_ref
topk = topk_ref
