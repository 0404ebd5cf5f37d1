"""Routed experts kept packed per layer (``PackedExperts``): the loader stacks the checkpoint's
bytes without dequantizing, the model gives the dequantized model's logits and greedy tokens,
and checkpoints that cannot be packed fail with named errors (CPU: the kernels' torch path).

Checkpoints: tiny V4.1 and V4 (fp4 experts), tiny V4 with fp8 experts (block 32), and copies
rewritten with other storage (U8 / F32 scales, U8 fp4 bytes, bf16 experts, fp4 scales per 16).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app.config import EngineConfig, EngineConfigError
from app.engine.llm import LLM
from app.engine.request import SamplingParams
from app.model.checkpoint import INDEX_FILE, CheckpointError, scale_name
from app.model.loader import load_model
from app.model.model import DeepseekModel
from app.model.moe import MoE, PackedExperts
from kernels.moe_formats import fp4_to_pairs
from kernels.quant import dequantize_fp4, e8m0_to_float, quantize_fp4
from tests.support.loader import expert_packing
from tests.support.reference import sequence_logits
from tests.unit.triton_util import rel

FP8 = {"expert_dtype": "fp8", "block": 32}
CKPTS = {"v41-fp4": ("v41", {}), "v4-fp4": ("v4", {}), "v4-fp8": ("v4", FP8)}
_WEIGHT_DTYPE = {"fp4": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.fixture(params=sorted(CKPTS))
def ckpt(request: pytest.FixtureRequest, tiny_ckpt) -> str:
    arch, options = CKPTS[request.param]
    return tiny_ckpt(arch, **options)


def _moes(model: DeepseekModel) -> dict[str, MoE]:
    """Every MoE of the model (decoder layers and mtp blocks) by module path."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MoE)}


