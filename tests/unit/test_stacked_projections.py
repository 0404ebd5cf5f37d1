"""Projections of one input run as one GEMM over their stacked weights
(``app.model.layers.stacked_projection``): attention's wq_a / wkv and the experts' W1 / W3."""

from __future__ import annotations

import pytest
import torch

from app.model.layers import Fp8Linear, Linear, stack_problem, stack_projections
from app.model.loader import load_model
from kernels.quant import quantize_fp8_block


def _fp8(rows: int, cols: int, block: tuple[int, int], seed: int) -> Fp8Linear:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.3
    return Fp8Linear(*quantize_fp8_block(w, block), block)


def test_stack_problem_names_what_keeps_projections_apart():
    a, b = Linear(64, 32), Linear(64, 16)
    assert stack_problem((a, b)) is None
    assert "fewer than two" in stack_problem((a,))
    assert "input widths" in stack_problem((a, Linear(48, 16)))
    assert "input widths" in stack_problem((a, Linear(64, 16, dtype=torch.bfloat16)))
    assert "plain or all fp8" in stack_problem((a, _fp8(32, 64, (32, 32), 0)))
    # fp8: every part but the last must end at a scale block; the last may end inside one
    assert stack_problem((_fp8(64, 64, (32, 32), 0), _fp8(48, 64, (32, 32), 1))) is None
    assert "straddles" in stack_problem((_fp8(48, 64, (32, 32), 0), _fp8(64, 64, (32, 32), 1)))
    assert "blocks or scale dtypes" in stack_problem(
        (_fp8(64, 64, (32, 32), 0), _fp8(64, 64, (64, 32), 1)))  # fmt: skip


def _calls(module: torch.nn.Module, log: list[str], name: str) -> None:
    """Record every forward of ``module`` under ``name``."""
    module.register_forward_hook(lambda *_: log.append(name))


@pytest.mark.parametrize("arch,packed", [("v41", False), ("v4", False), ("v41", True),
                                         ("v4", True)])  # fmt: skip
def test_attention_runs_wq_a_and_wkv_as_one_gemm(tiny_ckpt, arch, packed):
    """After ``stack_projections`` every layer's wq_a / wkv are views of one stacked weight,
    the batched step's q, c_q and kv come from one GEMM (neither part runs) and equal the
    reference's op sequence; the state dict is unchanged. fp8 (``packed_dense``) parts stack
    when their scale blocks end at the seam: V4.1's 32-row blocks do on the tiny model's 32
    rows of wq_a, V4's 128-row blocks do not, and those layers keep two GEMMs."""
    model = load_model(tiny_ckpt(arch), packed_dense=packed)
    keys = sorted(model.state_dict())
    n = stack_projections(model)
    assert sorted(model.state_dict()) == keys
    stacks = 0
    torch.manual_seed(0)
    for layer in model.layers:
        att = layer.attn
        stack = att.stack_of("_qkv_a")  # made by stack_projections (None: not stacked)
        stacked = stack is not None
        fp8 = isinstance(att.wq_a, Fp8Linear)
        assert fp8 == packed
        assert stacked == (not fp8 or not att.wq_a.out_features % att.wq_a.block[0])
        stacks += stacked
        x = torch.randn(3, model.cfg.hidden_size)
        angles = torch.randn(3, model.cfg.qk_rope_head_dim // 2)
        log: list[str] = []
        _calls(att.wq_a, log, "wq_a")
        _calls(att.wkv, log, "wkv")
        if stacked:
            _calls(stack, log, "stack")
            assert att.wq_a.weight.data_ptr() == stack.weight.data_ptr()  # views: no copy
            assert att.wkv.weight.data_ptr() == stack.weight[att.wq_a.out_features].data_ptr()
        q, c_q, kv = att.qkv_fused(x, angles.cos(), angles.sin())
        assert log == (["stack"] if stacked else ["wq_a", "wkv"])
        log.clear()
        q_ref, c_q_ref, kv_ref = att.qkv(x, angles)
        torch.testing.assert_close(c_q, c_q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv, kv_ref, rtol=1e-5, atol=1e-5)
    assert stacks == (0 if packed and arch == "v4" else len(model.layers))
    assert n >= stacks  # the experts' W1 / W3 count too


def test_attention_stack_follows_a_replaced_weight(tiny_ckpt):
    """A loader replacing wkv after the stack was made: the next step stacks again and
    computes with the new weight."""
    model = load_model(tiny_ckpt("v41"))
    stack_projections(model)
    att = model.layers[2].attn
    old = att.stack_of("_qkv_a")
    x = torch.randn(2, model.cfg.hidden_size)
    angles = torch.randn(2, model.cfg.qk_rope_head_dim // 2)
    att.wkv.weight.data = torch.randn_like(att.wkv.weight) * 0.1
    _, _, kv = att.qkv_fused(x, angles.cos(), angles.sin())
    assert att.stack_of("_qkv_a") not in (None, old)
    _, _, kv_ref = att.qkv(x, angles)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_compressors_run_wkv_and_wgate_as_one_gemm(tiny_ckpt, arch):
    """Every gated compressor (V4.1 ratio 2, V4 CSA / HCA and the V4 indexer's) projects kv
    and gate with one GEMM over the stacked [wkv; wgate] and equals the two projections; a
    V4.1 ratio-1 compressor (no wgate) keeps its one GEMM and a zero gate."""
    from app.model.compressor import Compressor

    model = load_model(tiny_ckpt(arch))
    stack_projections(model)
    comps = [m for m in model.modules() if isinstance(m, Compressor)]
    gated = [c for c in comps if "wgate" in c._modules]
    assert gated and (arch == "v4" or len(gated) < len(comps))
    for c in comps:
        x = torch.randn(5, model.cfg.hidden_size)
        pos = torch.arange(5)
        log: list[str] = []
        _calls(c.wkv, log, "wkv")
        if c in gated:
            _calls(c.wgate, log, "wgate")
            stack = c.stack_of("_kv_gate")
            _calls(stack, log, "stack")
        kv, gate = c.project(x, pos)
        assert log == (["stack"] if c in gated else ["wkv"])
        log.clear()
        torch.testing.assert_close(kv, c.wkv(x), rtol=1e-6, atol=1e-6)
        if c in gated:
            ape = c.ape.float()[pos % c.ratio] if hasattr(c, "ape") else 0.0
            torch.testing.assert_close(gate, c.wgate(x) + ape, rtol=1e-6, atol=1e-6)
        else:
            assert not gate.any()


def test_moving_a_module_drops_its_stacks(tiny_ckpt):
    """``to()`` (a device move or a cast) frees the stacked storage at once -- the parts get
    tensors of their own -- and the next forward stacks again, in the new dtype."""
    model = load_model(tiny_ckpt("v41"))
    stack_projections(model)
    att = model.layers[2].attn
    old = att.stack_of("_qkv_a")
    assert old is not None and att.wq_a.weight.data_ptr() == old.weight.data_ptr()
    att.to(torch.float64)
    assert att.stack_of("_qkv_a") is None
    assert att.wq_a.weight.dtype == torch.float64
    assert att.wq_a.weight.untyped_storage().data_ptr() != old.weight.untyped_storage().data_ptr()
    x = torch.randn(2, model.cfg.hidden_size, dtype=torch.float64)
    angles = torch.randn(2, model.cfg.qk_rope_head_dim // 2, dtype=torch.float64)
    _, c_q, _ = att.qkv_fused(x, angles.cos(), angles.sin())
    new = att.stack_of("_qkv_a")
    assert new is not None and new.weight.dtype == torch.float64 and c_q.dtype == torch.float64
