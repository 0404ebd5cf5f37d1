"""Config parsing: official V4 / V4.1 layouts, derived layer modes, clear errors."""

from __future__ import annotations

import json

import pytest

from app.model.config import ConfigError, LayerMode, ModelConfig


def v41_flash() -> dict:
    text = {
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2304, "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-20,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_target_layer_ids": [37, 38, 39],
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    }  # fmt: skip
    return {
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]},
    }


def v4_flash() -> dict:
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
        "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
        "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "num_hash_layers": 3,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }  # fmt: skip


def test_v41_flash_layer_modes():
    cfg = ModelConfig.from_dict(v41_flash())
    modes = [spec.mode for spec in cfg.layers]
    assert modes[:2] == [LayerMode.SWA] * 2
    assert [i for i, m in enumerate(modes) if m is LayerMode.FULL] == [2, 8, 14, 20]
    assert [i for i, m in enumerate(modes) if m is LayerMode.REINDEX] == [24, 28, 32, 36]
    assert all(m is LayerMode.REUSE for i, m in enumerate(modes) if i not in
               {0, 1, 2, 8, 14, 20, 24, 28, 32, 36})  # fmt: skip
    # Reuse layers: KV of the owning Full layer, indices of the most recent index layer
    assert (cfg.layers[25].kv_source, cfg.layers[25].index_source) == (20, 24)
    assert (cfg.layers[13].kv_source, cfg.layers[13].index_source) == (8, 8)
    assert cfg.layers[20].is_candidate_source and cfg.layers[24].uses_candidates
    assert not cfg.layers[21].uses_candidates
    assert [s.layer_id for s in cfg.layers if s.engram] == [1, 14]
    assert cfg.layers[19].ratio == 2 and cfg.layers[20].ratio == 1
    assert cfg.quantization.weight_block_size == (32, 32)
    assert cfg.rms_norm_eps == 1e-20 and cfg.image_token_id == 129264
    assert cfg.mtp_ratio(0) == 0 and cfg.num_mtp_layers == 3


def test_v4_flash_layer_modes():
    cfg = ModelConfig.from_dict(v4_flash())
    assert len(cfg.layers) == 43
    assert [s.mode for s in cfg.layers[:4]] == [
        LayerMode.SWA, LayerMode.SWA, LayerMode.CSA, LayerMode.HCA,
    ]  # fmt: skip
    assert cfg.layers[42].mode is LayerMode.CSA and cfg.mtp_ratio(0) == 0
    assert [s.hash_moe for s in cfg.layers[:4]] == [True, True, True, False]
    assert cfg.rms_norm_eps == 1e-6 and cfg.quantization.weight_block_size == (128, 128)


def test_round_trip_through_file(tmp_path):
    for raw in (v41_flash(), v4_flash()):
        cfg = ModelConfig.from_dict(raw)
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
        again = ModelConfig.from_file(tmp_path)
        assert again == cfg and again.layers == cfg.layers


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda r: r.update(architectures=["LlamaForCausalLM"]), "unsupported architectures"),
        (lambda r: r.pop("text_config"), "text_config"),
        (lambda r: r["text_config"].pop("hidden_size"), "'hidden_size'"),
        (lambda r: r["text_config"].update(hidden_size=-4), "'hidden_size' must be a positive"),
        (lambda r: r["text_config"].update(compress_ratios=[0, 0]), "compress_ratios"),
        (lambda r: r["text_config"].update(o_groups=7), "o_groups"),
        (lambda r: r["text_config"].update(kv_source_layer_ids=[3]), "index_source"),
        (lambda r: r["text_config"].update(candidate_source_layer_id=24), "candidate"),
        (lambda r: r["text_config"].update(scoring_func="softmax"), "scoring_func"),
    ],
)
def test_bad_configs_name_the_problem(mutate, needle):
    raw = v41_flash()
    mutate(raw)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)


def test_missing_and_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.from_file(tmp_path)
