"""fp8 activations as the release computes them: the per-token-group quantizer
(``kernels.quant.quantize_fp8_act``, ``kernels.fp8_act``), the fp8 GEMM against block-scaled
fp8 weights (``kernels.linear.fp8_act_linear``), the MoE kernels' rounding and the model's
``dense_act`` / ``expert_act``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from app.config import EngineConfig, EngineConfigError
from app.engine.llm import LLM
from app.engine.request import SamplingParams
from app.model.layers import Fp8Linear, Linear
from app.model.loader import load_model
from kernels.dispatch import batch_invariant
from kernels.fp8_act import act_quant_triton, act_round_triton
from kernels.linear import fp8_act_linear_ref, fp8_act_linear_triton
from kernels.moe_ref import swiglu_clamp
from kernels.quant import (
    dequantize_fp8_block,
    quantize_fp8_act,
    quantize_fp8_block,
    round_fp8_act,
)
from tests.support.reference import sequence_logits


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


@pytest.mark.parametrize("fmt,block,group", [("fp8", (32, 32), 32), ("fp8", (128, 128), 128),
                                              ("fp4", (1, 32), 32), ("fp4", (1, 32), 128),
                                              ("pairs", (1, 32), 32)])  # fmt: skip
@pytest.mark.parametrize("split", [None, 2])
def test_moe_kernels_round_x_and_h_as_the_release(fmt, block, group, split):
    """The MegaMoE launches with ``act_group`` (x rounded in one launch, H in the SwiGLU
    epilogue or the K splits' reduction) = the reference rounding x and H, with fp32 sums;
    the rounding is real (the unrounded experts differ by far more)."""
    from kernels.moe import moe_fp4_triton, moe_fp8_triton
    from kernels.moe_formats import fp4_to_pairs
    from kernels.moe_ref import moe_fp4_ref, moe_fp8_ref
    from kernels.quant import quantize_fp4

    def stacked(quant, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quant(m) for m in ws]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

    g = torch.Generator().manual_seed(group + (split or 0))
    e, d, inter, t, k = 4, 128, 128, 5, 2
    w13 = torch.randn(e, 2 * inter, d, generator=g) / 8
    w2 = torch.randn(e, d, inter, generator=g) / 8
    x = _acts(t, d, torch.float32, seed=group) / 100
    ids, w = torch.randint(0, e, (t, k), generator=g), torch.rand(t, k, generator=g)
    if fmt == "fp8":
        (q13, s13), (q2, s2) = (stacked(lambda m: quantize_fp8_block(m, block), ws)
                                for ws in (w13, w2))  # fmt: skip
        ref = moe_fp8_ref(x, ids, w, q13, s13, q2, s2, block, 10.0, act_group=group)
        plain = moe_fp8_ref(x, ids, w, q13, s13, q2, s2, block, 10.0)
        out = moe_fp8_triton(x, ids, w, q13, s13, q2, s2, block, 10.0, split_k=split,
                             act_group=group)  # fmt: skip
    else:
        (q13, s13), (q2, s2) = (stacked(quantize_fp4, ws) for ws in (w13, w2))
        ref = moe_fp4_ref(x, ids, w, q13, s13, q2, s2, 10.0, act_group=group)
        plain = moe_fp4_ref(x, ids, w, q13, s13, q2, s2, 10.0)
        pairs = fmt == "pairs"
        if pairs:
            q13, q2 = fp4_to_pairs(q13), fp4_to_pairs(q2)
        out = moe_fp4_triton(x, ids, w, q13, s13, q2, s2, 10.0, split_k=split, pairs=pairs,
                             act_group=group)  # fmt: skip
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 1e-6 and ((plain - ref).norm() / ref.norm()).item() > 100 * rel


# ---- the model: dense_act="fp8" --------------------------------------------------------------
# the modules whose input the release rounds, written from its model.py: every fp8 weight's
# linear() -- the attention's wq_a / wq_b / wkv / wo_b, the indexer's wq_b, the shared expert
# (W1 and W3 read its input; W2 its SwiGLU output), Engram's wkv; not wo_a (bf16 there)
RELEASE_ROUNDED = re.compile(r"(?:attn\.(?:wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|engram\.wkv"
                             r"|shared_experts|shared_experts\.w2)$")


def rounding_on_reference(path: str):
    """The checkpoint's model with unrounded projections, every input the release rounds
    rounded by :func:`release_round` in hooks (groups of the weight block's columns)."""
    model = load_model(path)
    group = model.cfg.quantization.weight_block_size[1]
    hooked = 0
    for name, m in model.named_modules():
        if RELEASE_ROUNDED.search(name) and not name.startswith("mtp."):
            m.register_forward_pre_hook(lambda _, a: (release_round(a[0], group), *a[1:]))
            hooked += 1
    assert hooked
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def release_experts(x, ids, weights, w1, w2, w3, limit, act_fp8=False, out_dtype=None,
                    act_group=0, *, group: int) -> torch.Tensor:  # fmt: skip
    """The routed experts as the release computes them (``moe_experts``' signature): its
    ``linear()`` rounds x before W1 / W3 and, before W2, the SwiGLU output times the routing
    weight (its ``Expert.forward`` weights the intermediate state, not the output)."""
    out = torch.zeros(x.shape[0], w2[0].shape[0], dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        xe = release_round(x[t], group)
        h = swiglu_clamp(xe @ w1[e].T, xe @ w3[e].T, limit) * weights[t, j, None]
        out.index_add_(0, t, release_round(h, group) @ w2[e].T)
    return out.to(out_dtype or x.dtype)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_fp8_acts_compute_the_release_rounding(tiny_ckpt, arch, monkeypatch):
    """The model with ``dense_act="fp8"`` (fp8 weights kept, as the engine loads them) against
    the rounding-on reference of the dense projections, and with ``expert_act="fp8"`` too
    (packed experts, as on CUDA) against the release's whole rounding: as close as fp32 sums
    allow, far closer than the exact (unrounded, the default) path. The dense rounding alone
    is not closer to the whole rounding than none: on these models every rounding moves the
    logits by tens of percent."""
    from app.model import moe

    path = tiny_ckpt(arch)
    ref = rounding_on_reference(path)
    dense = load_model(path, dense_act="fp8", packed_dense=True)
    both = load_model(path, dense_act="fp8", expert_act="fp8", packed_dense=True,
                      packed_experts=True)  # fmt: skip
    exact = load_model(path)
    rounded = [m for m in dense.modules() if getattr(m, "act_group", 0)]
    assert rounded and all(isinstance(m, Fp8Linear) for m in rounded)
    assert not any(m.act_group for m in exact.modules() if hasattr(m, "act_group"))
    group = ref.cfg.quantization.weight_block_size[1]
    moes = [m for m in both.modules() if isinstance(m, moe.MoE)]
    assert moes and all(m.act_group == group and isinstance(m.experts, moe.PackedExperts)
                        for m in moes)  # fmt: skip
    ids = torch.randint(3, 500, (23,), generator=torch.Generator().manual_seed(1))
    got_dense, got_both = sequence_logits(dense, ids), sequence_logits(both, ids)
    got_exact = sequence_logits(exact, ids)
    want = sequence_logits(ref, ids)
    e_dense, e_exact = _rel(got_dense, want), _rel(got_exact, want)
    assert e_dense < 1e-5 and e_dense * 100 < e_exact, (e_dense, e_exact)
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **k: release_experts(*a, **k, group=group))
    whole = sequence_logits(ref, ids)
    e_both, e_exact = _rel(got_both, whole), _rel(got_exact, whole)
    assert e_both < 1e-5 and e_both * 100 < e_exact, (e_both, e_exact)


def test_the_engine_options(tiny_ckpt, monkeypatch):
    """``dense_act`` / ``expert_act`` in the one config path: "fp8" loads the release's
    projections as fp8 with rounded inputs, the MoE layers rounding their experts', and
    greedy decoding follows the release's rounding; the deterministic mode takes them with
    dequantized dense weights (its invariant GEMM); bad values and the per-row fp8 MoE
    activations beside ``expert_act`` are refused naming the options."""
    from app.model import moe

    path = tiny_ckpt("v41")
    ids = torch.randint(3, 500, (19,), generator=torch.Generator().manual_seed(2))
    llm = LLM(path, kv_cache_bytes=1 << 22, dense_act="fp8", expert_act="fp8",
              bounded_replay="off")  # fmt: skip
    att = llm.engine.model.layers[0].attn
    assert isinstance(att.wq_a, Fp8Linear) and att.wq_a.act_group == 32
    assert att.wo_a.act_group == 0  # fp8 in the checkpoint, bf16 in the release: an einsum
    assert llm.engine.model.layers[0].ffn.act_group == 32
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got = llm.generate(prompt_token_ids=[ids.tolist()], sampling_params=params)[0].token_ids
    ref, out = rounding_on_reference(path), ids.clone()
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **k: release_experts(*a, **k, group=32))
    for _ in range(5):
        out = torch.cat((out, sequence_logits(ref, out)[-1].argmax().view(1)))
    assert list(got) == out[ids.numel():].tolist()
    det = LLM(path, kv_cache_bytes=1 << 22, dense_act="fp8", deterministic=True,
              bounded_replay="off")  # fmt: skip
    assert not det.engine.cfg.dense_weights_packed()
    wq_a = det.engine.model.layers[0].attn.wq_a
    assert type(wq_a) is Linear and wq_a.act_group == 32
    assert EngineConfig.from_options(path, dense_act="fp8").dense_weights_packed()
    with pytest.raises(EngineConfigError, match="dense_act must be one of"):
        EngineConfig(model=path, dense_act="fp16")
    with pytest.raises(EngineConfigError, match="expert_act must be one of"):
        EngineConfig(model=path, expert_act="fp4")
    with pytest.raises(EngineConfigError, match="expert_act 'fp8' rounds"):
        EngineConfig(model=path, expert_act="fp8", expert_layout="fp8_rows",
                     moe_prefill_act="fp8")  # fmt: skip


def test_a_rounded_projection_is_batch_invariant():
    """What the deterministic mode runs for ``dense_act="fp8"``: a plain projection with
    rounded inputs gives row 0 the same bits whatever the row count (the rounding is per row,
    the Triton quantizer's rows too)."""
    g = torch.Generator().manual_seed(5)
    lin = Linear(96, 40)
    lin.weight.data = torch.randn(40, 96, generator=g)
    lin.act_group = 32
    x = _acts(40, 96, torch.float32, seed=5)
    with batch_invariant():
        outs = [lin(x[:m]) for m in (1, 2, 3, 16, 17, 40)]
    assert all(torch.equal(o[:1], outs[0][:1]) for o in outs)
    full = act_round_triton(x, 32)
    assert all(torch.equal(act_round_triton(x[:m], 32), full[:m]) for m in (1, 3, 17))


def test_the_dense_act_bench_checks_what_it_times(monkeypatch):
    """``bench/dense_act.py``'s layer on small shapes, under the interpreter: every variant
    is checked against its reference before it is timed (the quantizer bit for bit), and its
    bytes and FLOPs (the floors) count the weights as the variant holds them."""
    from bench import dense_act

    monkeypatch.setattr(dense_act, "ARCHS", {"v41": (((96, 64), (64, 96)), (32, 32)),
                                             "v4": (((128, 128),), (128, 128))})  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for arch in ("v41", "v4"):
        layer = dense_act.Layer(arch, "cpu", g)
        xs = layer.inputs(20, g)
        for v in dense_act.VARIANTS:
            assert layer.error(v, xs) <= (0 if v == "quant" else 1e-2), v
        (b16, f16), (b8, f8) = layer.bytes_flops("bf16", 20), layer.bytes_flops("fp8act", 20)
        assert f16 == f8 == sum(2 * 20 * n * k for n, k in layer.shapes) and b8 < b16
