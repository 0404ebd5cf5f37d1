"""fp8 activations as the release computes them, on CUDA: the quantizer with the GPU's e4m3
conversion (bit for bit the torch reference), the fp8 GEMM's two paths at V4.1- and
V4-Flash shapes against fp64, in a CUDA graph, the MoE kernels' rounding at V4.1-Flash
expert shapes, and the model's ``dense_act`` / ``expert_act`` against the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.gpu_mem(8)]  # fmt: skip

# one layer's dense projections [N, K] (bench/dense_act.py's ARCHS) and weight blocks
SHAPES = {"v41": (((1792, 5120), (32768, 1280), (5120, 8192), (4608, 5120), (5120, 2304)),
                  (32, 32)),
          "v4": (((1536, 4096), (32768, 1024), (4096, 8192), (4096, 4096), (4096, 2048)),
                 (128, 128))}  # fmt: skip


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _acts(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    spread = torch.exp2(torch.randint(-8, 8, (k,), device="cuda", generator=g).float())
    x = torch.randn(m, k, device="cuda", generator=g) * spread
    x[0, :64] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_with_the_gpu_conversion_is_the_reference(group, dtype):
    from kernels.fp8_act import act_quant_triton, act_round_triton
    from kernels.quant import quantize_fp8_act, round_fp8_act

    x = _acts(300, 5120, dtype, seed=group)
    q, s = act_quant_triton(x, group)
    rq, rs = quantize_fp8_act(x.cpu(), group)
    assert torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8))
    assert torch.equal(s.view(torch.uint8).cpu(), rs.view(torch.uint8))
    assert torch.equal(act_round_triton(x, group).cpu(), round_fp8_act(x.cpu(), group))


@pytest.mark.parametrize("arch", ["v41", "v4"])
@pytest.mark.parametrize("m", [1, 17, 64, 128, 300, 2048])
@pytest.mark.parametrize("mma", [False, True])
def test_fp8_act_linear_against_fp64(arch, m, mma):
    """Both paths, bf16 activations: within a bf16 rounding of the output of the fp64
    ``round(x) @ dequant(W)^T`` (the fp8 MMA's fast accumulation stays inside each group)."""
    from kernels.linear import fp8_act_linear_triton, fp8_decode_plan
    from kernels.quant import dequantize_fp8_block, quantize_fp8_block, round_fp8_act

    shapes, block = SHAPES[arch]
    for i, (n, k) in enumerate(shapes):
        g = torch.Generator(device="cuda").manual_seed(i)
        q, s = quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) / k**0.5, block)
        x = _acts(m, k, torch.bfloat16, seed=i + m)
        ref = round_fp8_act(x, block[1]).double() @ dequantize_fp8_block(q, s, block).double().T
        out = fp8_act_linear_triton(x, q, s, block, block[1], fp8_decode_plan(q, s, block),
                                    mma=mma)  # fmt: skip
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        assert _rel(out, ref) < 4e-3, (n, k)


@pytest.mark.parametrize("m", [8, 512])
def test_fp8_act_linear_in_a_cuda_graph(m):
    """The dispatch (rounded activations below 128 rows, fp8 MMA above) replays in a graph
    with the eager result's bits."""
    from kernels.linear import fp8_act_linear, fp8_decode_plan
    from kernels.quant import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(m)
    q, s = quantize_fp8_block(torch.randn(4608, 5120, device="cuda", generator=g), (32, 32))
    plan = fp8_decode_plan(q, s, (32, 32))
    x = _acts(m, 5120, torch.bfloat16, seed=m)
    want = fp8_act_linear(x, q, s, (32, 32), 32, plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fp8_act_linear(x, q, s, (32, 32), 32, plan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("pairs", [False, True])
def test_moe_rounds_x_and_h_as_the_release(t, pairs):
    """fp4 experts of V4.1-Flash shape (d 5120, I 2304, 48 of 384 experts local) with
    ``act_group`` 32, bf16 activations: the reference's rounding of x and the weighted H,
    within bf16 roundings (the kernel rounds the fp32 H, the reference its bf16 copy)."""
    from kernels.moe import moe_fp4_triton
    from kernels.moe_formats import fp4_to_pairs
    from kernels.moe_ref import moe_fp4_ref

    g = torch.Generator(device="cuda").manual_seed(t)
    e, d, inter = 48, 5120, 2304
    def ints(lo: int, hi: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(lo, hi, shape, device="cuda", generator=g).to(dtype)

    p13 = ints(-128, 128, (e, 2 * inter, d // 2), torch.int8)
    p2 = ints(-128, 128, (e, d, inter // 2), torch.int8)
    q13 = ints(119, 123, (e, 2 * inter, d // 32), torch.uint8)
    q2 = ints(119, 123, (e, d, inter // 32), torch.uint8)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, 384, device="cuda", generator=g).argsort(-1)[:, :6]
    w = torch.rand(t, 6, device="cuda", generator=g)
    ref = moe_fp4_ref(x.float(), ids, w, p13, q13, p2, q2, 10.0, act_group=32)
    w13, w2 = (fp4_to_pairs(p13), fp4_to_pairs(p2)) if pairs else (p13, p2)
    out = moe_fp4_triton(x, ids, w, w13, q13, w2, q2, 10.0, n_experts=384, pairs=pairs,
                         act_group=32)  # fmt: skip
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_fp8_act_model_matches_cpu(ckpts, arch):
    """The fp32 model with ``dense_act`` and ``expert_act`` "fp8" (fp8 dense weights kept,
    experts packed) on CUDA against the same on the CPU, over 41 tokens (the rounded dense
    activations) and 300 (the fp8 MMA path): the logits of the CPU's release rounding."""
    from app.model.loader import load_model
    from tests.support.reference import sequence_logits

    opts = {"dense_act": "fp8", "expert_act": "fp8", "packed_dense": True}
    cpu = load_model(ckpts[arch], **opts)
    gpu = load_model(ckpts[arch], device="cuda", **opts)
    for n in (41, 300):
        ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n))
        ref = sequence_logits(cpu, ids).double()
        got = sequence_logits(gpu, ids.cuda()).cpu().double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-3, n
