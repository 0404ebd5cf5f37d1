"""Triton indexer scores and top-k vs the torch references, under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import indexer as ix  # noqa: E402
from kernels.topk_grid import grid_topk  # noqa: E402

pytestmark = pytest.mark.skipif(
    not ix._INTERPRET and not torch.cuda.is_available(),
    reason="kernels were imported without TRITON_INTERPRET=1",
)


def _inputs(seed: int, T=5, H=3, D=24, C=50):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, D, generator=g), torch.randn(C, D, generator=g)
    w = torch.randn(T, H, generator=g)
    visible = torch.randint(0, C + 1, (T,), generator=g)
    visible[0], visible[-1] = 0, C
    return q, k, w, visible


@pytest.mark.parametrize(("H", "D"), [(3, 24), (8, 16)])
def test_scores_match_fp64_reference(H, D):
    q, k, w, visible = _inputs(H, H=H, D=D)
    out = torch.full((q.shape[0], k.shape[0]), float("nan"))
    ix.indexer_scores_triton(q, k, w, visible, out=out)
    ref = ix.indexer_scores_ref(q.double(), k.double(), w.double(), visible)
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    assert float((out.double() - ref)[fin].norm() / ref[fin].norm()) < 1e-5


def _hard_scores(seed: int, T: int, C: int) -> torch.Tensor:
    """Heavy ties (small integers), +-0, +inf (forced blocks), -inf (masked) tails."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (T, C), generator=g).float()
    s[0, 5] = float("inf")
    s[0, :3] = -0.0
    s[1 % T, C // 3 :] = float("-inf")
    s[-1] += torch.rand(C, generator=g)  # one row of distinct values
    return s


@pytest.mark.parametrize("k", [1, 5, 37, 299, 300, 512])
def test_topk_matches_reference_exactly(k):
    s = _hard_scores(k, 3, 300)
    kk = min(k, 300)
    out = torch.full((3, kk), -7, dtype=torch.int64)
    ix.topk_triton(s, k, out=out)
    assert torch.equal(out, ix.topk_ref(s, k))


def test_topk_chunked_passes(monkeypatch):
    """Shrink the chunk sizes so a 1000-wide row goes through two intermediate passes."""
    monkeypatch.setattr(ix, "_ONE_CHUNK", 32)
    monkeypatch.setattr(ix, "_CHUNK", 128)
    s = _hard_scores(9, 2, 1000)
    for k in (3, 8):
        assert torch.equal(ix.topk_triton(s, k), ix.topk_ref(s, k))


def test_indexer_topk_end_to_end():
    q, k, w, visible = _inputs(4, T=4, C=64)
    got = ix.indexer_topk_triton(q, k, w, visible, 10)
    want = ix.topk_ref(ix.indexer_scores_ref(q.double(), k.double(), w.double(), visible), 10)
    assert torch.equal(got, want)
    assert (got[0] == -1).all()  # visible 0: nothing to pick


def test_dispatch_uses_reference_on_cpu():
    q, k, w, visible = _inputs(5)
    assert torch.equal(ix.indexer_scores(q, k, w, visible), ix.indexer_scores_ref(q, k, w, visible))
    s = _hard_scores(5, 2, 40)
    assert torch.equal(ix.topk(s, 7), ix.topk_ref(s, 7))


@pytest.mark.parametrize("k", [1, 64, 300])
def test_topk_coarse_path_long_rows(k):
    """Rows longer than one program: coarse histogram + candidate list; row 1's heavy ties
    (3 values, ~6700 entries in the top bin > the 4096-entry list) take the chunked fallback."""
    g = torch.Generator().manual_seed(k)
    T, C = 4, 20000
    s = torch.randn(T, C, generator=g)
    s[1] = torch.randint(0, 3, (C,), generator=g).float()
    s[2, : C - 100] = float("-inf")  # fewer visible than some k
    s[3, 5::9] = float("inf")
    s[3, 1::7] = -0.0
    assert torch.equal(ix.topk_triton(s, k), ix.topk_ref(s, k))


def test_topk_coarse_one_octave():
    """Every score of a row in one binade (one top-byte bin): the second-byte histogram picks
    the threshold; the list stays near k and the result is exact -- positive keys, negative
    keys, and 340 equal scores inside the 16-bit prefix that holds the 300th (row 2: the
    ranks break those ties by the lower id)."""
    g = torch.Generator().manual_seed(7)
    u = 1.0 + torch.rand(3, 17000, generator=g)
    s = torch.stack((u[0], -u[1], u[2]))
    s[2, ::50] = 1.99
    for k in (1, 300):
        assert torch.equal(ix.topk_triton(s, k), ix.topk_ref(s, k)), k


def test_topk_coarse_ties_at_threshold():
    """Equal scores straddling the k-th place: the lower ids win, in list order or not."""
    C = 17000
    s = torch.full((1, C), -5.0)
    s[0, 3000:3010] = 2.0
    s[0, ::1000] = 1.5  # 17 entries tie for the last places
    got = ix.topk_triton(s, 15)
    assert torch.equal(got, ix.topk_ref(s, 15))
    # 2.0 at 3001..3009 (3000 was overwritten by 1.5), then the 6 lowest of 17 tied 1.5s
    assert got[0].tolist() == [0, 1000, 2000, 3000, *range(3001, 3010), 4000, 5000]


@pytest.mark.parametrize(("programs", "block"), [(None, 2048), (3, 256)])
def test_grid_topk_phases(programs, block):
    """The grid-synchronized select (kernels.topk_grid), its six phases launched one by one:
    spans of several tiles, a row of 3 values (ties across spans), one mostly -inf (fewer
    usable scores than k), +inf and -0. Ascending ids, lowest ids among ties, -1 tails."""
    g = torch.Generator().manual_seed(11)
    T, C = 4, 3000
    s = torch.randn(T, C, generator=g)
    s[1] = torch.randint(0, 3, (C,), generator=g).float()
    s[2, : C - 100] = float("-inf")
    s[3, 5::9] = float("inf")
    s[3, 1::7] = -0.0
    for k in (1, 300, C):
        out = torch.full((T, k), -7, dtype=torch.int64)
        grid_topk(s, k, out, fused=False, programs=programs, block=block)  # 2 / 3 programs
        assert torch.equal(out, ix.topk_ref(s, k)), k


def test_grid_topk_fused_one_program_per_row():
    """The fused launch (barriers included) with one program per row, as the interpreter can
    run it; an exact tie at the threshold shared by 1000 scores. Six launches in a row on
    the one persistent workspace (no memset between them: each launch zeroes the other
    histogram half and advances the epoch), alternating rows that run every level with a
    row shorter than k (found short at level 0, it ends at level 1), so a stale count or a
    skipped barrier would show (a barrier behind its target hangs)."""
    from kernels import topk_grid as tg

    s = torch.full((2, 3000), -1.0)
    s[0, ::3] = 0.5
    s[1, 7] = 2.0
    g = torch.Generator().manual_seed(5)
    r = torch.randn(2, 3000, generator=g)
    r[1, 100:] = float("-inf")  # 100 usable scores < k: a -1 tail
    grid_topk(s, 100, torch.empty(2, 100, dtype=torch.int64), fused=True, programs=1, block=1024)
    bars = tg._PERSISTENT[torch.device("cpu"), 1][1]
    epoch = bars[:, 4].clone()
    for i in range(5):
        x = s if i % 2 == 0 else r
        out = torch.full((2, 100 if i % 2 == 0 else 150), -7, dtype=torch.int64)
        grid_topk(x, out.shape[1], out, fused=True, programs=1, block=1024)
        assert torch.equal(out, ix.topk_ref(x, out.shape[1])), i
    assert tg._PERSISTENT[torch.device("cpu"), 1][1] is bars  # the same workspace, reused
    assert bars[:, 4].tolist() == (epoch + 5).tolist()  # one epoch per launch
    grid_topk(s, 100, out := torch.empty(2, 100, dtype=torch.int64), fused=True, programs=1,
              block=1024)  # fmt: skip
    assert out[0].tolist() == list(range(0, 300, 3)) and out[1, :2].tolist() == [0, 1]
