"""Tiny checkpoint writer and loader: round trip, layout, and every bad-checkpoint error."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.model.checkpoint import INDEX_FILE, CheckpointError, checkpoint_quant_kind, scale_name
from app.model.config import ConfigError, ModelConfig
from app.model.loader import load_model
from app.model.tiny import make_tiny_checkpoint
from app.model.tiny_config import tiny_config_v4
from kernels.quant import (
    dequantize_fp4,
    dequantize_fp8_block,
    dequantize_fp8_rowwise,
    quantize_fp8_block,
)
from tests.support.reference import sequence_logits

_STORED = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8, "fp8_rowwise": torch.float8_e4m3fn,
           "bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_v41(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v41"), "v41", seed=0)


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4"), "v4", seed=0)


@pytest.fixture(params=["v41", "v4"])
def tiny(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture
def ckpt(tiny_v41: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny V4.1 checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_v41, tmp_path / "ckpt"))


@pytest.fixture
def ckpt_v4(tiny_v4: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny V4 checkpoint (hash-routed layers)."""
    return Path(shutil.copytree(tiny_v4, tmp_path / "ckpt_v4"))


def _weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(_weight_map(path).values())):
        out.update(load_file(str(path / file)))
    return out


def _edit(path: Path, name: str, value: torch.Tensor | None) -> str:
    """Replace (or with None delete) tensor ``name`` in its shard; -> the shard's file name."""
    file = _weight_map(path)[name]
    tensors = load_file(str(path / file))
    if value is None:
        del tensors[name]
        wm = _weight_map(path)
        del wm[name]
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        tensors[name] = value
    save_file(tensors, str(path / file))
    return file


def _add(path: Path, name: str, value: torch.Tensor) -> str:
    """Add a tensor to the first shard and the index; -> the shard's file name."""
    wm = _weight_map(path)
    file = sorted(set(wm.values()))[0]
    tensors = load_file(str(path / file))
    tensors[name] = value
    save_file(tensors, str(path / file))
    wm[name] = file
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return file


def _load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    return str(e.value)


# ---- writer ---------------------------------------------------------------------------


def test_layout_matches_official_storage(tiny: Path) -> None:
    cfg = ModelConfig.from_file(tiny)
    wm = _weight_map(tiny)
    files = sorted(set(wm.values()))
    assert len(files) >= 2
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    split = [n for n in wm if n.endswith(".scale") and wm[n] != wm[n[: -len("scale")] + "weight"]]
    assert split, "no weight/scale pair crosses a shard boundary"
    index = json.loads((tiny / INDEX_FILE).read_text())
    tensors = _read_all(tiny)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    for name, t in tensors.items():
        if name.endswith(".scale"):
            assert t.dtype == torch.float8_e8m0fnu
            continue
        kind = checkpoint_quant_kind(name, cfg)
        assert t.dtype == _STORED[kind], name
        assert (scale_name(name) in tensors) == (kind in ("fp8", "fp4", "fp8_rowwise")), name


def test_quant_kinds_follow_model_spec() -> None:
    raw = tiny_config_v4()
    cfg = ModelConfig.from_dict(raw)
    kinds = {
        "layers.3.attn.wq_a.weight": "fp8", "layers.3.attn.wo_b.weight": "fp8",
        "layers.2.attn.indexer.wq_b.weight": "fp8", "layers.2.ffn.shared_experts.w2.weight": "fp8",
        "layers.1.engram.wkv.weight": "fp8", "mtp.0.main_proj.weight": "fp8",
        "mtp.1.attn.wkv.weight": "fp8", "layers.2.ffn.experts.5.w1.weight": "fp4",
        "mtp.0.ffn.experts.0.w3.weight": "fp4", "layers.1.engram.embed.weight": "fp8_rowwise",
        "embed.weight": "bf16", "head.weight": "bf16", "norm.weight": "bf16",
        "layers.2.attn.compressor.wkv.weight": "bf16",
        "layers.2.attn.indexer.compressor.wgate.weight": "bf16",
        "layers.2.ffn.gate.weight": "bf16", "layers.2.attn.indexer.weights_proj.weight": "bf16",
        "layers.0.hc_attn_fn": "fp32", "hc_head_scale": "fp32", "layers.0.attn.attn_sink": "fp32",
        "layers.2.ffn.gate.bias": "fp32", "layers.2.ffn.gate.bias_vl": "fp32",
        "layers.2.attn.compressor.ape": "fp32", "layers.0.ffn.gate.tid2eid": "int64",
    }  # fmt: skip
    assert {n: checkpoint_quant_kind(n, cfg) for n in kinds} == kinds
    del raw["quantization_config"]
    unquantized = ModelConfig.from_dict(raw)
    assert checkpoint_quant_kind("layers.3.attn.wq_a.weight", unquantized) == "bf16"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_writer_is_deterministic_per_seed(tiny_v41: Path, tiny_v4: Path, tmp_path: Path) -> None:
    assert _digest(make_tiny_checkpoint(tmp_path / "a", "v41", seed=0)) == _digest(tiny_v41)
    assert _digest(make_tiny_checkpoint(tmp_path / "b", "v4", seed=1)) != _digest(tiny_v4)


