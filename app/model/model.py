"""DeepSeek-V4 / V4.1 decoder: embeddings, mHC blocks, final norm and head, MTP/DSpark weights.

Parameter names equal the official checkpoint names (``embed.weight``, ``layers.{i}.attn.wq_a
.weight``, ``layers.{i}.hc_attn_fn``, ``mtp.{k}....``), so the loader maps tensors 1:1.

mHC per sublayer (V4):   pre, post, comb = mix(X); X = post*f(norm(sum pre_j X_j)) + comb^T X
V4.1 single-pass:        the pre-mix of a sublayer is the one computed before the previous
                         sublayer (p starts as e_0); Engram updates X before attention.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from app.model.attention import Attention, CompressedState
from app.model.attn_meta import StepMeta
from app.model.config import LayerMode, LayerSpec, ModelConfig
from app.model.engram import Engram
from app.model.engram_hash import EngramHashSpec, engram_hash_spec
from app.model.ep import EPGroup, ExpertShard
from app.model.forward_batch import ForwardBatch
from app.model.layers import Linear, RMSNorm
from app.model.moe import MoE
from kernels.invariant import linear, pointwise, row_mean, stream_mean
from kernels.linear import linear_f32
from kernels.mhc import hc_post, hc_post_pre, hc_pre
from kernels.mhc_ref import hc_collapse

# The post update of the last sublayer, not applied yet: (sublayer output, post, comb). The
# batched step fuses it with the next sublayer's mix (kernels.mhc.hc_post_pre).
Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _hc_params(module: nn.Module, prefix: str, n: int, d: int) -> None:
    width = n * (n + 2)
    module.register_parameter(f"{prefix}_fn", nn.Parameter(torch.zeros(width, n * d)))
    module.register_parameter(f"{prefix}_base", nn.Parameter(torch.zeros(width)))
    module.register_parameter(f"{prefix}_scale", nn.Parameter(torch.ones(3)))


class Block(nn.Module):
    """One decoder layer: attention and MoE sublayers wrapped in mHC (+ Engram on V4.1)."""

    def __init__(
        self,
        cfg: ModelConfig,
        spec: LayerSpec,
        *,
        n_experts: int | None = None,
        k: int | None = None,
        engram: tuple[int, EngramHashSpec] | None = None,
        kv_quant: bool = False,
        shard: ExpertShard | None = None,
    ):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        d, n = cfg.hidden_size, cfg.hc_mult
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, spec, kv_quant)
        self.ffn = MoE(
            d,
            cfg.moe_intermediate_size,
            n_experts or cfg.n_routed_experts,
            k or cfg.num_experts_per_tok,
            cfg.routed_scaling_factor,
            cfg.swiglu_limit,
            hash_vocab=cfg.vocab_size if spec.hash_moe else 0,
            has_bias_vl=cfg.is_v41,
            shard=shard,
        )
        _hc_params(self, "hc_attn", n, d)
        _hc_params(self, "hc_ffn", n, d)
        if engram is not None:
            self.engram = Engram(cfg, engram[0], engram[1])

    def idle(self, x: torch.Tensor) -> None:
        """This layer's gang exchanges with no tokens (sharded Engram rows, then the MoE)."""
        if hasattr(self, "engram"):
            self.engram.idle(x)
        self.ffn.idle(x)

    def _mix_args(self, which: str, norm: RMSNorm) -> tuple:
        c = self.cfg
        return (
            getattr(self, f"{which}_fn"),
            getattr(self, f"{which}_base"),
            getattr(self, f"{which}_scale"),
            norm.weight,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
            norm.eps,
        )

    def pre_mix(self, X: torch.Tensor, which: str, norm: RMSNorm, pre_in: torch.Tensor | None):
        """Fused mix + Sinkhorn + collapse + RMSNorm -> (sublayer input, post, comb, pre);
        collapses with ``pre_in`` when given (V4.1 single pass)."""
        return hc_pre(X, *self._mix_args(which, norm), pre_in=pre_in)

    def _post_pre(self, X, pending: Pending | None, which: str, norm: RMSNorm, pre_in):
        """Apply ``pending`` to ``X`` and mix for the next sublayer (one fused kernel on CUDA)
        -> (X', sublayer input, post, comb, pre)."""
        if pending is None:
            return (X, *self.pre_mix(X, which, norm, pre_in))
        out, post, comb = pending
        return hc_post_pre(out, X, post, comb, *self._mix_args(which, norm), pre_in=pre_in)

    def forward(
        self,
        X: torch.Tensor,
        p: torch.Tensor | None,
        pending: Pending | None,
        batch: ForwardBatch,
        meta: StepMeta,
        state: CompressedState,
        ngram: torch.Tensor | None,
        pad_id: int,
        capture: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, Pending]:
        """``X`` [T, n, d] streams (with the previous sublayer's update ``pending``), ``p``
        the carried pre-mix [T, n] (V4.1) -> (X, p', this layer's pending FFN update).
        ``capture``: appends the mean of the streams entering attention (DSpark taps)."""
        v41 = self.cfg.is_v41
        if v41 and hasattr(self, "engram"):
            X = apply_pending(X, pending)
            pending = None
            X = self.engram(X, ngram, pad_id)
        X, h, post, comb, a_pre = self._post_pre(
            X, pending, "hc_attn", self.attn_norm, p if v41 else None
        )
        if capture is not None:
            capture.append(stream_mean(X).to(X.dtype))
        att = self.attn(h, batch, meta, state)
        X, h, post, comb, f_pre = self._post_pre(
            X, (att, post, comb), "hc_ffn", self.ffn_norm, a_pre if v41 else None
        )
        return X, (f_pre if v41 else None), (self.ffn(h, batch.input_ids), post, comb)


