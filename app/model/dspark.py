"""DeepSeek-V4.1 DSpark drafting over the checkpoint's ``mtp.{0,1,2}`` stages (MODEL_SPEC §4,
docs/model.md "DSpark").

    target features  F(p) = [mean_h X_37(p) | mean_h X_38(p) | mean_h X_39(p)]   (streams
                     entering attention of the tap layers, after Engram)       [N, 3d]
    context KV       k_s(p) = RoPE_p(kv_norm_s(wkv_s(main_norm(main_proj F(p)))))  per stage s,
                     a ring of W rows per request slot (position p at slot*W + p % W)
    block            [bonus, noise x (B-1)] at positions a+1 .. a+B (a = the last committed
                     position, the bonus = the target's token at a+1); every row sees the
                     context window [a-W+1, a] and the whole block (bidirectional)
    stages           single-pass mHC, SWA attention over the two key sources, routed MoE
    heads            g = collapse(streams) (pre-norm); U = head(norm(g));
                     z_k = U_k + markov(prev_k) with prev_0 = bonus, prev_k = d_k (drafted one
                     after another); confidence c_k = sigmoid(proj([g_k ; markov_embed(prev_k)]))

Row k of the block proposes d_{k+1}, the token at position a+2+k; a verify of the bonus and
k drafts covers positions a+1 .. a+1+k. Every row of the block runs the stages (they attend
to each other); the heads run on the first k rows only (the head GEMM over all B rows read
B / k of the logits nobody used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.kv_store import KVRows
from app.model.model import DeepseekModel, apply_pending
from kernels.attention import sparse_attention
from kernels.invariant import linear, pointwise, stream_mean
from kernels.kv_quant import kv_qdq
from kernels.mhc_ref import hc_collapse
from kernels.norm import norm_rope


@dataclass
class DraftBlock:
    """One block per request: ``ids`` [R, k] drafted tokens, ``logits`` [R, k, V] fp32
    (before temperature: the proposal distribution is their softmax at the request's
    temperature; DSpark's are Markov-corrected), ``confidence`` [R, k] in (0, 1) (None: the
    drafter has no confidence head, e.g. V4 MTP)."""

    ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None


def supports_dspark(model: DeepseekModel) -> str | None:
    """Why ``model`` cannot draft with DSpark, or None."""
    cfg = model.cfg
    problem = cfg.draft_problem("dspark")
    if problem is None and (len(model.mtp) != cfg.num_nextn_predict_layers or not model.mtp):
        return "the checkpoint has no mtp.* DSpark stages"
    return problem


class DSparkDrafter:
    """Context KV and draft blocks of V4.1 DSpark for a batch of requests."""

    def __init__(self, model: DeepseekModel) -> None:
        problem = supports_dspark(model)
        if problem is not None:
            raise ValueError(problem)
        self.model, self.cfg = model, model.cfg
        self.stages = list(model.mtp)
        self.block = self.cfg.dspark_block_size
        self.window = self.cfg.sliding_window
        self.quant = any(layer.attn.kv_quant for layer in model.layers)

    # ---- context ---------------------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """Per stage, the context KV [N, head_dim] of positions ``positions`` [N] from their
        target features [N, taps * hidden]."""
        first = self.stages[0]
        # the projection casts to its own weights (a bf16 Linear) or keeps the activations'
        # dtype (an fp8 one kept as stored: casting to its e4m3 weight dtype would clip)
        x = first.main_norm(first.main_proj(features))
        out = []
        for stage in self.stages:
            att = stage.attn
            ang = att.rotary.angles(positions)
            kv = norm_rope(att.wkv(x), att.kv_norm.weight, att.kv_norm.eps, ang.cos(), ang.sin())
            out.append(kv_qdq(kv, "fp8", 32) if self.quant else kv)
        return out

    def write_context(
        self, rings: list[KVRows], slots: torch.Tensor, features: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:  # fmt: skip
        """Store the context KV of rows (``slots``, ``positions``) [N] in the stage rings."""
        if positions.numel() == 0:
            return
        rows = slots * self.window + positions.remainder(self.window)
        for ring, kv in zip(rings, self.context_kv(features, positions), strict=True):
            ring.write(rows, kv)

    # ---- the block --------------------------------------------------------------------------
    def draft(
        self,
        rings: list[KVRows],
        slots: torch.Tensor,
        anchors: torch.Tensor,
        bonus: torch.Tensor,
        num_drafts: int,
        pick=None,
    ) -> DraftBlock:
        """Draft ``num_drafts`` (<= block size) tokens per request: ``slots`` [R], ``anchors``
        [R] (last committed positions), ``bonus`` [R] (the token at anchor + 1).
        ``pick(k, logits [R, V]) -> tokens [R]`` chooses draft k (default: argmax)."""
        cfg, B, W = self.cfg, self.block, self.window
        if not 1 <= num_drafts <= B:
            raise ValueError(f"num_drafts must be in [1, {B}], got {num_drafts}")
        R, dev = anchors.numel(), anchors.device
        model = self.model
        ids = torch.full((R, B), cfg.dspark_noise_token_id, dtype=torch.int64, device=dev)
        ids[:, 0] = bonus
        pos = (anchors.unsqueeze(1) + 1 + torch.arange(B, device=dev)).reshape(-1)  # [R*B]
        flat_ids = ids.reshape(-1)
        # context keys: positions a-W+1 .. a of the request's ring (-1 before position 0)
        q = anchors.unsqueeze(1) - W + 1 + torch.arange(W, device=dev)  # [R, W]
        ctx = torch.where(q >= 0, slots.unsqueeze(1) * W + q.remainder(W), -1)
        ctx = ctx.repeat_interleave(B, dim=0)  # every block row sees the same window
        own = torch.arange(R * B, device=dev).view(R, B).repeat_interleave(B, dim=0)  # [R*B, B]
        x = model.embed.weight[flat_ids]
        X = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        p = torch.zeros(R * B, cfg.hc_mult, dtype=torch.float32, device=dev)
        p[:, 0] = 1.0
        pending = None
        for stage, ring in zip(self.stages, rings, strict=True):
            X, h, post, comb, a_pre = stage._post_pre(X, pending, "hc_attn", stage.attn_norm, p)
            att = self._attention(stage.attn, h, pos, ring, ctx, own)
            X, h, post, comb, p = stage._post_pre(
                X, (att, post, comb), "hc_ffn", stage.ffn_norm, a_pre
            )
            pending = (stage.ffn(h, flat_ids), post, comb)
        g = hc_collapse(apply_pending(X, pending), p)  # [R*B, d], pre-norm
        last = self.stages[-1]
        g = g.view(R, B, -1)[:, :num_drafts]  # the rows that propose a draft
        base = model.compute_logits(last.norm(g.reshape(R * num_drafts, -1)))
        base = base.view(R, num_drafts, -1)
        embed = last.markov_head.embed.weight  # [V, rank]: a lookup
        head = last.markov_head.head.weight  # [V, rank]
        prev = bonus
        toks, logits, conf = [], [], []
        for k in range(num_drafts):  # semi-autoregressive: d_{k+1} conditions on d_k
            e = embed[prev]
            z = base[:, k] + linear(e.float(), head.float())
            c_in = torch.cat((g[:, k].float(), e.float()), dim=-1)
            w = last.confidence_head.proj.weight.float()
            conf.append(pointwise(torch.sigmoid, linear(c_in, w)).squeeze(-1))
            tok = z.argmax(-1) if pick is None else pick(k, z)
            toks.append(tok)
            logits.append(z)
            prev = tok
        return DraftBlock(torch.stack(toks, 1), torch.stack(logits, 1), torch.stack(conf, 1))

    def _attention(self, att, x, pos, ring: KVRows, ctx, own) -> torch.Tensor:
        """SWA attention of the block rows over [context window ; own block]."""
        ang = att.rotary.angles(pos)
        q, _, kv = att.qkv_fused(x, ang.cos(), ang.sin())
        if self.quant:
            kv = kv_qdq(kv, "fp8", 32)
        out = sparse_attention(
            q, ring.data, ctx, att.attn_sink, att.head_dim**-0.5, kv_scale=ring.scale,
            kv2=kv.to(q.dtype).contiguous(), idx2=own, inv_rope_angles=ang,
        )  # fmt: skip
        return att.project(out)


def stream_means(X: torch.Tensor) -> torch.Tensor:
    """The target feature of one tap layer: the mean of its input streams [T, n, d] -> [T, d]."""
    return stream_mean(X).to(X.dtype)
