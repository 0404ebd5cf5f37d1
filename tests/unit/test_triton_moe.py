"""MegaMoE (fp8 / packed fp4 experts) under the Triton interpreter vs the fp64 reference.

Tolerance: ||out - ref|| / ||ref|| <= 1e-2 (bf16 activations and output; weights exact).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from app.model.quant import quantize_fp4, quantize_fp8_block, unpack_fp4  # noqa: E402
from kernels import moe, quant_ref  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

T, D, INTER, E, K, LIMIT = 5, 64, 32, 4, 2, 0.7


pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN


def _routing(g: torch.Generator, t: int, n_exp: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:K] for _ in range(t)])
    return ids, torch.rand(t, K, generator=g) + 0.1


def _stack(fn, ws: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    q, s = zip(*(fn(w) for w in ws), strict=True)
    return torch.stack(q), torch.stack(s)


def _fp8_experts(g: torch.Generator, block: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    w13 = [torch.randn(2 * INTER, D, generator=g) / D**0.5 for _ in range(E)]
    w2 = [torch.randn(D, INTER, generator=g) / INTER**0.5 for _ in range(E)]
    return (*_stack(lambda w: quantize_fp8_block(w, block), w13),
            *_stack(lambda w: quantize_fp8_block(w, block), w2))  # fmt: skip


def _fp4_experts(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    w13 = [torch.randn(2 * INTER, D, generator=g) / D**0.5 for _ in range(E)]
    w2 = [torch.randn(D, INTER, generator=g) / INTER**0.5 for _ in range(E)]
    return (*_stack(quantize_fp4, w13), *_stack(quantize_fp4, w2))


def test_quant_ref_matches_app() -> None:
    from app.model.quant import dequantize_fp4, dequantize_fp8_block

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    q, s = quantize_fp8_block(w, (32, 32))
    torch.testing.assert_close(
        quant_ref.dequant_fp8_blocks(q, s, (32, 32), torch.float32),
        dequantize_fp8_block(q, s, (32, 32)),
    )
    p, s4 = quantize_fp4(w)
    assert unpack_fp4(p).shape == (64, 96)
    torch.testing.assert_close(
        quant_ref.dequant_fp4(p, s4, torch.float32), dequantize_fp4(p, s4), rtol=0, atol=0
    )


@pytest.mark.parametrize(
    ("block", "split_k", "scale_fp32"), [((32, 32), 1, False), ((32, 32), 2, True)]
)
def test_moe_fp8(block: tuple[int, int], split_k: int, scale_fp32: bool) -> None:
    g = torch.Generator().manual_seed(1 + split_k)
    w13, s13, w2, s2 = _fp8_experts(g, block)
    if scale_fp32:
        s13, s2 = quant_ref.scale_to_float(s13), quant_ref.scale_to_float(s2)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, E)
    ref = moe.moe_fp8_ref(x.double(), ids, w.double(), w13, s13, w2, s2, block, LIMIT)
    out = moe.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, block, LIMIT, split_k=split_k)
    assert out.dtype == torch.bfloat16 and out.shape == (T, D)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("split_k", [1, 2])
def test_moe_fp4_with_expert_parallel_offset(split_k: int) -> None:
    g = torch.Generator().manual_seed(7)
    w13, s13, w2, s2 = _fp4_experts(g)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, 3 * E)  # global experts 0..11; this rank holds 4..7
    ref = moe.moe_fp4_ref(x.double(), ids, w.double(), w13, s13, w2, s2, LIMIT, E)
    out = moe.moe_fp4_triton(x, ids, w, w13, s13, w2, s2, LIMIT, E, split_k=split_k)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-2


def test_align_tiles() -> None:
    ids = torch.tensor([[1, 0], [1, 5]])  # expert 5 is not local (2 local experts)
    rows, inv, tile_e = moe._align(ids, 2, 0, 2)
    assert tile_e.tolist()[:2] == [0, 1] and all(e == -1 for e in tile_e.tolist()[2:])
    assert rows.tolist()[:4] == [1, 4, 0, 2]
    assert inv.tolist() == [2, 0, 3, -1]