def apply_pending(X: torch.Tensor, pending: Pending | None) -> torch.Tensor:
    """``X`` with a pending sublayer update applied."""
    return X if pending is None else hc_post(pending[0], X, pending[1], pending[2])


class MTPBlock(Block):
    """V4 MTP (``mtp.0``) or V4.1 DSpark stage (``mtp.{k}``): weights kept for speculation."""

    def __init__(self, cfg: ModelConfig, k: int):
        ratio = cfg.mtp_ratio(k)
        spec = LayerSpec(
            layer_id=cfg.num_hidden_layers + k,
            mode=LayerMode.SWA if ratio == 0 else (LayerMode.CSA if ratio == 4 else LayerMode.HCA),
            ratio=ratio,
            kv_source=cfg.num_hidden_layers + k if ratio else -1,
            index_source=cfg.num_hidden_layers + k if ratio == 4 else -1,
        )
        if cfg.is_v41:
            super().__init__(
                cfg, spec, n_experts=cfg.dspark_n_routed_experts, k=cfg.dspark_num_experts_per_tok
            )
        else:
            super().__init__(cfg, spec)
        d, n = cfg.hidden_size, cfg.hc_mult
        if cfg.is_v41:
            if k == 0:
                self.main_proj = Linear(d * len(cfg.dspark_target_layer_ids), d)
                self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
            if k == cfg.num_nextn_predict_layers - 1:
                self.norm = RMSNorm(d, cfg.rms_norm_eps)
                self.markov_head = nn.Module()
                self.markov_head.embed = Linear(cfg.dspark_markov_rank, cfg.vocab_size)
                self.markov_head.head = Linear(cfg.dspark_markov_rank, cfg.vocab_size)
                self.confidence_head = nn.Module()
                self.confidence_head.proj = Linear(d + cfg.dspark_markov_rank, 1)
        else:
            self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)
            self.enorm = RMSNorm(d, cfg.rms_norm_eps)
            self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * d))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekModel(nn.Module):
    """The full model. ``forward(batch)`` -> logits of every token [T, vocab] (fp32).

    V4.1 Engram needs the compressed token map of the checkpoint's tokenizer:
    pass ``engram_token_map`` (see :func:`app.model.engram_hash.compressed_token_map`).
    ``kv_quant`` rounds V4.1 KV like the released cache formats (see ``kernels.kv_quant``).
    ``shard``: expert parallelism: the decoder layers hold only this rank's experts (the
    MTP / DSpark blocks keep all of theirs: drafting stays local); :meth:`set_ep` joins the
    gang, and every step of a rank with no tokens is :meth:`idle_step`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        engram_token_map: Sequence[int] | None = None,
        kv_quant: bool = False,
        shard: ExpertShard | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.empty(cfg.vocab_size, d))
        self.hash_spec: EngramHashSpec | None = None
        if cfg.is_v41 and cfg.engram_layer_ids:
            self.hash_spec = engram_hash_spec(
                cfg.engram_layer_ids,
                cfg.engram_max_ngram_size,
                cfg.engram_n_heads,
                cfg.engram_vocab_size,
                cfg.engram_compressed_vocab_size,
            )
        layers = []
        for spec in cfg.layers:
            eng = None
            if spec.engram and self.hash_spec is not None:
                eng = (cfg.engram_layer_ids.index(spec.layer_id), self.hash_spec)
            layers.append(Block(cfg, spec, engram=eng, kv_quant=kv_quant, shard=shard))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size)
        if not cfg.is_v41:
            self.hc_head_fn = nn.Parameter(torch.zeros(n, n * d))
            self.hc_head_base = nn.Parameter(torch.zeros(n))
            self.hc_head_scale = nn.Parameter(torch.ones(1))
        self.mtp = nn.ModuleList(MTPBlock(cfg, k) for k in range(cfg.num_nextn_predict_layers))
        self.register_buffer(
            "engram_map", torch.zeros(0, dtype=torch.int64, device="cpu"), persistent=False
        )
        self.ep: EPGroup | None = None
        if engram_token_map is not None:
            self.set_engram_token_map(engram_token_map)

    def set_engram_token_map(self, token_map: Sequence[int]) -> None:
        """Install the tokenizer's token id -> compressed id map. Embedding rows past the
        tokenizer (never produced by encoding) map to the pad token's compressed id."""
        tmap = list(token_map)
        pad = tmap[self.cfg.engram_pad_token_id]
        tmap += [pad] * (self.cfg.vocab_size - len(tmap))
        self.engram_map = torch.tensor(tmap, dtype=torch.int64, device=self.engram_map.device)
        self._engram_pad = int(pad)

    def set_ep(self, group: EPGroup, shard: ExpertShard) -> None:
        """Run every decoder layer's routed experts over ``group`` (this rank: ``shard``)."""
        for layer in self.layers:
            layer.ffn.set_ep(shard.placement, group)
        self.ep = group

    @property
    def gang_exchanges(self) -> bool:
        """Whether a step exchanges with the gang (EP experts or sharded Engram rows): then
        every rank runs every step, :meth:`idle_step` when it has no tokens."""
        return self.ep is not None and self.ep.size > 1

    @torch.no_grad()
    def idle_step(self) -> None:
        """The gang exchanges of one step with no tokens of this rank, in layer order."""
        self._idle_layers(0)

    def _idle_layers(self, first: int) -> None:
        x = self.embed.weight[:0]
        for layer in self.layers[first:]:
            layer.idle(x)

    @property
    def engram_pad(self) -> int:
        """Compressed id of the Engram pad token (a host integer; -1 without Engram)."""
        return getattr(self, "_engram_pad", -1)

    # ---- forward ------------------------------------------------------------------------
    @property
    def decoder_start(self) -> int:
        """First V4.1 "decoder" layer: after the last layer that owns compressed KV; such
        layers keep only window KV, so decoder replay may skip their early prompt rows."""
        if not self.cfg.is_v41 or not self.cfg.kv_source_layer_ids:
            return self.cfg.num_hidden_layers
        return max(self.cfg.kv_source_layer_ids) + 1

    def _ngrams(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[T, max_ngram] compressed ids of each token and its predecessors (-1 before the
        sequence start or on image tokens); predecessors before the chunk come from
        ``batch.history`` (newest first). Example (max 3), chunk [c d] at position 2 after
        [a b]: history [b, a] -> [[c, b, a], [d, c, b]]."""
        if self.hash_spec is None:
            return None
        if self.engram_map.numel() == 0:
            raise RuntimeError("V4.1 Engram needs the tokenizer's compressed token map")
        n_back = self.hash_spec.max_ngram - 1
        ids, dev = batch.input_ids, batch.device
        T = ids.numel()
        k = torch.arange(n_back + 1, device=dev)
        q = batch.positions.unsqueeze(1) - k  # [T, n] predecessor positions
        a = batch.prefix_lens[batch.token_seq].unsqueeze(1)
        flat = (torch.arange(T, device=dev).unsqueeze(1) - k).clamp_min(0)
        tok = ids[flat]
        back = (a - 1 - q).clamp(0, max(n_back - 1, 0))  # history index: newest first
        if batch.history is not None and n_back:
            old = batch.history[batch.token_seq.unsqueeze(1).expand_as(back), back]
        else:
            old = torch.full_like(tok, -1)
        tok = torch.where(q >= a, tok, torch.where(q >= 0, old, -1))
        comp = torch.where(tok >= 0, self.engram_map[tok.clamp_min(0)], -1)
        if self.cfg.image_token_id is not None:
            comp = comp.masked_fill(tok == self.cfg.image_token_id, -1)
        return comp

    def head_input(self, X: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
        """Final streams -> the normalized hidden state the head reads [R, d]."""
        return self.norm(hc_collapse(X, p) if self.cfg.is_v41 else self.hc_head(X, self))

    def hc_head(self, X: torch.Tensor, owner: nn.Module) -> torch.Tensor:
        """V4's collapse of the streams [R, n, d] -> [R, d] with ``owner``'s ``hc_head_*``
        weights (the model's, or the MTP block's own)."""
        flat = X.flatten(1).float()
        mix = linear(flat, owner.hc_head_fn.float()) * torch.rsqrt(
            row_mean(flat.square()) + self.cfg.rms_norm_eps
        )
        logits = mix * owner.hc_head_scale.float() + owner.hc_head_base.float()
        pre = pointwise(torch.sigmoid, logits)
        return hc_collapse(X, pre + self.cfg.hc_eps)

    def hidden(self, batch: ForwardBatch, features: list | None = None) -> torch.Tensor:
        """One batched step over the paged cache -> final hidden states of the rows that reach
        the head [R, d]: every row, or with V4.1 decoder replay the rows of
        ``batch.decoder.keep``. ``features``: receives the draft features of those rows: on
        V4.1 the DSpark target features [R, taps * d] (``app.model.dspark``), on V4 the final
        streams [R, n * d] the MTP block reads (``app.model.mtp``)."""
        cfg = self.cfg
        x = self.embed.weight[batch.input_ids]
        X = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        p = None
        if cfg.is_v41:
            p = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
            p[:, 0] = 1.0
        ngram = self._ngrams(batch)
        meta, state = StepMeta(batch, cfg.sliding_window), CompressedState()
        pending = None
        taps = set(cfg.dspark_target_layer_ids) if features is not None else set()
        caught: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i == self.decoder_start and batch.decoder is not None:
                keep = batch.decoder.keep
                if keep.numel() == 0:  # no row of this step reaches the decoder layers
                    if self.gang_exchanges:
                        self._idle_layers(i)
                    if features is not None:
                        features.append(X.new_zeros(0, cfg.hidden_size * len(taps)))
                    return X.new_zeros(0, cfg.hidden_size)
                X, pending = apply_pending(X, pending)[keep], None
                p = p[keep] if p is not None else None
                ngram = ngram[keep] if ngram is not None else None
                state = state.subset(keep)
                caught = [c[keep] for c in caught]
                batch = batch.decoder.batch
                meta = StepMeta(batch, cfg.sliding_window)
            cap = caught if i in taps else None
            X, p, pending = layer(X, p, pending, batch, meta, state, ngram, self.engram_pad, cap)
        X = apply_pending(X, pending)
        if features is not None:  # V4.1: the DSpark taps; V4: the final streams (MTP)
            features.append(torch.cat(caught, dim=-1) if cfg.is_v41 else X.flatten(1))
        return self.head_input(X, p)

    def forward(self, batch: ForwardBatch, features: list | None = None) -> torch.Tensor:
        """fp32 logits [S, vocab] of ``batch.logit_rows`` (every head row when None);
        ``features`` as in :meth:`hidden`."""
        h = self.hidden(batch, features)
        if batch.logit_rows is not None:
            h = h[batch.logit_rows]
        return self.compute_logits(h)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 head over final hidden states [R, d] -> [R, vocab] (bf16 weights are read as
        stored: products are exact in the fp32 accumulation)."""
        return linear_f32(h.to(self.head.weight.dtype), self.head.weight)


__all__ = ["Block", "DeepseekModel", "MTPBlock"]
