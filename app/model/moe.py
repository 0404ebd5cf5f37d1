"""Mixture of experts: gate (sqrtsoftplus, bias or hash selection), routed + shared experts."""

from __future__ import annotations

import torch
from torch import nn

from app.model.layers import Linear
from kernels.gate import moe_gate_fused
from kernels.moe import moe_experts, swiglu_clamp


class Gate(nn.Module):
    """Router: ``weight`` [E, d] (fp32 logits); ``bias`` [E] selection bias, or ``tid2eid``
    [vocab, k] for V4 hash layers; V4.1 ``bias_vl`` [E] for image tokens."""

    def __init__(
        self,
        d: int,
        n_experts: int,
        k: int,
        route_scale: float,
        *,
        hash_vocab: int = 0,
        has_bias_vl: bool = False,
    ):
        super().__init__()
        self.k, self.route_scale = k, route_scale
        self.weight = nn.Parameter(torch.empty(n_experts, d, dtype=torch.float32))
        if hash_vocab:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, k, dtype=torch.int64))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        if has_bias_vl:
            self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [T, k], weights [T, k] fp32)."""
        hash_idx = self.tid2eid[token_ids] if self.bias is None else None
        return moe_gate_fused(x, self.weight, self.bias, self.k, self.route_scale, hash_idx)


class Expert(nn.Module):
    """``W2(silu(min(W1 x, L)) * clamp(W3 x, +-L))``."""

    def __init__(self, d: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(d, inter), Linear(inter, d), Linear(d, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_clamp(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    """``sum_k w_k expert_{e_k}(x) + shared(x)``."""

    def __init__(
        self,
        d: int,
        inter: int,
        n_experts: int,
        k: int,
        route_scale: float,
        limit: float,
        *,
        hash_vocab: int = 0,
        has_bias_vl: bool = False,
    ):
        super().__init__()
        self.limit = limit
        self.gate = Gate(
            d, n_experts, k, route_scale, hash_vocab=hash_vocab, has_bias_vl=has_bias_vl
        )
        self.experts = nn.ModuleList(Expert(d, inter, limit) for _ in range(n_experts))
        self.shared_experts = Expert(d, inter, limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        ids, w = self.gate(x, token_ids)
        routed = moe_experts(
            x, ids, w,
            [e.w1.weight for e in self.experts],
            [e.w2.weight for e in self.experts],
            [e.w3.weight for e in self.experts],
            self.limit,
        )  # fmt: skip
        return routed + self.shared_experts(x)
