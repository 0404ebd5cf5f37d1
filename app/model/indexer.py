"""Lightning indexer modules (V4 CSA and V4.1 Full/Reindex) and V4.1 candidate blocks."""

from __future__ import annotations

import torch
from torch import nn

from app.model.compressor import CompressorV4
from app.model.config import ModelConfig
from app.model.layers import Linear, RMSNorm
from kernels.indexer import indexer_scores
from kernels.topk import topk


class Indexer(nn.Module):
    """Query side of the indexer: ``qI = RoPE(wq_b c_q)``, ``w = weights_proj(x) / sqrt(Di*Hi)``.

    V4 also owns a compressor producing its keys (``compressor``, overlapping, ratio 4);
    V4.1 Full layers own ``wk``/``k_norm`` applied to the unrotated compressed latent.
    """

    def __init__(self, cfg: ModelConfig, owns_keys: bool):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        if owns_keys and cfg.is_v41:
            self.wk = Linear(cfg.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        elif owns_keys:
            self.compressor = CompressorV4(
                cfg.hidden_size, self.head_dim, 4, overlap=True, eps=cfg.rms_norm_eps
            )

    def queries(
        self, x: torch.Tensor, c_q: torch.Tensor, angles: torch.Tensor, rope
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [L, Hi, Di], head weights [L, Hi])."""
        q = rope(self.wq_b(c_q).view(x.shape[0], self.n_heads, self.head_dim), angles)
        w = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w

    def scores(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        return indexer_scores(q, keys, w, visible)


def candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int
) -> torch.Tensor:
    """V4.1 candidate mask [L, C]: blocks of ``block`` entries scored by their max, the
    latest visible block always kept, the best ``n_blocks`` blocks (ties: lower block) kept.

    Example (block 2, n_blocks 1): scores [[5, -inf, 1, 2]] visible [4] -> block maxes
    [5, 2]; latest block (1) forced -> keep block 1 only -> [[F, F, T, T]] & visible.
    """
    L, C = scores.shape
    pad = (-C) % block
    bs = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    bs = bs.view(L, -1, block).amax(dim=-1)
    last = (visible - 1).div(block, rounding_mode="floor")
    ids = torch.arange(bs.shape[1], device=scores.device)
    bs = bs.masked_fill(ids.unsqueeze(0) == last.unsqueeze(1), float("inf"))
    chosen = topk(bs, n_blocks)  # -1 where the block score is -inf
    keep = torch.zeros(L, bs.shape[1] + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, torch.where(chosen >= 0, chosen, bs.shape[1]), True)
    keep = keep[:, :-1].repeat_interleave(block, dim=1)[:, :C]
    cols = torch.arange(C, device=scores.device)
    return keep & (cols.unsqueeze(0) < visible.unsqueeze(1))
