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

from kernels import moe, moe_align, moe_formats, moe_grouped, moe_ref, moe_tiles, quant  # noqa: E402
from kernels.moe_tiles import GemmTiles, MoeTiles  # noqa: E402
from kernels.quant import quantize_fp4, quantize_fp8_block  # noqa: E402
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


@pytest.mark.parametrize(
    ("block", "split_k", "scale_fp32"), [((32, 32), 1, False), ((32, 32), 2, True)]
)
def test_moe_fp8(block: tuple[int, int], split_k: int, scale_fp32: bool) -> None:
    g = torch.Generator().manual_seed(1 + split_k)
    w13, s13, w2, s2 = _fp8_experts(g, block)
    if scale_fp32:
        s13, s2 = quant.e8m0_to_float(s13), quant.e8m0_to_float(s2)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, E)
    ref = moe_ref.moe_fp8_ref(x.double(), ids, w.double(), w13, s13, w2, s2, block, LIMIT)
    out = moe.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, block, LIMIT, split_k=split_k)
    assert out.dtype == torch.bfloat16 and out.shape == (T, D)
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("split_k", [1, 2])
def test_moe_fp4_with_expert_parallel_offset(split_k: int) -> None:
    g = torch.Generator().manual_seed(7)
    w13, s13, w2, s2 = _fp4_experts(g)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, 3 * E)  # global experts 0..11; this rank holds 4..7
    ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), w13, s13, w2, s2, LIMIT, E)
    out = moe.moe_fp4_triton(x, ids, w, w13, s13, w2, s2, LIMIT, E, split_k=split_k)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < 1e-2
    # an EP rank's partial sums: the combine's fp32 sums, not rounded to bf16
    out32 = moe.moe_fp4_triton(x, ids, w, w13, s13, w2, s2, LIMIT, E, split_k=split_k,
                               out_dtype=torch.float32)  # fmt: skip
    assert out32.dtype == torch.float32  # the same sums (the interpreter's bf16 store
    # truncates, the GPU's rounds to nearest: one bf16 unit apart at most)
    torch.testing.assert_close(out32, out.float(), rtol=2**-7, atol=1e-6)
    kept = (out32 != out32.bfloat16().float())[out32 != 0].float().mean()
    assert kept > 0.9  # the fp32 digits a bf16 output drops are kept
    ref32 = moe_ref.moe_fp4_ref(x, ids, w, w13, s13, w2, s2, LIMIT, E, out_dtype=torch.float32)
    assert ref32.dtype == torch.float32 and rel(out32, ref) < 1e-2 and rel(ref32, ref) < 1e-2


def test_align_tiles() -> None:
    ids = torch.tensor([[1, 0], [1, 5]])  # expert 5 is not local (2 local experts)
    rows, inv, tile_e = moe_align._align(ids, 2, 0, 2)
    assert tile_e.tolist()[:2] == [0, 1] and all(e == -1 for e in tile_e.tolist()[2:])
    assert rows.tolist()[:2] == [1, 4]  # expert 0: slot 1, then padding (= T*k)
    assert sorted(rows.tolist()[2:4]) == [0, 2]  # expert 1, in either order
    assert inv[1] == 0 and inv[3] == -1
    assert rows[inv[0]] == 0 and rows[inv[2]] == 2


