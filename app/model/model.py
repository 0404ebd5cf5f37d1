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
from app.model.config import LayerMode, LayerSpec, ModelConfig
from app.model.engram import Engram
from app.model.engram_hash import EngramHashSpec, engram_hash_spec
from app.model.forward_batch import ForwardBatch
from app.model.layers import Linear, RMSNorm
from app.model.moe import MoE
from kernels.mhc import hc_collapse, hc_expand, hc_mix
from kernels.norm import rms_norm


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
        )
        _hc_params(self, "hc_attn", n, d)
        _hc_params(self, "hc_ffn", n, d)
        if engram is not None:
            self.engram = Engram(cfg, engram[0], engram[1])

    def _mix(self, X: torch.Tensor, which: str):
        c = self.cfg
        return hc_mix(
            X,
            getattr(self, f"{which}_fn"),
            getattr(self, f"{which}_base"),
            getattr(self, f"{which}_scale"),
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
        )

    def forward(
        self,
        X: torch.Tensor,
        p: torch.Tensor | None,
        batch: ForwardBatch,
        state: CompressedState,
        ngram: torch.Tensor | None,
        pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``X`` [T, n, d]; ``p`` the carried pre-mix [T, n] (V4.1) -> (X', p')."""
        ids = batch.input_ids
        if self.cfg.is_v41:
            if hasattr(self, "engram"):
                X = self.engram(X, ngram, pad_id)
            a_pre, a_post, a_comb = self._mix(X, "hc_attn")
            o = self.attn(self.attn_norm(hc_collapse(X, p)), batch, state)
            X = hc_expand(o, X, a_post, a_comb)
            f_pre, f_post, f_comb = self._mix(X, "hc_ffn")
            o = self.ffn(self.ffn_norm(hc_collapse(X, a_pre)), ids)
            return hc_expand(o, X, f_post, f_comb), f_pre
        pre, post, comb = self._mix(X, "hc_attn")
        o = self.attn(self.attn_norm(hc_collapse(X, pre)), batch, state)
        X = hc_expand(o, X, post, comb)
        pre, post, comb = self._mix(X, "hc_ffn")
        o = self.ffn(self.ffn_norm(hc_collapse(X, pre)), ids)
        return hc_expand(o, X, post, comb), None


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
    """

    def __init__(
        self,
        cfg: ModelConfig,
        engram_token_map: Sequence[int] | None = None,
        kv_quant: bool = False,
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
            layers.append(Block(cfg, spec, engram=eng, kv_quant=kv_quant))
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
        if engram_token_map is not None:
            self.set_engram_token_map(engram_token_map)

    def set_engram_token_map(self, token_map: Sequence[int]) -> None:
        """Install the tokenizer's token id -> compressed id map. Embedding rows past the
        tokenizer (never produced by encoding) map to the pad token's compressed id."""
        tmap = list(token_map)
        pad = tmap[self.cfg.engram_pad_token_id]
        tmap += [pad] * (self.cfg.vocab_size - len(tmap))
        self.engram_map = torch.tensor(tmap, dtype=torch.int64, device=self.engram_map.device)

    # ---- forward ------------------------------------------------------------------------
    def _ngrams(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[T, max_ngram] compressed ids of the token and its predecessors in its sequence
        (-1 out of range or image). Example (max 3), seq [a b]: [[a, -1, -1], [b, a, -1]]."""
        if self.hash_spec is None:
            return None
        if self.engram_map.numel() == 0:
            raise RuntimeError("V4.1 Engram needs the tokenizer's compressed token map")
        ids = batch.input_ids
        comp = self.engram_map[ids]
        if self.cfg.image_token_id is not None:
            comp = comp.masked_fill(ids == self.cfg.image_token_id, -1)
        cols = []
        for s in range(self.hash_spec.max_ngram):
            shifted = torch.full_like(comp, -1)
            for sl in batch.seq_slices():
                if sl.stop - sl.start > s:
                    shifted[sl.start + s : sl.stop] = comp[sl.start : sl.stop - s]
            cols.append(shifted)
        return torch.stack(cols, dim=1)

    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Final normalized hidden state [T, d]."""
        cfg = self.cfg
        x = self.embed.weight[batch.input_ids]
        X = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        p = None
        if cfg.is_v41:
            p = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
            p[:, 0] = 1.0
        ngram = self._ngrams(batch)
        pad_id = -1
        if ngram is not None:
            pad_id = int(self.engram_map[cfg.engram_pad_token_id])
        state = CompressedState()
        for layer in self.layers:
            X, p = layer(X, p, batch, state, ngram, pad_id)
        if cfg.is_v41:
            h = hc_collapse(X, p)
        else:
            flat = X.flatten(1).float()
            mix = (flat @ self.hc_head_fn.float().t()) * torch.rsqrt(
                flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps
            )
            pre = torch.sigmoid(mix * self.hc_head_scale.float() + self.hc_head_base.float())
            h = hc_collapse(X, pre + cfg.hc_eps)
        return self.norm(h)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [T, vocab] in fp32 for every token of the batch."""
        h = self.hidden(batch)
        return torch.nn.functional.linear(h.float(), self.head.weight.float())

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """One full-sequence forward of ``token_ids`` [T] -> [T, vocab] fp32."""
        dev = self.embed.weight.device
        return self.forward(ForwardBatch.from_sequences([token_ids], device=dev))


__all__ = ["Block", "DeepseekModel", "MTPBlock", "rms_norm"]
