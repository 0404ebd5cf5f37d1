"""The shared expert's fused SwiGLU under TRITON_INTERPRET=1, and the stacked W1/W3 GEMM of
:class:`app.model.moe.Expert`."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from app.model.moe import Expert  # noqa: E402
from kernels.moe_ref import swiglu_clamp  # noqa: E402
from kernels.swiglu import swiglu_halves_ref, swiglu_halves_triton  # noqa: E402


@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("inter", [96, 2304])
def test_swiglu_halves_matches_torch(limit, inter):
    g = torch.Generator().manual_seed(inter)
    h = torch.randn(3, 2 * inter, generator=g) * 8  # past the clamp on both sides
    ref = swiglu_halves_ref(h, limit)
    out = swiglu_halves_triton(h, limit)
    assert out.shape == (3, inter)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    if limit:  # the clamp acted: without it the outputs differ
        assert not torch.allclose(swiglu_halves_ref(h, 0.0), ref)
    # bf16: the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, and the
    # GPU test asks for torch's bits); two truncations (silu, product): within two steps
    hb = h.to(torch.bfloat16)
    got, want = swiglu_halves_triton(hb, limit).float(), swiglu_halves_ref(hb, limit).float()
    torch.testing.assert_close(got, want, rtol=2**-6, atol=1e-3)


def test_swiglu_halves_refuses_odd_widths():
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        swiglu_halves_triton(torch.zeros(2, 7), 1.0)


def test_expert_stacks_w1_w3_once_and_follows_replaced_weights():
    torch.manual_seed(0)
    e = Expert(64, 96, 10.0)
    for p in e.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 64)

    def unfused() -> torch.Tensor:
        return e.w2(swiglu_clamp(e.w1(x), e.w3(x), 10.0))

    want = unfused()
    out = e(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    w13 = e.stacked_w13().weight
    assert e.w1.weight.data_ptr() == w13.data_ptr()  # views of the stack: no second copy
    assert e.w3.weight.data_ptr() == w13[96:].data_ptr()
    assert e.stacked_w13().weight.data_ptr() == w13.data_ptr()  # stacked once
    assert sorted(e.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]
    e.w3.weight.data = torch.randn(96, 64)  # a loader replacing a weight: stacked again
    torch.testing.assert_close(e(x), unfused(), rtol=1e-5, atol=1e-5)
    assert e.stacked_w13().weight.data_ptr() != w13.data_ptr()


@pytest.mark.parametrize("inter,block,stacked", [(96, (32, 32), True), (96, (64, 32), False)])
def test_expert_stacks_fp8_w1_w3_into_one_projection(inter, block, stacked):
    """fp8 W1 / W3 kept as stored (``packed_dense``) run as one :class:`Fp8Linear` over the
    stacked bytes and scale rows when the scale blocks end at the seam (views, no copy, the
    state dict unchanged, stacked again after a loader replaces a weight); a block that
    straddles the seam keeps two projections. Both compute the unstacked result."""
    from app.model.layers import Fp8Linear, prepare_fp8_linears
    from kernels.quant import quantize_fp8_block

    torch.manual_seed(1)
    e = Expert(64, inter, 10.0)
    for name in ("w1", "w3"):
        setattr(e, name, Fp8Linear(*quantize_fp8_block(torch.randn(inter, 64) * 0.3, block),
                                   block))  # fmt: skip
    torch.nn.init.normal_(e.w2.weight, std=0.3)
    x = torch.randn(5, 64)

    def unfused() -> torch.Tensor:
        return e.w2(swiglu_clamp(e.w1(x), e.w3(x), 10.0))

    keys = sorted(e.state_dict())
    torch.testing.assert_close(e(x), unfused(), rtol=1e-5, atol=1e-5)
    assert e.stackable == stacked
    assert sorted(e.state_dict()) == keys
    if not stacked:
        assert e.stacked_w13() is None and not e.stack_projections()
        return
    lin = e.stacked_w13()
    assert lin.weight.shape == (2 * inter, 64) and lin.scale.shape == (2 * inter // 32, 2)
    assert e.w1.weight.data_ptr() == lin.weight.data_ptr()  # views of the stack
    assert e.w3.weight.data_ptr() == lin.weight[inter:].data_ptr()
    assert e.w3.scale.data_ptr() == lin.scale[inter // 32:].data_ptr()
    assert e.stacked_w13() is lin  # stacked once
    # the runner's prepare_fp8_linears plans the stack once, and its parts (a part may run
    # alone: the drafters' wkv)
    prepared = []

    def prepare(self: Fp8Linear) -> bool:
        prepared.append(self)
        return True

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fp8Linear, "prepare", prepare)
        assert prepare_fp8_linears(e) == (3, [])
    assert prepared == [e.w1, lin, e.w3]  # the stack once, beside its parts
    q, s = quantize_fp8_block(torch.randn(inter, 64), block)
    e.w3.weight.data, e.w3.scale = q, s  # a loader replacing a weight: stacked again
    torch.testing.assert_close(e(x), unfused(), rtol=1e-5, atol=1e-5)
    assert e.stacked_w13() is not lin