def _ids(n: int = 23, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


def _rewrite(src: str, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with ``edit`` applied to all its tensors (in place:
    replace or delete names); every tensor stays in its shard, the index follows."""
    path = Path(shutil.copytree(src, dst))
    wm: dict[str, str] = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(wm.values())):
        tensors.update(load_file(str(path / f)))
    edit(tensors)
    assert set(tensors) <= set(wm), "rewrite may only replace or delete tensors"
    for f in sorted(set(wm.values())):
        save_file({n: t.contiguous() for n, t in tensors.items() if wm[n] == f}, str(path / f))
    index = {"metadata": {}, "weight_map": {n: wm[n] for n in sorted(tensors)}}
    (path / INDEX_FILE).write_text(json.dumps(index))
    return path


def _expert_weights(tensors: dict[str, torch.Tensor], layer: str = "") -> list[str]:
    return [n for n in tensors if ".ffn.experts." in n and n.endswith(".weight")
            and n.startswith(layer)]  # fmt: skip


# ---- packed = dequantized -------------------------------------------------------------


@torch.no_grad()
def test_packed_logits_equal_dequantized(ckpt: str) -> None:
    ref = load_model(ckpt, packed_experts=False)
    packed = load_model(ckpt, packed_experts=True)
    ids = _ids(41)
    assert rel(sequence_logits(packed, ids), sequence_logits(ref, ids)) < 1e-5
    # every MoE (mtp blocks too, which logits() does not run) gives the same output
    g = torch.Generator().manual_seed(1)
    ref_moes = _moes(ref)
    for name, moe in _moes(packed).items():
        assert isinstance(moe.experts, PackedExperts), name
        assert isinstance(ref_moes[name].experts, torch.nn.ModuleList), name
        x = torch.randn(9, packed.cfg.hidden_size, generator=g)
        tok = _ids(9, seed=2)
        assert rel(moe(x, tok), ref_moes[name](x, tok)) < 1e-5, name


def test_packed_module_holds_checkpoint_bytes(ckpt: str) -> None:
    model = load_model(ckpt, packed_experts=True)
    sd = model.state_dict()
    per_expert = [n for n in sd if re.search(r"\.experts\.\d+\.", n)]
    assert not per_expert, "per-expert (dequantized) tensors remain"
    assert "layers.0.ffn.experts.w13" in sd
    raw: dict[str, torch.Tensor] = {}
    for f in Path(ckpt).glob("*.safetensors"):
        raw.update(load_file(str(f)))
    for name, moe in _moes(model).items():
        pe = moe.experts
        assert isinstance(pe, PackedExperts)
        assert dict(pe.named_buffers()).keys() == {"w13", "s13", "w2", "s2"}
        assert not list(pe.parameters()) and not list(pe.children())
        assert pe.w13.dtype == pe.w2.dtype == _WEIGHT_DTYPE[pe.fmt], name
        assert pe.s13.dtype == pe.s2.dtype == torch.float8_e8m0fnu, name
        assert pe.local_expert_offset == 0 and pe.limit == moe.limit
        inter = pe.w13.shape[1] // 2
        for e in range(pe.n_local):
            w = {k: raw[f"{name}.experts.{e}.{k}.weight"] for k in ("w1", "w2", "w3")}
            s = {k: raw[scale_name(f"{name}.experts.{e}.{k}.weight")] for k in w}
            sr = s["w1"].shape[0]  # scale rows of W1
            for got, want in ((pe.w13[e, :inter], w["w1"]), (pe.w13[e, inter:], w["w3"]),
                              (pe.w2[e], w["w2"]), (pe.s13[e, :sr], s["w1"]),
                              (pe.s13[e, sr:], s["w3"]), (pe.s2[e], s["w2"])):  # fmt: skip
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, e)


@pytest.mark.parametrize("name", ["v41-fp4", "v4-fp8"])
def test_engine_greedy_tokens_equal(tiny_ckpt, name: str) -> None:
    arch, options = CKPTS[name]
    path = tiny_ckpt(arch, **options)
    prompts = [_ids(n, seed=n).tolist() for n in (23, 5, 37)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for mode in ("on", "off"):
        llm = LLM(path, packed_experts=mode, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)
        experts = llm.engine.model.layers[0].ffn.experts
        assert isinstance(experts, PackedExperts) == (mode == "on")
        outs[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]  # fmt: skip
    assert outs["on"] == outs["off"]
    assert all(len(t) == 8 for t in outs["on"])


@torch.no_grad()
def test_other_scale_and_byte_storage(tiny_ckpt, tmp_path: Path) -> None:
    """U8 scales (e8m0 codes), F32 scales and U8 fp4 bytes pack to the same model."""
    src = tiny_ckpt("v41")

    def edit(t: dict[str, torch.Tensor]) -> None:
        for n in _expert_weights(t, "layers.0."):  # U8 e8m0 codes: still e8m0 when packed
            t[scale_name(n)] = t[scale_name(n)].view(torch.uint8)
        for n in _expert_weights(t, "layers.2.ffn.experts.1."):  # one expert's scales F32
            t[scale_name(n)] = e8m0_to_float(t[scale_name(n)])
        for n in _expert_weights(t, "layers.3."):  # fp4 bytes stored as U8
            t[n] = t[n].view(torch.uint8)

    path = _rewrite(src, tmp_path / "ckpt", edit)
    model = load_model(path, packed_experts=True)
    layers = model.layers
    assert layers[0].ffn.experts.s13.dtype == torch.float8_e8m0fnu
    assert layers[2].ffn.experts.s13.dtype == torch.float32  # one F32 expert: all fp32
    assert layers[3].ffn.experts.w13.dtype == torch.int8
    ids = _ids(41)
    assert rel(sequence_logits(model, ids), sequence_logits(load_model(src), ids)) < 1e-5


@torch.no_grad()
def test_local_expert_range_sums_to_the_layer(tiny_ckpt) -> None:
    """Expert parallelism's layout: two halves with offsets add up to the whole layer."""
    pe = load_model(tiny_ckpt("v4", **FP8), packed_experts=True).layers[2].ffn.experts
    assert isinstance(pe, PackedExperts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    halves = []
    for lo, hi in ((0, 4), (4, 8)):
        part = [t[lo:hi] for t in (pe.w13, pe.s13, pe.w2, pe.s2)]
        halves.append(PackedExperts(*part, pe.fmt, pe.block, pe.limit, local_expert_offset=lo))
    assert [h.n_local for h in halves] == [4, 4]
    assert rel(halves[0](x, ids, w) + halves[1](x, ids, w), pe(x, ids, w)) < 1e-6


@torch.no_grad()
def test_fp4_pairs_layout_gives_the_same_layer(tiny_ckpt) -> None:
    """``repack("pairs")`` (what the loader does on CUDA) changes the bytes' order, not the
    layer: same output on the torch path, and back to the checkpoint's bytes exactly."""
    pe = load_model(tiny_ckpt("v41"), packed_experts=True).layers[1].ffn.experts
    assert isinstance(pe, PackedExperts) and pe.layout == "mx"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    want, w13, w2 = pe(x, ids, w), pe.w13.clone(), pe.w2.clone()
    n, two_i, half_d = w13.shape
    pe.repack("pairs")
    assert pe.layout == "pairs" and "layout=pairs" in repr(pe)
    assert pe.w13.shape == (n, two_i // 2, 2 * half_d) and pe.w2.shape[1] == 32
    assert torch.equal(pe.w13, fp4_to_pairs(w13)) and torch.equal(pe.w2, fp4_to_pairs(w2))
    assert torch.equal(pe(x, ids, w), want)
    pe.repack("mx")
    assert torch.equal(pe.w13, w13) and torch.equal(pe.w2, w2)
    with pytest.raises(ValueError, match="layouts are"):
        pe.repack("halves")  # type: ignore[arg-type]
    fp8 = load_model(tiny_ckpt("v4", **FP8), packed_experts=True).layers[2].ffn.experts
    with pytest.raises(ValueError, match="only fp4"):
        fp8.repack("pairs")


@torch.no_grad()
def test_cuda_repack_of_the_loader(tiny_ckpt) -> None:
    """What ``load_model`` does to fp4 layers on CUDA, run on the CPU: every fp4 layer of the
    tiny model (d = 64) goes to the pairs layout, in place (same storage), with the same
    logits; a layer whose d is not a multiple of 64 keeps the checkpoint's layout."""
    from app.model.loader import _repack_fp4_for_cuda

    model = load_model(tiny_ckpt("v41"), packed_experts=True)
    ids = _ids(19)
    want = sequence_logits(model, ids)
    packed = [m for m in model.modules() if isinstance(m, PackedExperts)]
    ptrs = [m.w13.data_ptr() for m in packed]
    _repack_fp4_for_cuda(model)
    assert {m.layout for m in packed} == {"pairs"}
    assert [m.w13.data_ptr() for m in packed] == ptrs
    assert torch.equal(sequence_logits(model, ids), want)
    g = torch.Generator().manual_seed(2)
    narrow = PackedExperts(
        *_stack_fp4(torch.randn(2, 64, 96, generator=g)),
        *_stack_fp4(torch.randn(2, 96, 32, generator=g)),
        "fp4",
        (1, 32),
        7.0,
    )  # d = 96
    container = torch.nn.Sequential(narrow)
    _repack_fp4_for_cuda(container)
    assert narrow.layout == "mx"
    with pytest.raises(ValueError, match="d % 64"):
        narrow.repack("pairs")


def _stack_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = zip(*(quantize_fp4(e) for e in w), strict=True)
    return torch.stack(q), torch.stack(s)


# ---- when packing applies, and the errors ---------------------------------------------


def test_auto_packs_on_cuda_only(tiny_ckpt) -> None:
    """Headers only (no GPU needed): auto packs every MoE on CUDA, none on CPU."""
    path = tiny_ckpt("v41")
    plan = expert_packing(path, device="cuda")
    layers = [f"layers.{i}" for i in range(8)] + [f"mtp.{k}" for k in range(3)]
    assert set(plan) == {f"{n}.ffn.experts" for n in layers}
    assert all(p.fmt == "fp4" and p.block == (1, 32) for p in plan.values())
    assert plan["layers.0.ffn.experts"].experts == tuple(range(8))
    assert plan["mtp.0.ffn.experts"].experts == tuple(range(4))  # DSpark stages have 4 experts
    assert expert_packing(path, device="cpu") == {}
    assert expert_packing(path, device="cuda", packed_experts=False) == {}
    fp8 = expert_packing(tiny_ckpt("v4", **FP8), device="cuda")
    assert {(p.fmt, p.block) for p in fp8.values()} == {("fp8", (32, 32))}
    assert isinstance(load_model(path).layers[0].ffn.experts, torch.nn.ModuleList)  # CPU auto


def test_unquantized_experts(tiny_ckpt, tmp_path: Path, caplog) -> None:
    def to_bf16(t: dict[str, torch.Tensor]) -> None:
        for n in _expert_weights(t):
            t[n] = dequantize_fp4(t[n], t.pop(scale_name(n))).bfloat16()

    path = _rewrite(tiny_ckpt("v41"), tmp_path / "bf16", to_bf16)
    with pytest.raises(CheckpointError) as e:
        load_model(path, packed_experts=True)
    msg = str(e.value)
    assert "packed_experts" in msg and "layers.0.ffn.experts" in msg and "mtp.2.ffn.experts" in msg
    assert "unquantized (BF16)" in msg
    with caplog.at_level(logging.INFO, logger="app.model.checkpoint"):
        assert expert_packing(path, device="cuda") == {}  # auto falls back
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert isinstance(load_model(path).layers[0].ffn.experts, torch.nn.ModuleList)


def test_fp8_block_the_kernels_cannot_take(tiny_ckpt, caplog) -> None:
    path = tiny_ckpt("v4", expert_dtype="fp8")  # block 128 > expert width 32
    with pytest.raises(CheckpointError) as e:
        load_model(path, packed_experts=True)
    msg = str(e.value)
    assert "layers.0.ffn.experts" in msg and "mtp.0.ffn.experts" in msg
    assert "expert width 32 is not a multiple of the fp8 block rows 128" in msg
    with caplog.at_level(logging.WARNING, logger="app.model.checkpoint"):
        assert expert_packing(path, device="cuda") == {}  # auto: dequantized, with a warning
    assert any("cannot be packed" in r.getMessage() for r in caplog.records)
    load_model(path)  # still loads dequantized


@pytest.mark.parametrize(("experts", "needle"), [
    (range(8), "fp4 scales cover 16 columns each, the kernels need 32"),
    (range(1), "experts use scale blocks [(1, 16), (1, 32)]; the kernels take one"),
])  # fmt: skip
def test_fp4_scale_group_the_kernels_cannot_take(
    tiny_ckpt, tmp_path: Path, experts: range, needle: str
) -> None:
    def regroup(t: dict[str, torch.Tensor]) -> None:
        for e in experts:
            for k in ("w1", "w2", "w3"):
                n = f"layers.2.ffn.experts.{e}.{k}.weight"
                t[n], t[scale_name(n)] = quantize_fp4(dequantize_fp4(t[n], t[scale_name(n)]), 16)

    path = _rewrite(tiny_ckpt("v41"), tmp_path / "g16", regroup)
    with pytest.raises(CheckpointError) as e:
        load_model(path, packed_experts=True)
    msg = str(e.value)
    assert "1 MoE layers" in msg and "layers.2.ffn.experts: " + needle in msg
    load_model(path)  # the dequantized path takes any group


def test_plan_still_validates_expert_tensors(tiny_ckpt, tmp_path: Path) -> None:
    def damage(t: dict[str, torch.Tensor]) -> None:
        t["layers.1.ffn.experts.2.w2.weight"] = torch.zeros(64, 8, dtype=torch.int8)
        del t[scale_name("layers.4.ffn.experts.0.w3.weight")]

    path = _rewrite(tiny_ckpt("v41"), tmp_path / "bad", damage)
    with pytest.raises(CheckpointError) as e:
        load_model(path, packed_experts=True)
    msg = str(e.value)
    assert "2 problems" in msg and "layers.1.ffn.experts.2.w2.weight" in msg and "[64, 16]" in msg
    assert "layers.4.ffn.experts.0.w3.scale" in msg


def test_packed_experts_rejects_bad_tensors() -> None:
    w13, s13 = torch.zeros(2, 64, 32, dtype=torch.int8), torch.zeros(2, 64, 2)
    w2, s2 = torch.zeros(2, 64, 16, dtype=torch.int8), torch.zeros(2, 64, 1)
    PackedExperts(w13, s13, w2, s2, "fp4", (1, 32), 10.0)
    with pytest.raises(ValueError, match="fp4 experts must be torch.int8"):
        PackedExperts(w13.float(), s13, w2, s2, "fp4", (1, 32), 10.0)
    with pytest.raises(ValueError, match="w2"):
        PackedExperts(w13, s13, w2[:, :32], s2, "fp4", (1, 32), 10.0)
    with pytest.raises(ValueError, match="scales"):
        PackedExperts(w13, s13[:, :, :1], w2, s2, "fp4", (1, 32), 10.0)
    with pytest.raises(ValueError, match="'fp8' or 'fp4'"):
        PackedExperts(w13, s13, w2, s2, "nvfp4", (1, 32), 10.0)  # type: ignore[arg-type]


def test_engine_option_is_validated(tiny_ckpt) -> None:
    cfg = EngineConfig.from_options(tiny_ckpt("v41"), packed_experts="on")
    assert cfg.packed_experts == "on" and cfg.packed_experts_flag() is True
    assert EngineConfig(model="m").packed_experts_flag() is None
    assert EngineConfig(model="m", packed_experts="off").packed_experts_flag() is False
    with pytest.raises(EngineConfigError, match="packed_experts"):
        EngineConfig.from_options("m", packed_experts=True)


@torch.no_grad()
def test_fp8_rows_layout_gives_the_same_layer(tiny_ckpt) -> None:
    """``repack("fp8_rows")`` (the prefill layout): e4m3 rows with one fp32 scale each hold the
    fp4 weights exactly, so the torch path's output is unchanged; with ``prefill_act_fp8`` a
    step above 96 rows per local expert asks for fp8 activations with one scale per row (the
    forward's choice, checked against the rows reference called with those arguments; the
    kernel itself is tested in test_triton_moe_rows) and a smaller one does not. One way: it
    does not convert back."""
    from kernels.moe_ref import moe_fp8_rows_ref

    pe = load_model(tiny_ckpt("v41"), packed_experts=True).layers[1].ffn.experts
    assert isinstance(pe, PackedExperts)
    g = torch.Generator().manual_seed(3)
    n_exp = 8
    x = torch.randn(450, 64, generator=g)  # 450 * 2 / 8 = 112 rows per expert: prefill
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(450)])
    w = torch.rand(450, 2, generator=g)
    w13 = dequantize_fp4(pe.w13, pe.s13, torch.float32)
    want, small = pe(x, ids, w), pe(x[:40], ids[:40], w[:40])
    pe.repack("fp8_rows")
    assert pe.layout == "fp8_rows" and pe.w13.dtype == torch.float8_e4m3fn
    assert pe.s13.shape == pe.w13.shape[:2] and pe.s2.shape == pe.w2.shape[:2]
    assert torch.equal(pe.w13.float() * pe.s13.unsqueeze(-1), w13)
    assert torch.equal(pe(x, ids, w), want)
    pe.prefill_act_fp8 = True
    assert "prefill_act_fp8" in repr(pe)
    fp8 = pe(x, ids, w)
    ref = moe_fp8_rows_ref(x, ids, w, pe.w13, pe.s13, pe.w2, pe.s2, pe.limit, act_fp8=True)
    assert torch.equal(fp8, ref) and 1e-3 < rel(fp8, want) < 0.1
    assert torch.equal(pe(x[:40], ids[:40], w[:40]), small)  # 10 rows per expert: bf16
    with pytest.raises(ValueError, match="does not convert back"):
        pe.repack("pairs")


@torch.no_grad()
def test_fp8_rows_refuses_an_inexact_layer(tiny_ckpt, caplog) -> None:
    """A row whose scales span 15 binades cannot be one e4m3 row: the layer refuses the
    layout, unchanged, and the loader keeps it in fp4 with a warning naming it."""
    from app.model.loader import _fp8_rows_layout

    model = load_model(tiny_ckpt("v41"), packed_experts=True)
    pe = model.layers[2].ffn.experts
    assert isinstance(pe, PackedExperts)
    codes = pe.s13.view(torch.uint8)
    codes[1, 3, 0], codes[1, 3, 1] = 127, 127 - 15
    pe.w13.view(torch.uint8)[1, 3, :16] = 0x77  # the first group 6.0s, the second 0.5s:
    pe.w13.view(torch.uint8)[1, 3, 16:32] = 0x11  # 0.5 * 2^-15 is below e4m3 under 6's scale
    before = pe.w13.clone()
    with pytest.raises(ValueError, match="local expert 1: 1 rows"):
        pe.repack("fp8_rows")
    assert pe.layout == "mx" and torch.equal(pe.w13, before)
    with caplog.at_level(logging.WARNING):
        _fp8_rows_layout(model, prefill_act_fp8=True, cuda=False)
    assert "layers.2.ffn.experts" in caplog.text and "1 layer(s) keep fp4" in caplog.text
    layouts = [m.layout for m in model.modules() if isinstance(m, PackedExperts)]
    assert layouts.count("mx") == 1 and layouts.count("fp8_rows") == len(layouts) - 1


def test_engine_fp8_rows_layout_greedy_tokens(tiny_ckpt) -> None:
    """The engine with ``expert_layout="fp8_rows"`` (packed implied): the default engine's
    greedy tokens with bf16 activations (same weights); the config checks its partners."""
    path = tiny_ckpt("v41")
    prompts = [_ids(n, seed=n).tolist() for n in (23, 5, 37)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for opts in ({"packed_experts": "on"}, {"expert_layout": "fp8_rows"}):
        llm = LLM(path, kv_cache_bytes=1 << 22, max_num_batched_tokens=16, **opts)
        layout = llm.engine.model.layers[0].ffn.experts.layout
        assert layout == ("fp8_rows" if "expert_layout" in opts else "mx")
        outs.append([o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                       sampling_params=params)])  # fmt: skip
    assert outs[0] == outs[1]
    llm = LLM(path, kv_cache_bytes=1 << 22, expert_layout="fp8_rows", moe_prefill_act="fp8")
    pes = [m for m in llm.engine.model.modules() if isinstance(m, PackedExperts)]
    assert pes and all(m.layout == "fp8_rows" and m.prefill_act_fp8 for m in pes)
    with pytest.raises(EngineConfigError, match="needs expert_layout 'fp8_rows'"):
        EngineConfig(model=path, moe_prefill_act="fp8")
    with pytest.raises(EngineConfigError, match="packed_experts cannot be 'off'"):
        EngineConfig(model=path, expert_layout="fp8_rows", packed_experts="off")
    with pytest.raises(EngineConfigError, match="expert_layout must be one of"):
        EngineConfig(model=path, expert_layout="fp16")
