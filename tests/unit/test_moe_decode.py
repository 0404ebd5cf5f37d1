"""The decode MoE kernel's scheme (kernels.moe_decode), checked on the CPU: the K permutation
of its fragments and the fp16 scale re-basing. The Gluon kernel itself runs only on a GPU
(tests/gpu/test_moe_kernels.py checks it against the torch reference there)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_decode import HEAD, SPREAD, row_refs
from kernels.quant import fp4_decode
from tests.support import decode_gemm
from tests.support.decode_gemm import emulate as decode_emulate
from tests.support.decode_gemm import k_perm, rebased_weights


@pytest.mark.parametrize("kb", [64, 128])
def test_k_perm_gives_each_thread_one_contiguous_scale_group(kb: int) -> None:
    """Logical MMA column k = 16 s + 8 h + 2 t + b goes to stored column (KB/4) t + 4 s + 2 h
    + b: a permutation, and thread t's logical columns are its KB/4 contiguous stored ones,
    inside one 32-column scale group."""
    perm = k_perm(kb)
    assert sorted(perm.tolist()) == list(range(kb))
    for t in range(4):
        mine = [int(perm[k]) for k in range(kb) if (k // 2) % 4 == t]
        assert sorted(mine) == list(range(t * kb // 4, (t + 1) * kb // 4))
        assert len({c // 32 for c in mine}) == 1
    # the m16n8k16 fragment of thread t at step s: k = 16 s + 2 t + {0, 1} and + 8 + {0, 1}
    assert perm[16 * 1 + 2 * 3 + 8 + 1] == (kb // 4) * 3 + 4 * 1 + 2 + 1


def _case(span: int, seed: int = 0, rows: int = 24, k: int = 256, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    codes = fp4_decode(torch.randint(0, 16, (rows, k), generator=g))
    base = torch.randint(100, 110, (rows, 1), generator=g)
    c = (base + torch.randint(0, span + 1, (rows, k // 32), generator=g)).to(torch.uint8)
    c[:, 0] = base[:, 0]  # every row spans exactly ``span`` binades
    c[:, 1] = base[:, 0] + span
    x = torch.randn(t, k, generator=g)
    x16 = (x * 0.0625).half()
    w = codes * torch.exp2(c.float() - 127).repeat_interleave(32, 1)
    ref = (x16.double() * 16) @ w.double().T  # the weights exactly, the fp16 activations
    return x16, codes, c, w, ref


@pytest.mark.parametrize("span", [0, 4, 20, SPREAD])
@pytest.mark.parametrize("kb", [64, 128])
def test_fp16_rebased_weights_are_exact_up_to_the_spread(span: int, kb: int) -> None:
    """code x 2^(c - R) in fp16 with R = max c - HEAD is the weight exactly while a row's
    scales span at most SPREAD binades, so the kernel's product equals x @ W^T up to the
    fp32 accumulation (here fp64: to 1e-12)."""
    x16, codes, c, _, ref = _case(span)
    refs, exact = row_refs(c[None])
    assert exact
    assert torch.equal(refs[0], c.int().amax(1) - HEAD)
    out = decode_emulate(x16, codes, c.int(), refs[0], kb)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-6


def _rebased_exact(codes: torch.Tensor, c: torch.Tensor, w: torch.Tensor) -> bool:
    refs, _ = row_refs(c[None])
    w16 = rebased_weights(codes, c.int(), refs[0])
    back = w16.double() * torch.exp2((refs[0] - 127).double())[:, None]
    return torch.equal(back, w.double())


def test_the_spread_bound_is_tight() -> None:
    """At SPREAD binades every fp16 weight is exact; one binade more and ``row_refs`` says
    not exact (the layer keeps the tl kernel), and the smallest group's 0.5 codes would
    indeed flush to zero in fp16 (0.5 x 2^(c - R) = 2^-25)."""
    x16, codes, c, w, _ = _case(SPREAD)
    assert row_refs(c[None])[1] and _rebased_exact(codes, c, w)
    x16, codes, c, w, _ = _case(SPREAD + 1)
    assert not row_refs(c[None])[1]
    assert not _rebased_exact(codes, c, w)
    refs, _ = row_refs(c[None])
    small = (codes[:, :32].abs() == 0.5)
    w16 = rebased_weights(codes, c.int(), refs[0])
    assert bool(small.any()) and float(w16[:, :32][small].abs().max()) == 0.0


def test_a_row_of_tiny_scales_is_not_taken() -> None:
    """A row whose largest scale is below 2^-121 would put the row factor 2^(R - 123) outside
    fp32's normal range: ``row_refs`` says not exact (the layer keeps the tl kernel)."""
    c = torch.full((1, 2, 4), 40, dtype=torch.uint8)
    assert row_refs(c)[1]
    c[0, 1] = 5
    assert not row_refs(c)[1]


