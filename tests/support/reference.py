"""The full-sequence reference forward: the oracle of the batched cache-facing step.

One sequence at a time from position 0, no cache, pure torch for attention (the window is a
causal band over the sequence's own KV, compressed entries come from the compressor run over
the whole sequence). It shares the modules' weights and projections with the batched step but
none of its addressing (rings, block tables, tails, candidates compaction), so comparing the
two checks the cache path. Matches the public references (tests/unit/test_fidelity.py).
"""

from __future__ import annotations

import torch

from app.model.config import LayerMode
from app.model.indexer import candidate_blocks
from app.model.model import DeepseekModel
from app.model.mtp import MTPDrafter
from app.model.rope import apply_rope
from kernels.attention import sparse_attention_ref
from kernels.indexer import indexer_scores_ref
from kernels.mhc import hc_post
from kernels.topk import topk_ref


class _State:
    """Per-sequence state shared across layers: compressed entries / keys of owner layers,
    top-k entry ids [L, k] and candidate masks [L, C] of index layers."""

    def __init__(self) -> None:
        self.entries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.topk: dict[int, torch.Tensor] = {}
        self.cand: dict[int, torch.Tensor] = {}


@torch.no_grad()
def sequence_logits(model: DeepseekModel, token_ids: torch.Tensor) -> torch.Tensor:
    """:func:`reference_logits` of ``token_ids`` [T] without autograd: fp32 [T, vocab], what
    the tests hold the batched step to."""
    return reference_logits(model, token_ids)


def reference_logits(model: DeepseekModel, token_ids: torch.Tensor,
                     features: list | None = None) -> torch.Tensor:  # fmt: skip
    """fp32 logits [L, vocab] of one sequence ``token_ids`` [L] (every position);
    ``features`` receives the DSpark target features [L, taps * d] (the mean of the streams
    entering attention of each ``dspark_target_layer_ids`` layer, concatenated); on V4 the
    final streams [L, n * d] (the MTP block's input)."""
    cfg = model.cfg
    ids = token_ids.to(model.embed.weight.device).reshape(-1)
    L = ids.numel()
    X = model.embed.weight[ids].unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    p = None
    if cfg.is_v41:
        p = torch.zeros(L, cfg.hc_mult, dtype=torch.float32, device=ids.device)
        p[:, 0] = 1.0
    ngram = _ngrams(model, ids)
    st = _State()
    taps: list[torch.Tensor] = []
    for i, layer in enumerate(model.layers):
        tap = features is not None and i in cfg.dspark_target_layer_ids
        if tap:  # the streams entering attention: after this layer's Engram update
            X = _engram(layer, X, ngram, model.engram_pad)
            taps.append(X.mean(dim=1))
        X, p = _block(layer, X, p, ids, st, ngram, model.engram_pad, engram=not tap)
    if features is not None:  # V4: the final streams (the MTP block's input)
        features.append(torch.cat(taps, dim=-1) if cfg.is_v41 else X.flatten(1))
    return model.compute_logits(model.head_input(X, p))


def reference_mtp_logits(model: DeepseekModel, token_ids: torch.Tensor) -> torch.Tensor:
    """The full-sequence reference of MTP: fp32 logits [L - 1, V] of the token at p + 2 for
    every position p < L - 1 of ``token_ids`` [L] (the block over the whole sequence with
    causal window attention)."""
    ids = token_ids.to(model.embed.weight.device).reshape(-1)
    streams: list[torch.Tensor] = []
    reference_logits(model, ids, streams)
    drafter = MTPDrafter(model)
    X = drafter.block_input(streams[0][:-1], ids[1:])
    X, _ = _block(drafter.block, X, None, ids[1:], _State(), None, -1)
    return drafter.logits(X)


def _engram(layer, X, ngram, pad_id: int):
    """The Engram update a V4.1 layer applies to its input streams (identity elsewhere)."""
    if layer.cfg.is_v41 and hasattr(layer, "engram"):
        X = layer.engram(X, ngram, pad_id)
    return X


def _ngrams(model, ids: torch.Tensor) -> torch.Tensor | None:
    """[L, max_ngram] compressed ids of each token and its predecessors (-1 before the start
    or on image tokens). Example (max 3), [a b]: [[a, -1, -1], [b, a, -1]]."""
    if model.hash_spec is None:
        return None
    n_back = model.hash_spec.max_ngram - 1
    ext = torch.cat((torch.full((n_back,), -1, dtype=torch.int64, device=ids.device), ids))
    comp = torch.where(ext >= 0, model.engram_map[ext.clamp_min(0)], -1)
    if model.cfg.image_token_id is not None:
        comp = comp.masked_fill(ext == model.cfg.image_token_id, -1)
    L = ids.numel()
    return torch.stack([comp[n_back - k : n_back - k + L] for k in range(n_back + 1)], 1)


