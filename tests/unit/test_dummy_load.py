"""``load_format: dummy``: random weights of config.json's shapes through the real loader's
plan and install (same state as a checkpoint's, refusals, finite logits, determinism), and
the shipped flash-rank config with its generated tokenizer."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

import app.config
from app.api.protocols import CHAT, RecipeFrontend
from app.config import EngineConfig, EngineConfigError
from app.engine.llm import LLM
from app.engine.model_path import CONFIG_MODELS, resolve_model
from app.engine.request import SamplingParams
from app.engine.validation import RequestLimits
from app.model.checkpoint import (
    LOAD_FORMATS,
    SINGLE_FILE,
    Checkpoint,
    CheckpointError,
    LoadFormatError,
    plan_loads,
    plan_packing,
)
from app.model.config import ModelConfig
from app.model.dummy import random_source
from app.model.engram_hash import compressed_token_map
from app.model.ep import ExpertPlacement, ExpertShard
from app.model.layers import Fp8Linear
from app.model.loader import build_empty_model, load_model, tensor_specs
from app.model.moe import PackedExperts
from app.model.tiny import make_tiny_checkpoint
from app.model.tiny_config import v41_schedule_config
from app.model.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tiny_tokenizer
from bench.flash_rank import flash_config
from tests.support.reference import sequence_logits

CONFIG_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
CASES = {"v41": {}, "v4": {}, "v4-fp8-experts": {"expert_dtype": "fp8", "block": 32}}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(a tiny checkpoint, a directory with only its config and tokenizer files)."""
    arch = request.param.split("-")[0]
    root = tmp_path_factory.mktemp(request.param)
    ckpt = make_tiny_checkpoint(root / "ckpt", arch, seed=0, **CASES[request.param])
    bare = root / "bare"
    bare.mkdir()
    for name in CONFIG_FILES:
        if (ckpt / name).is_file():
            shutil.copyfile(ckpt / name, bare / name)
    return ckpt, bare


def _specs(path: Path) -> dict:
    return tensor_specs(build_empty_model(ModelConfig.from_file(path)))


def test_random_source_lists_the_checkpoint_headers(pair):
    """Every checkpoint name with its stored dtype and shape, and nothing else."""
    ckpt, bare = pair
    cfg = ModelConfig.from_file(bare)
    src = random_source(bare, _specs(bare), cfg, torch.device("cpu"))
    with contextlib.ExitStack() as stack:
        real = Checkpoint(ckpt, stack)
        assert set(src.weight_map) == set(real.weight_map)
        for name in real.weight_map:
            assert src.header(name) == real.header(name), name
            t = src.read(name)
            assert str(t.dtype) == str(real.read(name).dtype), name
            assert tuple(t.shape) == real.header(name)[1], name


