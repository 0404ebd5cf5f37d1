"""The one dispatch rule of the kernel ops (kernels.dispatch): which implementation runs."""

from __future__ import annotations

import pytest
import torch

from kernels import attention, compressor, engram, gate, indexer, kv_quant, linear, mhc, moe, norm
from kernels.dispatch import op, reference_kernels


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


@pytest.mark.parametrize(
    "fn",
    [attention.sparse_attention, compressor.compress_pool, engram.engram_rows,
     engram.engram_gather, engram.engram_gate, gate.moe_gate_fused, indexer.indexer_scores,
     indexer.indexer_scores_paged, indexer.topk, kv_quant.kv_pack, kv_quant.kv_qdq,
     linear.linear_f32, mhc.hc_pre, mhc.hc_post, mhc.hc_post_pre, moe.moe_fp8, moe.moe_fp4,
     norm.norm_rope, norm.rms_norm],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_every_op_dispatches_through_one_rule(fn):
    assert callable(fn.reference) and callable(fn.triton)
    assert fn.reference is not fn.triton