def _block(layer, X, p, ids, st: _State, ngram, pad_id: int, engram: bool = True):
    v41 = layer.cfg.is_v41
    if engram:
        X = _engram(layer, X, ngram, pad_id)
    h, post, comb, a_pre = layer.pre_mix(X, "hc_attn", layer.attn_norm, p if v41 else None)
    X = hc_post(_attention(layer.attn, h, st), X, post, comb)
    h, post, comb, f_pre = layer.pre_mix(X, "hc_ffn", layer.ffn_norm, a_pre if v41 else None)
    X = hc_post(layer.ffn(h, ids), X, post, comb)
    return X, (f_pre if v41 else None)


def _attention(att, x: torch.Tensor, st: _State) -> torch.Tensor:
    spec, _cfg = att.spec, att.cfg
    L, W, D = x.shape[0], att.window, att.head_dim
    pos = torch.arange(L, device=x.device)
    angles = att.rotary.angles(pos)
    q, c_q, kv = att.qkv(x, angles)
    kv = att.qdq(kv, "fp8", 32)
    rows = pos.unsqueeze(1) - W + 1 + torch.arange(W, device=x.device)
    rows = torch.where(rows >= 0, rows, -1)
    pool = kv
    if spec.compressed:
        r = spec.ratio
        if spec.owns_compressor:
            _emit(att, x, st)
        entries = st.entries[spec.kv_source]
        visible = torch.div(pos + 1, r, rounding_mode="floor")
        if spec.computes_topk:
            sel = _select(att, x, c_q, angles, visible, st)
            st.topk[spec.layer_id] = sel
        elif spec.mode is LayerMode.HCA:
            cols = torch.arange(entries.shape[0], device=x.device)
            sel = torch.where(cols.unsqueeze(0) < visible.unsqueeze(1), cols, -1)
        else:
            sel = st.topk[spec.index_source]
        pool = torch.cat((kv, entries.to(kv.dtype)))
        rows = torch.cat((rows, torch.where(sel >= 0, sel + L, -1)), dim=1)
    out = sparse_attention_ref(q, pool, rows, att.attn_sink, D**-0.5, inv_rope_angles=angles)
    return att.project(out)


def _emit(att, x: torch.Tensor, st: _State) -> None:
    """Every complete group of the sequence: entries (and index keys) of this owner layer."""
    spec, r = att.spec, att.spec.ratio
    latent = att.compressor(x)  # [L // r, D] unrotated, fp32
    ang = att.rotary.angles(torch.arange(latent.shape[0], device=x.device) * r)
    st.entries[spec.layer_id] = att.qdq(apply_rope(latent, ang).to(x.dtype), "nvfp4", 16)
    if spec.owns_index_keys:
        ix = att.indexer
        raw = ix.k_norm(ix.wk(latent.to(x.dtype))) if att.cfg.is_v41 else ix.compressor(x)
        st.keys[spec.layer_id] = att.qdq(apply_rope(raw, ang).to(x.dtype), "mxfp4", 32)


def _select(att, x, c_q, angles, visible, st: _State) -> torch.Tensor:
    """Top-k entry ids [L, k] (-1 empty) of an index layer."""
    spec, cfg = att.spec, att.cfg
    keys = st.keys[spec.kv_source]
    if keys.shape[0] == 0:
        if spec.is_candidate_source:
            st.cand[spec.layer_id] = torch.zeros(x.shape[0], 0, dtype=torch.bool)
        return torch.empty(x.shape[0], 0, dtype=torch.int64, device=x.device)
    q, w = att.indexer.queries(x, c_q, angles, apply_rope)
    q = att.qdq(q, "mxfp4", 32)
    scores = indexer_scores_ref(q, keys, w, visible).float()
    if spec.is_candidate_source:
        cand = candidate_blocks(
            scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size
        )
        st.cand[spec.layer_id] = cand
    elif spec.uses_candidates:
        scores = scores.masked_fill(~st.cand[cfg.candidate_source_layer_id], float("-inf"))
    return topk_ref(scores, cfg.index_topk)
