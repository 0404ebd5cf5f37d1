"""Cache byte accounting against MODEL_SPEC §3 for the released configs, and the CLI."""

from __future__ import annotations

import json

import pytest

from app.cache.accounting import cache_bytes, entry_bytes, main
from app.model.config import ModelConfig

_COMMON = {
    "vocab_size": 129280, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "index_head_dim": 128,
    "index_topk": 512, "num_experts_per_tok": 6, "n_shared_experts": 1,
}  # fmt: skip


def v41_flash() -> ModelConfig:
    text = {
        **_COMMON, "hidden_size": 5120, "num_hidden_layers": 40, "q_lora_rank": 1280,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "n_routed_experts": 384, "moe_intermediate_size": 2304,
        "num_nextn_predict_layers": 3,
    }  # fmt: skip
    return ModelConfig.from_dict({"architectures": ["DeepseekV41ForCausalLM"], "text_config": text})


def v4_flash() -> ModelConfig:
    return ModelConfig.from_dict({
        **_COMMON, "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096,
        "num_hidden_layers": 43, "q_lora_rank": 1024,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "index_n_heads": 64,
        "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_hash_layers": 3,
    })  # fmt: skip


def test_spec_entry_sizes():
    assert entry_bytes(v41_flash(), "spec") == (528, 288, 68)
    assert entry_bytes(v4_flash(), "spec") == (584, 584, 68)  # 448 + 7 + 128 = 583 -> 584
    assert entry_bytes(v4_flash(), "spec", v4_index_fp8=True)[2] == 132
    assert entry_bytes(v41_flash(), "bf16") == (1024, 1024, 256)
    with pytest.raises(ValueError):
        entry_bytes(v41_flash(), "fp8")  # type: ignore[arg-type]


def test_v41_flash_paged_bytes():
    cb = cache_bytes(v41_flash())
    rows = {g.name: (g.layer_ids, g.bytes_per_token) for g in cb.paged}
    assert rows == {
        "compressed_kv r2": ((2, 8, 14), 432),
        "compressed_kv r1": ((20,), 288),
        "index_keys r2": ((2, 8, 14), 102),
        "index_keys r1": ((20,), 68),
    }
    assert cb.paged_bytes_per_token == 890  # 3 x (288 + 68) / 2 + (288 + 68)
    assert cb.window_bytes_per_request == 40 * 128 * 528
    assert cb.tail_bytes_per_request == 3 * 2 * 2 * 512 * 4  # (kv, gate) of 2 positions, r2
    assert cb.min_block_size == 2
    assert cb.bytes_per_block(64) == 64 * 890
    assert cache_bytes(v41_flash(), "bf16").paged_bytes_per_token == 3 * 1280 / 2 + 1280


def test_v4_flash_paged_bytes():
    cb = cache_bytes(v4_flash())
    # 21 CSA x (584 + 68) / 4 + 20 HCA x 584 / 128
    assert cb.paged_bytes_per_token == pytest.approx(3514.25)
    assert 3400 < cb.paged_bytes_per_token < 3600  # MODEL_SPEC: "about 3.5 KB"
    csa = 8 * 1024 * 2 * 4 + 8 * 256 * 2 * 4
    assert cb.tail_bytes_per_request == 21 * csa + 20 * 128 * 512 * 2 * 4
    assert cb.min_block_size == 128
    with pytest.raises(ValueError, match="multiple"):
        cb.bytes_per_block(64)


def test_blocks_for_budget_reserves_per_request_bytes():
    cb = cache_bytes(v41_flash())
    per_block = 64 * 890
    assert cb.blocks_for_budget(10 * per_block + 5, 64) == 10
    budget = 100 * per_block + 2 * cb.fixed_bytes_per_request
    assert cb.blocks_for_budget(budget, 64, max_requests=2) == 100


def test_tiny_configs(tiny_cfg):
    for arch in ("v41", "v4"):
        cb = cache_bytes(tiny_cfg(arch))
        assert cb.paged_bytes_per_token > 0 and cb.fixed_bytes_per_request > 0
        assert cb.bytes_per_block(cb.min_block_size) > 0


def test_cli_prints_table(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v41_flash().to_dict()))
    assert main([str(tmp_path), "--block-size", "64", "--budget-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "890.00" in out and "compressed_kv r2" in out and "56,960 B" in out
    assert main([str(path), "--dtype", "fp32"]) == 0
    assert "fp32 format" in capsys.readouterr().out


def test_the_allocated_layout_has_the_accounted_bytes():
    """The one derivation: the cache's tensors (packed V4.1 formats) hold exactly the bytes
    the accounting reports (890 B per token of paged state, 528 B window rows)."""
    import torch

    from app.cache.layout import CacheLayout

    cfg = v41_flash()
    lay = CacheLayout.build(cfg, 64, torch.bfloat16, kv_quant=True)
    cb = cache_bytes(cfg)
    assert lay.bytes_per_token == cb.paged_bytes_per_token == 890
    assert lay.bytes_per_slot == cb.fixed_bytes_per_request
    exact = CacheLayout.build(cfg, 64, torch.bfloat16)
    assert exact.bytes_per_token == cache_bytes(cfg, "bf16").paged_bytes_per_token
