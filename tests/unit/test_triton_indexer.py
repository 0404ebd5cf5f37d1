"""Triton indexer scores and top-k vs the torch references, under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import indexer as ix  # noqa: E402
from kernels import topk as tk  # noqa: E402
from kernels.indexer_token import FIXED_LAUNCH, FIXED_TILES, splits, t_class  # noqa: E402
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
    tk.topk_triton(s, k, out=out)
    assert torch.equal(out, tk.topk_ref(s, k))


def test_topk_chunked_passes(monkeypatch):
    """Shrink the chunk sizes so a 1000-wide row goes through two intermediate passes."""
    monkeypatch.setattr(tk, "_ONE_CHUNK", 32)
    monkeypatch.setattr(tk, "_CHUNK", 128)
    s = _hard_scores(9, 2, 1000)
    for k in (3, 8):
        assert torch.equal(tk.topk_triton(s, k), tk.topk_ref(s, k))


def test_indexer_topk_end_to_end():
    q, k, w, visible = _inputs(4, T=4, C=64)
    got = ix.indexer_topk_triton(q, k, w, visible, 10)
    want = tk.topk_ref(ix.indexer_scores_ref(q.double(), k.double(), w.double(), visible), 10)
    assert torch.equal(got, want)
    assert (got[0] == -1).all()  # visible 0: nothing to pick


def test_dispatch_uses_reference_on_cpu():
    q, k, w, visible = _inputs(5)
    assert torch.equal(ix.indexer_scores(q, k, w, visible), ix.indexer_scores_ref(q, k, w, visible))
    s = _hard_scores(5, 2, 40)
    assert torch.equal(tk.topk(s, 7), tk.topk_ref(s, 7))


@pytest.mark.parametrize("k", [1, 64, 300])
def test_topk_coarse_path_long_rows(k):
    """Rows longer than one program: coarse histogram + candidate list; row 1's heavy ties
    (3 values, ~6700 entries in the top bin > the 4096-entry list) take the chunked fallback."""
    g = torch.Generator().manual_seed(k)
    T, C = 4, 20000
    s = torch.randn(T, C, generator=g)
    s[1] = torch.randint(0, 3, (C,), generator=g).float()
    s[2, : C - 100] = float("-inf")  # fewer visible than some k
    # 409 +infs (none under a -0): tau is +inf for every k, its ties ranked by id in a list of
    # 4 rank programs (one in 9, 1905 +infs, cost ~4 s of all-pairs ranks per k interpreted)
    s[3, 5::49] = float("inf")
    s[3, 1::7] = -0.0
    assert torch.equal(tk.topk_triton(s, k), tk.topk_ref(s, k))


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
        assert torch.equal(tk.topk_triton(s, k), tk.topk_ref(s, k)), k


def test_topk_coarse_ties_at_threshold():
    """Equal scores straddling the k-th place: the lower ids win, in list order or not."""
    C = 17000
    s = torch.full((1, C), -5.0)
    s[0, 3000:3010] = 2.0
    s[0, ::1000] = 1.5  # 17 entries tie for the last places
    got = tk.topk_triton(s, 15)
    assert torch.equal(got, tk.topk_ref(s, 15))
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
        assert torch.equal(out, tk.topk_ref(s, k)), k


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
        assert torch.equal(out, tk.topk_ref(x, out.shape[1])), i
    assert tg._PERSISTENT[torch.device("cpu"), 1][1] is bars  # the same workspace, reused
    assert bars[:, 4].tolist() == (epoch + 5).tolist()  # one epoch per launch
    grid_topk(s, 100, out := torch.empty(2, 100, dtype=torch.int64), fused=True, programs=1,
              block=1024)  # fmt: skip
    assert out[0].tolist() == list(range(0, 300, 3)) and out[1, :2].tolist() == [0, 1]


def _bucket_rows(C: int = 3000) -> torch.Tensor:
    """Two rows whose top 200 scores share one 16-bit prefix (4 + r * 2^-15, r = 0..19, ten
    ties per value, at scattered ids, and at ids 1024 and 2048, where spans start) over -1
    elsewhere; row 1 adds 300 scores of 2.5, in the same level-0 bin but below the cluster.
    With k = 105 the cut falls inside the ties of r = 9: byte 2 of the cluster is r // 4
    (about 40 keys per bin), byte 3 tells the r apart."""
    g = torch.Generator().manual_seed(3)
    s = torch.full((2, C), -1.0)
    r = (torch.arange(200) % 20).float()
    for row in range(2):
        ids = torch.randperm(C, generator=g)
        s[row, ids[:200]] = 4.0 + r * 2**-15
        if row == 1:
            s[row, ids[200:500]] = 2.5
        s[row, 1024] = 4.0 + 9 * 2**-15  # a tie at tau and a key above it, each the first
        s[row, 2048] = 4.0 + 19 * 2**-15  # id of a span (1024-score tiles)
    return s


@pytest.mark.parametrize(
    ("cap", "sub", "ends"),
    [
        (8192, 256, 5),  # level 1 buckets the 200 (row 1: of 500 in the bin); picks there
        (8192, 64, 6),  # 200 > 64 slots: level 2 buckets again, its bin of 40 picks
        (300, 64, 6),  # row 1's 500 > cap: level 1 counts only, level 2 buckets the 200
        (100, 64, 3),  # never few enough to bucket: all four levels
        (8192, 16, 3),  # buckets overflow at levels 1 and 2: level 3 ends it
    ],
)
@pytest.mark.parametrize(("fused", "programs", "block"), [(False, 3, 1024), (True, 1, 4096)])
def test_grid_topk_buckets(cap, sub, ends, fused, programs, block):
    """The bucket ends (kernels.topk_grid): a level buckets the keys of tau's bin by their byte
    when the bin holds at most ``cap``; the select ends at the next barrier when tau's bucket
    holds at most ``sub`` (its entries ranked in full, ties by id), else it goes on as a
    radix level. ``ends`` says where it ended (level, +4 at a bucket); the ids are exact
    every way, cut inside a run of ties, with the spans (3 programs) splitting the ties."""
    s = _bucket_rows()
    for k in (105, 100, 1):
        out = torch.full((2, k), -7, dtype=torch.int64)
        where = torch.full((2,), -1, dtype=torch.int32)
        grid_topk(s, k, out, fused=fused, programs=programs, block=block, cap=cap, sub=sub,
                  ends=where)  # fmt: skip
        assert torch.equal(out, tk.topk_ref(s, k)), k
        if k == 105:
            assert where.tolist() == [ends, ends]
    above = (s[0] >= 4.0 + 10 * 2**-15).nonzero().flatten()
    nine = (s[0] == 4.0 + 9 * 2**-15).nonzero().flatten()  # the ties at tau, 1024 among them
    assert len(above) < 105 < len(above) + len(nine) and 1024 in nine and 2048 in above
    want = torch.cat((above, nine[: 105 - len(above)])).sort().values
    assert torch.equal(tk.topk_ref(s, 105)[0], want)


def test_grid_topk_massive_ties_fall_back():
    """~1000 equal scores at tau: few enough to bucket (cap), too many for one bucket (sub), at
    levels 1 and 2, so the select runs all four levels and cuts the ties by id; the same with
    no bucketing at all (cap 1) and with 16-slot buckets."""
    g = torch.Generator().manual_seed(2)
    s = torch.randint(0, 3, (1, 3000), generator=g).float()
    for k, cap, sub, ends in ((300, 8192, 256, 3), (300, 1, 256, 3), (7, 8192, 16, 3)):
        out = torch.full((1, k), -7, dtype=torch.int64)
        where = torch.full((1,), -1, dtype=torch.int32)
        grid_topk(s, k, out, fused=False, programs=3, block=1024, cap=cap, sub=sub, ends=where)
        assert torch.equal(out, tk.topk_ref(s, k)), (k, cap, sub)
        assert where.tolist() == [ends], (k, cap, sub)


@pytest.mark.parametrize("fused", [False, True])
def test_grid_topk_bucket_overflow_beside_tau(fused):
    """The bucket just below tau's overflows: 1000 scores of 3.99 (byte 1 = 127) beside the 30
    of 4 + t * 2^-15 (byte 1 = 128) that hold the top 20. Its extra keys must not land in
    tau's bucket (they would, past its 256 slots, without the room check); tau's bucket of 30
    ends the select at level 1."""
    g = torch.Generator().manual_seed(4)
    s = torch.full((1, 3000), -1.0)
    ids = torch.randperm(3000, generator=g)
    s[0, ids[:30]] = 4.0 + torch.arange(30).float() * 2**-15
    s[0, ids[30:1030]] = 3.99
    out = torch.full((1, 20), -7, dtype=torch.int64)
    where = torch.full((1,), -1, dtype=torch.int32)
    grid_topk(s, 20, out, fused=fused, programs=1 if fused else 3, block=4096 if fused else 1024,
              sub=256, ends=where)  # fmt: skip
    assert torch.equal(out, tk.topk_ref(s, 20))
    assert where.tolist() == [5]


def test_grid_topk_random_rows_caps():
    """Random rows (normal, 5 values, a narrow cluster, mostly -inf, +inf and -0 sprinkled)
    under random k, cap and slots, as phase launches over 3 spans: every end (exact bin,
    short row, a bucket at level 1 or 2, all four levels) must give the reference's ids.
    Seed 21 takes them all in its first two draws (ends 1 for the randn row's exact bin and
    for the short row, 5 and 6 by the 5-value row and the cluster; 3 next), four draws here."""
    g = torch.Generator().manual_seed(21)
    C = 700
    seen = set()
    for it in range(4):
        s = torch.randn(4, C, generator=g)
        s[1] = torch.randint(0, 5, (C,), generator=g).float()
        s[2] = 3.0 + torch.randint(0, 64, (C,), generator=g).float() * 2**-16
        s[3, torch.rand(C, generator=g) < 0.9] = float("-inf")
        s[0, torch.randint(0, C, (3,), generator=g)] = float("inf")
        s[0, torch.randint(0, C, (3,), generator=g)] = -0.0
        k = int(torch.randint(1, C + 1, (1,), generator=g))
        cap = int(torch.randint(1, 2 * C, (1,), generator=g))
        sub = 2 ** int(torch.randint(4, 9, (1,), generator=g))
        out = torch.full((4, k), -7, dtype=torch.int64)
        where = torch.full((4,), -1, dtype=torch.int32)
        grid_topk(s, k, out, fused=False, programs=3, block=256, cap=cap, sub=sub, ends=where)
        assert torch.equal(out, tk.topk_ref(s, k)), (it, k, cap, sub, where.tolist())
        seen.update(where.tolist())
    assert {1, 3, 5, 6} <= seen  # both bucket ends, an early radix end and all four levels


def test_grid_topk_256k_rows_end_where_the_gpu_test_expects():
    """The ends the GPU test test_grid_topk_fused checks at 256K: a randn row ends at level 1, at
    its bucket (5) or its exact 16-bit bin (1: seed 5's k = 512 here); the row of 50 values
    (~5000 ties at tau: too many for a bucket) runs all four levels (3). That test's row 0 at
    T = 1 is the 50-value row (``s[1 % T]``), so 3 is its right end there, not 5. The ends
    come from the rows' histograms, not the tiling: 4 spans of 4 16K-score tiles here (the
    interpreter's cost grows with programs x tiles; 32 spans of 2048-score tiles ended the
    same), the GPU's one tile a program there."""
    C = 262144
    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, C, generator=g)
    s[1] = torch.randint(0, 50, (C,), generator=g).float()
    for k, randn_end in ((512, 1), (2048, 5)):
        out = torch.full((2, k), -7, dtype=torch.int64)
        where = torch.full((2,), -1, dtype=torch.int32)
        grid_topk(s, k, out, fused=False, programs=4, block=16384, ends=where)
        assert torch.equal(out, tk.topk_ref(s, k)), k
        assert where.tolist() == [randn_end, 3], (k, where.tolist())