def test_align_many_slots_and_experts() -> None:
    """Several chunks of slots, experts beyond the local range on both sides."""
    g = torch.Generator().manual_seed(3)
    n_local, offset, bm = 5, 3, 4
    ids = torch.randint(0, 12, (700, 3), generator=g)
    rows, inv, tile_e = moe_align._align(ids, n_local, offset, bm)
    flat = ids.reshape(-1) - offset
    local = (flat >= 0) & (flat < n_local)
    assert ((inv >= 0) == local).all()
    assert (rows[inv[local].long()] == torch.nonzero(local).squeeze(1).int()).all()
    row_expert = tile_e.repeat_interleave(bm)
    assert (row_expert[inv[local].long()] == flat[local].int()).all()
    used = rows < ids.numel()
    assert used.sum() == local.sum()
    counts = torch.bincount(flat[local], minlength=n_local)
    assert (tile_e >= 0).sum() == ((counts + bm - 1) // bm).sum()


def test_align_converts_the_activations_in_the_same_launch() -> None:
    """With x and xa the align launch also writes xa = fp16(x * 2^-4) (programs 1..) for the
    F16 GEMMs, every element, and lays out the same tiles as without them."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (300, 3), generator=g)
    x = (torch.randn(300, 40, generator=g) * 100).bfloat16()
    xa = torch.full(x.shape, float("nan"), dtype=torch.float16)
    rows, inv, tile_e = moe_align._align(ids, 6, 2, 4, x, xa)
    assert torch.equal(xa, (x.float() * 0.0625).half())
    r2, i2, t2 = moe_align._align(ids, 6, 2, 4)
    assert torch.equal(inv >= 0, i2 >= 0) and torch.equal(tile_e, t2)
    assert torch.equal(rows.sort().values, r2.sort().values)


def test_decode_tiles_take_256_wide_k_blocks() -> None:
    """V4.1-Flash decode shapes (1 token, 48 of 384 experts local): 256-wide K blocks with
    the split-K of the H200 tile sweep."""
    t = moe_tiles.pick_tiles(6, 48, 384, 5120, 2304, 32, 132)
    assert t.bm == 16
    assert t.gate_up == GemmTiles(64, 256, 8, 4, 3)
    assert t.down == GemmTiles(64, 256, 4, 4, 3)


def test_prefill_tiles() -> None:
    """V4.1-Flash prefill (4096 tokens, all 48 experts local, ~512 rows each), the picks of
    the H200 prefill sweep: bf16 fp8 weights BM 64 x BN 128 x BK 64; fp4 pairs BK 128, three
    stages."""
    args = (4096 * 6, 48, 48, 5120, 2304, 32, 132)
    t = moe_tiles.pick_tiles(*args)
    assert t.bm == 64 and t.gate_up == t.down == GemmTiles(128, 64, 1, 4, 4)
    t = moe_tiles.pick_tiles(*args, pairs=True)
    assert t.bm == 64 and t.gate_up == t.down == GemmTiles(128, 128, 1, 4, 3)


@pytest.mark.parametrize("fp4", [False, True])
def test_moe_256_wide_k_blocks(fp4: bool) -> None:
    """BK = 256 (eight 32-column scale groups per step) and split-K against the reference."""
    g = torch.Generator().manual_seed(11)
    d, inter, e = 256, 256, 2
    w13 = [torch.randn(2 * inter, d, generator=g) / d**0.5 for _ in range(e)]
    w2 = [torch.randn(d, inter, generator=g) / inter**0.5 for _ in range(e)]
    quant = quantize_fp4 if fp4 else (lambda w: quantize_fp8_block(w, (32, 32)))
    q13, s13 = _stack(quant, w13)
    q2, s2 = _stack(quant, w2)
    x = torch.randn(3, d, generator=g).bfloat16()
    ids, w = _routing(g, 3, e)
    tiles = MoeTiles(16, GemmTiles(32, 256, 1, 4, 3), GemmTiles(32, 128, 2, 4, 3))
    if fp4:
        out = moe.moe_fp4_triton(x, ids, w, q13, s13, q2, s2, LIMIT, tiles=tiles)
        ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), q13, s13, q2, s2, LIMIT)
    else:
        out = moe.moe_fp8_triton(x, ids, w, q13, s13, q2, s2, (32, 32), LIMIT, tiles=tiles)
        ref = moe_ref.moe_fp8_ref(x.double(), ids, w.double(), q13, s13, q2, s2, (32, 32), LIMIT)
    assert rel(out, ref) < 1e-2


def test_fp4_pairs_layout() -> None:
    """The pairs layout: byte (r, c) = W[r, c] | W[r + R/2, c] << 4, same values, and back."""
    g = torch.Generator().manual_seed(6)
    ps = [quantize_fp4(torch.randn(8, 96, generator=g)) for _ in range(3)]
    p, s = torch.stack([a for a, _ in ps]), torch.stack([b for _, b in ps])
    q = moe_formats.fp4_to_pairs(p)
    assert q.dtype == p.dtype and q.shape == (3, 4, 96)
    assert torch.equal(moe_formats.fp4_from_pairs(q), p)
    table = torch.tensor(quant.FP4_VALUES)
    b = q.view(torch.uint8).long()
    vals = torch.cat((table[b & 0xF], table[b >> 4]), dim=-2)  # rows 0..3, then 4..7
    scale = quant.e8m0_to_float(s).repeat_interleave(32, -1)
    assert torch.equal(vals * scale, quant.dequantize_fp4(p, s, torch.float32))


@pytest.mark.parametrize("bm", [16, 64])
def test_moe_fp4_pairs(bm: int) -> None:
    """Experts in the pairs layout give the MX layout's result on every path (bf16 MMA with
    scales on the partial or on the weights), W2 as two row sets per tile; and the nibbles'
    rows matter."""
    g = torch.Generator().manual_seed(14)
    w13, s13, w2, s2 = _fp4_experts(g)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, E)
    ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), w13, s13, w2, s2, LIMIT)
    p13, p2 = moe_formats.fp4_to_pairs(w13), moe_formats.fp4_to_pairs(w2)
    kw = dict(block_m=bm, split_k=2, pairs=True)
    out = moe.moe_fp4_triton(x, ids, w, p13, s13, p2, s2, LIMIT, **kw)
    assert rel(out, ref) < 1e-2
    swap = (p2.view(torch.uint8) >> 4 | p2.view(torch.uint8) << 4).view(torch.int8)
    wrong = moe.moe_fp4_triton(x, ids, w, p13, s13, swap, s2, LIMIT, **kw)
    assert rel(wrong, ref) > 0.3
    with pytest.raises(ValueError, match="pairs expert shapes"):
        moe.moe_fp4_triton(x, ids, w, w13, s13, w2, s2, LIMIT, pairs=True)


@pytest.mark.parametrize("f16", [False, True])
def test_moe_fp4_pairs_several_blocks(f16: bool) -> None:
    """The pairs layout where both GEMMs have several N blocks (program n > 0: row offsets,
    the second row set's scale rows) and e8m0 scales are read four per int32 word (BK 128),
    with split-K on W13; and tiles that would leave W2 columns unwritten are refused."""
    g = torch.Generator().manual_seed(15)
    d, inter = 256, 128
    w13 = [torch.randn(2 * inter, d, generator=g) / d**0.5 for _ in range(2)]
    w2 = [torch.randn(d, inter, generator=g) / inter**0.5 for _ in range(2)]
    q13, s13 = _stack(quantize_fp4, w13)
    q2, s2 = _stack(quantize_fp4, w2)
    x = torch.randn(3, d, generator=g).bfloat16()
    ids, w = _routing(g, 3, 2)
    ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), q13, s13, q2, s2, LIMIT)
    tiles = MoeTiles(16, GemmTiles(32, 128, 2, 4, 2), GemmTiles(32, 128, 1, 4, 2))
    p13, p2 = moe_formats.fp4_to_pairs(q13), moe_formats.fp4_to_pairs(q2)
    out = moe.moe_fp4_triton(x, ids, w, p13, s13, p2, s2, LIMIT, tiles=tiles, pairs=True,
                             fp16_mma=f16)  # fmt: skip
    assert rel(out, ref) < 1e-2
    wide = MoeTiles(16, GemmTiles(32, 128, 1, 4, 2), GemmTiles(96, 128, 1, 4, 2))
    with pytest.raises(ValueError, match="do not divide"):
        moe.moe_fp4_triton(x, ids, w, p13, s13, p2, s2, LIMIT, tiles=wide, pairs=True)
    with pytest.raises(ValueError, match="even row count"):
        moe_formats.fp4_to_pairs(q13[:, :3])


def test_quant_rows_matches_fake_quant() -> None:
    """The fp8 rows layout's activation quantizer rounds as the reference: one scale per row."""
    g = torch.Generator().manual_seed(19)
    x = (torch.randn(40, 96, generator=g) * torch.logspace(-3, 3, 96)).bfloat16()
    q, sc = moe_align._quant_rows(x)
    torch.testing.assert_close(q * sc, moe_ref.fake_quant_act(x.float()), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fmt", "split_k"),
    [("fp8", 1), ("fp8-f32-scales", 2), ("fp4", 2), ("fp4-pairs", 1)],
)
def test_moe_fp16_mma_path(fmt: str, split_k: int) -> None:
    """The decode path the GPU takes for bf16 activations (fp16 MMA on activations stored as
    fp16 x 2^-4, the scales' power-of-two factors in their exponents), forced on under the
    interpreter: fp8 with e8m0 and fp32 scales, fp4 in both layouts, with and without split-K
    (H then written by ``_swiglu_reduce``)."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(T, D, generator=g).bfloat16()
    ids, w = _routing(g, T, E)
    if fmt.startswith("fp8"):
        w13, s13, w2, s2 = _fp8_experts(g, (32, 32))
        ref = moe_ref.moe_fp8_ref(x.double(), ids, w.double(), w13, s13, w2, s2, (32, 32), LIMIT)
        if fmt == "fp8-f32-scales":
            s13, s2 = quant.e8m0_to_float(s13), quant.e8m0_to_float(s2)
        out = moe.moe_fp8_triton(x, ids, w, w13, s13, w2, s2, (32, 32), LIMIT, block_m=16,
                                 split_k=split_k, fp16_mma=True)  # fmt: skip
    else:
        w13, s13, w2, s2 = _fp4_experts(g)
        ref = moe_ref.moe_fp4_ref(x.double(), ids, w.double(), w13, s13, w2, s2, LIMIT)
        pairs = fmt == "fp4-pairs"
        if pairs:
            w13, w2 = moe_formats.fp4_to_pairs(w13), moe_formats.fp4_to_pairs(w2)
        out = moe.moe_fp4_triton(x, ids, w, w13, s13, w2, s2, LIMIT, block_m=16, split_k=split_k,
                                 pairs=pairs, fp16_mma=True)  # fmt: skip
    assert rel(out, ref) < 1e-2
    with pytest.raises(ValueError, match="fp16_mma needs"):
        moe.moe_fp4_triton(x, ids, w, *_fp4_experts(g), 0.0, fp16_mma=True)


def test_scale_words_only_where_the_int32_view_holds() -> None:
    codes = torch.randint(100, 140, (2, 8, 9, 8), dtype=torch.uint8)
    args, kw = moe_grouped._scale_launch(codes[0], True, 32, 256)
    assert kw["SCALE_WORDS"] and args[0].dtype == torch.int32 and args[1:] == (18, 2, 1)
    assert not moe_grouped._scale_launch(codes[0], True, 32, 64)[1]["SCALE_WORDS"]  # BK < 128
    assert not moe_grouped._scale_launch(codes[0], True, 128, 256)[1]["SCALE_WORDS"]  # V4 blocks
    assert not moe_grouped._scale_launch(codes[0], False, 32, 256)[1]["SCALE_WORDS"]  # fp32 scales
    odd = codes.reshape(-1)[1 : 1 + 72 * 8].view(1, 72, 8)  # storage offset 1
    args, kw = moe_grouped._scale_launch(odd, True, 32, 256)
    assert not kw["SCALE_WORDS"] and args[0].dtype == torch.uint8
