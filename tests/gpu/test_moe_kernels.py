"""MegaGate / MegaMoE / Mega-mHC / Engram Triton kernels at V4.1-Flash shapes (CUDA only).

d=5120, I=2304, 48 local experts, top-6, n=4; tolerances ||out - ref|| / ||ref||: 1e-2 for
bf16 activations, 1e-4 for fp32 paths (tf32x3 mixing).
"""

from __future__ import annotations

import pytest
import torch

# the fp32 references dequantize 48 experts (~7 GiB) with transients beside the fixtures
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.gpu_mem(16)]  # fmt: skip
LIGHT = pytest.mark.gpu_mem(4)  # no expert reference

D, INTER, E_LOCAL, E_ALL, TOPK, N = 5120, 2304, 48, 384, 6, 4


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _routing(t: int, first_local: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform top-6 of 384 global experts; a token with no local expert gets ``first_local``
    in slot 0, so every test does local work."""
    ids = torch.rand(t, E_ALL, device="cuda").argsort(-1)[:, :TOPK]
    local = (ids >= first_local) & (ids < first_local + E_LOCAL)
    ids[:, 0] = torch.where(local.any(-1), ids[:, 0], first_local)
    return ids, torch.rand(t, TOPK, device="cuda") + 0.1


@pytest.fixture(scope="module")
def fp8_experts() -> tuple[torch.Tensor, ...]:
    def w(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = (torch.randn(E_LOCAL, rows, cols, device="cuda") * 64).to(torch.float8_e4m3fn)
        s = torch.randint(117, 121, (E_LOCAL, rows // 32, cols // 32), device="cuda")
        return q, s.to(torch.uint8)

    return (*w(2 * INTER, D), *w(D, INTER))


@pytest.fixture(scope="module")
def fp4_experts() -> tuple[torch.Tensor, ...]:
    def w(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.randint(-128, 128, (E_LOCAL, rows, cols // 2), device="cuda", dtype=torch.int8)
        s = torch.randint(121, 125, (E_LOCAL, rows, cols // 32), device="cuda")
        return q, s.to(torch.uint8)

    return (*w(2 * INTER, D), *w(D, INTER))


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_moe_fp8(fp8_experts: tuple[torch.Tensor, ...], t: int) -> None:
    from kernels.moe import moe_fp8_triton
    from kernels.moe_ref import moe_fp8_ref

    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, w = _routing(t)
    out = moe_fp8_triton(x, ids, w, *fp8_experts, (32, 32), 10.0)
    ref = moe_fp8_ref(x.float(), ids, w, *fp8_experts, (32, 32), 10.0)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_moe_fp4(fp4_experts: tuple[torch.Tensor, ...], t: int) -> None:
    from kernels.moe import moe_fp4_triton
    from kernels.moe_ref import moe_fp4_ref

    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, w = _routing(t, first_local=96)  # this rank holds global experts 96..143
    out = moe_fp4_triton(x, ids, w, *fp4_experts, 10.0, 96)
    ref = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0, 96)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("t", [1, 64, 1024])
def test_moe_fp4_pairs_layout(fp4_experts: tuple[torch.Tensor, ...], t: int) -> None:
    """Experts repacked to the pairs layout at load time = the MX layout's reference: one
    byte tile gives W1 and W3 (W2: both halves of d), on every path (fp16 MMA at decode,
    bf16 at prefill)."""
    from kernels.moe import moe_fp4_triton
    from kernels.moe_formats import fp4_to_pairs
    from kernels.moe_ref import moe_fp4_ref

    w13, s13, w2, s2 = fp4_experts
    h13, h2 = fp4_to_pairs(w13), fp4_to_pairs(w2)
    x = torch.randn(t, D, device="cuda").bfloat16()
    if t >= 1024:  # all local, ~128 rows per expert: prefill tiles
        n_all = E_LOCAL
        ids = torch.rand(t, n_all, device="cuda").argsort(-1)[:, :TOPK]
        w = torch.rand(t, TOPK, device="cuda") + 0.1
    else:
        n_all = E_ALL
        ids, w = _routing(t)
    out = moe_fp4_triton(x, ids, w, h13, s13, h2, s2, 10.0, n_experts=n_all, pairs=True)
    ref = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0)
    assert _rel(out, ref) < 1e-2
    # same products, another order of accumulation: near-identical to the MX layout
    mx = moe_fp4_triton(x, ids, w, *fp4_experts, 10.0, n_experts=n_all)
    assert _rel(out, mx) < 1e-3


DECODE_CASES = [(1, False, False), (8, False, False), (64, False, True), (512, False, False),
                (64, True, False), (200, True, True)]


@pytest.mark.parametrize(("t", "all_local", "wide"), DECODE_CASES)
def test_moe_decode_kernel(fp4_experts: tuple[torch.Tensor, ...], t: int, all_local: bool,
                           wide: bool) -> None:  # fmt: skip
    """The Gluon decode GEMMs (kernels.moe_decode: weights as the MMA's A, K permuted per
    block, scales re-based into fp16) = the fp32 reference on the same fp4 weights, and the
    tl kernel's fp16 path to accumulation order: 8-, 16- and 32-row token tiles, one and
    several K splits, row scales spanning 4 or 30 binades (``wide``). Each call's output is
    poisoned first; every element must be written."""
    from kernels import moe_decode
    from kernels.moe import moe_fp4_triton
    from kernels.moe_formats import fp4_to_pairs
    from kernels.moe_ref import moe_fp4_ref

    w13, s13, w2, s2 = fp4_experts
    if wide:  # every row: scales over 30 binades (R re-basing; fp16 would overflow otherwise)
        s13 = torch.randint(95, 126, s13.shape, device="cuda").to(torch.uint8)
        s2 = torch.randint(95, 126, s2.shape, device="cuda").to(torch.uint8)
    h13, h2 = fp4_to_pairs(w13), fp4_to_pairs(w2)
    (r13, ok13), (r2, ok2) = moe_decode.row_refs(s13), moe_decode.row_refs(s2)
    assert ok13 and ok2
    n_all = E_LOCAL if all_local else E_ALL
    torch.manual_seed(t)
    x = torch.randn(t, D, device="cuda").bfloat16()
    if all_local:
        ids = torch.rand(t, n_all, device="cuda").argsort(-1)[:, :TOPK]
        w = torch.rand(t, TOPK, device="cuda") + 0.1
    else:
        ids, w = _routing(t)
    kw = dict(n_experts=n_all, pairs=True, out_dtype=torch.float32)
    out = moe_fp4_triton(x, ids, w, h13, s13, h2, s2, 10.0, row_refs=(r13, r2), **kw)
    assert bool(torch.isfinite(out).all())
    ref = moe_fp4_ref(x.float(), ids, w, w13, s13, w2, s2, 10.0)
    err = _rel(out, ref)
    assert err < 1e-2
    tl_ = moe_fp4_triton(x, ids, w, h13, s13, h2, s2, 10.0, **kw)  # no row refs: the tl path
    # the same fp16 weights and activations, summed in another order; H rounds to fp16 in
    # both (2^-11), so order effects flip some of its roundings: ~1e-4, not more
    assert _rel(out, tl_) < 1e-3
    assert err < 1.2 * _rel(tl_, ref)  # and no less accurate than the tl kernel


@LIGHT
def test_moe_decode_kernel_writes_every_row_and_stays_out_of_prefill(
    fp4_experts: tuple[torch.Tensor, ...],
) -> None:
    """Launched directly on a poisoned H (NaN): every valid token row of every touched tile
    is written; a prefill-sized call with row references takes the tl path (the same output
    as without them)."""
    from kernels import moe_decode
    from kernels.moe import moe_fp4_triton
    from kernels.moe_align import _align
    from kernels.moe_formats import fp4_to_pairs

    w13, s13, w2, s2 = fp4_experts
    h13 = fp4_to_pairs(w13)
    r13, _ = moe_decode.row_refs(s13)
    t = 40
    x = (torch.randn(t, D, device="cuda") * 0.0625).half()
    ids, _ = _routing(t)
    rows, _, tile_e = _align(ids, E_LOCAL, 0, 16)
    h = torch.full((rows.numel(), INTER), float("nan"), dtype=torch.float16, device="cuda")
    moe_decode.launch(x, rows, tile_e, h13, s13, r13, h, t * TOPK, TOPK, INTER, D, 1, 10.0,
                      True, True, 16)  # fmt: skip
    valid = rows < t * TOPK
    assert int(valid.sum()) == int(((ids >= 0) & (ids < E_LOCAL)).sum())
    assert bool(torch.isfinite(h[valid]).all())
    x2 = torch.randn(4096, D, device="cuda").bfloat16()
    ids2 = torch.rand(4096, E_LOCAL, device="cuda").argsort(-1)[:, :TOPK]
    (r2, _) = moe_decode.row_refs(s2)
    args2 = (x2, ids2, torch.rand(4096, TOPK, device="cuda"), h13, s13, fp4_to_pairs(w2), s2,
             10.0)  # fmt: skip
    with_refs = moe_fp4_triton(*args2, n_experts=E_LOCAL, pairs=True, row_refs=(r13, r2))
    assert torch.equal(with_refs, moe_fp4_triton(*args2, n_experts=E_LOCAL, pairs=True))


@LIGHT
@pytest.mark.parametrize(("t", "bt", "split"), [(8, 8, 1), (40, 16, 1), (64, 8, 3), (512, 16, 1),
                                                (200, 32, 2)])  # fmt: skip
def test_moe_decode_grid_orders_are_bit_identical(fp4_experts: tuple[torch.Tensor, ...], t: int,
                                                  bt: int, split: int) -> None:  # fmt: skip
    """The decode GEMMs' grid order (``tiles_last``: the token tiles on the grid's slowest
    dimension, the default) changes which CTA runs when, not the arithmetic: W13 (gathered
    rows, fused SwiGLU, or fp32 split partials) and W2 are bit-identical in both orders, on
    poisoned outputs, every valid row written."""
    from kernels import moe_decode
    from kernels.moe_align import _align
    from kernels.moe_formats import fp4_to_pairs

    w13, s13, w2, s2 = fp4_experts
    h13, h2 = fp4_to_pairs(w13), fp4_to_pairs(w2)
    (r13, _), (r2, _) = moe_decode.row_refs(s13), moe_decode.row_refs(s2)
    torch.manual_seed(t)
    x = (torch.randn(t, D, device="cuda") * 0.0625).half()
    ids, _ = _routing(t)
    rows, _, tile_e = _align(ids, E_LOCAL, 0, bt)
    valid = rows < t * TOPK
    outs = []
    for last in (False, True):
        shape = (rows.numel(), INTER) if split == 1 else (split, rows.numel(), 2 * INTER)
        h = torch.full(shape, float("nan"), device="cuda",
                       dtype=torch.float16 if split == 1 else torch.float32)  # fmt: skip
        moe_decode.launch(x, rows, tile_e, h13, s13, r13, h, t * TOPK, TOPK, INTER, D, split,
                          10.0, True, split == 1, bt, tiles_last=last)  # fmt: skip
        hv = h[valid] if split == 1 else h[:, valid]
        assert bool(torch.isfinite(hv).all()), last
        h16 = torch.where(valid[:, None], h if split == 1 else h.sum(0)[:, :INTER].half(), 0)
        y = torch.full((1, rows.numel(), D), float("nan"), device="cuda")
        moe_decode.launch(h16.half(), rows, tile_e, h2, s2, r2, y, t * TOPK, TOPK, D // 2, INTER,
                          1, 10.0, False, False, bt, tiles_last=last)  # fmt: skip
        assert bool(torch.isfinite(y[:, valid]).all()), last
        outs.append((hv, y[:, valid]))
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])


@pytest.mark.parametrize(("t", "act_fp8"), [(1, False), (64, False), (2048, False),
                                            (2048, True)])  # fmt: skip
def test_moe_fp8_rows_layout(fp4_experts: tuple[torch.Tensor, ...], t: int,
                             act_fp8: bool) -> None:  # fmt: skip
    """fp4 experts re-encoded exactly in the fp8 rows layout: with bf16 activations the fp4
    reference (decode and prefill tiles); with fp8 activations (one scale per row) the
    reference with that rounding."""
    from kernels.moe import moe_fp8_rows_triton
    from kernels.moe_formats import fp4_to_fp8_rows
    from kernels.moe_ref import moe_fp4_ref, moe_fp8_rows_ref

    w13, s13, w2, s2 = fp4_experts

    def rows_of(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, r, exact = zip(*(fp4_to_fp8_rows(w[e], s[e]) for e in range(E_LOCAL)), strict=True)
        assert all(bool(ok.all()) for ok in exact)  # every row exact
        return torch.stack(q), torch.stack(r)

    q13, r13 = rows_of(w13, s13)
    q2, r2 = rows_of(w2, s2)
    x = torch.randn(t, D, device="cuda").bfloat16()
    n_all = E_LOCAL if t >= 1024 else E_ALL
    if t >= 1024:
        ids = torch.rand(t, n_all, device="cuda").argsort(-1)[:, :TOPK]
        w = torch.rand(t, TOPK, device="cuda") + 0.1
    else:
        ids, w = _routing(t)
    rows = (q13, r13, q2, r2)
    if not act_fp8:
        out = moe_fp8_rows_triton(x, ids, w, *rows, 10.0, n_experts=n_all)
        ref = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0)
        assert _rel(out, ref) < 1e-2
        return
    out = moe_fp8_rows_triton(x, ids, w, *rows, 10.0, n_experts=n_all, act_fp8=True)
    ref = moe_fp8_rows_ref(x.float(), ids, w, *rows, 10.0, act_fp8=True)
    plain = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0)
    assert _rel(out, ref) < 5e-2
    assert _rel(out, ref) < 0.6 * _rel(out, plain)


def test_moe_fp8_v4_blocks_and_fp32_scales() -> None:
    """V4 layout: 128x128 weight blocks (scales as e8m0 and as fp32)."""
    from kernels.moe import moe_fp8_triton
    from kernels.moe_ref import moe_fp8_ref
    from kernels.quant import e8m0_to_float

    e, inter = 8, 2048
    w13 = (torch.randn(e, 2 * inter, D, device="cuda") * 64).to(torch.float8_e4m3fn)
    s13 = torch.randint(117, 121, (e, 2 * inter // 128, D // 128), device="cuda").byte()
    w2 = (torch.randn(e, D, inter, device="cuda") * 64).to(torch.float8_e4m3fn)
    s2 = torch.randint(117, 121, (e, D // 128, inter // 128), device="cuda").byte()
    x = torch.randn(96, D, device="cuda").bfloat16()
    ids = torch.rand(96, e, device="cuda").argsort(-1)[:, :TOPK]
    w = torch.rand(96, TOPK, device="cuda") + 0.1
    ref = moe_fp8_ref(x.float(), ids, w, w13, s13, w2, s2, (128, 128), 10.0)
    out = moe_fp8_triton(x, ids, w, w13, s13, w2, s2, (128, 128), 10.0)
    assert _rel(out, ref) < 1e-2
    f13, f2 = e8m0_to_float(s13), e8m0_to_float(s2)
    assert _rel(moe_fp8_triton(x, ids, w, w13, f13, w2, f2, (128, 128), 10.0), ref) < 1e-2


@pytest.mark.parametrize("fp4", [False, True])
def test_moe_prefill_tiles(fp4: bool, fp8_experts: tuple, fp4_experts: tuple) -> None:
    """All experts local and ~128 rows each: the large-tile (no split) path, at the picked
    BM (64) and at BM=128."""
    from kernels.moe import moe_fp4_triton, moe_fp8_triton
    from kernels.moe_ref import moe_fp4_ref, moe_fp8_ref
    from kernels.moe_tiles import pick_tiles

    t = 1024
    x = torch.randn(t, D, device="cuda").bfloat16()
    ids = torch.rand(t, E_LOCAL, device="cuda").argsort(-1)[:, :TOPK]
    w = torch.rand(t, TOPK, device="cuda") + 0.1
    assert pick_tiles(t * TOPK, E_LOCAL, E_LOCAL, D, INTER, 32, 132).bm == 64
    for bm in (None, 128):
        if fp4:
            out = moe_fp4_triton(x, ids, w, *fp4_experts, 10.0, block_m=bm)
            ref = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0)
        else:
            out = moe_fp8_triton(x, ids, w, *fp8_experts, (32, 32), 10.0, block_m=bm)
            ref = moe_fp8_ref(x.float(), ids, w, *fp8_experts, (32, 32), 10.0)
        assert _rel(out, ref) < 1e-2, bm


@LIGHT
@pytest.mark.parametrize("block_m,limit", [(None, 0.0), (16, 1024.0)])
def test_dequant_tiles_exact(block_m: int | None, limit: float) -> None:
    """The PTX dequantization (fp8 incl. subnormals, every fp4 code): one-hot activations
    read W1 back through the MoE (W3 = 1, W2 = identity), against the reference
    dequantization put through the same SwiGLU. 256 rows of one expert take the bf16 tiles;
    16-row tiles with a SwiGLU limit take the fp16 MMA path (hardware e4m3 -> fp16)."""
    from kernels.moe import moe_fp4_triton, moe_fp8_triton
    from kernels.quant import dequantize_fp4, dequantize_fp8_block

    d, inter = 256, 256
    # every e4m3 byte except NaN, and every fp4 byte, in W1
    codes = torch.arange(256, device="cuda", dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)
    w1 = codes.repeat(inter * d // 256).view(inter, d).view(torch.float8_e4m3fn)
    s_w1 = torch.randint(118, 130, (inter // 32, d // 32), device="cuda").byte()
    deq = dequantize_fp8_block(w1, s_w1, (32, 32), torch.float32)
    x = torch.zeros(d, d, device="cuda")
    x[torch.arange(d), torch.arange(d)] = 1.0  # token j reads column j
    ids = torch.zeros(d, 1, dtype=torch.long, device="cuda")
    wts = torch.ones(d, 1, device="cuda")
    # silu(h1) * h3 with h3 = 1 is not linear; compare through the same nonlinearity
    one = torch.ones(inter, d, device="cuda")
    eye_w2 = torch.eye(d, inter, device="cuda")
    q1, q3 = w1, one.to(torch.float8_e4m3fn)
    w13 = torch.cat([q1, q3], 0)[None].contiguous()
    s13 = torch.cat([s_w1, torch.full_like(s_w1, 127)], 0)[None].contiguous()
    w2 = eye_w2.to(torch.float8_e4m3fn)[None].contiguous()
    s2 = torch.full((1, d // 32, inter // 32), 127, dtype=torch.uint8, device="cuda")
    out = moe_fp8_triton(x.bfloat16(), ids, wts, w13, s13, w2, s2, (32, 32), limit,
                         block_m=block_m)  # fmt: skip
    h3 = (x @ one.t()).float()
    h1 = x @ deq.t()
    if limit:
        h1 = h1.clamp(max=limit)
    want = (torch.nn.functional.silu(h1) * h3).bfloat16().float()
    # a wrong bit or a flushed subnormal moves a value by >= 1/8 (or by all of it)
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-6)
    # fp4: all 256 byte values in every row group
    p1 = codes.view(torch.int8).repeat(inter * d // 2 // 256).view(inter, d // 2)
    q_s = torch.randint(118, 130, (inter, d // 32), device="cuda").byte()
    deq4 = dequantize_fp4(p1, q_s, torch.float32)
    ones4 = torch.full((inter, d // 2), 0x22, dtype=torch.int8, device="cuda")  # 1.0, 1.0
    w13_4 = torch.cat([p1, ones4], 0)[None].contiguous()
    s13_4 = torch.cat([q_s, torch.full_like(q_s, 127)], 0)[None].contiguous()
    w2_4 = torch.zeros(1, d, inter // 2, dtype=torch.int8, device="cuda")
    w2_4[0, torch.arange(d), torch.arange(d) // 2] = torch.where(
        torch.arange(d, device="cuda") % 2 == 0, 0x02, 0x20
    ).to(torch.int8)  # W2 = identity (code 2 = 1.0 in the right nibble)
    s2_4 = torch.full((1, d, inter // 32), 127, dtype=torch.uint8, device="cuda")
    out4 = moe_fp4_triton(x.bfloat16(), ids, wts, w13_4, s13_4, w2_4, s2_4, limit,
                          block_m=block_m)  # fmt: skip
    want4 = (torch.nn.functional.silu(x @ deq4.t()) * h3).bfloat16().float()
    torch.testing.assert_close(out4.float(), want4, rtol=1e-2, atol=1e-6)


@LIGHT
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_shared_expert_swiglu_on_gpu(t: int) -> None:
    """The fused SwiGLU of the stacked W1/W3 GEMM = torch's four launches: the same bf16
    bits but for the rare element where the two exp implementations round apart (one step)."""
    from kernels.moe_ref import swiglu_clamp
    from kernels.swiglu import swiglu_halves_triton

    inter = 2304
    h = (torch.randn(t, 2 * inter, device="cuda") * 6).bfloat16()  # past the clamp at 10
    got = swiglu_halves_triton(h, 10.0)
    want = swiglu_clamp(h[:, :inter], h[:, inter:], 10.0)
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2**-7).all()
    assert (diff > 0).float().mean() < 1e-3
    assert (h[:, :inter].float() > 10).any()  # the clamp was exercised


@LIGHT
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_gate(t: int) -> None:
    from kernels.gate import moe_gate_ref, moe_gate_triton

    x = torch.randn(t, D, device="cuda").bfloat16()
    w = (torch.randn(E_ALL, D, device="cuda") / D**0.5).bfloat16()
    bias = 0.1 * torch.randn(E_ALL, device="cuda")
    ids, wts = moe_gate_triton(x, w, bias, TOPK, 2.5)
    ref_ids, ref_w = moe_gate_ref(x.float() @ w.float().t(), bias, TOPK, 2.5)
    same = (ids == ref_ids).all(dim=1)  # near-ties may flip with summation order
    assert same.float().mean() > 0.99
    # a row whose picks differ has different weights by design: compare the rows that agree
    assert _rel(wts[same], ref_w[same]) < 1e-3


@LIGHT
@pytest.mark.parametrize("form", ["auto", "fused", "tile", "loop"])
@pytest.mark.parametrize("t", [1, 8, 64, 4096])
def test_mhc(t: int, form: str) -> None:
    """The fused mHC kernels against the reference at V4.1-Flash widths, in every form
    ("auto": one launch up to 4 tokens, then the two-launch one-tile finish up to one wave
    of tokens; 4096 tokens take the loop in every form)."""
    from tests.support.forms import mhc_finish_form

    with mhc_finish_form(form):
        _check_mhc(t)


@LIGHT
@pytest.mark.parametrize("t", [1, 3, 8])
def test_mhc_one_launch_replays_in_a_graph(t: int) -> None:
    """The one-launch mHC (programs count themselves in at their token's counter, the last
    one finishes) captured in a CUDA graph and replayed with new streams three times: each
    replay equals an eager launch on the same inputs bit for bit (the last program sums the
    partials in split order, whichever arrives last), so no replay finished early on a
    counter left over; the counters are all zero afterwards."""
    from kernels import dispatch, mhc, mhc_ref
    from tests.support.forms import mhc_finish_form

    fn = torch.randn(N * (N + 2), N * D, device="cuda") / (N * D) ** 0.5
    base, scale = 0.5 * torch.randn(24, device="cuda"), 1 + 0.2 * torch.randn(3, device="cuda")
    nw = 1 + 0.1 * torch.randn(D, device="cuda")
    eps = (20, 1e-6, 1e-6, 1e-6)
    x = torch.randn(t, N, D, device="cuda").bfloat16()
    out = torch.randn(t, D, device="cuda").bfloat16()
    post, comb = 2 * torch.rand(t, N, device="cuda"), torch.rand(t, N, N, device="cuda")
    pre_in = torch.rand(t, N, device="cuda")

    def run():
        return mhc.hc_post_pre_triton(out, x, post, comb, fn, base, scale, nw, *eps, pre_in)

    with mhc_finish_form("fused"):
        run()  # compile and make the counters outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = run()
        for _ in range(3):
            x.copy_(torch.randn(t, N, D, device="cuda").bfloat16())
            out.copy_(torch.randn(t, D, device="cuda").bfloat16())
            g.replay()
            want = run()
            for o, w in zip(res, want, strict=True):
                assert torch.equal(o, w)
            ref = mhc_ref.hc_post_pre_ref(out, x, post, comb, fn, base, scale, nw, *eps, pre_in)
            assert _rel(res[0], ref[0]) < 1e-2 and _rel(res[1], ref[1]) < 1e-2
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for kept in dispatch._COUNTERS.values() for c in kept)


def _check_mhc(t: int) -> None:
    from kernels import mhc, mhc_ref

    x = torch.randn(t, N, D, device="cuda").bfloat16()
    fn = torch.randn(N * (N + 2), N * D, device="cuda") / (N * D) ** 0.5
    base, scale = 0.5 * torch.randn(24, device="cuda"), 1 + 0.2 * torch.randn(3, device="cuda")
    nw = 1 + 0.1 * torch.randn(D, device="cuda")
    eps = (20, 1e-6, 1e-6, 1e-6)
    out = torch.randn(t, D, device="cuda").bfloat16()
    pre_in = torch.rand(t, N, device="cuda")
    res = mhc.hc_post_pre_triton(out, x, *mhc_ref.hc_mix_ref(x, fn, base, scale, *eps[:3])[1:],
                                 fn, base, scale, nw, *eps, pre_in)  # fmt: skip
    ref = mhc_ref.hc_post_pre_ref(out, x, *mhc_ref.hc_mix_ref(x, fn, base, scale, *eps[:3])[1:],
                              fn, base, scale, nw, *eps, pre_in)  # fmt: skip
    assert _rel(res[0], ref[0]) < 1e-2 and _rel(res[1], ref[1]) < 1e-2
    for o, r in zip(res[2:], ref[2:], strict=True):
        assert _rel(o, r) < 1e-4
    pre_out = mhc.hc_pre_triton(x, fn, base, scale, nw, *eps)
    pre_ref = mhc_ref.hc_pre_ref(x, fn, base, scale, nw, *eps)
    assert _rel(pre_out[0], pre_ref[0]) < 1e-2 and _rel(pre_out[2], pre_ref[2]) < 1e-4


@LIGHT
@pytest.mark.parametrize("pinned", [False, True])
def test_engram_gather_and_gate(pinned: bool) -> None:
    from kernels import engram

    table = (torch.randn(100_000, 256) * 8).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 122, (100_000, 8), dtype=torch.uint8)
    if pinned:
        table, scale = table.pin_memory(), scale.pin_memory()
    else:
        table, scale = table.cuda(), scale.cuda()
    rows = torch.randint(0, 100_000, (64, 24), device="cuda")
    out = engram.engram_gather_triton(table, rows, scale, torch.bfloat16)
    ref = engram.engram_gather_ref(table.cuda(), rows, scale.cuda(), torch.bfloat16)
    assert torch.equal(out, ref)
    x, key = torch.randn(64, N, D, device="cuda").bfloat16(), torch.randn(64, N, D, device="cuda")
    val, qw, kw = (
        torch.randn(64, D, device="cuda"),
        torch.rand(N, D, device="cuda"),
        torch.rand(N, D, device="cuda"),
    )
    blocked = torch.rand(64, device="cuda") < 0.2
    y = engram.engram_gate_triton(x, key, val, qw, kw, 1e-6, blocked)
    assert _rel(y, engram.engram_gate_ref(x, key, val, qw, kw, 1e-6, blocked)) < 1e-2


@pytest.mark.parametrize("t", [1, 64])
def test_ep_layer_captures_in_a_cuda_graph(fp8_experts: tuple[torch.Tensor, ...], t: int) -> None:
    """The EP path of one MoE layer (ep_size 1: gate -> slots -> the fused k-way experts at
    the rank's slot offset) reads nothing on the host: it captures in a CUDA graph, and the
    replay equals the plain layer eagerly, bit for bit."""
    from app.model.ep import EPGroup, ExpertPlacement
    from app.model.moe import MoE, PackedExperts

    torch.manual_seed(t)
    with torch.device("cuda"):
        moe = MoE(D, INTER, E_LOCAL, TOPK, 2.5, 10.0).to(torch.bfloat16)
    for p in moe.parameters():
        p.data.normal_(0, 0.02)
    moe.gate.bias.data = moe.gate.bias.data.float()
    w13, s13, w2, s2 = fp8_experts
    e8 = torch.float8_e8m0fnu
    moe.experts = PackedExperts(w13, s13.view(e8), w2, s2.view(e8), "fp8", (32, 32), 10.0)
    x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
    tok = torch.arange(t, device="cuda")
    with torch.inference_mode():
        plain = moe(x, tok)
        moe.set_ep(ExpertPlacement.default(E_LOCAL, 1), EPGroup(0, 1))
        moe(x, tok)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(x, tok)
        graph.replay()
        torch.cuda.synchronize()
    assert plain.abs().max() > 0 and torch.equal(out, plain)


@pytest.mark.parametrize("t", [1, 8, 24])
def test_moe_decode_w13_split_sum_in_the_kernel(fp4_experts: tuple[torch.Tensor, ...],
                                                t: int) -> None:  # fmt: skip
    """W13's K splits summed by each tile's last CTA with the clamped SwiGLU (the two-launch
    layer at 1 and 8 tokens, the four launches at 24): as accurate against the fp32 reference
    as the tl path, and replayed in a CUDA graph with new inputs the eager layer's bit for bit
    (the counters must be back at zero after every launch); the counters are zero afterwards."""
    from kernels import dispatch, moe_decode
    from kernels.dispatch import sm_count
    from kernels.moe import moe_fp4_triton
    from kernels.moe_formats import fp4_to_pairs
    from kernels.moe_ref import moe_fp4_ref

    # W13 takes K splits here (about one active tile per 1-4 tokens)
    assert moe_decode.pick_split(max(1.0, t / 4), INTER, D, sm_count(0)) > 1
    w13, s13, w2, s2 = fp4_experts
    h13, h2 = fp4_to_pairs(w13), fp4_to_pairs(w2)
    refs = (moe_decode.row_refs(s13)[0], moe_decode.row_refs(s2)[0])
    torch.manual_seed(t)
    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, w = _routing(t)
    kw = dict(n_experts=E_ALL, pairs=True, out_dtype=torch.float32)

    def layer(xx: torch.Tensor) -> torch.Tensor:
        return moe_fp4_triton(xx, ids, w, h13, s13, h2, s2, 10.0, row_refs=refs, **kw)

    one = layer(x)
    tl_ = moe_fp4_triton(x, ids, w, h13, s13, h2, s2, 10.0, **kw)  # no row refs: the tl path
    ref = moe_fp4_ref(x.float(), ids, w, w13, s13, w2, s2, 10.0)
    # the split sum's order differs from the tl path's (H rounds to fp16 in both): as accurate
    # against the fp32 reference as the tl path, not equal to it
    assert bool(torch.isfinite(one).all()) and _rel(one, ref) < 1e-2
    assert _rel(one, ref) < 1.2 * _rel(tl_, ref)
    static = x.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(static)
    for _ in range(3):
        static.copy_(torch.randn(t, D, device="cuda").bfloat16())
        g.replay()
        assert torch.equal(out, layer(static))
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for kept in dispatch._COUNTERS.values() for c in kept)


@LIGHT
@pytest.mark.parametrize("t,first_local,none_local", [(1, 0, False), (2, 96, False),
                                                      (3, 96, False), (8, 0, False),
                                                      (2, 0, True)])  # fmt: skip
def test_moe_decode_two_launch_layer(fp4_experts: tuple[torch.Tensor, ...], t: int,
                                     first_local: int, none_local: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """At a few token slots the decode layer is two launches: W13 lays out its tiles from
    the router's ids and W2's last CTA per row block combines. Its output equals the four
    launches' (align, W13, W2, combine: what calls past ``FUSED_SLOTS`` take, forced here by
    a bound of 0) bit for bit, with the local experts at an offset, with tokens that take no
    local expert (and none that does), in a CUDA graph replayed with new activations and
    new routing; the rows, inverse map and tile experts it writes are the align launch's
    (rows in slot order); the split counters are zero afterwards."""
    from kernels import dispatch, moe_decode
    from kernels import moe as moe_mod
    from kernels.moe import FUSED_SLOTS, moe_fp4_triton
    from kernels.moe_align import _align
    from kernels.moe_formats import fp4_to_pairs

    assert t * TOPK <= FUSED_SLOTS
    w13, s13, w2, s2 = fp4_experts
    h13, h2 = fp4_to_pairs(w13), fp4_to_pairs(w2)
    refs = (moe_decode.row_refs(s13)[0], moe_decode.row_refs(s2)[0])
    torch.manual_seed(100 + t)

    def routing() -> tuple[torch.Tensor, torch.Tensor]:
        ids, wt = _routing(t, first_local)
        if none_local:  # every expert outside [first_local, first_local + 48)
            ids = (ids % (E_ALL - E_LOCAL - first_local)) + first_local + E_LOCAL
        return ids, wt

    ids, wt = routing()
    x = torch.randn(t, D, device="cuda").bfloat16()

    def layer(xx: torch.Tensor, ii: torch.Tensor, ww: torch.Tensor, fused: bool) -> torch.Tensor:
        with monkeypatch.context() as m:
            m.setattr(moe_mod, "FUSED_SLOTS", FUSED_SLOTS if fused else 0)
            return moe_fp4_triton(xx, ii, ww, h13, s13, h2, s2, 10.0, n_experts=E_ALL,
                                  local_expert_offset=first_local, pairs=True,
                                  row_refs=refs)  # fmt: skip

    fused, four = layer(x, ids, wt, True), layer(x, ids, wt, False)
    assert bool(torch.isfinite(fused).all()) and torch.equal(fused, four)
    assert (fused.abs().amax() == 0) == none_local
    static_x, static_ids, static_w = x.clone(), ids.clone(), wt.clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(static_x, static_ids, static_w, True)
    for _ in range(3):
        ids, wt = routing()
        static_x.copy_(torch.randn(t, D, device="cuda").bfloat16())
        static_ids.copy_(ids)
        static_w.copy_(wt)
        g.replay()
        assert torch.equal(out, layer(static_x, static_ids, static_w, False))
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for kept in dispatch._COUNTERS.values() for c in kept)
    # the routing it writes for the launches after W13: the align launch's tiles
    n_slots, bt = t * TOPK, 8
    n_tiles = moe_decode.tile_count(n_slots, E_LOCAL, bt)
    rows = torch.full((n_tiles * bt,), -7, dtype=torch.int32, device="cuda")
    inv = torch.full((n_slots,), -7, dtype=torch.int32, device="cuda")
    tile_e = torch.full((n_tiles,), -7, dtype=torch.int32, device="cuda")
    h = torch.empty(n_tiles * bt, INTER, dtype=torch.float16, device="cuda")
    part = torch.empty(4, n_tiles * bt, 2 * INTER, device="cuda")
    moe_decode.launch(x, rows, tile_e, h13, s13, refs[0], part, n_slots, TOPK, INTER, D, 4,
                      10.0, True, False, bt, fin=h,
                      counters=dispatch.split_counters(n_tiles * INTER // 64, x.device),
                      route=(ids.reshape(-1), first_local, E_LOCAL, inv))  # fmt: skip
    a_rows, a_inv, a_tile_e = _align(ids, E_LOCAL, first_local, bt)
    assert torch.equal(tile_e, a_tile_e)
    for m in range(n_tiles):  # the same slots per tile; here in slot order
        mine = rows[m * bt:(m + 1) * bt]
        assert torch.equal(mine, torch.sort(a_rows[m * bt:(m + 1) * bt]).values)
    local = a_inv >= 0
    assert torch.equal(inv < 0, ~local)
    assert torch.equal(rows[inv[local].long()], torch.arange(n_slots, device="cuda")[local].int())