@pytest.mark.parametrize("ratio,P", [(2, 64), (1, 64), (4, 256), (128, 256)])
@pytest.mark.parametrize("edtype", [torch.int64, torch.int32])
def test_entry_rows_one_launch_equals_reference(ratio, P, edtype):
    """Pool rows of selected entries (the top-k's ids, -1 padded) through each token's block
    table row, in one launch: equal to the reference's arithmetic, with -1s kept, ids past
    the table clamped to its last block, per-token sequences and a strided id tensor."""
    g = torch.Generator().manual_seed(ratio + P)
    T, B, nb, k = 7, 3, 5, 37
    table = torch.randperm(40, generator=g)[: B * nb].view(B, nb)
    seq = torch.randint(0, B, (T,), generator=g)
    cap = nb * P // ratio + 6  # some ids past the table
    ids = torch.randint(-1, cap, (T, 2 * k), generator=g).to(edtype)[:, ::2]
    assert not ids.is_contiguous()
    ids[0, :5] = -1
    want = ix.entry_rows_ref(ids, seq, table, ratio, P)
    got = ix.entry_rows_triton(ids, seq, table, ratio, P)
    assert got.dtype == want.dtype == torch.int64
    assert torch.equal(got, want)
    assert (got[0, :5] == -1).all() and (got[ids >= 0] >= 0).all()
    assert ix.entry_rows_triton(ids[:0], seq[:0], table, ratio, P).shape == (0, k)


