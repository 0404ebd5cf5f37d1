"""The fp8 rows layout of fp4 experts (prefill): exact conversion, and the MegaMoE kernel
over it under the Triton interpreter against its torch reference.

Tolerance as test_triton_moe: ||out - ref|| / ||ref|| <= 1e-2 with bf16 activations.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from kernels import moe, moe_formats, moe_ref, moe_tiles  # noqa: E402
from kernels.quant import dequantize_fp4, quantize_fp4  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

T, D, INTER, E, K, LIMIT = 6, 128, 128, 3, 2, 0.7

pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN


def _experts(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """fp4 experts (MX layout) with 32-column scales spread over several binades per row."""
    def one(r: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(r, c, generator=g) * torch.exp2(torch.randint(-5, 1, (r, c // 32),
                                                                      generator=g)  # fmt: skip
                                                        .float().repeat_interleave(32, -1))
        return quantize_fp4(w / c**0.5)

    w13, s13 = zip(*(one(2 * INTER, D) for _ in range(E)), strict=True)
    w2, s2 = zip(*(one(D, INTER) for _ in range(E)), strict=True)
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


def _rows(experts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    w13, s13, w2, s2 = experts
    q13, r13, ok13 = moe_formats.fp4_to_fp8_rows(w13, s13)
    q2, r2, ok2 = moe_formats.fp4_to_fp8_rows(w2, s2)
    assert ok13.all() and ok2.all()
    return q13, r13, q2, r2


def _routing(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=g) + 0.1


def test_fp4_to_fp8_rows_is_exact_within_14_binades() -> None:
    g = torch.Generator().manual_seed(3)
    w13, s13, _, _ = _experts(g)
    q, scale, exact = moe_formats.fp4_to_fp8_rows(w13, s13)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == w13.shape[:2]
    assert exact.all()
    assert torch.equal(q.float() * scale.unsqueeze(-1), dequantize_fp4(w13, s13, torch.float32))
    # One row whose groups span 14 binades stays exact; 15 binades loses its 0.5 codes.
    codes = torch.full((2, 32), 0x11, dtype=torch.uint8)  # 64 columns, every value 0.5
    codes[:, :16] = 0x77  # the first group: 6.0
    sc = torch.full((2, 2), 127, dtype=torch.uint8)
    sc[0, 1], sc[1, 1] = 127 - 14, 127 - 15
    q, scale, exact = moe_formats.fp4_to_fp8_rows(codes.view(torch.int8), sc)
    assert exact.tolist() == [True, False]
    assert q[0, 32:].float().mul(scale[0]).eq(0.5 * 2.0**-14).all()
    assert q[1, 32:].float().eq(0).all()  # 2^-10 below e4m3's smallest subnormal: flushed


@pytest.mark.parametrize(("bm", "split_k"), [(16, 2), (64, 1)])
def test_moe_fp8_rows_bf16_activations_equal_the_fp4_experts(bm: int, split_k: int) -> None:
    """The rows layout holds the same weights: its kernel (row scales after the loop, MMAs
    accumulating in place) matches the fp4 experts' reference; a wrong row scale shows."""
    g = torch.Generator().manual_seed(5)
    experts = _experts(g)
    rows = _rows(experts)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g)
    ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), *experts, LIMIT)
    out = moe.moe_fp8_rows_triton(x, ids, w, *rows, LIMIT, block_m=bm, split_k=split_k)
    assert rel(out, ref) < 1e-2
    q13, r13, q2, r2 = rows
    r2_wrong = r2.clone()
    r2_wrong[:, : D // 2] *= 2
    wrong = moe.moe_fp8_rows_triton(x, ids, w, q13, r13, q2, r2_wrong, LIMIT, block_m=bm)
    assert rel(wrong, ref) > 0.2


@pytest.mark.parametrize("bm", [16, 64])
def test_moe_fp8_rows_fp16_mma_path(bm: int) -> None:
    """The fp16-MMA path (activations as fp16 x 2^-4), which the rows layout takes at every
    tile height on the GPU (no weight-tile scales to overflow fp16)."""
    g = torch.Generator().manual_seed(6)
    experts = _experts(g)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g)
    ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), *experts, LIMIT)
    out = moe.moe_fp8_rows_triton(x, ids, w, *_rows(experts), LIMIT, block_m=bm,
                                  split_k=2 if bm == 16 else 1, fp16_mma=True)  # fmt: skip
    assert rel(out, ref) < 1e-2


def test_moe_fp8_rows_fp8_activations() -> None:
    """fp8 activations with one scale per row (the MMAs accumulating in place): close to the
    reference with the same rounding and clearly closer to it than to bf16 activations."""
    g = torch.Generator().manual_seed(7)
    experts = _experts(g)
    rows = _rows(experts)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g)
    ref = moe_ref.moe_fp8_rows_ref(x.double(), ids, w.double(), *rows, LIMIT, act_fp8=True)
    plain = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), *experts, LIMIT)
    out = moe.moe_fp8_rows_triton(x, ids, w, *rows, LIMIT, act_fp8=True, block_m=64)
    assert rel(out, ref) < 3e-2
    assert rel(out, ref) < 0.6 * rel(out, plain)


def test_moe_fp8_rows_checks_shapes() -> None:
    g = torch.Generator().manual_seed(8)
    q13, r13, q2, r2 = _rows(_experts(g))
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g)
    with pytest.raises(ValueError, match="row scales"):
        moe.moe_fp8_rows_triton(x, ids, w, q13, r13[:, :-1], q2, r2, LIMIT)


def test_moe_fp8_rows_prefill_tiles_fit_small_widths() -> None:
    """Above 96 rows per expert the rows layout takes its 128-row prefill tiles; their N tile
    must still divide widths that are not multiples of 128 (d 64, I 96 here)."""
    g = torch.Generator().manual_seed(9)
    d, inter, t = 64, 96, 150  # 150 * 2 / 3 = 100 rows per expert

    def fp4(r: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = zip(*(quantize_fp4(torch.randn(r, c, generator=g) / c**0.5) for _ in range(E)),
                   strict=True)  # fmt: skip
        return torch.stack(q), torch.stack(s)

    experts = (*fp4(2 * inter, d), *fp4(d, inter))
    rows = _rows(experts)
    tiles = moe_tiles.pick_tiles(t * K, E, E, d, inter, 0, 4, True, False)
    assert tiles.bm == 128 and inter % tiles.gate_up.bn == 0 and d % tiles.down.bn == 0
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.rand(t, K, generator=g) + 0.1
    ref = moe_ref.moe_fp8_rows_ref(x.double(), ids, w.double(), *rows, LIMIT, act_fp8=True)
    out = moe.moe_fp8_rows_triton(x, ids, w, *rows, LIMIT, act_fp8=True)
    assert rel(out, ref) < 3e-2
