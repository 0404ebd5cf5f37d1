"""The model and engine on CUDA use the Triton kernels; outputs match the CPU reference path.

Routed experts: dequantized (``packed_experts=False``) or packed (the default on CUDA: the
MegaMoE kernels, which multiply fp32 activations with exact fp32 products and keep the SwiGLU
output in fp32), both matching the CPU reference closely enough for identical greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.loader import load_model
from app.model.moe import PackedExperts
from tests.support.reference import sequence_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_logits_match_cpu(ckpts, arch):
    cpu = load_model(ckpts[arch])
    gpu = load_model(ckpts[arch], device="cuda", packed_experts=False)
    ids = torch.randint(3, 500, (41,), generator=torch.Generator().manual_seed(0))
    ref = sequence_logits(cpu, ids)
    got = sequence_logits(gpu, ids.cuda()).cpu()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_packed_experts_logits_match_cpu(ckpts, arch):
    cpu = load_model(ckpts[arch])
    gpu = load_model(ckpts[arch], device="cuda")  # auto: packed on CUDA
    assert all(isinstance(b.ffn.experts, PackedExperts) for b in [*gpu.layers, *gpu.mtp])
    # fp4 experts (the tiny checkpoints') run in the pairs layout on CUDA
    assert {b.ffn.experts.layout for b in [*gpu.layers, *gpu.mtp]} == {"pairs"}
    ids = torch.randint(3, 500, (41,), generator=torch.Generator().manual_seed(0))
    ref = sequence_logits(cpu, ids).double()
    got = sequence_logits(gpu, ids.cuda()).cpu().double()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, rel


def _greedy_on(ckpt: str, dev: str, seed: int, **opts) -> dict[str, list[int]]:
    eng = EngineCore(EngineConfig.from_options(
        ckpt, device=dev, kv_cache_bytes=1 << 24, max_num_batched_tokens=16, **opts))
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate((23, 5, 37)):
        p = tuple(torch.randint(3, 500, (n,), generator=g).tolist())
        eng.add_request(EngineRequest(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return got


@pytest.mark.parametrize("packed", ["off", "on"])
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_engine_greedy_matches_cpu(ckpts, arch, packed):
    cpu = _greedy_on(ckpts[arch], "cpu", 1, packed_experts="off")
    assert _greedy_on(ckpts[arch], "cuda", 1, packed_experts=packed) == cpu


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_packed_dense_engine_greedy_matches_cpu(ckpts, arch):
    """Dense fp8 projections in the fp8 kernel (packed_dense) on CUDA: the CPU greedy tokens."""
    cpu = _greedy_on(ckpts[arch], "cpu", 2)
    assert _greedy_on(ckpts[arch], "cuda", 2, experimental={"packed_dense": "on"}) == cpu


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_fp8_rows_expert_layout_matches_cpu(ckpts, arch):
    """fp4 experts re-encoded as e4m3 rows (``expert_layout="fp8_rows"``, the prefill layout;
    bf16-free fp32 model, so no fp8 activations): logits and greedy tokens of the CPU path."""
    cpu = load_model(ckpts[arch])
    gpu = load_model(ckpts[arch], device="cuda", expert_layout="fp8_rows")
    assert {b.ffn.experts.layout for b in [*gpu.layers, *gpu.mtp]} == {"fp8_rows"}
    ids = torch.randint(3, 500, (41,), generator=torch.Generator().manual_seed(0))
    ref = sequence_logits(cpu, ids).double()
    got = sequence_logits(gpu, ids.cuda()).cpu().double()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-4
    want = _greedy_on(ckpts[arch], "cpu", 3)
    assert _greedy_on(ckpts[arch], "cuda", 3, expert_layout="fp8_rows") == want