def test_writer_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="v5"):
        make_tiny_checkpoint(tmp_path, "v5")


# ---- round trip -----------------------------------------------------------------------


def _dequantized(path: Path) -> dict[str, torch.Tensor]:
    """What the model should hold: the written tensors, dequantized independently."""
    cfg = ModelConfig.from_file(path)
    assert cfg.quantization is not None
    raw = _read_all(path)
    out = {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        kind = checkpoint_quant_kind(name, cfg)
        s = raw.get(scale_name(name))
        if kind == "fp8":
            out[name] = dequantize_fp8_block(t, s, cfg.quantization.weight_block_size)
        elif kind == "fp4":
            out[name] = dequantize_fp4(t, s)
        elif kind == "fp8_rowwise":
            out[name] = dequantize_fp8_rowwise(t, s)
        else:
            out[name] = t.float() if t.is_floating_point() else t
    return out


def test_round_trip(tiny: Path) -> None:
    model = load_model(tiny)
    want = _dequantized(tiny)
    got = model.state_dict()
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.device.type == "cpu" and t.dtype == want[name].dtype, name
        assert torch.equal(t, want[name]), name
    assert not any(t.is_meta for t in model.parameters())
    # Non-degenerate: norms near 1, distinct experts per token in the hash layers.
    assert 0.5 < float(got["norm.weight"].mean()) < 1.5
    for name, t in got.items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
            assert all(len(set(row)) == len(row) for row in t.tolist())


def test_compute_dtype_applies_to_quantized_weights(tiny_v41: Path) -> None:
    sd = load_model(tiny_v41, dtype=torch.bfloat16).state_dict()
    assert sd["layers.2.attn.wq_a.weight"].dtype == torch.bfloat16
    assert sd["layers.0.ffn.experts.1.w2.weight"].dtype == torch.bfloat16
    assert sd["layers.1.engram.embed.weight"].dtype == torch.bfloat16
    assert sd["layers.0.attn_norm.weight"].dtype == torch.float32
    assert sd["layers.0.hc_attn_fn"].dtype == torch.float32


def test_single_file_without_index(ckpt_v4: Path) -> None:
    tensors = _read_all(ckpt_v4)
    for f in set(_weight_map(ckpt_v4).values()):
        (ckpt_v4 / f).unlink()
    (ckpt_v4 / INDEX_FILE).unlink()
    save_file(tensors, str(ckpt_v4 / "model.safetensors"))
    want = _dequantized_from(tensors, ModelConfig.from_file(ckpt_v4))
    got = load_model(ckpt_v4).state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def _dequantized_from(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    assert cfg.quantization is not None
    return {
        n: dequantize_fp8_block(t, raw[scale_name(n)], cfg.quantization.weight_block_size)
        for n, t in raw.items()
        if checkpoint_quant_kind(n, cfg) == "fp8"
    }


def test_accepts_int32_tid2eid_fp32_storage_and_vision(ckpt_v4: Path) -> None:
    tid = load_file(str(ckpt_v4 / _weight_map(ckpt_v4)["layers.0.ffn.gate.tid2eid"]))[
        "layers.0.ffn.gate.tid2eid"
    ]
    _edit(ckpt_v4, "layers.0.ffn.gate.tid2eid", tid.to(torch.int32))  # trap 4
    head = load_file(str(ckpt_v4 / _weight_map(ckpt_v4)["head.weight"]))["head.weight"]
    _edit(ckpt_v4, "head.weight", head.float())  # trap 6: fp32 where bf16 is usual
    _add(ckpt_v4, "vision.patch_embed.weight", torch.zeros(2, 2))  # trap 8
    _add(ckpt_v4, "image_newline", torch.zeros(4))
    sd = load_model(ckpt_v4).state_dict()
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(sd["layers.0.ffn.gate.tid2eid"], tid)
    assert torch.equal(sd["head.weight"], head.float())


def test_scale_block_derived_from_scale_shape(ckpt_v4: Path) -> None:
    # The config says 128x128; a checkpoint quantized with 16x64 blocks still loads.
    name = "layers.2.attn.wq_b.weight"  # [256, 32]
    w = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_block(w, (16, 64))
    _edit(ckpt_v4, name, q)
    _edit(ckpt_v4, scale_name(name), s)
    got = load_model(ckpt_v4).state_dict()[name]
    assert torch.equal(got, dequantize_fp8_block(q, s, (16, 64)))


# ---- errors ---------------------------------------------------------------------------


def test_missing_shard(ckpt: Path) -> None:
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    msg = _load_error(ckpt)
    assert "model-00002-of-00003.safetensors" in msg and "missing" in msg


def test_truncated_shard(ckpt: Path) -> None:
    f = ckpt / "model-00003-of-00003.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    msg = _load_error(ckpt)
    assert "model-00003-of-00003.safetensors" in msg and "truncated" in msg


def test_missing_index_and_single_file(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).unlink()
    assert INDEX_FILE in _load_error(ckpt)


def test_index_points_to_wrong_shard(ckpt: Path) -> None:
    wm = _weight_map(ckpt)
    name = "layers.3.attn.wkv.weight"
    wm[name] = next(f for f in sorted(set(wm.values())) if f != wm[name])
    (ckpt / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    msg = _load_error(ckpt)
    assert name in msg and wm[name] in msg


def test_wrong_shape(ckpt: Path) -> None:
    file = _edit(ckpt, "layers.0.attn_norm.weight", torch.ones(65, dtype=torch.bfloat16))
    msg = _load_error(ckpt)
    assert "layers.0.attn_norm.weight" in msg and file in msg
    assert "[65]" in msg and "[64]" in msg


def test_wrong_fp8_scale_shape(ckpt: Path) -> None:
    name = "layers.2.attn.wo_a.scale"
    file = _edit(ckpt, name, torch.ones(3, 5).to(torch.float8_e8m0fnu))
    msg = _load_error(ckpt)
    assert name in msg and file in msg and "block" in msg


def test_wrong_packed_fp4_shape(ckpt: Path) -> None:
    name = "layers.0.ffn.experts.3.w1.weight"  # [32, 64] -> packed [32, 32]
    _edit(ckpt, name, torch.zeros(32, 64, dtype=torch.int8))
    msg = _load_error(ckpt)
    assert name in msg and "[32, 32]" in msg


def test_fp8_weight_without_scale(ckpt: Path) -> None:
    _edit(ckpt, "layers.4.attn.wkv.scale", None)
    msg = _load_error(ckpt)
    assert "layers.4.attn.wkv.weight" in msg and "layers.4.attn.wkv.scale" in msg


def test_int8_where_float_expected(ckpt: Path) -> None:
    file = _edit(ckpt, "layers.0.attn.attn_sink", torch.zeros(4, dtype=torch.int8))
    msg = _load_error(ckpt)
    assert "layers.0.attn.attn_sink" in msg and file in msg and "I8" in msg


def test_float_where_integer_expected(ckpt_v4: Path) -> None:
    _edit(ckpt_v4, "layers.1.ffn.gate.tid2eid", torch.zeros(512, 2))
    msg = _load_error(ckpt_v4)
    assert "layers.1.ffn.gate.tid2eid" in msg and "integer" in msg


def test_missing_tensor(ckpt: Path) -> None:
    _edit(ckpt, "mtp.2.markov_head.head.weight", None)
    msg = _load_error(ckpt)
    assert "mtp.2.markov_head.head.weight" in msg and "missing" in msg


def test_unexpected_tensor(ckpt: Path) -> None:
    file = _add(ckpt, "layers.9.attn.wq_a.weight", torch.zeros(2, 2, dtype=torch.bfloat16))
    msg = _load_error(ckpt)
    assert "layers.9.attn.wq_a.weight" in msg and file in msg and "unexpected" in msg


def test_scale_of_unquantized_tensor_is_unexpected(ckpt: Path) -> None:
    _add(ckpt, "norm.scale", torch.ones(1, 1).to(torch.float8_e8m0fnu))
    assert "norm.scale" in _load_error(ckpt)


def test_all_problems_reported_together(ckpt: Path) -> None:
    _edit(ckpt, "head.weight", None)
    _add(ckpt, "bogus", torch.zeros(1))
    msg = _load_error(ckpt)
    assert "head.weight" in msg and "bogus" in msg and "2 problems" in msg


def test_unknown_architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_model(ckpt)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_packed_dense_keeps_fp8_projections(tiny_ckpt, arch):
    """packed_dense: the dense fp8 projections stay e4m3 + e8m0 as stored (Fp8Linear, not wo_a)
    and the model computes the same logits as the dequantized one (the CPU reference of the
    fp8 kernel dequantizes the same bytes the same way)."""
    from app.model.layers import Fp8Linear

    path = tiny_ckpt(arch)
    plain, packed = load_model(path), load_model(path, packed_dense=True)
    att = packed.layers[2].attn
    assert isinstance(att.wq_b, Fp8Linear) and att.wq_b.weight.dtype == torch.float8_e4m3fn
    assert not isinstance(att.wo_a, Fp8Linear)
    shared = packed.layers[0].ffn.shared_experts
    assert isinstance(shared.w2, Fp8Linear)
    assert {"layers.2.attn.wq_b.weight", "layers.2.attn.wq_b.scale"} <= set(packed.state_dict())
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(sequence_logits(packed, ids), sequence_logits(plain, ids))
    # W1 / W3 ran as one projection where their scale blocks end at the seam (V4.1's 32-row
    # blocks; V4's 128-row blocks hold the tiny model's 32 rows of each: two projections)
    seam = not shared.w1.out_features % shared.w1.block[0]
    assert shared.stackable == seam == (shared.stack_of("_w13") is not None) == (arch == "v41")
