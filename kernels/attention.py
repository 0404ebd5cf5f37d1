"""Sparse single-latent attention with a per-head sink (torch reference).

Every query token attends to its own list of key rows in a shared KV pool (K = V, one head):
the window ring and the selected compressed entries are both just rows of ``kv``.
"""

from __future__ import annotations

import torch


def sparse_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q`` [T, H, D], ``kv`` [N, D], ``idx`` [T, K] int64 rows of ``kv`` (-1 = empty),
    ``sink`` [H] fp32 logits -> out [T, H, D] in q.dtype.

    ``p_i = exp(l_i - m) / (sum_j exp(l_j - m) + exp(sink_h - m))``; fp32 softmax.
    """
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"bad shapes q{tuple(q.shape)} kv{tuple(kv.shape)} idx{tuple(idx.shape)}")
    valid = idx >= 0
    keys = kv.float()[idx.clamp_min(0)]  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


sparse_attention = sparse_attention_ref
