"""Configs of the tiny V4.1 / V4 checkpoints: every layer mode and mechanism, CPU-fast.

V4.1 layer schedule (8 layers + 3 DSpark slots):

    layer   0    1        2         3              4                   5      6         7
    mode    SWA  SWA+Eng  FULL r2   REUSE r2 +Eng  FULL r1 (cand.src)  REUSE  REINDEX   REUSE
                                                                              (cands)   (idx of 6)

V4 schedule (6 layers + 1 MTP slot): SWA, SWA, CSA r4, HCA r16, CSA r4, HCA r16;
layers 0-1 hash-routed.
Windows, top-k and candidate blocks are shrunk so that 40-token prompts exercise eviction,
selection and the candidate mask.
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer

from app.model.engram_hash import compressed_token_map, engram_hash_spec

TINY_VOCAB = 512


def _common() -> dict[str, Any]:
    return {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 8,
        "index_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
    }


def tiny_config_v41(
    tokenizer: Tokenizer, block: int = 32, expert_dtype: str = "fp4"
) -> dict[str, Any]:
    """Official-layout config.json (``text_config`` nested) of the tiny V4.1 model;
    ``block`` is the fp8 weight block, ``expert_dtype`` how routed experts are stored."""
    return v41_schedule_config(compressed_token_map(tokenizer)[1], block, expert_dtype)


def v41_schedule_config(
    n_compressed: int,
    block: int = 32,
    expert_dtype: str = "fp4",
    engram_vocab: int = 97,
    engram_heads: int = 2,
    **sizes: Any,
) -> dict[str, Any]:
    """The tiny V4.1 layer schedule's config.json, with ``sizes`` overriding ``text_config``
    fields (widths, windows, vocabulary: the trained demo model, ``tools/train_tiny.py``);
    ``engram_vocab`` / ``engram_heads`` also size the Engram tables."""
    engram_layers = (1, 3)
    spec = engram_hash_spec(engram_layers, 4, engram_heads, engram_vocab, n_compressed)
    text = {
        **_common(),
        "model_type": "deepseek_v41_text",
        "num_hidden_layers": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "index_n_heads": 4,
        "index_topk": 6,
        "rms_norm_eps": 1e-20,
        "engram_layer_ids": list(engram_layers),
        "engram_num_embeddings": list(spec.table_rows()),
        "engram_max_ngram_size": 4,
        "engram_vocab_size": engram_vocab,
        "engram_n_heads": engram_heads,
        "engram_head_dim": 32,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": n_compressed,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": TINY_VOCAB - 1,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "pad_token_id": 2,
        **sizes,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": {"num_hidden_layers": 0},
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": TINY_VOCAB - 2,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [block, block],
            "expert_dtype": expert_dtype,
        },
    }


def tiny_config_v4(block: int = 128, expert_dtype: str = "fp4") -> dict[str, Any]:
    """Official-layout config.json of the tiny V4 model (``block``, ``expert_dtype`` as for
    :func:`tiny_config_v41`)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **_common(),
        "num_hidden_layers": 6,
        "compress_ratios": [0, 0, 4, 16, 4, 16, 0],
        "num_hash_layers": 2,
        "index_n_heads": 4,
        "index_topk": 4,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [block, block],
            "expert_dtype": expert_dtype,
        },
    }
