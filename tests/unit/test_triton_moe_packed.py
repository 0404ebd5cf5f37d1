"""MegaMoE Triton kernels (interpreter) on the loader's packed tensors of the tiny checkpoints
vs the dequantized ``Expert`` modules of the same layer.

fp32 activations run the kernels with fp32 operands and an fp32 H between the two GEMMs (as
fp32 models do on the GPU), so the layer agrees to rounding: ||out - ref|| / ||ref|| < 1e-5.
A layout error (W1 / W3 swapped, scales of another expert or block) gives O(1); bf16 H would
give ~3e-3.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from app.model.loader import load_model  # noqa: E402
from app.model.moe import MoE, PackedExperts  # noqa: E402
from kernels import moe  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN

T = 11


def _expert_path(m: MoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_j w_j Expert_{ids_j}(x)`` token by token with the dequantized modules."""
    rows = []
    for t in range(x.shape[0]):
        ys = [w[t, j] * m.experts[int(e)](x[t : t + 1])[0] for j, e in enumerate(ids[t])]
        rows.append(torch.stack(ys).sum(0))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("arch", "options", "layer"),
    [("v41", {}, "layers.2"), ("v41", {}, "mtp.0"),
     ("v4", {"expert_dtype": "fp8", "block": 32}, "layers.0"),
     ("v4", {"expert_dtype": "fp8", "block": 32}, "layers.3")],
)  # fmt: skip
@torch.no_grad()
def test_triton_on_packed_layer(tiny_ckpt, arch: str, options: dict, layer: str) -> None:
    path = tiny_ckpt(arch, **options)
    ref_moe = load_model(path, packed_experts=False).get_submodule(f"{layer}.ffn")
    pe = load_model(path, packed_experts=True).get_submodule(f"{layer}.ffn.experts")
    assert isinstance(ref_moe, MoE) and isinstance(pe, PackedExperts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, ref_moe.gate.weight.shape[1], generator=g)
    ids, w = ref_moe.gate(x, torch.randint(3, 500, (T,), generator=g))
    ref = _expert_path(ref_moe, x, ids, w)
    if pe.fmt == "fp8":
        out = moe.moe_fp8_triton(x, ids, w, pe.w13, pe.s13, pe.w2, pe.s2, pe.block, pe.limit)
    else:
        out = moe.moe_fp4_triton(x, ids, w, pe.w13, pe.s13, pe.w2, pe.s2, pe.limit)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("arch", ["v41", "v4"])
@torch.no_grad()
def test_engine_greedy_through_the_kernels(tiny_ckpt, monkeypatch, arch: str) -> None:
    """The engine with packed experts run by the Triton MegaMoE kernels (interpreter; fp32
    model: fp32 operands and H, as on the GPU for fp32 models) decodes the same greedy tokens as
    the dequantized reference: the prefill's token and one decode step's, both through the
    kernels (each step costs seconds in the interpreter; a layout error shows at the first)."""
    import app.model.moe as model_moe
    from app.engine.llm import LLM
    from app.engine.request import SamplingParams

    calls = {"fp8": 0, "fp4": 0}
    rows: set[int] = set()  # tokens per kernel call

    def counted(fmt: str, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[fmt] += 1
            rows.add(args[0].shape[0])
            return fn(*args, **kwargs)

        return run

    path = tiny_ckpt(arch)
    prompts = [[5, 17, 301, 44, 9, 120, 77], [250, 3, 88]]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = {}
    for mode in ("off", "on"):
        if mode == "on":
            monkeypatch.setattr(model_moe, "moe_fp8", counted("fp8", moe.moe_fp8_triton))
            monkeypatch.setattr(model_moe, "moe_fp4", counted("fp4", moe.moe_fp4_triton))
        llm = LLM(path, packed_experts=mode, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)
        outs[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]  # fmt: skip
    assert sum(calls.values()) > 0  # the kernels ran
    assert {10, 2} <= rows  # the prefill of both prompts and their decode step
    assert outs["on"] == outs["off"] and all(len(t) == 2 for t in outs["on"])
