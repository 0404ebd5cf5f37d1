"""Row kernels of the batched step under TRITON_INTERPRET=1: the KV cache packers (bit for bit
against the torch references, every format, ties and subnormals) and fused RMSNorm + RoPE."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.kv_quant import (  # noqa: E402
    KV_BLOCKS,
    kv_pack_into_ref,
    kv_pack_into_triton,
    kv_pack_ref,
    kv_pack_triton,
    kv_qdq_ref,
    kv_qdq_triton,
    kv_storage,
)
from kernels.norm import norm_rope_ref, norm_rope_triton  # noqa: E402
from kernels.rope import apply_rope_ref  # noqa: E402

TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 6.0, -6.0, 0.0, -0.0, 7.0, 100.0, 1e-30]


@pytest.mark.parametrize("fmt", list(KV_BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_pack_bit_exact(fmt, dtype):
    g = torch.Generator().manual_seed(len(fmt))
    for scale in (1e-7, 1e-3, 1.0, 500.0):
        x = torch.randn(9, 64, generator=g) * scale
        x[0, : len(TIES)] = torch.tensor(TIES) * scale  # E2M1 / e4m3 rounding ties
        x[1, :32] = torch.tensor(TIES[:8]).repeat(4) * 2.0**-8  # e4m3 subnormal range
        x = x.to(dtype)
        a, sa = kv_pack_ref(x, fmt)
        b, sb = kv_pack_triton(x, fmt)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (fmt, scale)
        assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8)), (fmt, scale)
        assert torch.equal(kv_qdq_ref(x, fmt, KV_BLOCKS[fmt]), kv_qdq_triton(x, fmt))


@pytest.mark.parametrize("fmt", list(KV_BLOCKS))
def test_kv_pack_into_cache_rows(fmt):
    """Pack + store in one launch: the rows named land bit-exact, every other row of the
    cache tensors keeps its bytes (int32 and int64 row ids)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 64, generator=g) * 3).to(torch.bfloat16)
    i32 = torch.tensor([3, 11, 12, 1, 7], dtype=torch.int32)
    for rows in (torch.tensor([9, 2, 14, 0, 5]), i32):
        want_c, want_s = kv_storage(fmt, 16, 64, torch.bfloat16, "cpu")
        want_c.view(torch.uint8).fill_(0xA5)
        want_s.view(torch.uint8).fill_(0x3C)
        got_c, got_s = want_c.clone(), want_s.clone()
        kv_pack_into_ref(x, rows.long(), want_c, want_s, fmt)
        kv_pack_into_triton(x, rows, got_c, got_s, fmt)
        assert torch.equal(want_c.view(torch.uint8), got_c.view(torch.uint8))
        assert torch.equal(want_s.view(torch.uint8), got_s.view(torch.uint8))
        c, s = kv_pack_ref(x, fmt)  # the written rows are the packed rows, the rest untouched
        assert torch.equal(got_c.view(torch.uint8)[rows.long()], c.view(torch.uint8))
        assert torch.equal(got_s.view(torch.uint8)[rows.long()], s.view(torch.uint8))
        untouched = torch.ones(16, dtype=torch.bool)
        untouched[rows.long()] = False
        assert (got_c.view(torch.uint8)[untouched] == 0xA5).all()
        assert (got_s.view(torch.uint8)[untouched] == 0x3C).all()
    with pytest.raises(ValueError, match="rows must be integer"):
        kv_pack_into_triton(x, torch.zeros(4, dtype=torch.int64), got_c, got_s, fmt)


def test_kv_qdq_keeps_leading_dims():
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(kv_qdq_triton(x, "mxfp4"), kv_qdq_ref(x, "mxfp4", 32))


@pytest.mark.parametrize("shape,R", [((5, 64), 16), ((3, 4, 64), 16), ((6, 80), 0),
                                     ((2, 3, 128), 64), ((3, 64), 16)])  # fmt: skip
