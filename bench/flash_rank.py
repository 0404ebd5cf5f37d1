"""A scaled DeepSeek-V4.1-Flash rank: the shipped ``flash-rank`` config with random weights.

``configs/models/flash-rank`` (README there) holds every per-layer shape of V4.1-Flash
(hidden 5120, 64 x 512 heads, q_lora 1280, o 8 x 1024, window 128, top-512, indexer 32 x 128,
experts 2304 wide, top-6), all 40 layers and the 3 DSpark stages, small Engram tables of the
real row width, and the expert share of one rank of an EP8 deployment as the model's own
expert count (48 routed experts per layer, 16 in the DSpark stages): on one GPU each token's
6 experts are all local, so the per-token expert work is the EP8 rank's and the distinct
experts a batch touches are within ~1% of its; the dispatch / combine all-to-all is not part
of a one-GPU step. :func:`build_flash_rank` loads it with ``load_format="dummy"`` (the
engine's loader: fp8 dense weights dequantized to bf16 or kept fp8, fp4 experts packed in the
pairs layout, V4.1 cache formats), so the benches measure the model the engine holds. That
includes its memory: the loader keeps the tensors stored bf16 other than the router
(embedding, head, compressors, indexer keys, DSpark heads) in fp32 under a bf16 engine, as it
does for a real checkpoint: the rank's weights take 57.7 GB, 2.8 GB more than the in-memory
rank this loader replaced (which held those tensors in bf16).

:func:`flash_config` is V4.1-Flash's config with all 384 / 128 experts: the KV-cache benches
(``kv_tiers_gpu``, ``pd_transfer``) size their pools from it (experts do not enter a cache
layout); ``engine_steps`` and ``spec_decode`` use :func:`build_flash_rank`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from app.engine.model_path import DEFAULT_CACHE_DIR, resolve_model
from app.model.config import ModelConfig
from app.model.engram_hash import engram_hash_spec
from app.model.loader import load_model
from app.model.model import DeepseekModel
from app.model.tiny_config import tiny_config_v41
from app.model.tokenizer import write_tiny_tokenizer

EP = 8
ENGRAM_VOCAB = 4099  # real Engram rows come from a 16M-entry vocabulary; this keeps 50 MB


def flash_config() -> ModelConfig:
    """V4.1-Flash's config (MODEL_SPEC §1) with small Engram tables."""
    spec = engram_hash_spec((1, 14), 4, 8, ENGRAM_VOCAB, 99092)
    text = {
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2304, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 3,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "engram_layer_ids": [1, 14],
        "engram_num_embeddings": list(spec.table_rows()), "engram_max_ngram_size": 4,
        "engram_vocab_size": ENGRAM_VOCAB, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "pad_token_id": 2,
    }  # fmt: skip
    return ModelConfig.from_dict({
        "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [32, 32], "expert_dtype": "fp4"},
    })  # fmt: skip


def build_flash_rank(
    device: str = "cuda", ep: int = EP, seed: int = 0, dense: str = "bf16",
    expert_act: str = "bf16",
) -> DeepseekModel:
    """The rank of an EP-``ep`` deployment on ``device`` (EP8: the shipped ``flash-rank``,
    57.7 GB on a GPU): random weights (``seed``) through the engine's loader; ``dense="fp8"``
    keeps the dense fp8 projections as stored (the loader's ``packed_dense``, 51.8 GB),
    ``dense="fp8act"`` also rounds their activations (``dense_act: fp8``); ``expert_act``
    as the engine option."""
    return load_rank(rank_dir(ep), device, seed, dense, expert_act)


def rank_dir(ep: int = EP) -> Path:
    """A model directory (config.json + tokenizer) of V4.1-Flash with ``1/ep`` of its experts:
    the shipped ``flash-rank`` for EP8, else a copy in the cache with the counts divided."""
    path = resolve_model("flash-rank")
    if ep == EP:
        return path
    full = flash_config()
    if full.n_routed_experts % ep or full.dspark_n_routed_experts % ep:
        raise ValueError(f"ep {ep} does not divide {full.n_routed_experts} experts")
    out = Path(DEFAULT_CACHE_DIR).expanduser() / f"flash-rank-ep{ep}"
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"]["n_routed_experts"] = full.n_routed_experts // ep
    raw["text_config"]["dspark_n_routed_experts"] = full.dspark_n_routed_experts // ep
    for f in path.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def tiny_rank_dir(out: str | Path) -> Path:
    """The tiny V4.1 config and tokenizer (no weights) in ``out``: a CPU smoke run of the
    benches loads it with :func:`load_rank`."""
    out = Path(out)
    tok = write_tiny_tokenizer(out)
    (out / "config.json").write_text(json.dumps(tiny_config_v41(tok), indent=2) + "\n")
    return out


DENSE_MODES = ("bf16", "fp8", "fp8act")  # bf16 copies; fp8 as stored; + rounded activations