def test_paged_scores_take_the_step_token_blocks():
    """The scores kernel with the step's precomputed token blocks (scores_token_blocks) equals
    the kernel making its own; blocks made for another head count are an error, not a wrong
    tiling."""
    g = torch.Generator().manual_seed(5)
    P, r, B, n, C, H, D = 16, 2, 2, 3, 32, 4, 32
    nb = C * r // P
    T = B * n
    table = torch.randperm(B * nb + 2, generator=g)[: B * nb].view(B, nb)
    keys = torch.randn((B * nb + 2) * (P // r), D, generator=g)
    q, w = torch.randn(T, H, D, generator=g), torch.randn(T, H, generator=g)
    seq = torch.arange(B).repeat_interleave(n)
    start = torch.arange(B) * n
    vis = torch.randint(1, C + 1, (T,), generator=g)
    own = ix.indexer_scores_paged_triton(q, keys, None, w, vis, seq, table, r, P, C,
                                         seq_start=start)  # fmt: skip
    blocks = ix.scores_token_blocks(seq, start, H)
    given = ix.indexer_scores_paged_triton(q, keys, None, w, vis, seq, table, r, P, C,
                                           seq_start=start, blocks=blocks)  # fmt: skip
    assert torch.equal(own, given)
    ref = ix.indexer_scores_paged_ref(q, keys, None, w, vis, seq, table, r, P, C, blocks=blocks)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(given))
    assert ((given[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item() < 1e-5
    other = ix.scores_token_blocks(seq, start, 64)  # 64 heads: one token per block
    assert other.block_t != blocks.block_t
    with pytest.raises(ValueError, match="token blocks of"):
        ix.indexer_scores_paged_triton(q, keys, None, w, vis, seq, table, r, P, C,
                                       seq_start=start, blocks=other)  # fmt: skip


def _decode_case(seed: int, B: int, ratio: int, mx: bool, P=16, nb=4, H=5, D=64):
    """B sequences of one token each over shuffled, non-contiguous blocks of one pool; mxfp4
    keys as random bytes (every code, -0 included) with scales 2^-17 .. 2^12, or floats."""
    g = torch.Generator().manual_seed(seed)
    n = (B * nb + 3) * (P // ratio)
    table = torch.randperm(B * nb + 3, generator=g)[: B * nb].view(B, nb)
    if mx:
        keys = torch.randint(0, 256, (n, D // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(110, 140, (n, D // 32), generator=g, dtype=torch.uint8)
    else:
        keys, scale = torch.randn(n, D, generator=g), None
    q, w = torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g)
    return q, keys, scale, w, table, nb * P // ratio


def _close_to_ref(out, q, keys, scale, w, vis, seq, table, ratio, P, C):
    ref = ix.indexer_scores_paged_ref(q.double(), keys if scale is not None else keys.double(),
                                      scale, w.double(), vis, seq, table, ratio, P, C)  # fmt: skip
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)) and bool((out[~fin] == float("-inf")).all())
    assert float((out.double() - ref)[fin].norm() / ref[fin].norm()) < 1e-6


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize(("B", "ratio"), [(1, 1), (4, 2)])
def test_decode_steps_take_the_token_kernel(monkeypatch, mx, B, ratio):
    """A decode step (one token per sequence) goes to the token kernel, whose scores equal the
    reference's: ragged visible counts (none, a block edge, mid-block, all), B = 1 and B > 1,
    chunk programs wholly past the visible ones; a fixed launch (the deterministic mode's
    split, by the key count) gives the same bits as the free one."""
    P = 16
    q, keys, scale, w, table, C = _decode_case(B + ratio, B, ratio, mx, P=P)
    vis = torch.tensor([C - 5, 0, P // ratio, C][:B]) if B > 1 else torch.tensor([C // 2 + 3])
    seq = torch.arange(B)
    calls = []

    def spy(*a, **kw):
        calls.append(a[0].shape[0])
        return token_scores(*a, **kw)

    token_scores = ix.token_scores
    monkeypatch.setattr(ix, "token_scores", spy)
    out = torch.full((B, C), float("nan"))
    ix.indexer_scores_paged_triton(q, keys, scale, w, vis, seq, table, ratio, P, C,
                                   seq_start=seq, out=out)  # fmt: skip
    assert calls == [B]
    _close_to_ref(out, q, keys, scale, w, vis, seq, table, ratio, P, C)
    fixed = ix.indexer_scores_paged_triton(q, keys, scale, w, vis, seq, table, ratio, P, C,
                                           seq_start=seq, launch=FIXED_LAUNCH)  # fmt: skip
    assert torch.equal(out, fixed)
    n_tiles = C // FIXED_LAUNCH["BLOCK_C"]
    assert splits(B, n_tiles, 1, fixed=False) > splits(B, n_tiles, 1, fixed=True)


def test_the_token_kernel_serves_prefill_chunks(monkeypatch):
    """Chunks of several tokens (the deterministic mode's every step) through the token
    kernel equal the reference; "auto" gives them to the token-blocks kernel."""
    P, r = 16, 2
    q, keys, scale, w, table, C = _decode_case(7, 2, r, True, P=P)
    seq = torch.tensor([0, 0, 0, 1, 1])
    start = torch.tensor([0, 3])
    g = torch.Generator().manual_seed(8)
    q, w = torch.randn(5, *q.shape[1:], generator=g), torch.randn(5, w.shape[1], generator=g)
    vis = torch.tensor([3, 4, 5, 31, 32])
    out = ix.indexer_scores_paged_triton(q, keys, scale, w, vis, seq, table, r, P, C,
                                         seq_start=start, kernel="token")  # fmt: skip
    _close_to_ref(out, q, keys, scale, w, vis, seq, table, r, P, C)
    monkeypatch.setattr(ix, "token_scores", None)  # "auto" must not call it at T > B
    blocks = ix.indexer_scores_paged_triton(q, keys, scale, w, vis, seq, table, r, P, C,
                                            seq_start=start)  # fmt: skip
    _close_to_ref(blocks, q, keys, scale, w, vis, seq, table, r, P, C)


def test_token_kernel_splits():
    """A free launch fills the SMs (at most one tile a program, more chunks for fewer
    tokens); a fixed one splits by the key count alone."""
    assert splits(1, 256, 132, fixed=False) == 256  # B = 1 at 32K: a tile a program
    assert splits(256, 256, 132, fixed=False) == 5
    assert splits(8, 16, 132, fixed=False) == 16
    assert {splits(t, 256, 132, fixed=True) for t in (1, 7, 256)} == {256 // FIXED_TILES}
    assert splits(4096, 3, 132, fixed=False) == 1
    assert [t_class(t) for t in (1, 7, 8, 63, 64, 256, 4096)] == [0, 0, 1, 1, 2, 2, 2]


def test_the_modes_entry_gives_a_row_the_same_bits_in_any_step():
    """The deterministic mode's entry (the token kernel, fixed launch) at 1 token (a decode
    step) and at 2 and 5 tokens of one sequence (prefill chunks): row 0 has the same bits."""
    P, r = 16, 1
    q, keys, scale, w, table, C = _decode_case(11, 1, r, True, P=P)
    g = torch.Generator().manual_seed(12)
    q, w = torch.randn(5, *q.shape[1:], generator=g), torch.randn(5, w.shape[1], generator=g)
    vis = torch.tensor([37, 38, 39, 40, 41])
    seq, start = torch.zeros(5, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    rows = [
        ix.indexer_scores_paged.invariant(
            q[:m], keys, scale, w[:m], vis[:m], seq[:m], table, r, P, C, seq_start=start
        )[:1]
        for m in (1, 2, 5)
    ]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    _close_to_ref(rows[0], q[:1], keys, scale, w[:1], vis[:1], seq[:1], table, r, P, C)
