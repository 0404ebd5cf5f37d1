"""fp8 activations as the release computes them: the per-token-group quantizer
(``kernels.quant.quantize_fp8_act``, ``kernels.fp8_act``), the fp8 GEMM against block-scaled
fp8 weights (``kernels.linear.fp8_act_linear``) and the model's ``dense_act="fp8"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.fp8_act import act_quant_triton, act_round_triton
from kernels.linear import fp8_act_linear_ref, fp8_act_linear_triton
from kernels.quant import (
    dequantize_fp8_block,
    quantize_fp8_act,
    quantize_fp8_block,
    round_fp8_act,
)


def release_round(x: torch.Tensor, group: int) -> torch.Tensor:
    """The release's ``act_quant(x, group, "ue8m0", inplace=True)`` written out from its
    definition: per row and ``group`` columns (a narrower last group zero-padded), amax
    floored at 1e-4, times fp32(1/448), rounded up to a power of two from the fp32 bits;
    values divided by it, clamped to +-448, cast to e4m3, multiplied back."""
    k = x.shape[-1]
    g = F.pad(x.float(), (0, -k % group)).unflatten(-1, (-1, group))
    ratio = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) * torch.tensor(1 / 448)
    bits = ratio.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scale = (exp << 23).view(torch.float32)
    q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)[..., :k].to(x.dtype)


def _acts(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows spanning many binades, an all-zero group, a signed zero, ties and a tiny row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-7, 4, k)[torch.randperm(k, generator=g)]
    x[0, : min(k, 32)] = 0.0
    x[1 % m, 1] = -0.0
    x[2 % m, :] = torch.randn(k, generator=g) * 1e-6  # every group under the amax floor
    x[3 % m, :8] = torch.tensor([448.0, 0.5625, 0.59375, -2.5, 3.25, 1e-3, 7e-5, 14.5])
    return x.to(dtype)


@pytest.mark.parametrize("m,k,group", [(7, 96, 32), (5, 64, 128), (6, 1280, 32), (4, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_is_the_release_rounding_bit_for_bit(m, k, group, dtype):
    """Reference = the release's rule written out; Triton = reference, codes, e8m0 scales and
    rounded values, bit for bit (a last group narrower than ``group`` included)."""
    x = _acts(m, k, dtype, seed=k + m)
    q, s = quantize_fp8_act(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (m, -(-k // group))
    assert torch.equal(round_fp8_act(x, group), release_round(x, group))
    tq, ts = act_quant_triton(x, group)
    assert torch.equal(tq.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(ts.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(act_round_triton(x, group), round_fp8_act(x, group))
    assert int(s.view(torch.uint8)[2].max()) == 105  # 1e-4 / 448 -> 2^-22 (code 127 - 22)


def _weights(n: int, k: int, block: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)


@pytest.mark.parametrize("m,n,k,block,group", [
    (5, 64, 96, (32, 32), 32), (20, 64, 256, (128, 128), 128), (3, 64, 64, (128, 128), 128),
    (33, 96, 128, (32, 32), 32)])  # fmt: skip
@pytest.mark.parametrize("mma", [False, True])
def test_fp8_act_gemm_is_dequantize_then_matmul(m, n, k, block, group, mma):
    """Both paths (the rounded activations through the fp8 weight kernels; e4m3 x e4m3 with
    per-group promotion) = fp64 ``dequant(quant(x)) @ dequant(w)^T``; the rounding is real:
    the unrounded product differs by far more."""
    q, s = _weights(n, k, block, seed=m)
    x = _acts(m, k, torch.float32, seed=n) / 100
    exact = x.double() @ dequantize_fp8_block(q, s, block).double().T
    ref = round_fp8_act(x, group).double() @ dequantize_fp8_block(q, s, block).double().T
    out = fp8_act_linear_triton(x, q, s, block, group, mma=mma)
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-6
    assert ((exact - ref).norm() / ref.norm()).item() > 100 * rel
    assert torch.equal(fp8_act_linear_ref(x, q, s, block, group).double(),
                       round_fp8_act(x, group) @ dequantize_fp8_block(q, s, block).T)  # fmt: skip


@pytest.mark.parametrize("split", [1, 3])
def test_fp8_act_gemm_bf16_rounds_once_and_splits_k(split):
    """bf16 activations on the fp8 MMA path: the fp32 result rounded once to bf16 (stored by
    the GEMM, or by the sum of K splits)."""
    m, n, k = 20, 64, 384
    q, s = _weights(n, k, (32, 32), seed=split)
    x = _acts(m, k, torch.bfloat16, seed=split) / 100
    out = fp8_act_linear_triton(x, q, s, (32, 32), 32, mma=True,
                                launch=(16, 32, 128, split, 4, 1))  # fmt: skip
    ref = round_fp8_act(x, 32).double() @ dequantize_fp8_block(q, s, (32, 32)).double().T
    assert out.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((out.double() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()
