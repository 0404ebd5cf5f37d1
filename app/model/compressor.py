"""KV compressors: V4.1 CSA2 (non-overlapping, ratio 1 or 2) and V4 CSA/HCA (gated windows).

A compressor works in two steps so that chunked prefill and decode can keep the projections
of not-yet-complete groups in a per-request tail ring:

    project(x, pos) -> (kv, gate)      per token, ``width`` channels (gate includes ape)
    pool(kv, gate)  -> entries          per group, from the ``span`` tokens the group needs

Entry w (first position ``w*ratio``) needs tokens ``[(w+1)*ratio - span, (w+1)*ratio)``:
``span = ratio`` except V4 CSA (overlapping), where ``span = 2*ratio`` (window w-1's ``Ca``
half and window w's ``Cb`` half; for w = 0 the missing window has gate -inf).
Entries are normalized and *unrotated*; attention applies RoPE at ``w*ratio``.
"""

from __future__ import annotations

import abc

import torch
from torch import nn

from app.model.layers import Linear, RMSNorm, StackingModule, stacked_projection
from kernels.compressor import compress_pool


class Compressor(StackingModule, abc.ABC):
    """Base: ``wkv``/``wgate`` projections, RMSNorm ``norm`` of the pooled entry."""

    ratio: int
    span: int
    width: int

    @abc.abstractmethod
    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (kv, gate) projections [n, width] in the weights' dtype (V4's gate, with
        ape, fp32)."""

    def pool(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        first: torch.Tensor,
        angles: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``kv``/``gate`` [E, span, width] -> entries [E, dim] (fp32), rotated when
        ``angles`` [E, rope/2] are given; ``first`` [E] marks w = 0. One fused kernel."""
        return compress_pool(
            kv,
            gate if self.ratio > 1 else None,
            first,
            self.norm.weight,
            self.norm.eps,
            overlap=self.span > self.ratio,
            ratio=self.ratio,
            dim=self.norm.weight.shape[0],
            angles=angles,
        )

    def kv_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(wkv x, wgate x) in the weights' dtype (gate None without ``wgate``: V4.1 ratio 1),
        as one GEMM over the stacked weights where they stack (:meth:`stack_projections`)."""
        if "wgate" not in self._modules:
            return self.wkv(x), None
        stack = stacked_projection(self, "_kv_gate", (self.wkv, self.wgate))
        if stack is None:
            return self.wkv(x), self.wgate(x)
        y, w = stack(x), self.wkv.out_features
        return y[..., :w], y[..., w:]

    def stack_projections(self) -> bool:
        """Stack wkv / wgate (``app.model.layers.stacked_projection``) -> whether they run as
        one GEMM."""
        return "wgate" in self._modules and \
            stacked_projection(self, "_kv_gate", (self.wkv, self.wgate)) is not None  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every complete group of one sequence that starts at position 0: [L // ratio, dim]."""
        pos = torch.arange(x.shape[0], device=x.device)
        kv, gate = self.project(x, pos)
        n = x.shape[0] // self.ratio
        ends = (torch.arange(n, device=x.device) + 1) * self.ratio
        idx = ends.unsqueeze(1) - self.span + torch.arange(self.span, device=x.device)
        safe = idx.clamp_min(0)
        return self.pool(kv[safe], gate[safe], ends == self.ratio)


class Compressor41(Compressor):
    """V4.1: ratio 1 ``norm(wkv x)``; ratio 2 ``norm(sum softmax_pair(wgate x) * wkv x)``."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = self.span = ratio
        self.width = dim
        self.wkv = Linear(hidden, dim)
        if ratio > 1:
            self.wgate = Linear(hidden, dim)
        self.norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self.kv_gate(x)
        return kv, gate if gate is not None else torch.zeros_like(kv)


class CompressorV4(Compressor):
    """V4 gated windows: HCA (``overlap=False``) softmaxes the m tokens of window w (per
    channel) of ``wgate x + ape[t mod m]`` weighting ``wkv x``; CSA (``overlap=True``) has
    2*dim-wide projections ``[Ca | Cb]`` and softmaxes over Ca of window w-1 and Cb of w."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.span = 2 * ratio if overlap else ratio
        self.width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, self.width)
        self.wgate = Linear(hidden, self.width)
        self.ape = nn.Parameter(torch.zeros(ratio, self.width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self.kv_gate(x)
        return kv, gate + self.ape.float()[pos % self.ratio]