def load_rank(path: str | Path, device: str, seed: int = 0, dense: str = "bf16",
              expert_act: str = "bf16") -> DeepseekModel:  # fmt: skip
    """Random weights for the config at ``path`` (``load_format="dummy"``): bf16 compute,
    routed experts packed (fp4 in the pairs layout on CUDA), V4.1 cache formats; ``dense``
    one of :data:`DENSE_MODES`, ``expert_act`` the engine option's value."""
    if dense not in DENSE_MODES:
        raise ValueError(f"dense must be one of {DENSE_MODES}, got {dense!r}")
    return load_model(path, device, torch.bfloat16, kv_quant=True, packed_experts=True,
                      packed_dense=dense != "bf16", load_format="dummy", seed=seed,
                      dense_act="fp8" if dense == "fp8act" else "bf16",
                      expert_act=expert_act)  # fmt: skip


# ---- floors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must read (each weight once, each KV row once)."""

    dense: float  # attention, shared expert, router, mHC, Engram, head of every layer
    experts: float  # local routed experts touched
    kv: float  # window + selected compressed entries + every visible index key

    @property
    def total(self) -> float:
        return self.dense + self.experts + self.kv


def expected_experts(n_local: int, n_all: int, k: int, tokens: int) -> float:
    """Distinct local experts ``tokens`` uniformly routed tokens touch: E_l [1 - (1-k/E)^t]."""
    return n_local * (1 - (1 - k / n_all) ** tokens)


def decode_bytes(
    model: DeepseekModel, batch: int, ctx: int, q: int = 1, dense_fp8: bool = False
) -> StepBytes:
    """The floor's bytes for a decode step of ``batch`` requests x ``q`` tokens at context
    ``ctx``: the model's own storage (bf16 dense), or the checkpoint's fp8 dense weights
    (``dense_fp8``: 1 B per value + e8m0 per 32 x 32 block of each bf16 matrix; the head
    stays). The local experts are the model's own (the rank's share)."""
    cfg = model.cfg
    dense = 0.0
    expert_bytes, n_local = 0.0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("mtp.") or ".experts." in name:
            continue
        per = t.element_size()
        if dense_fp8 and t.dim() == 2 and t.dtype == torch.bfloat16 and not name.startswith(
            ("head.", "embed.")
        ) and "engram.embed" not in name:
            per = 1 + 1 / 1024
        if name.startswith("embed.") or "engram.embed" in name:
            continue  # gathered rows, not read whole
        dense += t.numel() * per
    layer_pe = model.layers[0].ffn.experts
    n_local = layer_pe.n_local
    for b in (layer_pe.w13, layer_pe.s13, layer_pe.w2, layer_pe.s2):
        expert_bytes += b.numel() * b.element_size()
    per_expert = expert_bytes / n_local
    touched = expected_experts(n_local, cfg.n_routed_experts, cfg.num_experts_per_tok, batch * q)
    experts = cfg.num_hidden_layers * touched * per_expert
    tokens = batch * q
    kv_tok = 0.0
    for s in cfg.layers:
        kv_tok += cfg.sliding_window * 528  # fp8 window rows
        if s.compressed:
            kv_tok += min(cfg.index_topk, ctx // s.ratio) * 288  # nvfp4 entries
        if s.computes_topk:
            kv_tok += (ctx // s.ratio) * 68  # the indexer scores every visible mxfp4 key
    return StepBytes(dense, experts, tokens * kv_tok)


def prefill_flops(
    model: DeepseekModel, tokens: int, ctx: int, decoder_rows: int | None = None
) -> float:
    """Matrix FLOPs of a prefill step of ``tokens`` new tokens at context ``ctx`` (average
    position ctx): dense projections, each token's routed experts, attention over window +
    top-k, indexer scores; ``decoder_rows`` = rows that run the decoder layers (decoder
    replay), else all."""
    cfg = model.cfg
    per_layer_dense = {}
    for i, layer in enumerate(model.layers):
        n = 0
        for name, t in layer.named_parameters():
            if ".experts." not in f".{name}" and t.dim() == 2 and "engram.embed" not in name:
                n += t.numel()
        per_layer_dense[i] = n
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    # k expert slots per token, 3 GEMMs of d x inter each
    routed = cfg.num_experts_per_tok * 3 * d * inter
    flops = 0.0
    for i, s in enumerate(cfg.layers):
        rows = tokens if decoder_rows is None or i < model.decoder_start else decoder_rows
        keys = cfg.sliding_window + (cfg.index_topk if s.compressed else 0)
        attn = keys * cfg.head_dim * cfg.num_attention_heads * 4
        idx = 0
        if s.computes_topk:
            idx = (ctx // s.ratio) * cfg.index_n_heads * cfg.index_head_dim * 2
        flops += rows * (2 * per_layer_dense[i] + 2 * routed + attn + idx)
    return flops