def _summary(model: torch.nn.Module) -> dict:
    """Every state tensor's shape and dtype, every module's type, packed formats."""
    out: dict = {n: (tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}
    for name, m in model.named_modules():
        out[f"{name}:type"] = type(m).__name__
        if isinstance(m, PackedExperts):
            out[f"{name}:packed"] = (m.fmt, m.block, m.n_local, m.layout)
        if isinstance(m, Fp8Linear):
            out[f"{name}:fp8"] = (m.block, tuple(m.weight.shape), m.weight.dtype)
    return out


@pytest.mark.parametrize(
    "opts",
    [{}, {"packed_experts": True}, {"packed_experts": True, "packed_dense": True},
     {"dtype": torch.bfloat16, "kv_quant": True}],  # fmt: skip
)
def test_dummy_state_equals_the_real_loaders(pair, opts):
    ckpt, bare = pair
    real, dummy = load_model(ckpt, **opts), load_model(bare, load_format="dummy", **opts)
    want, got = _summary(real), _summary(dummy)
    assert list(got) == list(want)
    assert {k: v for k, v in got.items() if v != want[k]} == {}
    if opts.get("packed_experts"):
        assert any(k.endswith(":packed") for k in got)
    if opts.get("packed_dense"):
        assert any(k.endswith(":fp8") for k in got)


def test_dummy_logits_are_finite_and_spread(pair):
    _, bare = pair
    model = load_model(bare, load_format="dummy", packed_experts=True)
    logits = sequence_logits(model, torch.tensor([0, 7, 19, 100, 300, 511, 42, 3]))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 100


def test_dummy_is_deterministic_for_a_seed(pair):
    _, bare = pair
    a = load_model(bare, load_format="dummy", seed=3).state_dict()
    b = load_model(bare, load_format="dummy", seed=3).state_dict()
    c = load_model(bare, load_format="dummy", seed=4).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    differ = [n for n in a if a[n].is_floating_point() and not torch.equal(a[n], c[n])]
    assert len(differ) > len(a) // 2


def test_dummy_expert_shards_hold_the_real_names_and_agree(pair):
    """Expert parallelism: each rank draws only its experts, as the real loader reads them;
    an expert held by two ranks (a redundant slot) has the same weights on both."""
    ckpt, bare = pair
    placement = ExpertPlacement.default(8, 2, redundant=2)
    shards = [ExpertShard(placement, r) for r in (0, 1)]
    a, b = (load_model(bare, load_format="dummy", shard=s) for s in shards)
    assert _summary(b) == _summary(load_model(ckpt, shard=shards[1]))
    sa, sb = a.state_dict(), b.state_dict()
    shared = [n for n in sa if ".experts." in n and n in sb]
    assert shared and all(torch.equal(sa[n], sb[n]) for n in shared)


def test_dummy_refuses_a_directory_with_weights(pair, tmp_path):
    """The loader refuses it (a checkpoint error of the option); the engine reports it as a
    config error."""
    ckpt, bare = pair
    with pytest.raises(LoadFormatError, match="load_format 'dummy'.*holds a checkpoint"):
        load_model(ckpt, load_format="dummy")
    with pytest.raises(EngineConfigError, match="load_format 'dummy'.*holds a checkpoint"):
        LLM(str(ckpt), load_format="dummy", cuda_graphs=False)
    single = Path(shutil.copytree(bare, tmp_path / "single"))
    (single / SINGLE_FILE).write_bytes(b"")
    with pytest.raises(LoadFormatError, match=f"load_format.*{SINGLE_FILE}"):
        load_model(single, load_format="dummy")
    with pytest.raises(EngineConfigError, match=f"load_format.*{SINGLE_FILE}"):
        LLM(str(single), load_format="dummy", cuda_graphs=False)


def test_auto_without_weights_suggests_dummy(pair):
    _, bare = pair
    with pytest.raises(CheckpointError, match="set load_format: dummy"):
        load_model(bare)
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(bare, load_format="random")


def test_engine_option_and_llm(pair):
    _, bare = pair
    assert app.config.LOAD_FORMATS == LOAD_FORMATS  # the option's choices are the loader's
    assert EngineConfig.from_options(str(bare), load_format="dummy").load_format == "dummy"
    assert EngineConfig(model=str(bare)).load_format == "auto"
    with pytest.raises(EngineConfigError, match="load_format"):
        EngineConfig.from_options(str(bare), load_format="random")
    with pytest.raises(EngineConfigError, match="load_format"):
        EngineConfig(model=str(bare), load_format="random")
    llm = LLM(str(bare), load_format="dummy", cuda_graphs=False)
    out = llm.generate(prompt_token_ids=[[0, 5, 6, 7]],
                       sampling_params=SamplingParams(temperature=0, max_tokens=3))  # fmt: skip
    assert len(out[0].token_ids) == 3


def test_forty_layers_of_dummy_weights_stay_finite(tmp_path):
    """The flash rank's 40-layer schedule (and DSpark targets) at small widths."""
    tok = write_tiny_tokenizer(tmp_path)
    full = flash_config()
    raw = v41_schedule_config(
        compressed_token_map(tok)[1], num_hidden_layers=full.num_hidden_layers,
        compress_ratios=list(full.compress_ratios),
        kv_source_layer_ids=list(full.kv_source_layer_ids),
        index_source_layer_ids=list(full.index_source_layer_ids),
        candidate_source_layer_id=full.candidate_source_layer_id,
        dspark_target_layer_ids=list(full.dspark_target_layer_ids),
        hidden_size=256, moe_intermediate_size=128,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, load_format="dummy", packed_experts=True)
    assert len(model.layers) == 40
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(0))
    logits = sequence_logits(model, ids)
    assert torch.isfinite(logits).all() and 0.1 < logits.std().item() < 100


