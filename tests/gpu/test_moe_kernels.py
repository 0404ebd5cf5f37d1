"""MegaGate / MegaMoE / Mega-mHC / Engram Triton kernels at V4.1-Flash shapes (CUDA only).

d=5120, I=2304, 48 local experts, top-6, n=4; tolerances ||out - ref|| / ||ref||: 1e-2 for
bf16 activations, 1e-4 for fp32 paths (tf32x3 mixing).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

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
    from kernels.moe import moe_fp8_ref, moe_fp8_triton

    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, w = _routing(t)
    out = moe_fp8_triton(x, ids, w, *fp8_experts, (32, 32), 10.0)
    ref = moe_fp8_ref(x.float(), ids, w, *fp8_experts, (32, 32), 10.0)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("t", [1, 8, 64])
def test_moe_fp4(fp4_experts: tuple[torch.Tensor, ...], t: int) -> None:
    from kernels.moe import moe_fp4_ref, moe_fp4_triton

    x = torch.randn(t, D, device="cuda").bfloat16()
    ids, w = _routing(t, first_local=96)  # this rank holds global experts 96..143
    out = moe_fp4_triton(x, ids, w, *fp4_experts, 10.0, 96)
    ref = moe_fp4_ref(x.float(), ids, w, *fp4_experts, 10.0, 96)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_gate(t: int) -> None:
    from kernels.gate import moe_gate_ref, moe_gate_triton

    x = torch.randn(t, D, device="cuda").bfloat16()
    w = (torch.randn(E_ALL, D, device="cuda") / D**0.5).bfloat16()
    bias = 0.1 * torch.randn(E_ALL, device="cuda")
    ids, wts = moe_gate_triton(x, w, bias, TOPK, 2.5)
    ref_ids, ref_w = moe_gate_ref(x.float() @ w.float().t(), bias, TOPK, 2.5)
    assert (ids == ref_ids).float().mean() > 0.999  # near-ties may flip with summation order
    assert _rel(wts, ref_w) < 1e-3


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_mhc(t: int) -> None:
    from kernels import mhc

    x = torch.randn(t, N, D, device="cuda").bfloat16()
    fn = torch.randn(N * (N + 2), N * D, device="cuda") / (N * D) ** 0.5
    base, scale = 0.5 * torch.randn(24, device="cuda"), 1 + 0.2 * torch.randn(3, device="cuda")
    nw = 1 + 0.1 * torch.randn(D, device="cuda")
    eps = (20, 1e-6, 1e-6, 1e-6)
    out = torch.randn(t, D, device="cuda").bfloat16()
    pre_in = torch.rand(t, N, device="cuda")
    res = mhc.hc_post_pre_triton(out, x, *mhc.hc_mix_ref(x, fn, base, scale, *eps[:3])[1:],
                                 fn, base, scale, nw, *eps, pre_in)  # fmt: skip
    ref = mhc.hc_post_pre_ref(out, x, *mhc.hc_mix_ref(x, fn, base, scale, *eps[:3])[1:],
                              fn, base, scale, nw, *eps, pre_in)  # fmt: skip
    assert _rel(res[0], ref[0]) < 1e-2 and _rel(res[1], ref[1]) < 1e-2
    for o, r in zip(res[2:], ref[2:], strict=True):
        assert _rel(o, r) < 1e-4
    pre_out = mhc.hc_pre_triton(x, fn, base, scale, nw, *eps)
    pre_ref = mhc.hc_pre_ref(x, fn, base, scale, nw, *eps)
    assert _rel(pre_out[0], pre_ref[0]) < 1e-2 and _rel(pre_out[2], pre_ref[2]) < 1e-4


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
