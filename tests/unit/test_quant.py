"""Checkpoint number formats: e8m0, fp8 blocks, rowwise fp8, packed fp4."""

from __future__ import annotations

import pytest
import torch

from kernels import quant
from kernels.quant import (
    dequantize_fp4,
    dequantize_fp8_block,
    dequantize_fp8_rowwise,
    e8m0_dtype,
    e8m0_to_float,
    float_to_e8m0,
    fp4_decode,
    fp4_encode,
    pack_fp4,
    pow2_scale,
    quantize_fp4,
    quantize_fp8_block,
    quantize_fp8_rowwise,
    unpack_fp4,
)


def _fp4_bits(code: int) -> float:
    """E2M1 by bit arithmetic: sign s, exponent e (bias 1), mantissa m."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
    return -mag if s else mag


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- e8m0 -----------------------------------------------------------------------------


def test_e8m0_decode_matches_exponent_bias() -> None:
    raw = torch.tensor([0, 1, 100, 126, 127, 128, 200, 254], dtype=torch.uint8)
    want = torch.tensor([2.0 ** (int(b) - 127) for b in raw], dtype=torch.float32)
    assert torch.equal(e8m0_to_float(raw), want)
    assert torch.equal(e8m0_to_float(raw.view(e8m0_dtype())), want)


def test_e8m0_encode_round_trip_and_rejects_non_powers() -> None:
    s = torch.ldexp(torch.ones(255), torch.arange(-127, 128))
    enc = float_to_e8m0(s)
    assert enc.dtype == e8m0_dtype()
    assert torch.equal(enc.view(torch.uint8), torch.arange(0, 255, dtype=torch.uint8))
    assert torch.equal(e8m0_to_float(enc), s)
    with pytest.raises(ValueError):
        float_to_e8m0(torch.tensor([3.0]))


def test_pow2_scale_is_smallest_power_of_two_covering_amax() -> None:
    amax = torch.tensor([448.0, 449.0, 224.0, 1.0, 0.0, 1e6])
    s = pow2_scale(amax, 448.0)
    assert torch.equal(s[:4], torch.tensor([1.0, 2.0, 0.5, 2.0**-8]))
    assert s[4] == 2.0**-127
    assert amax[5] / s[5] <= 448 < 2 * amax[5] / s[5]


# ---- fp8 blocks -----------------------------------------------------------------------


@pytest.mark.parametrize("shape,block", [((64, 96), (32, 32)), ((70, 100), (32, 32)),
                                         ((130, 40), (128, 128)), ((5, 64), (1, 32))])  # fmt: skip
def test_fp8_block_scale_shape_and_error(shape: tuple[int, int], block: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=_gen())
    q, s = quantize_fp8_block(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == e8m0_dtype()
    assert tuple(s.shape) == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    d = dequantize_fp8_block(q, s, block)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; absolute floor per block.
    sf = e8m0_to_float(s).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    sf = sf[: shape[0], : shape[1]]
    assert bool(((d - w).abs() <= w.abs() / 16 + sf * 2.0**-9).all())


def test_fp8_block_dequant_matches_elementwise_reference() -> None:
    w = torch.randn(40, 72, generator=_gen(1)) * 5
    q, s = quantize_fp8_block(w, (16, 32))
    d = dequantize_fp8_block(q, s, (16, 32), dtype=torch.float64)
    ref = torch.empty(40, 72, dtype=torch.float64)
    for i in range(40):
        for j in range(72):
            exp = int(s.view(torch.uint8)[i // 16, j // 32]) - 127
            ref[i, j] = float(q[i, j].float()) * 2.0**exp
    assert torch.equal(d, ref)


def test_fp8_block_scale_is_minimal_and_values_exact() -> None:
    # Every value is representable in e4m3 after the scale: the round trip is exact.
    w = torch.tensor([[448.0, -3.5, 0.0, 1.0], [0.5, 2.0, -448.0, 0.125]]) * 2.0**-3
    q, s = quantize_fp8_block(w, (2, 4))
    assert e8m0_to_float(s).item() == 2.0**-3
    assert torch.equal(dequantize_fp8_block(q, s, (2, 4)), w)


def test_fp8_dequant_chunks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(100, 64, generator=_gen(2))
    q, s = quantize_fp8_block(w, (32, 32))
    whole = dequantize_fp8_block(q, s, (32, 32))
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 64)
    assert torch.equal(dequantize_fp8_block(q, s, (32, 32)), whole)
    assert torch.equal(dequantize_fp8_block(q, s, (32, 32), dtype=torch.bfloat16),
                       whole.bfloat16())  # fmt: skip


def test_fp8_dequant_rejects_wrong_scale_shape() -> None:
    q, s = quantize_fp8_block(torch.randn(64, 64, generator=_gen()), (32, 32))
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_fp8_block(q, s, (16, 32))


def test_fp8_rowwise_engram_layout() -> None:
    w = torch.randn(10, 256, generator=_gen(3))
    q, s = quantize_fp8_rowwise(w)
    assert q.shape == (10, 256) and s.shape == (10, 8)
    d = dequantize_fp8_rowwise(q, s)
    assert torch.equal(d, dequantize_fp8_block(q, s, (1, 32)))
    assert bool(((d - w).abs() <= w.abs() / 16 + 2.0**-12).all())


# ---- fp4 ------------------------------------------------------------------------------


def test_fp4_decode_matches_bit_arithmetic() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert fp4_decode(codes).tolist() == [_fp4_bits(c) for c in range(16)]


def test_fp4_encode_exact_values_and_saturation() -> None:
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert fp4_encode(grid).tolist() == list(range(8))
    assert fp4_encode(-grid[1:]).tolist() == list(range(9, 16))
    assert fp4_encode(torch.tensor([7.0, -100.0])).tolist() == [7, 15]


def test_fp4_ties_round_to_even_code() -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # 0.25->0 (code 0), 0.75->1 (2), 1.25->1 (2), 1.75->2 (4), 2.5->2 (4), 3.5->4 (6), 5->4 (6)
    assert fp4_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert fp4_encode(-ties).tolist() == [8, 10, 10, 12, 12, 14, 14]


def test_fp4_encode_is_nearest() -> None:
    x = (torch.rand(2000, generator=_gen(4)) * 2 - 1) * 6.5
    got = fp4_decode(fp4_encode(x))
    table = torch.tensor([_fp4_bits(c) for c in range(16)])
    best = (x[:, None] - table[None, :]).abs().min(dim=1).values
    assert torch.equal((x - got).abs(), best)


def test_fp4_nibble_order_even_column_low() -> None:
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.int8 and packed.shape == (2, 2)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F], [0x87, 0xC3]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_fp4_round_trip_exact_on_grid() -> None:
    g = _gen(5)
    codes = torch.randint(0, 16, (6, 64), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7  # each group holds a 6.0 so the scale is exactly 2^k
    exps = torch.randint(-5, 5, (6, 2), generator=g)
    w = fp4_decode(codes) * torch.ldexp(torch.ones(6, 2), exps).repeat_interleave(32, 1)
    packed, s = quantize_fp4(w)
    assert s.shape == (6, 2) and packed.shape == (6, 32)
    assert torch.equal(e8m0_to_float(s), torch.ldexp(torch.ones(6, 2), exps))
    assert torch.equal(dequantize_fp4(packed, s), w)


def test_fp4_dequant_matches_independent_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(9, 96, generator=_gen(6))
    packed, s = quantize_fp4(w)
    raw = packed.view(torch.uint8)
    ref = torch.empty(9, 96)
    for i in range(9):
        for j in range(96):
            byte = int(raw[i, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            ref[i, j] = _fp4_bits(code) * 2.0 ** (int(s.view(torch.uint8)[i, j // 32]) - 127)
    assert torch.equal(dequantize_fp4(packed, s), ref)
    monkeypatch.setattr(quant, "_CHUNK_ELEMS", 100)
    assert torch.equal(dequantize_fp4(packed, s), ref)
    err = (ref - w).abs() / e8m0_to_float(s).repeat_interleave(32, 1)
    assert float(err.max()) <= 1.0  # half the widest grid gap (4 -> 6)


def test_fp4_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        quantize_fp4(torch.zeros(2, 48))
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    packed, s = quantize_fp4(torch.zeros(2, 64))
    with pytest.raises(ValueError):
        dequantize_fp4(packed, s[:1])
