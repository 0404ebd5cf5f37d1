"""Model forward: ragged batches, official parameter names, every layer mode exercised."""

from __future__ import annotations

import pytest
import torch

from app.model.attention import CompressedState
from app.model.config import LayerMode
from app.model.forward_batch import ForwardBatch
from app.model.kv_store import DenseKVStore


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_ragged_batch_equals_one_at_a_time(tiny_model, arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(3, 500, (n,), generator=g) for n in (41, 1, 17, 33)]
    batched = model(ForwardBatch.from_sequences(seqs))
    start = 0
    for s in seqs:
        single = model.logits(s)
        part = batched[start : start + s.numel()]
        assert torch.allclose(part, single, rtol=0, atol=1e-4 * single.abs().max())
        start += s.numel()


def test_forward_batch_layout():
    b = ForwardBatch.from_sequences([[5, 6, 7], [8], [9, 10]])
    assert b.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert b.last_token_index().tolist() == [2, 3, 5]
    assert [(s.start, s.stop) for s in b.seq_slices()] == [(0, 3), (3, 4), (4, 6)]
    with pytest.raises(ValueError):
        ForwardBatch.from_sequences([[1], []])


def test_official_parameter_names(tiny_model):
    names = set(tiny_model("v41").state_dict())
    for n in (
        "embed.weight", "head.weight", "norm.weight", "layers.0.hc_attn_fn", "layers.0.hc_ffn_base",
        "layers.2.attn.wq_a.weight", "layers.2.attn.attn_sink",
        "layers.2.attn.compressor.wgate.weight",
        "layers.4.attn.compressor.wkv.weight", "layers.2.attn.indexer.wk.weight",
        "layers.2.attn.indexer.k_norm.weight", "layers.6.attn.indexer.wq_b.weight",
        "layers.1.engram.embed.weight", "layers.1.engram.wkv.weight", "layers.1.engram.q_weight",
        "layers.3.ffn.experts.7.w2.weight", "layers.3.ffn.gate.bias", "layers.3.ffn.gate.bias_vl",
        "layers.3.ffn.shared_experts.w3.weight", "mtp.0.main_proj.weight", "mtp.2.norm.weight",
        "mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight",
    ):  # fmt: skip
        assert n in names, n
    assert "layers.4.attn.compressor.wgate.weight" not in names  # ratio-1 layers have no gate
    assert "layers.6.attn.indexer.wk.weight" not in names  # Reindex layers own no keys
    assert not any(n.startswith("layers.5.attn.compressor") for n in names)
    v4 = set(tiny_model("v4").state_dict())
    for n in (
        "hc_head_fn", "hc_head_base", "hc_head_scale", "layers.0.ffn.gate.tid2eid",
        "layers.2.attn.compressor.ape", "layers.2.attn.indexer.compressor.wkv.weight",
        "layers.3.attn.compressor.ape", "mtp.0.e_proj.weight", "mtp.0.hc_head_fn",
    ):  # fmt: skip
        assert n in v4, n
    assert "layers.0.ffn.gate.bias" not in v4 and "layers.2.ffn.gate.bias" in v4
    assert v4 >= {"layers.2.attn.indexer.weights_proj.weight"}


def test_tiny_v41_exercises_every_mode(tiny_model):
    """A 40-token prompt closes windows, selects top-k among more than k entries, and the
    candidate mask of layer 4 removes entries that Reindex layer 6 would otherwise pick."""
    model = tiny_model("v41")
    cfg = model.cfg
    assert {s.mode for s in cfg.layers} == {
        LayerMode.SWA, LayerMode.FULL, LayerMode.REUSE, LayerMode.REINDEX,
    }  # fmt: skip
    state = CompressedState()
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(3))
    batch = ForwardBatch.from_sequences([ids])
    X = model.embed.weight[ids].unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    p = torch.zeros(40, cfg.hc_mult)
    p[:, 0] = 1
    ngram = model._ngrams(batch)
    pad = int(model.engram_map[cfg.engram_pad_token_id])
    store = DenseKVStore()
    for layer in model.layers:
        X, p = layer(X, p, batch, state, store, ngram, pad)
    assert store.read_entries(2, 0, 99).shape[0] == 20
    assert store.read_entries(4, 0, 99).shape[0] == 40
    top2, top6 = state.topk[2][0], state.topk[6][0]
    assert (top2[-1] >= 0).all() and (top2[0] == -1).all()  # early tokens see no entries
    cand = state.cand[4][0]
    assert cand[-1].sum() == cfg.candidate_topk_blocks * cfg.candidate_block_size
    assert bool(cand[-1, 38:].all())  # the latest block is always a candidate
    picked = top6[-1][top6[-1] >= 0]
    assert bool(cand[-1, picked].all())
