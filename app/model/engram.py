"""Engram memory (V4.1): hashed n-gram rows -> key/value -> gated update of every stream."""

from __future__ import annotations

import torch
from torch import nn

from app.model.config import ModelConfig
from app.model.engram_hash import EngramHashSpec
from app.model.ep import EPGroup, sharded_rows
from app.model.layers import Linear
from kernels.engram import engram_gate, engram_gather, engram_rows


class Engram(nn.Module):
    """``e = table[rows]`` [T, heads*dim]; ``[key(n*d) | val(d)] = wkv(e)``; per stream j:

    dot = sum(X_j * q_w_j * k_w_j * key_j) * rsqrt(ms(X_j)+eps) * rsqrt(ms(key_j)+eps) / sqrt(d)
    X_j += sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) * val     (gate 0 on masked tokens)

    ``embed.weight`` is the whole table (replicated, or a host table shared by the ranks of a
    node), or with :meth:`shard` rows ``[start, start + per_rank)`` of it: a lookup then
    fetches rows from their owners over the gang (``app.model.engram_place``).
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
        # this layer's hash constants (derived, not in the checkpoint; real even on "meta")
        for name, vals in (
            ("hash_mult", spec.multipliers[layer_index]),
            ("hash_primes", spec.primes[layer_index]),
            ("hash_offsets", spec.offsets[layer_index]),
        ):
            t = torch.tensor(vals, dtype=torch.int64, device="cpu")
            self.register_buffer(name, t, persistent=False)
        self.sharding: tuple[int, int, EPGroup] | None = None  # (start, per_rank, group)

    def shard(self, start: int, per_rank: int, group: EPGroup) -> None:
        """This rank holds table rows ``[start, start + per_rank)`` (``embed.weight``)."""
        self.sharding = (start, per_rank, group)

    def idle(self, x: torch.Tensor) -> None:
        """A sharded table's exchange with no rows of this rank (answers the others)."""
        if self.sharding is not None:
            start, per, group = self.sharding
            none = torch.zeros(0, dtype=torch.int64, device=x.device)
            sharded_rows(self.embed.weight, start, none, per, group)

    def _gather(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.sharding is None:
            return engram_gather(self.embed.weight, rows, None, dtype)
        start, per, group = self.sharding
        found = sharded_rows(self.embed.weight, start, rows, per, group)
        local = torch.arange(found.shape[0], device=rows.device).view(rows.shape)
        return engram_gather(found, local, None, dtype)

    def forward(self, X: torch.Tensor, ngram: torch.Tensor, pad_id: int) -> torch.Tensor:
        """``X`` [T, n, d]; ``ngram`` [T, max_ngram] compressed ids (-1 = blocked)."""
        rows = engram_rows(
            ngram,
            self.hash_mult,
            self.hash_primes,
            self.hash_offsets,
            self.hash_spec.n_heads,
            pad_id,
        )
        e = self._gather(rows, X.dtype)
        key, val = self.wkv(e).split((self.n * self.d, self.d), dim=-1)
        key = key.view(-1, self.n, self.d)
        return engram_gate(X, key, val, self.q_weight, self.k_weight, self.eps, ngram[:, 0] < 0)
