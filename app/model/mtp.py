"""DeepSeek-V4 MTP-1 drafting over the checkpoint's ``mtp.0`` block (MODEL_SPEC §4, last
paragraph; docs/model.md "MTP").

    input      x(p) = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(S(p)))   [n, d] per row:
               S(p) the target's final streams at position p (before its hc_head), t_{p+1}
               the token after p; the embedding term is added to every stream
    block      one V4 Block (mHC, SWA attention at layer id = num_hidden_layers, routed MoE)
               at position p; its window KV is a ring of W rows per request slot
    head       own hc_head (mtp.0.hc_head_*) -> mtp.0.norm -> the target's head: logits of
               t_{p+2}

A row's window KV depends only on its own input (wkv of the attention input), so the ring is
filled from the rows a step commits (``write_context``); only the anchor row (the last
committed position a, with t_{a+1} the token the step emitted) runs the whole block. Its
attention reads ring positions a - W + 1 .. a, all committed.
"""

from __future__ import annotations

import torch

from app.model.kv_store import KVRows
from app.model.model import DeepseekModel, MTPBlock, apply_pending
from kernels.attention import sparse_attention
from kernels.norm import norm_rope


def supports_mtp(model: DeepseekModel) -> str | None:
    """Why ``model`` cannot draft with MTP, or None."""
    problem = model.cfg.draft_problem("mtp")
    if problem is None and not len(model.mtp):
        return "the checkpoint has no mtp.0 block"
    return problem


class MTPDrafter:
    """Window KV and one-token drafts of the V4 MTP block for a batch of requests."""

    def __init__(self, model: DeepseekModel) -> None:
        problem = supports_mtp(model)
        if problem is not None:
            raise ValueError(problem)
        self.model, self.cfg = model, model.cfg
        self.block: MTPBlock = model.mtp[0]
        self.window = self.cfg.sliding_window

    def block_input(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """x(p) [N, n, d] from the target's final streams ``streams`` [N, n * d] (or
        [N, n, d]) and the next tokens ``next_ids`` [N]."""
        mtp, n, d = self.block, self.cfg.hc_mult, self.cfg.hidden_size
        S = streams.reshape(-1, n, d)
        e = mtp.e_proj(mtp.enorm(self.model.embed.weight[next_ids]))
        return (e.unsqueeze(1) + mtp.h_proj(mtp.hnorm(S))).to(S.dtype)

    def write_context(
        self, ring: KVRows, slots: torch.Tensor, streams: torch.Tensor, next_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:  # fmt: skip
        """Store the window KV of rows (``slots``, ``positions``) [N] in the ring."""
        if positions.numel() == 0:
            return
        mtp = self.block
        h, _, _, _ = mtp.pre_mix(self.block_input(streams, next_ids), "hc_attn",
                                 mtp.attn_norm, None)  # fmt: skip
        att = mtp.attn
        ang = att.rotary.angles(positions)
        kv = norm_rope(att.wkv(h), att.kv_norm.weight, att.kv_norm.eps, ang.cos(), ang.sin())
        ring.write(slots * self.window + positions.remainder(self.window), kv)

    def draft(
        self, ring: KVRows, slots: torch.Tensor, anchors: torch.Tensor, streams: torch.Tensor,
        bonus: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """fp32 logits [R, V] of the token at anchor + 2: ``slots`` / ``anchors`` [R], the
        streams of the anchor rows [R, n * d], ``bonus`` [R] (the token at anchor + 1). The
        anchor rows' own KV must be in the ring already (``write_context``)."""
        mtp, W = self.block, self.window
        X = self.block_input(streams, bonus)
        q = anchors.unsqueeze(1) - W + 1 + torch.arange(W, device=anchors.device)  # [R, W]
        ctx = torch.where(q >= 0, slots.unsqueeze(1) * W + q.remainder(W), -1)
        X, h, post, comb, _ = mtp._post_pre(X, None, "hc_attn", mtp.attn_norm, None)
        att = mtp.attn
        ang = att.rotary.angles(anchors)
        qh, _, _ = att.qkv_fused(h, ang.cos(), ang.sin())
        out = sparse_attention(qh, ring.data, ctx, att.attn_sink, att.head_dim**-0.5,
                               kv_scale=ring.scale, inv_rope_angles=ang)  # fmt: skip
        X, h, post, comb, _ = mtp._post_pre(
            X, (att.project(out), post, comb), "hc_ffn", mtp.ffn_norm, None
        )
        X = apply_pending(X, (mtp.ffn(h, bonus), post, comb))
        return self.logits(X)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """The MTP head over output streams [R, n, d] -> fp32 logits [R, V]."""
        mtp = self.block
        return self.model.compute_logits(mtp.norm(self.model.hc_head(X, mtp)))

