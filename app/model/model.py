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
from app.model.kv_store import DenseKVStore, KVStore
from app.model.layers import Linear, RMSNorm
from app.model.moe import MoE
from kernels.mhc import hc_collapse, hc_post, hc_pre


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

    def _pre(self, X: torch.Tensor, which: str, norm: RMSNorm, pre_in: torch.Tensor | None):
        """Fused mix + Sinkhorn + collapse + RMSNorm -> (sublayer input, post, comb, pre);
        collapses with ``pre_in`` when given (V4.1 single pass)."""
        c = self.cfg
        return hc_pre(
            X,
            getattr(self, f"{which}_fn"),
            getattr(self, f"{which}_base"),
            getattr(self, f"{which}_scale"),
            norm.weight,
            c.hc_sinkhorn_iters,
            c.hc_eps,
            c.rms_norm_eps,
            norm.eps,
            pre_in=pre_in,
        )

    def forward(
        self,
        X: torch.Tensor,
        p: torch.Tensor | None,
        batch: ForwardBatch,
        state: CompressedState,
        store: KVStore,
        ngram: torch.Tensor | None,
        pad_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``X`` [T, n, d]; ``p`` the carried pre-mix [T, n] (V4.1) -> (X', p')."""
        ids = batch.input_ids
        v41 = self.cfg.is_v41
        if v41 and hasattr(self, "engram"):
            X = self.engram(X, ngram, pad_id)
        h, post, comb, a_pre = self._pre(X, "hc_attn", self.attn_norm, p if v41 else None)
        X = hc_post(self.attn(h, batch, state, store), X, post, comb)
        h, post, comb, f_pre = self._pre(X, "hc_ffn", self.ffn_norm, a_pre if v41 else None)
        X = hc_post(self.ffn(h, ids), X, post, comb)
        return X, (f_pre if v41 else None)


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
    @property
    def decoder_start(self) -> int:
        """First V4.1 "decoder" layer: after the last layer that owns compressed KV; such
        layers keep only window KV, so decoder replay may skip their early prompt rows."""
        if not self.cfg.is_v41 or not self.cfg.kv_source_layer_ids:
            return self.cfg.num_hidden_layers
        return max(self.cfg.kv_source_layer_ids) + 1

    def _ngrams(self, batch: ForwardBatch) -> torch.Tensor | None:
        """[T, max_ngram] compressed ids of each token and its predecessors (-1 before the
        sequence start or on image tokens). Predecessors before the batch come from
        ``batch.history``. Example (max 3), seq [a b], no history: [[a, -1, -1], [b, a, -1]]."""
        if self.hash_spec is None:
            return None
        if self.engram_map.numel() == 0:
            raise RuntimeError("V4.1 Engram needs the tokenizer's compressed token map")
        n_back = self.hash_spec.max_ngram - 1
        cols = []
        for s, sl in enumerate(batch.seq_slices()):
            ids = batch.input_ids[sl]
            hist = torch.full((n_back,), -1, dtype=torch.int64, device=ids.device)
            if batch.history is not None:
                hist = batch.history[s].to(ids.device)
            ext = torch.cat((hist.flip(0), ids))  # oldest first
            comp = torch.where(ext >= 0, self.engram_map[ext.clamp_min(0)], -1)
            if self.cfg.image_token_id is not None:
                comp = comp.masked_fill(ext == self.cfg.image_token_id, -1)
            L = ids.numel()
            cols.append(
                torch.stack([comp[n_back - k : n_back - k + L] for k in range(n_back + 1)], 1)
            )
        return torch.cat(cols)

    def hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Final normalized hidden states and the flat batch rows they belong to.

        Every row is returned unless V4.1 decoder replay (``batch.decoder_floors``) drops the
        rows below a sequence's floor before the decoder layers."""
        cfg = self.cfg
        x = self.embed.weight[batch.input_ids]
        X = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        p = None
        if cfg.is_v41:
            p = torch.zeros(x.shape[0], cfg.hc_mult, dtype=torch.float32, device=x.device)
            p[:, 0] = 1.0
        ngram = self._ngrams(batch)
        pad_id = int(self.engram_map[cfg.engram_pad_token_id]) if ngram is not None else -1
        store = batch.kv if batch.kv is not None else DenseKVStore()
        state = CompressedState()
        rows = torch.arange(x.shape[0], device=x.device)
        for i, layer in enumerate(self.layers):
            if i == self.decoder_start and any(batch.decoder_floors):
                sub = _decoder_batch(batch, store, state)
                if sub is None:  # no row of this step reaches the decoder layers
                    empty = X.new_zeros(0, cfg.hidden_size)
                    return empty, rows[:0]
                batch, keep, state = sub
                X, rows = X[keep], rows[keep]
                p = p[keep] if p is not None else None
                ngram = ngram[keep] if ngram is not None else None
            X, p = layer(X, p, batch, state, store, ngram, pad_id)
        if cfg.is_v41:
            h = hc_collapse(X, p)
        else:
            flat = X.flatten(1).float()
            mix = (flat @ self.hc_head_fn.float().t()) * torch.rsqrt(
                flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps
            )
            pre = torch.sigmoid(mix * self.hc_head_scale.float() + self.hc_head_base.float())
            h = hc_collapse(X, pre + cfg.hc_eps)
        return self.norm(h), rows

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [T, vocab] in fp32 for every token of the batch (no decoder replay)."""
        if any(batch.decoder_floors):
            raise ValueError("decoder replay drops rows: use forward_rows()")
        return self.forward_rows(batch)[0]

    def forward_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits [R, vocab], flat batch rows [R]) for the rows that reach the head."""
        h, rows = self.hidden(batch)
        return self.compute_logits(h), rows

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 head over final hidden states [R, d] -> [R, vocab]."""
        return torch.nn.functional.linear(h.float(), self.head.weight.float())

    @torch.no_grad()
    def logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """One full-sequence forward of ``token_ids`` [T] -> [T, vocab] fp32."""
        dev = self.embed.weight.device
        return self.forward(ForwardBatch.from_sequences([token_ids], device=dev))


def _decoder_batch(
    batch: ForwardBatch, store: KVStore, state: CompressedState
) -> tuple[ForwardBatch, torch.Tensor, CompressedState] | None:
    """The sub-batch of rows at or above each sequence's decoder floor (a suffix of every
    sequence's chunk; a sequence with no such row is dropped), the kept flat rows, and the
    selection state restricted to those rows; None when no row is kept.

    Example: chunk positions [0..9] of one sequence, floor 6 -> rows 6..9 with prefix 6 and
    window floor 6 (decoder windows read nothing below the floor)."""
    keep, lens, prefix, wfloor, cached, slots, skip = [], [], [], [], [], [], []
    for s, sl in enumerate(batch.seq_slices()):
        a, n, f = batch.prefix_lens[s], batch.seq_lens[s], batch.decoder_floors[s]
        start = max(a, f)
        if start >= a + n:
            continue
        keep.append(torch.arange(sl.start + start - a, sl.stop))
        lens.append(a + n - start)
        prefix.append(start)
        wfloor.append(max(batch.window_floors[s], f))
        cached.append(max(batch.cached_lens[s], start))
        slots.append(s)
        skip.append(start - a)
    if not keep:
        return None
    idx = torch.cat(keep).to(batch.input_ids.device)
    sub = ForwardBatch(
        input_ids=batch.input_ids[idx],
        positions=batch.positions[idx],
        seq_lens=tuple(lens),
        prefix_lens=tuple(prefix),
        kv=_SubsetStore(store, slots),
        window_floors=tuple(wfloor),
        cached_lens=tuple(cached),
    )
    sub_state = CompressedState(
        topk={
            k: [v[s][o:] for s, o in zip(slots, skip, strict=True)] for k, v in state.topk.items()
        },
        cand={
            k: [v[s][o:] for s, o in zip(slots, skip, strict=True)] for k, v in state.cand.items()
        },
    )
    return sub, idx, sub_state


class _SubsetStore(KVStore):
    """A store view that renumbers sequences of a sub-batch to the parent batch's indices."""

    def __init__(self, parent: KVStore, slots: list[int]):
        self.parent, self.slots = parent, slots

    def read_window(self, layer, s, lo, hi):  # noqa: D102
        return self.parent.read_window(layer, self.slots[s], lo, hi)

    def write_window(self, layer, s, pos0, kv):  # noqa: D102
        self.parent.write_window(layer, self.slots[s], pos0, kv)

    def read_tail(self, layer, name, s, lo, hi):  # noqa: D102
        return self.parent.read_tail(layer, name, self.slots[s], lo, hi)

    def write_tail(self, layer, name, s, pos0, kv, gate):  # noqa: D102
        self.parent.write_tail(layer, name, self.slots[s], pos0, kv, gate)

    def write_entries(self, layer, s, w0, entries, keys):  # noqa: D102
        self.parent.write_entries(layer, self.slots[s], w0, entries, keys)

    def read_entries(self, layer, s, n):  # noqa: D102
        return self.parent.read_entries(layer, self.slots[s], n)

    def read_keys(self, layer, s, n):  # noqa: D102
        return self.parent.read_keys(layer, self.slots[s], n)


__all__ = ["Block", "DeepseekModel", "MTPBlock"]
