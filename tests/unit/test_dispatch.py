"""The one dispatch rule of the kernel ops (kernels.dispatch): which implementation runs."""

from __future__ import annotations

import pytest
import torch

from kernels import (
    attention,
    compressor,
    engram,
    fp8_act,
    gate,
    indexer,
    kv_quant,
    linear,
    mhc,
    moe,
    moe_formats,
    moe_ref,
    norm,
    swiglu,
    topk,
)
from kernels.dispatch import op, reference_kernels
from kernels.moe_decode import row_refs


def _spy(tag: str, calls: list):
    def fn(*args, **kwargs):
        calls.append(tag)
        return tag

    return fn


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports ``is_cuda`` (selection logic only, nothing is launched)."""

    @property
    def is_cuda(self):  # type: ignore[override]
        return True


def test_selection_rules():
    calls: list[str] = []
    f = op(_spy("ref", calls), _spy("triton", calls), when=lambda x, k=0: k < 5)
    cpu, dev = torch.zeros(2), torch.zeros(2).as_subclass(_FakeCuda)
    assert f(cpu) == "ref"  # CPU tensors: the reference
    assert f(dev) == "triton"  # CUDA tensors: the kernel
    assert f(dev, k=7) == "ref"  # outside what the kernel supports
    with reference_kernels():
        assert f(dev) == "ref"  # forced references, e.g. A/B checks on a GPU
    assert f(dev) == "triton"  # the context restores the rule
    g = op(_spy("ref", calls), _spy("triton", calls), device_arg=1)
    assert g(cpu, dev) == "triton" and g(dev, cpu) == "ref"  # the named argument decides
    assert f.reference is not f.triton and f.__name__ == "fn"


def test_reference_kernels_by_name_bisects_one_op(monkeypatch):
    """``reference_kernels("name")`` sends only the named ops to their references (how a
    mismatch is narrowed to one kernel); nesting adds names; the bare form takes every op; an
    unknown name is an error; ``op(name=...)`` registers under that name."""
    from kernels import dispatch
    from kernels.dispatch import op_name

    monkeypatch.setattr(dispatch, "OPS", {})  # this test's ops only, run after run
    OPS = dispatch.OPS
    calls: list[str] = []

    def a_ref(x):
        return "a_ref"

    def b_ref(x):
        return "b_ref"

    fa, fb = op(a_ref, _spy("a_tri", calls)), op(b_ref, _spy("b_tri", calls))
    dev = torch.zeros(2).as_subclass(_FakeCuda)
    assert (op_name(fa), op_name(b_ref)) == ("a", "b") and OPS["a"] is fa
    with reference_kernels("a"):
        assert (fa(dev), fb(dev)) == ("a_ref", "b_tri")
        with reference_kernels("b"):
            assert (fa(dev), fb(dev)) == ("a_ref", "b_ref")
        assert fb(dev) == "b_tri"
        with reference_kernels():
            assert fb(dev) == "b_ref"
    assert (fa(dev), fb(dev)) == ("a_tri", "b_tri")
    with reference_kernels(), reference_kernels("a"):  # a name inside "all" keeps all
        assert fb(dev) == "b_ref"
    with pytest.raises(ValueError, match="no kernel op named"), reference_kernels("a", "c"):
        pass
    fc = op(a_ref, _spy("c_tri", calls), name="c")
    assert OPS["c"] is fc and op_name(fc) == "c" and OPS["a"] is fa
    with reference_kernels("c"):
        assert (fa(dev), fc(dev)) == ("a_tri", "a_ref")


@pytest.mark.parametrize(
    "fn",
    [attention.sparse_attention, compressor.compress_pool, engram.engram_rows,
     engram.engram_gather, engram.engram_gate, gate.moe_gate_fused, indexer.indexer_scores,
     indexer.indexer_scores_paged, topk.topk, kv_quant.kv_pack, kv_quant.kv_pack_into,
     kv_quant.kv_qdq, linear.linear_f32, linear.fp8_linear, linear.fp8_act_linear,
     linear.dense_linear, fp8_act.act_quant, fp8_act.act_round, mhc.hc_pre,
     mhc.hc_post, mhc.hc_post_pre, moe.moe_fp8, moe.moe_fp4, moe.moe_fp8_rows, norm.norm_rope,
     norm.rms_norm, swiglu.swiglu_halves],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_every_op_dispatches_through_one_rule(fn):
    from kernels.dispatch import OPS, op_name

    assert callable(fn.reference) and callable(fn.triton)
    assert fn.reference is not fn.triton
    assert OPS[op_name(fn)] is fn  # reference_kernels(name) reaches it (hc_post: by its name)


def test_moe_row_refs_off_the_gpu_take_the_portable_path():
    """Experts with exact row references on the CPU (where the Gluon decode GEMMs cannot
    run) take the portable path, which matches the reference."""
    g = torch.Generator().manual_seed(0)
    e, d, inter, t = 4, 128, 128, 3
    w13 = moe_formats.fp4_to_pairs(torch.randint(-128, 128, (e, 2 * inter, d // 2), generator=g,
                                         dtype=torch.int8))  # fmt: skip
    w2 = moe_formats.fp4_to_pairs(torch.randint(-128, 128, (e, d, inter // 2), generator=g,
                                        dtype=torch.int8))  # fmt: skip
    s13 = torch.randint(120, 124, (e, 2 * inter, d // 32), generator=g).to(torch.uint8)
    s2 = torch.randint(120, 124, (e, d, inter // 32), generator=g).to(torch.uint8)
    from kernels.quant import e8m0_dtype

    s13, s2 = s13.view(e8m0_dtype()), s2.view(e8m0_dtype())
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.randint(0, e, (t, 2), generator=g)
    w = torch.rand(t, 2, generator=g)
    args = (x, ids, w, w13, s13, w2, s2, 10.0)
    (r13, ok13), (r2, ok2) = row_refs(s13), row_refs(s2)
    assert ok13 and ok2
    out = moe.moe_fp4_triton(*args, pairs=True, row_refs=(r13, r2))
    ref = moe_ref.moe_fp4_ref(x.float(), ids, w, w13, s13, w2, s2, 10.0, pairs=True)
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
