"""The decode MoE kernel's scheme (kernels.moe_decode), checked on the CPU: the K permutation
of its fragments and the fp16 scale re-basing. The Gluon kernel itself runs only on a GPU
(tests/gpu/test_moe_kernels.py checks it against the torch reference there)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_decode import HEAD, SPREAD, k_perm, rebased_weights, row_refs
from kernels.moe_decode import emulate as decode_emulate
from kernels.quant import fp4_decode


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
