"""Dense fp8 projections at decode sizes (CUDA only): the Gluon kernels that planned
``Fp8Linear`` projections take -- the mma.sync decode kernel (``kernels.moe_decode``, FP8)
up to 64 rows and the wgmma kernel (``kernels.dense_wgmma``, sm_90) from 17 to 256 rows --
against the fp64 torch reference and the previous path (the MegaMoE GEMM, ``tl``).

Shapes are V4.1-Flash's dense projections (``bench/decode_plumbing.py``'s DENSE), which
cover one K split with a bf16 store and several with the fp32 partials' sum.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.gpu_mem(4)]  # fmt: skip

SHAPES = ((1280, 5120), (32768, 1280), (512, 5120), (5120, 8192), (4608, 5120), (5120, 2304))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _weight(n: int, k: int, block: tuple[int, int], seed: int):
    """e4m3 + e8m0 weights whose blocks span 12 binades (as trained weights' scales do)."""
    from kernels.quant import quantize_fp8_block

    g = torch.Generator(device="cuda").manual_seed(seed)
    nb, kb = -(-n // block[0]), -(-k // block[1])
    mag = torch.exp2(torch.randint(-6, 7, (nb, kb), device="cuda", generator=g).float())
    mag = mag.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return quantize_fp8_block(torch.randn(n, k, device="cuda", generator=g) * mag / k**0.5, block)


def _cases(m: int, dtype: torch.dtype, block, seed: int):
    """Each V4.1-Flash dense shape: (n, k, e4m3 weight, scale, plan, x [m, k], the fp64
    reference)."""
    from kernels.linear import fp8_decode_plan, fp8_linear_ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    for i, (n, k) in enumerate(SHAPES):
        q, s = _weight(n, k, block, seed=i)
        plan = fp8_decode_plan(q, s, block)
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        yield n, k, q, s, plan, x, fp8_linear_ref(x.double(), q, s, block)


def _through(kernel: str, x, q, s, block, plan) -> torch.Tensor:
    """``fp8_linear``'s product ``x`` [M, K] @ W^T through one of its kernels: "gluon" (the
    mma.sync decode kernel), "wgmma" or "tl" (the one-group MegaMoE GEMM)."""
    from kernels import linear

    m, k = x.shape
    if kernel == "tl":
        return linear._fp8_grouped(x, q, s, block)
    run = linear._fp8_decode if kernel == "gluon" else linear._fp8_wgmma
    return run(x, q, plan, m, q.shape[0], k)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 32, 40, 64])
def test_fp8_decode_kernel(m: int, dtype: torch.dtype, block) -> None:
    """Every V4.1-Flash dense shape at 1-64 rows (8-, 16-, 32- and 64-row token tiles, pad rows,
    one and several K splits): the fp64 reference to one rounding of the output, and the
    tl path; the dispatch's output is the run of the kernel it takes, bit for bit."""
    from kernels.linear import WG_MIN_TOKENS
    from kernels.linear import fp8_linear_triton as fp8_linear

    wg = torch.cuda.get_device_capability() == (9, 0) and m >= WG_MIN_TOKENS
    for n, k, q, s, plan, x, ref in _cases(m, dtype, block, seed=m):
        assert plan is not None
        out = _through("gluon", x, q, s, block, plan)
        old = _through("tl", x, q, s, block, plan)
        picked = _through("wgmma" if wg else "gluon", x, q, s, block, plan)  # what auto takes
        assert out.dtype == dtype and out.shape == (m, n)
        assert _rel(out, ref) < 4e-3, (n, k)  # bf16: 2^-9 per value
        assert _rel(out, old) < 4e-3, (n, k)
        assert _rel(out, ref) <= 1.5 * _rel(old, ref) + 1e-4, (n, k)
        assert torch.equal(fp8_linear(x, q, s, block, plan), picked)


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the wgmma kernel needs sm_90")


@needs_sm90
@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [17, 33, 64, 100, 129, 256])
def test_fp8_wgmma_kernel(m: int, dtype: torch.dtype, block) -> None:
    """The wgmma kernel at every V4.1-Flash dense shape (32-128-token tiles, pad rows, two
    token tiles at 129 and 256 rows, one and several K splits): the fp64 reference to one
    rounding of the output and the tl path; the dispatch takes it (bit for bit the direct
    run) from WG_MIN_TOKENS rows."""
    from kernels.linear import WG_MIN_TOKENS
    from kernels.linear import fp8_linear_triton as fp8_linear

    for n, k, q, s, plan, x, ref in _cases(m, dtype, block, seed=100 + m):
        out = _through("wgmma", x, q, s, block, plan)
        old = _through("tl", x, q, s, block, plan)
        assert out.dtype == dtype and out.shape == (m, n)
        rows = (out.double() - ref).norm(dim=1) / ref.norm(dim=1)  # every row written
        assert bool((rows < 4e-3).all()), (n, k, rows.max())
        assert _rel(out, old) < 4e-3, (n, k)
        assert _rel(out, ref) <= 1.5 * _rel(old, ref) + 1e-4, (n, k)
        if m >= WG_MIN_TOKENS:
            assert torch.equal(fp8_linear(x, q, s, block, plan), out)