# ---- the dense fp8 projections (FP8: kernels.linear.fp8_decode_plan + launch_dense) ----------
def _fp8_weight(n: int, k: int, block: tuple[int, int], spread: int, seed: int):
    """e4m3 weights + e8m0 scales whose blocks' magnitudes differ by up to ``spread`` binades."""
    from kernels.quant import quantize_fp8_block

    g = torch.Generator().manual_seed(seed)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    binade = torch.randint(0, spread + 1, (nb, kb), generator=g).float()
    mag = torch.exp2(binade - spread // 2).repeat_interleave(block[0], 0)
    w = torch.randn(n, k, generator=g) * mag.repeat_interleave(block[1], 1)[:n, :k]
    return quantize_fp8_block(w, block)


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (32, 128)])
def test_fp8_plan_rebases_the_weights_exactly(block) -> None:
    """The plan's codes are the checkpoint's (one per 32 columns: 128-column blocks widened),
    its per-row references are each block row's largest code - HEAD_FP8, and the kernel's
    fp16 weights (e4m3 cvt x fp16 2^(c - R)) are the dequantized weights x 2^(127 - R)
    exactly; what the kernel then computes equals the reference."""
    from kernels import moe_decode as md
    from kernels.linear import fp8_decode_plan, fp8_linear_ref
    from kernels.quant import dequantize_fp8_block

    n, k = 256, 512
    q, s = _fp8_weight(n, k, block, 14, seed=block[1])
    plan = fp8_decode_plan(q, s, block)
    assert plan is not None and plan.b0 == block[0]
    codes = plan.words.view(torch.uint8).view(-1, k // 32)
    assert torch.equal(codes, s.view(torch.uint8).repeat_interleave(block[1] // 32, dim=1))
    hi = s.view(torch.uint8).int().amax(1).repeat_interleave(block[0])
    assert torch.equal(plan.refs, hi - md.HEAD_FP8)
    w16 = decode_gemm.rebased_fp8_weights(q, codes, plan.refs, block[0])
    exact = dequantize_fp8_block(q, s, block, torch.float64)
    assert torch.equal(w16.double(), exact * torch.exp2(127 - plan.refs.double())[:, None])
    # the kernel's arithmetic: x as fp16 x 2^-4, fp32-exact products, the row factor after K
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    x16 = (x.float() * 0.0625).half()
    got = (x16.double() @ w16.double().T) * torch.exp2(plan.refs.double() - 127 + 4)
    ref = fp8_linear_ref(x.double(), q, s, block)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_fp8_plan_rebases_the_wgmma_kernels_bf16_weights_exactly(block) -> None:
    """The same plan serves the wgmma kernel (``kernels.dense_wgmma``): its bf16 weights
    (e4m3 -> bf16, x bf16 2^(c - R)) are the dequantized weights x 2^(127 - R) exactly,
    also for e4m3 subnormals at the widest spread the plan admits; the kernel copies the
    activation columns in the weight fragments' order; and its arithmetic (bf16 activations
    as stored, fp32-exact products over those columns, the row factor after K) equals the
    reference."""
    from kernels import dense_wgmma as dw
    from kernels import moe_decode as md
    from kernels.linear import fp8_decode_plan, fp8_linear_ref
    from kernels.quant import dequantize_fp8_block

    n, k = 256, 512
    q, s = _fp8_weight(n, k, block, md.SPREAD_FP8 - 1, seed=block[1] + 1)
    q[5, 40] = 2.0**-9  # e4m3's smallest subnormal
    plan = fp8_decode_plan(q, s, block)
    assert plan is not None
    codes = plan.words.view(torch.uint8).view(-1, k // 32)
    wb = decode_gemm.rebased_bf16_weights(q, codes, plan.refs, block[0])
    assert wb.dtype == torch.bfloat16
    exact = dequantize_fp8_block(q, s, block, torch.float64)
    assert torch.equal(wb.double(), exact * torch.exp2(127 - plan.refs.double())[:, None])
    assert plan.r_max == int(plan.refs.max())
    # the kernel copies logical activation column k of a block from its stored column
    # _stored_cols(k): the weight fragments' order (k_perm), pairs adjacent
    cols = dw._stored_cols.fn(torch.arange(dw.KB), dw.KB)
    assert torch.equal(cols, k_perm(dw.KB)) and torch.equal(cols[1::2], cols[::2] + 1)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    perm = (torch.arange(k) // dw.KB) * dw.KB + cols.repeat(k // dw.KB)
    got = (x[:, perm].double() @ wb[:, perm].double().T) * torch.exp2(plan.refs.double() - 127)
    ref = fp8_linear_ref(x.double(), q, s, block)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-12


def test_fp8_plan_refuses_what_the_kernel_cannot_take() -> None:
    """No plan for a block row whose codes span SPREAD_FP8 + 1 binades (its smallest
    subnormal product would round in fp16: shown here), fp32 scales, K not a multiple of
    128, N not a multiple of 64; one at exactly SPREAD_FP8."""
    from kernels import moe_decode as md
    from kernels.linear import fp8_decode_plan
    from kernels.quant import dequantize_fp8_block

    n, k = 64, 256
    q = torch.ones(n, k).to(torch.float8_e4m3fn)
    q[0, 32] = 2.0**-9  # e4m3's smallest subnormal, in column block 1
    for span, planned in ((md.SPREAD_FP8, True), (md.SPREAD_FP8 + 1, False)):
        codes = torch.full((2, k // 32), 127, dtype=torch.uint8)
        codes[0, 1] = 127 - span
        s = codes.view(torch.float8_e8m0fnu)
        assert (fp8_decode_plan(q, s, (32, 32)) is not None) == planned
        refs, _ = md.fp8_refs(codes, 32, n)
        w16 = decode_gemm.rebased_fp8_weights(q, codes, refs, 32)
        exact = dequantize_fp8_block(q, s, (32, 32), torch.float64)
        same = torch.equal(w16.double(), exact * torch.exp2(127 - refs.double())[:, None])
        assert same == planned
    s = torch.full((2, k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert fp8_decode_plan(q, s, (32, 32)) is not None
    assert fp8_decode_plan(q, s.float(), (32, 32)) is None  # fp32 scales
    assert fp8_decode_plan(q[:, :224], s[:, :7], (32, 32)) is None  # K = 224
    assert fp8_decode_plan(q[:32], s[:1], (32, 32)) is None  # N = 32
    assert fp8_decode_plan(q, s[:, :5], (32, 48)) is None  # 48-column blocks
    assert fp8_decode_plan(q, s[:, :4], (32, 32)) is None  # a scale of another shape
    # largest code 2 (scales <= 2^-125): the fp32 row factor 2^(R - 123) would be subnormal
    tiny = torch.full((2, k // 32), 2, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert fp8_decode_plan(q, tiny, (32, 32)) is None
    assert fp8_decode_plan(q, (tiny.view(torch.uint8) + 1).view(torch.float8_e8m0fnu),
                           (32, 32)) is not None  # fmt: skip


def test_fp8_projection_plan_is_prepared_on_cuda_only() -> None:
    """``Fp8Linear.prepare`` makes no plan for CPU weights (the reference runs there)."""
    from app.model.layers import Fp8Linear, prepare_fp8_linears
    from kernels.linear import fp8_linear_ref

    q, s = _fp8_weight(64, 256, (32, 32), 4, seed=2)
    lin = Fp8Linear(q, s, (32, 32))
    assert prepare_fp8_linears(torch.nn.Sequential(lin)) == (0, []) and lin.plan is None
    x = torch.randn(2, 256)
    assert torch.equal(lin(x), fp8_linear_ref(x, q, s, (32, 32)))


def test_split_sum_in_the_kernel_needs_its_counters_and_shares_them() -> None:
    """The in-kernel split sum is refused without enough zeroed counters or with an output
    of another shape (before any launch), and ``split_counters`` hands out views of one kept
    zeroed buffer that grows when a launch needs more (launches in stream order share it:
    each tile's last CTA sets its counter back to zero). The kernels' sums themselves are
    checked bit for bit on the GPU (tests/gpu/test_dense_kernels.py)."""
    from kernels import moe_decode as md
    from kernels.dispatch import split_counters

    n, k, m, bt = 128, 256, 3, 8
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    words = torch.zeros(n // 32, k // 128, dtype=torch.int32)
    refs = torch.zeros(n, dtype=torch.int32)
    rows, tile_e = torch.arange(bt, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    part = torch.empty(2, bt, n)
    fin = torch.empty(bt, n, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="zeroed counters"):
        md.launch_dense(x, w, words, refs, rows, tile_e, part, m, 2, bt, 32, fin=fin)
    with pytest.raises(ValueError, match="zeroed counters"):  # one counter per row block
        md.launch_dense(x, w, words, refs, rows, tile_e, part, m, 2, bt, 32, fin=fin,
                        counters=torch.zeros(n // md.BR - 1, dtype=torch.int32))  # fmt: skip
    half, eight = fin[:, : n // 2], torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="fin"):
        md.launch_dense(x, w, words, refs, rows, tile_e, part, m, 2, bt, 32, fin=half,
                        counters=eight)  # fmt: skip
    dev = torch.device("cpu")
    a = split_counters(10, dev)
    assert a.dtype == torch.int32 and a.shape == (10,) and not bool(a.any())
    b = split_counters(5, dev)
    assert b.data_ptr() == a.data_ptr()  # the same kept buffer
    big = split_counters(1 << 15, dev)
    assert big.numel() == 1 << 15 and not bool(big.any())
    assert split_counters(3, dev).data_ptr() == big.data_ptr()  # the grown buffer from now on


@pytest.mark.parametrize("t,offset,bt", [(1, 0, 8), (3, 96, 8), (8, 0, 8), (10, 336, 16),
                                         (2, 200, 8), (16, 0, 32)])  # fmt: skip
def test_in_kernel_routing_lays_out_the_align_launchs_tiles(t: int, offset: int,
                                                            bt: int) -> None:  # fmt: skip
    """The two-launch decode layer's W13 lays out its tiles from the router's ids with
    counts per expert and running sums (``emulate_route``, the kernel's formulation): the same
    tile experts as the align launch (``kernels.moe_align._align``, interpreter), the same slots
    in each tile (there in atomic order, here in slot order), and an inverse map that
    points each local slot at its row; tokens of no local expert and repeated ids too."""
    from kernels.moe_align import _align
    from tests.support.decode_gemm import emulate_route

    g = torch.Generator().manual_seed(t * 1000 + offset)
    for trial in range(4):
        ids = torch.randperm(384, generator=g)[: t * 6].reshape(t, 6)
        ids[0, 0] = offset + 5  # at least one local slot
        if trial == 1:  # a few hot experts: several tiles of one expert when bt is small
            ids = offset + torch.randint(0, 3, (t, 6), generator=g)
        if trial == 2:  # nothing local
            ids = (ids % 48) + (offset + 48 if offset + 96 <= 384 else 0)
        rows, inv, tile_e = emulate_route(ids, offset, 48, bt)
        a_rows, a_inv, a_tile_e = _align(ids.int(), 48, offset, bt)
        assert torch.equal(tile_e, a_tile_e.cpu())
        for m in range(tile_e.numel()):
            seg = slice(m * bt, (m + 1) * bt)
            assert torch.equal(rows[seg], torch.sort(a_rows.cpu()[seg]).values)
        local = a_inv.cpu() >= 0
        assert torch.equal(inv >= 0, local)
        assert torch.equal(rows[inv[local].long()], torch.arange(t * 6)[local].int())
        if trial == 2:
            assert not bool(local.any()) and bool((tile_e == -1).all())
        else:
            assert bool(local.any())