# ---- the flash rank -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("flash-rank", str(tmp_path_factory.mktemp("cache")))


def test_flash_rank_config_is_v41_flash_with_an_ep8_share(flash_dir):
    shipped = ModelConfig.from_file(CONFIG_MODELS["flash-rank"])
    assert ModelConfig.from_file(flash_dir) == shipped
    full = flash_config()
    assert (shipped.n_routed_experts, shipped.dspark_n_routed_experts) == (48, 16)
    assert full.n_routed_experts // 8 == 48 and full.dspark_n_routed_experts // 8 == 16
    assert (shipped.num_experts_per_tok, shipped.dspark_num_experts_per_tok) == (6, 3)
    counts = {"n_routed_experts", "dspark_n_routed_experts"}
    for f in dataclasses.fields(ModelConfig):
        if f.name not in counts:
            assert getattr(shipped, f.name) == getattr(full, f.name), f.name
    raw = json.loads((flash_dir / "config.json").read_text())
    assert set(raw) >= {"architectures", "text_config", "quantization_config"}


def test_flash_rank_plans_from_headers(flash_dir):
    """The whole rank's random source passes the loader's plan; every MoE layer packs fp4."""
    cfg = ModelConfig.from_file(flash_dir)
    specs = tensor_specs(build_empty_model(cfg, kv_quant=True))
    src = random_source(flash_dir, specs, cfg, torch.device("cpu"))
    loads = plan_loads(src, specs, cfg, torch.bfloat16)
    packed = plan_packing(src, loads, True, torch.device("cpu"))
    assert len(packed) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert {(p.fmt, p.block, len(p.experts)) for n, p in packed.items()
            if not n.startswith("mtp.")} == {("fp4", (1, 32), 48)}  # fmt: skip
    assert {len(p.experts) for n, p in packed.items() if n.startswith("mtp.")} == {16}


def test_flash_rank_tokenizer_covers_the_vocabulary(flash_dir):
    cfg = ModelConfig.from_file(flash_dir)
    tok = Tokenizer.from_file(str(flash_dir / "tokenizer.json"))
    n = tok.get_vocab_size(with_added_tokens=True)
    assert n == cfg.vocab_size == 129280
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i
    assert (tok.token_to_id(SPECIAL_TOKENS[0]), tok.token_to_id(SPECIAL_TOKENS[1])) == (
        cfg.bos_token_id, cfg.eos_token_id)  # fmt: skip
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    assert all(texts)
    again = tok.decode_batch([e.ids for e in tok.encode_batch(texts)], skip_special_tokens=False)
    assert again == texts
    assert compressed_token_map(tok)[1] == cfg.engram_compressed_vocab_size
    text = "Hello world: the quick brown fox."
    assert tok.decode(tok.encode(text).ids) == text
    tcfg = json.loads((flash_dir / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"]) == SPECIAL_TOKENS[:2]
    assert build_tokenizer(1000).get_vocab_size(with_added_tokens=True) == 1000


def test_flash_rank_renders_a_chat_with_deepseek_recipe(flash_dir):
    front = RecipeFrontend(["flash-rank"], "v41", str(flash_dir / "tokenizer.json"),
                           RequestLimits(129280, 4096), 4000, 16)  # fmt: skip
    raw = {"model": "flash-rank", "messages": [{"role": "user", "content": "Hello there"}]}
    prep = front.prepare(CHAT, json.dumps(raw).encode(), raw)
    ids = list(prep.engine_request.prompt_token_ids)
    tok = Tokenizer.from_file(str(flash_dir / "tokenizer.json"))
    assert ids[0] == 0 and tok.token_to_id("<｜User｜>") in ids
    assert tok.token_to_id("<｜Assistant｜>") in ids
    assert "Hello there" in tok.decode(ids, skip_special_tokens=False)
    assert front.stop_ids == frozenset({1})