@needs_sm90
def test_fp8_wgmma_kernel_edges() -> None:
    """Launch choices the defaults do not take (2-8 ring slots, one warpgroup, splits that
    leave later splits empty, 128-token tiles for 40 rows, three 16-row tiles) against the
    reference; N = 192 (whole 64-row tiles only) at 40 rows, and 257 rows (past the kernel:
    the tl path)."""
    from kernels.linear import _fp8_wgmma, fp8_decode_plan, fp8_linear_ref
    from kernels.linear import fp8_linear_triton as fp8_linear

    q, s = _weight(1280, 5120, (32, 32), seed=11)
    plan = fp8_decode_plan(q, s, (32, 32))
    x = torch.randn(40, 5120, device="cuda").bfloat16()
    ref = fp8_linear_ref(x.double(), q, s, (32, 32))
    for bt, split, stages, warps in ((64, 1, 3, 8), (64, 7, 4, 4), (128, 3, 4, 8),
                                     (64, 39, 3, 8), (32, 2, 4, 4), (64, 5, 2, 8),
                                     (64, 3, 6, 8), (16, 4, 8, 8)):  # fmt: skip
        out = _fp8_wgmma(x, q, plan, 40, 1280, 5120, bt, split, stages, warps)
        assert _rel(out, ref) < 4e-3, (bt, split, stages, warps)
    big = torch.randn(257, 5120, device="cuda").bfloat16()
    # N = 192: whole 64-row tiles (one warpgroup, up to 64 tokens), not 128-row ones (two
    # warpgroups at 128-token tiles); the dispatch takes the wgmma kernel at 40 rows
    q2, s2 = _weight(64 * 3, 5120, (32, 32), seed=12)
    plan2 = fp8_decode_plan(q2, s2, (32, 32))
    assert _rel(fp8_linear(x, q2, s2, (32, 32), plan2),
                fp8_linear_ref(x.double(), q2, s2, (32, 32))) < 4e-3  # fmt: skip
    assert _rel(fp8_linear(big, q, s, (32, 32), plan), fp8_linear_ref(big.double(), q, s,
                                                                        (32, 32))) < 4e-3


def test_fp8_decode_kernel_writes_every_row_and_stays_out_of_prefill() -> None:
    """Output rows are all written (the buffer is fresh each call, so a missed row would be
    garbage: every row matches the reference), and 257 rows take the tl path."""
    from kernels.linear import fp8_decode_plan, fp8_linear_ref
    from kernels.linear import fp8_linear_triton as fp8_linear

    q, s = _weight(1280, 5120, (32, 32), seed=7)
    plan = fp8_decode_plan(q, s, (32, 32))
    for m in (3, 64):
        x = torch.randn(m, 5120, device="cuda").bfloat16()
        out = fp8_linear(x, q, s, (32, 32), plan).double()
        ref = fp8_linear_ref(x.double(), q, s, (32, 32))
        err = (out - ref).norm(dim=1) / ref.norm(dim=1)
        assert bool((err < 4e-3).all()), err
    x = torch.randn(257, 5120, device="cuda").bfloat16()
    assert _rel(fp8_linear(x, q, s, (32, 32), plan), fp8_linear_ref(x.double(), q, s,
                                                                      (32, 32))) < 4e-3