@pytest.mark.parametrize("norm", ["weighted", "weightless", "none"])
def test_norm_rope(shape, R, norm):
    g = torch.Generator().manual_seed(sum(shape) + R)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(shape[-1], generator=g) if norm == "weighted" else None
    eps = None if norm == "none" else 1e-6
    ang = torch.rand(shape[0], R // 2, generator=g) * 50 if R else None
    cs = (ang.cos(), ang.sin()) if R else (None, None)
    if eps is None and not R:
        pytest.skip("nothing to do")
    ref = norm_rope_ref(x, w, eps, *cs)
    out = norm_rope_triton(x, w, eps, *cs)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-6
    if R and eps is None:  # precomputed cos/sin = the model's polar RoPE
        polar = apply_rope_ref(x, ang)
        assert ((ref - polar).abs().max() / polar.abs().max()).item() < 1e-6


def test_norm_rope_reads_a_column_slice_in_place():
    """The halves of a stacked projection's output (wq_a | wkv): a [T, a] column slice of a
    [T, a + b] tensor is normalized as it lies (row stride a + b), like its copy."""
    g = torch.Generator().manual_seed(7)
    y = torch.randn(3, 96, generator=g)
    w = torch.randn(32, generator=g)
    ang = torch.rand(3, 8, generator=g) * 50
    part = y[:, 64:]
    assert not part.is_contiguous()
    out = norm_rope_triton(part, w, 1e-6, ang.cos(), ang.sin())
    ref = norm_rope_ref(part.contiguous(), w, 1e-6, ang.cos(), ang.sin())
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-6


@pytest.mark.parametrize("T,D1,D2,R", [(3, 32, 64, 16), (5, 48, 40, 0), (1, 64, 32, 32)])
def test_norm_rope_pair_equals_the_two_norms(T, D1, D2, R):
    """One launch over a stacked projection's output (wq_a | wkv): each range RMSNormed with
    its own weight, RoPE on the second, equal to norm_rope on each range (bit for bit: the
    same per-row arithmetic) and to the reference."""
    from kernels.norm import norm_rope_pair_ref, norm_rope_pair_triton

    g = torch.Generator().manual_seed(T + D1 + D2 + R)
    x = torch.randn(T, D1 + D2, generator=g)
    w1, w2 = torch.randn(D1, generator=g), torch.randn(D2, generator=g)
    ang = torch.rand(T, R // 2, generator=g) * 50 if R else None
    cs = (ang.cos(), ang.sin()) if R else (None, None)
    a, b = norm_rope_pair_triton(x, D1, w1, 1e-6, w2, 1e-5, *cs)
    assert a.shape == (T, D1) and b.shape == (T, D2) and a.is_contiguous() and b.is_contiguous()
    assert torch.equal(a, norm_rope_triton(x[:, :D1], w1, 1e-6))
    assert torch.equal(b, norm_rope_triton(x[:, D1:], w2, 1e-5, *cs))
    ra, rb = norm_rope_pair_ref(x, D1, w1, 1e-6, w2, 1e-5, *cs)
    for got, ref in ((a, ra), (b, rb)):
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6
    with pytest.raises(ValueError, match="split"):
        norm_rope_pair_triton(x, D1 + D2, w1, 1e-6, w2, 1e-5)


def test_linear_f32_head():
    """The LM head's bf16 x bf16 -> fp32 GEMM = the fp32 GEMM of the same bf16 values."""
    from kernels.linear import linear_f32_ref, linear_f32_triton

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 48, generator=g).bfloat16()
    w = torch.randn(70, 48, generator=g).bfloat16()
    out = linear_f32_triton(x, w)
    ref = linear_f32_ref(x, w)
    assert out.dtype == torch.float32
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-6


@pytest.mark.parametrize("shape", [(1, 70, 48), (5, 64, 96), (16, 33, 256), (1, 16, 8),
                                   (2, 3, 40, 64)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_linear_decode_kernel(shape, dtype):
    """The plain projections' decode kernel (split K, the last program of a row block sums the
    splits): each output within one ulp of the exact product plus the fp32 sums' rounding
    (2^-16 of the sum of |products|); repeated launches are bit-equal and leave the split
    counters at zero."""
    from kernels.dispatch import _COUNTERS
    from kernels.linear import dense_linear_triton

    *lead, n, k = shape
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    out = dense_linear_triton(x, w)
    exact = x.double() @ w.double().T
    assert out.shape == (*lead, n) and out.dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    slack = exact.abs() * ulp + (x.double().abs() @ w.double().abs().T) * 2.0**-16
    err = (out.double() - exact).abs() / slack
    assert err.max().item() <= 1.0, err.max().item()
    assert torch.equal(dense_linear_triton(x, w), out)
    assert all(int(c.abs().sum()) == 0 for c in _COUNTERS.get(torch.device("cpu"), []))


def test_dense_linear_dispatch():
    """nn.Linear's product goes through ``dense_linear``: its torch reference on the CPU (and
    for fp32 or over-wide inputs anywhere), the decode kernel only for <= 16 bf16 / fp16 rows."""
    from kernels.linear import GEMV_MAX_ROWS, _gemv_fits, dense_linear, dense_linear_ref

    w = torch.randn(8, 16).bfloat16()
    assert _gemv_fits(torch.randn(GEMV_MAX_ROWS, 16).bfloat16(), w)
    assert not _gemv_fits(torch.randn(GEMV_MAX_ROWS + 1, 16).bfloat16(), w)
    assert not _gemv_fits(torch.randn(2, 16), w.float())
    assert not _gemv_fits(torch.randn(2, 16).half(), w)
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(dense_linear(x, w), dense_linear_ref(x, w))


@pytest.mark.parametrize("shape,block", [((3, 64, 96), (32, 32)), ((40, 96, 256), (32, 32)),
                                         ((20, 64, 256), (128, 128)), ((3, 64, 64), (128, 128)),
                                         ((3, 128, 96), (128, 128))])  # fmt: skip
def test_fp8_linear(shape, block):
    """The fp8 dense projection kernel (the MegaMoE GEMM with one group) = dequantize + GEMM."""
    from kernels.linear import fp8_linear_ref, fp8_linear_triton
    from kernels.quant import quantize_fp8_block

    M, N, K = shape
    g = torch.Generator().manual_seed(M)
    q, s = quantize_fp8_block(torch.randn(N, K, generator=g) / K**0.5, block)
    x = torch.randn(M, K, generator=g)
    ref = fp8_linear_ref(x.double(), q, s, block)
    out = fp8_linear_triton(x, q, s, block)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("shape", [(3, 64, 96), (20, 64, 256), (3, 64, 1024)])  # 1, 1, 2 splits
def test_fp8_linear_bf16_rounds_once(shape):
    """bf16 activations: the output is the fp32 result rounded once to bf16 -- stored in bf16
    by the GEMM itself (one split) or by the split sum -- so every value is within one bf16
    ulp of the fp64 reference (the interpreter truncates where the GPU rounds to nearest)."""
    from kernels.linear import fp8_linear_ref, fp8_linear_triton
    from kernels.quant import quantize_fp8_block

    M, N, K = shape
    g = torch.Generator().manual_seed(K + 1)
    q, s = quantize_fp8_block(torch.randn(N, K, generator=g) / K**0.5, (32, 32))
    x = torch.randn(M, K, generator=g).bfloat16()
    out = fp8_linear_triton(x, q, s, (32, 32))
    ref = fp8_linear_ref(x.double(), q, s, (32, 32))
    assert out.dtype == torch.bfloat16
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    assert ((out.double() - ref).abs() <= ulp + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize("shape,block", [((3, 64, 1024), (128, 128)), ((5, 64, 2048), (32, 32))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_split_k(shape, block, dtype):
    """Decode-sized fp8 projections split K (2 and 4 splits here, as at M = 1 on the H200):
    the splits' one-launch sum + cast equals the fp32 sum of the splits rounded once, and the
    result is the reference's; the kernel's row map is reused, not remade per call."""
    from kernels import linear, moe_tiles
    from kernels.linear import fp8_linear_ref, fp8_linear_triton
    from kernels.quant import quantize_fp8_block

    M, N, K = shape
    assert moe_tiles._gemm_tiles(16, N, K, 1, 4, 32, False, False).split == K // 512
    g = torch.Generator().manual_seed(K)
    q, s = quantize_fp8_block(torch.randn(N, K, generator=g) / K**0.5, block)
    x = torch.randn(M, K, generator=g).to(dtype)
    out = fp8_linear_triton(x, q, s, block)
    ref = fp8_linear_ref(x.double(), q, s, block)
    assert out.dtype == dtype and out.shape == (M, N)
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: one rounding of the output
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    kept = list(linear._ROWS[x.device])
    fp8_linear_triton(x, q, s, block)
    assert len(linear._ROWS[x.device]) == 1 and linear._ROWS[x.device][0] is kept[0]
