"""Engram memory (V4.1): hashed n-gram rows -> key/value -> gated update of every stream."""

from __future__ import annotations

import torch
from torch import nn

from app.model.config import ModelConfig
from app.model.engram_hash import EngramHashSpec, engram_rows
from app.model.layers import Linear


class Engram(nn.Module):
    """``e = table[rows]`` [T, heads*dim]; ``[key(n*d) | val(d)] = wkv(e)``; per stream j:

        dot = sum(X_j * q_w_j * k_w_j * key_j) * rsqrt(ms(X_j)+eps) * rsqrt(ms(key_j)+eps) / sqrt(d)
        X_j += sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) * val     (gate 0 on masked tokens)
    """

    def __init__(self, cfg: ModelConfig, layer_index: int, spec: EngramHashSpec):
        super().__init__()
        self.layer_index, self.hash_spec = layer_index, spec
        self.n, self.d, self.eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        rows = cfg.engram_num_embeddings[layer_index]
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(
            torch.empty(rows, cfg.engram_head_dim, dtype=torch.float32)
        )
        self.wkv = Linear(spec.hash_heads * cfg.engram_head_dim, cfg.hidden_size * (self.n + 1))
        self.q_weight = nn.Parameter(torch.ones(self.n, self.d))
        self.k_weight = nn.Parameter(torch.ones(self.n, self.d))

    def forward(self, X: torch.Tensor, ngram: torch.Tensor, pad_id: int) -> torch.Tensor:
        """``X`` [T, n, d]; ``ngram`` [T, max_ngram] compressed ids (-1 = blocked)."""
        rows = engram_rows(ngram, self.hash_spec, self.layer_index, pad_id)
        e = self.embed.weight[rows].flatten(1)
        key, val = self.wkv(e).float().split((self.n * self.d, self.d), dim=-1)
        key = key.view(-1, self.n, self.d)
        h = X.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(
            key.square().mean(-1) + self.eps
        )
        w = self.q_weight.float() * self.k_weight.float()
        dot = (h * w * key).sum(-1) * rstd * self.d**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        gate = gate.masked_fill((ngram[:, :1] < 0), 0.0)
        return (h + gate.unsqueeze(-1) * val.unsqueeze(1)).to(X.dtype)