@pytest.mark.parametrize("kernel,m", [("gluon", 8), pytest.param("wgmma", 48, marks=needs_sm90)])
def test_fp8_projection_takes_its_plan_in_a_cuda_graph(kernel: str, m: int) -> None:
    """``Fp8Linear`` prepared on CUDA (``prepare_fp8_linears``) runs each decode kernel inside
    a captured CUDA graph (the dispatch takes the mma.sync kernel at 8 rows, the wgmma kernel
    at 48 on sm_90) and replays it on new inputs; preparing again keeps the plan the graph
    reads; making a plan inside a capture is an error."""
    from app.model.layers import Fp8Linear, prepare_fp8_linears
    from kernels.linear import fp8_linear_ref

    q, s = _weight(4608, 5120, (32, 32), seed=9)
    lin = Fp8Linear(q, s, (32, 32))
    assert prepare_fp8_linears(torch.nn.Sequential(lin)) == (1, [])
    plan = lin.plan
    x = torch.randn(m, 5120, device="cuda").bfloat16()
    lin(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lin(x)
    x.copy_(torch.randn(m, 5120, device="cuda").bfloat16())
    graph.replay()
    assert _rel(y, fp8_linear_ref(x.double(), q, s, (32, 32))) < 4e-3
    assert lin.prepare() and lin.plan is plan
    fresh = Fp8Linear(q, s, (32, 32))
    with torch.cuda.graph(torch.cuda.CUDAGraph()), pytest.raises(RuntimeError, match="prepare"):
        fresh.prepare()


def test_split_sum_in_the_kernel_equals_the_second_launch() -> None:
    """The mma.sync kernel's K splits summed by each tile's last CTA (``_fp8_decode``) equal,
    bit for bit, the same kernel's partials summed by ``_split_sum_cast``, at 2-40 splits,
    token tiles with pad rows; replayed in a CUDA graph with new inputs each time (the
    counters must be back at zero after every launch, or a later launch would sum too early
    or never); the counters are all zero afterwards."""
    from kernels import moe_decode as md
    from kernels.dispatch import _COUNTERS
    from kernels.linear import _fp8_decode, _one_group_rows, _sum_splits, fp8_decode_plan

    def two_launches(x, q, plan, m, n, k, bt, split):
        tiles = -(-m // bt)
        rows, tile_e = _one_group_rows(tiles * bt, tiles, x.device)
        y = torch.empty(split, tiles * bt, n, device=x.device, dtype=torch.float32)
        md.launch_dense(x, q, plan.words, plan.refs, rows, tile_e, y, m, split, bt, plan.b0,
                        md.pick_stages(bt, tiles))  # fmt: skip
        return _sum_splits(y, m, n, x.dtype)

    cases = ((1, 8, 2), (5, 8, 40), (16, 16, 3), (40, 32, 7))
    for n, k in ((1280, 5120), (512, 5120), (5120, 2304)):
        q, s = _weight(n, k, (32, 32), seed=n + k)
        plan = fp8_decode_plan(q, s, (32, 32))
        for m, bt, split in cases:
            split = min(split, k // md.KB)
            x = torch.randn(m, k, device="cuda").bfloat16()
            two = two_launches(x, q, plan, m, n, k, bt, split)
            one = _fp8_decode(x, q, plan, m, n, k, bt, split)
            assert one.shape == (m, n) and torch.equal(one, two), (n, k, m, bt, split)
            static = x.clone()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = _fp8_decode(static, q, plan, m, n, k, bt, split)
            for _ in range(3):
                static.copy_(torch.randn(m, k, device="cuda").bfloat16())
                g.replay()
                want = two_launches(static, q, plan, m, n, k, bt, split)
                assert torch.equal(out, want), (n, k, m, bt, split)
    torch.cuda.synchronize()
    assert all(int(c.abs().sum()) == 0 for kept in _COUNTERS.values() for c in kept)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_linear_decode_kernel(m: int, dtype: torch.dtype) -> None:
    """The plain (bf16 / fp16) projections' decode kernel at V4.1-Flash's shapes: every output
    within one ulp of the exact product plus the fp32 sums' rounding (2^-16 of the sum of
    |products|: outputs that cancel to ~0 carry it), as close as cuBLAS, and the nn.Linear
    dispatch takes it."""
    from kernels.linear import dense_linear, dense_linear_ref, dense_linear_triton

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
        w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
        exact = x.double() @ w.double().T
        out = dense_linear_triton(x, w)
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        slack = exact.abs() * ulp + (x.double().abs() @ w.double().abs().T) * 2.0**-16
        err = ((out.double() - exact).abs() / slack).max().item()
        assert err <= 1.0, (n, k, err)
        ref = dense_linear_ref(x, w)
        assert _rel(out, exact) <= 1.5 * _rel(ref, exact) + 1e-6, (n, k)
        assert torch.equal(dense_linear(x, w), out)


def test_dense_linear_decode_kernel_in_a_cuda_graph() -> None:
    """Captured once, replayed with new activations: each replay equals an eager launch bit
    for bit (the split counters are back at zero after every launch)."""
    from kernels.linear import dense_linear_triton

    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(512, 5120, device="cuda", generator=g) / 72).bfloat16()  # many K splits
    x = torch.randn(2, 5120, device="cuda", generator=g).bfloat16()
    dense_linear_triton(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = dense_linear_triton(x, w)
    for _ in range(3):
        x.copy_(torch.randn(2, 5120, device="cuda", generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, dense_linear_triton(x, w))
