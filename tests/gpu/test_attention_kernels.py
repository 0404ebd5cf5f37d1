"""Attention-path Triton kernels at V4.1-Flash shapes on the GPU, against the torch references.

H=64 heads x D=512 with window 128 + top-512 keys, indexer 32 x 128 over up to 256K entries,
compressor D=512 over up to 4096 entries. Errors are ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import attention as attn  # noqa: E402
from kernels import compressor as cp  # noqa: E402
from kernels import indexer as ix  # noqa: E402
from kernels import topk as tk  # noqa: E402
from kernels.kv_quant import pow2_ceil  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _decode_case(B: int, seed: int, H=64, D=512, W=128, top=512, n_comp=4096):
    """B decode tokens: own window rows (some short) + top-512 of a compressed pool."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(B, H, D, device=DEV, generator=g).bfloat16()
    kv = torch.randn(B * W + n_comp, D, device=DEV, generator=g)
    win = torch.arange(B * W, device=DEV).view(B, W)
    comp = B * W + torch.randint(0, n_comp, (B, top), device=DEV, generator=g)
    idx = torch.cat((win, comp), dim=1)
    idx[0, 100:W] = -1  # a short window
    idx[-1, W + 300 :] = -1  # few selected entries
    sink = torch.randn(H, device=DEV, generator=g)
    angles = torch.rand(B, 32, device=DEV, generator=g) * 100.0
    return q, kv, idx, sink, angles


def _fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = kv.unflatten(-1, (-1, 32))
    scale = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-4) / 448.0)
    return (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2), scale


@pytest.mark.parametrize("kernel", ["tl", "ws"])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_decode_attention(B, kv_dtype, kernel):
    q, kv, idx, sink, angles = _decode_case(B, B)
    scale = None
    kv = kv.bfloat16()
    if kv_dtype == "fp8":
        kv, scale = _fp8(kv.float())
    out = torch.full_like(q, float("nan"))
    attn.sparse_attention_triton(
        q, kv, idx, sink, 512**-0.5, inv_rope_angles=angles, kv_scale=scale, out=out,
        kernel=kernel,
    )  # fmt: skip
    ref = attn.sparse_attention_ref(
        q.double(),
        kv if scale is not None else kv.double(),
        idx,
        sink.double(),
        512**-0.5,
        inv_rope_angles=angles.double(),
        kv_scale=None if scale is None else scale.double(),
    )
    assert not out.isnan().any()
    assert _rel(out, ref) < 1e-2  # bf16 q, P and output rounding


@pytest.mark.parametrize("kernel", ["tl", "ws"])
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_kv_agrees(splits, kernel):
    q, kv, idx, sink, angles = _decode_case(2, 7)
    kv = kv.bfloat16()
    got = attn.sparse_attention_triton(
        q, kv, idx, sink, 0.05, inv_rope_angles=angles, splits=splits, kernel=kernel
    )
    ref = attn.sparse_attention_ref(
        q.double(), kv.double(), idx, sink.double(), 0.05, inv_rope_angles=angles.double()
    )
    assert _rel(got, ref) < 1e-2


def test_prefill_chunk_fp32_exact():
    """fp32 path (IEEE dots) on a prefill-like chunk: 256 tokens, 8 heads of 128."""
    g = torch.Generator(device=DEV).manual_seed(3)
    T, H, D, N, K = 256, 8, 128, 1024, 200
    q = torch.randn(T, H, D, device=DEV, generator=g)
    kv = torch.randn(N, D, device=DEV, generator=g)
    idx = torch.randint(-1, N, (T, K), device=DEV, generator=g)
    sink = torch.randn(H, device=DEV, generator=g)
    got = attn.sparse_attention_triton(q, kv, idx, sink, 0.09)
    ref = attn.sparse_attention_ref(q.double(), kv.double(), idx, sink.double(), 0.09)
    assert _rel(got, ref) < 1e-5


@pytest.mark.parametrize(("T", "C"), [(1, 262144), (8, 65536), (64, 16384)])
def test_indexer_scores(T, C):
    g = torch.Generator(device=DEV).manual_seed(T)
    q = torch.randn(T, 32, 128, device=DEV, generator=g).bfloat16()
    k = torch.randn(C, 128, device=DEV, generator=g).bfloat16()
    w = torch.randn(T, 32, device=DEV, generator=g)
    visible = torch.randint(1, C + 1, (T,), device=DEV, generator=g)
    visible[0] = C
    out = torch.full((T, C), float("nan"), device=DEV)
    ix.indexer_scores_triton(q, k, w, visible, out=out)
    ref = ix.indexer_scores_ref(q.double(), k.double(), w.double(), visible)
    assert torch.equal(out.isneginf(), ref.isneginf())
    fin = ref.isfinite()
    assert float((out.double() - ref)[fin].norm() / ref[fin].norm()) < 1e-5


@pytest.mark.parametrize("C", [512, 16384, 65536, 262144])
def test_topk_exact(C):
    g = torch.Generator(device=DEV).manual_seed(C)
    T = 4
    s = torch.randn(T, C, device=DEV, generator=g)
    s[1] = torch.randint(0, 50, (C,), device=DEV, generator=g).float()  # massive ties
    s[2, C // 2 :] = float("-inf")
    s[2, :300] = float("-inf")
    s[3, :: max(1, C // 16)] = float("inf")  # forced blocks
    s[3, 1::7] = -0.0
    for k in (512, 2048):
        assert torch.equal(tk.topk_triton(s, k), tk.topk_ref(s, k)), k


def test_topk_few_visible():
    s = torch.full((2, 262144), float("-inf"), device=DEV)
    s[0, 10:20] = 1.0
    got = tk.topk_triton(s, 512)
    assert torch.equal(got, tk.topk_ref(s, 512))
    assert (got[1] == -1).all() and got[0, :10].tolist() == list(range(10, 20))


def _hard_rows(T: int, C: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    s = torch.randn(T, C, device=DEV, generator=g)
    s[1 % T] = torch.randint(0, 50, (C,), device=DEV, generator=g).float()  # massive ties
    if T > 2:
        s[2, C // 2 :] = float("-inf")
        s[2, :300] = float("-inf")
    if T > 3:
        s[3, :: max(1, C // 16)] = float("inf")
        s[3, 1::7] = -0.0
    return s


@pytest.mark.parametrize("C", [65536, 262144])
@pytest.mark.parametrize("T", [1, 4, 64])
def test_grid_topk_fused(T, C):
    """One launch with grid barriers: exact against the reference (ties, -inf, +inf, -0),
    the same result on every one of 20 runs (a missing barrier shows as a moving result),
    the dispatch taking it, and the phase-by-phase launches agreeing."""
    from kernels.topk_grid import grid_topk

    s = _hard_rows(T, C, T + C)
    for k in (512, 2048):
        ref = tk.topk_ref(s, k)
        out = torch.full_like(ref, -7)
        ends = torch.full((T,), -1, device=DEV, dtype=torch.int32)
        grid_topk(s, k, out, ends=ends)
        assert torch.equal(out, ref), k
        if C == 262144:  # randn ends at level 1: its bucket (5), or its exact bin (1, ~1/30
            # of rows); the 50 values' ties run all 4 levels (3). They are row 1 % T: row 0
            # itself when T == 1 (the batch-1 randn row: test_grid_topk_randn_row_bucket)
            got = ends[:2].tolist()
            assert got[0] in ({3} if T == 1 else {1, 5}) and got[1:] in ([], [3]), (k, got)
        for _ in range(20):
            out.fill_(-7)
            grid_topk(s, k, out)
            assert torch.equal(out, ref), k
        assert torch.equal(tk.topk_triton(s, k), ref)
        split = torch.full_like(ref, -7)
        assert torch.equal(grid_topk(s, k, split, fused=False), ref)


def test_grid_topk_randn_row_bucket():
    """Batch 1 at 256K (the serving case): a randn row ends at level 1 in one launch of ~128
    programs, at tau's bucket (5) or, when tau's 16-bit bin holds exactly the keys still
    needed, at that bin (1); over 2 rows x 2 k the bucket ends at least once. Exact."""
    from kernels.topk_grid import grid_topk

    g = torch.Generator(device=DEV).manual_seed(11)
    seen = []
    for _ in range(2):
        s = torch.randn(1, 262144, device=DEV, generator=g)
        for k in (512, 2048):
            out = torch.full((1, k), -7, device=DEV, dtype=torch.int64)
            ends = torch.full((1,), -1, device=DEV, dtype=torch.int32)
            grid_topk(s, k, out, ends=ends)
            assert torch.equal(out, tk.topk_ref(s, k)), k
            seen += ends.tolist()
    assert set(seen) <= {1, 5} and 5 in seen, seen


def _cluster_rows(sizes: tuple[int, ...], C: int = 262144) -> torch.Tensor:
    """Rows of -5 + 0.1 randn with ``n`` scores of 4 + (r % 20) * 2^-15 (r < n) at random
    ids: one 16-bit prefix holds them all, byte 2 is (r % 20) // 4, ties of ~n / 20."""
    g = torch.Generator(device=DEV).manual_seed(len(sizes))
    s = torch.randn(len(sizes), C, device=DEV, generator=g) * 0.1 - 5
    for row, n in enumerate(sizes):
        ids = torch.randperm(C, device=DEV, generator=g)[:n]
        s[row, ids] = 4.0 + (torch.arange(n, device=DEV) % 20).float() * 2**-15
    return s


@pytest.mark.parametrize("programs", [None, 4])
@pytest.mark.parametrize(
    ("cap", "sub", "ends"),
    [(8192, 256, [5, 6]), (1, 256, [3, 3]), (8192, 16, [3, 3])],
)
def test_grid_topk_bucket_edges(programs, cap, sub, ends):
    """Tau's bucket at exactly its 256 slots (row 0: the select ends at the level-1 bucket)
    and one key over (row 1: it falls back, and ends at the level-2 bucket of 52), in one
    launch; with the buckets off (cap 1) and too small (16 slots) both run all four levels.
    k = 105 cuts inside a run of 13 ties. Exact, and the same on 20 replays of the one
    zero-ready workspace (stale bucket counts would move the result). ``programs`` 4: spans
    of 32 tiles (the multi-tile path)."""
    from kernels.topk_grid import grid_topk

    s = _cluster_rows((256, 257))
    ref = tk.topk_ref(s, 105)
    for _ in range(20):
        out = torch.full_like(ref, -7)
        where = torch.full((2,), -1, device=DEV, dtype=torch.int32)
        grid_topk(s, 105, out, programs=programs, cap=cap, sub=sub, ends=where)
        assert torch.equal(out, ref)
        assert where.tolist() == ends


def test_grid_topk_few_programs_long_spans():
    """Four programs per row, each span 16 tiles; fewer usable scores than k in row 0."""
    from kernels.topk_grid import grid_topk

    s = _hard_rows(4, 131072, 5)
    s[0, 700:] = float("-inf")
    ref = tk.topk_ref(s, 1024)
    out = torch.full_like(ref, -7)
    assert torch.equal(grid_topk(s, 1024, out, programs=4), ref)


@pytest.mark.parametrize(
    ("overlap", "ratio", "E"),
    [(False, 1, 4096), (False, 2, 4096), (True, 4, 1024), (False, 128, 64)],
)
def test_compressor(overlap, ratio, E):
    g = torch.Generator(device=DEV).manual_seed(ratio)
    dim = 512
    span, width = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
    kv = torch.randn(E, span, width, device=DEV, generator=g)
    gate = torch.randn(E, span, width, device=DEV, generator=g) if span > 1 else None
    first = torch.arange(E, device=DEV) % 7 == 0
    norm_w = 1 + 0.1 * torch.randn(dim, device=DEV, generator=g)
    angles = torch.rand(E, 32, device=DEV, generator=g) * 1000.0
    pool = torch.full((2 * E, dim), float("nan"), device=DEV, dtype=torch.bfloat16)
    rows = torch.randperm(2 * E, device=DEV, generator=g)[:E]
    kw = {"overlap": overlap, "ratio": ratio, "dim": dim, "angles": angles}
    cp.compress_pool_triton(kv, gate, first, norm_w, 1e-20, out=pool, out_rows=rows, **kw)
    ref = cp.compress_pool_ref(
        kv.double(), None if gate is None else gate.double(), first, norm_w.double(), 1e-20, **kw
    )
    assert _rel(pool[rows], ref) < 1e-2  # bf16 pool
    got32 = cp.compress_pool_triton(kv, gate, first, norm_w, 1e-20, **kw)
    assert _rel(got32, ref) < 1e-5


@pytest.mark.parametrize("kernel", ["tl", "ws"])
@pytest.mark.parametrize("B", [1, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_decode_attention_two_sources(B, packed, kernel):
    """The batched step's call: window rows from a ring, top-512 from a separate compressed
    pool; packed = the released V4.1 formats (fp8 + e8m0 window, nvfp4 + e4m3 entries)."""
    from kernels.kv_quant import kv_pack

    q, kv, idx, sink, angles = _decode_case(B, 100 + B)
    W = 128
    ring, comp = kv[: B * W], kv[B * W :]
    win, sel = idx[:, :W], idx[:, W:] - B * W
    sel = torch.where(idx[:, W:] >= 0, sel, -1)
    kw: dict = {}
    if packed:
        (ring, s1), (comp, s2) = kv_pack(ring, "fp8"), kv_pack(comp, "nvfp4")
        kw = dict(kv_scale=s1, kv2_scale=s2)
    else:
        ring, comp = ring.bfloat16(), comp.bfloat16()
    out = attn.sparse_attention_triton(
        q, ring, win, sink, 512**-0.5, kv2=comp, idx2=sel, inv_rope_angles=angles,
        kernel=kernel, **kw,
    )  # fmt: skip
    ref = attn.sparse_attention_ref(
        q.double(), ring if packed else ring.double(), win, sink.double(), 512**-0.5,
        kv2=comp if packed else comp.double(), idx2=sel, inv_rope_angles=angles.double(), **kw,
    )  # fmt: skip
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize("B,n,C", [(64, 1, 8192), (2, 300, 4096)])
def test_paged_indexer_scores(mx, B, n, C):
    """Scores read through block tables (V4.1: 32 heads x 128, ratio 2, 64-token blocks),
    decode (one token per sequence) and prefill chunks, float or mxfp4 keys."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(B + n + mx)
    P, r = 64, 2
    nb = C * r // P
    T = B * n
    table = torch.randperm(B * nb + 3, device=DEV, generator=g)[: B * nb].view(B, nb)
    keys = torch.randn((B * nb + 4) * (P // r), 128, device=DEV, generator=g)
    ks = None
    if mx:
        keys, ks = kv_pack(keys, "mxfp4")
    else:
        keys = keys.bfloat16()
    q = torch.randn(T, 32, 128, device=DEV, generator=g).bfloat16()
    w = torch.randn(T, 32, device=DEV, generator=g)
    seq = torch.arange(B, device=DEV).repeat_interleave(n)
    start = torch.arange(B, device=DEV) * n
    vis = torch.randint(1, C + 1, (T,), device=DEV, generator=g)
    out = ix.indexer_scores_paged_triton(q, keys, ks, w, vis, seq, table, r, P, C,
                                         seq_start=start)  # fmt: skip
    ref = ix.indexer_scores_paged_ref(q.float(), keys if mx else keys.float(), ks, w, vis, seq,
                                      table, r, P, C)  # fmt: skip
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    assert _rel(out[fin], ref[fin]) < 1e-2


@pytest.mark.parametrize("dequant", ["bits", "dot_scaled"])
@pytest.mark.parametrize("B,C,r", [(1, 32768, 1), (64, 8192, 2), (256, 2048, 1)])
def test_decode_indexer_scores_token_kernel(dequant, B, C, r):
    """The decode path (one token per sequence: the token kernel, "auto") at V4.1-Flash
    shapes (32 heads x 128, mxfp4 + e8m0 keys, 64-position blocks shuffled): equal to the
    reference and to the token-blocks kernel, ragged visible counts (0, mid-block, a block
    edge, all), B = 1 at 32K entries and B = 256; both dequantizations."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(B + C + r)
    P = 64
    nb = C * r // P
    table = torch.randperm(B * nb + 3, device=DEV, generator=g)[: B * nb].view(B, nb)
    keys, ks = kv_pack(torch.randn((B * nb + 4) * (P // r), 128, device=DEV, generator=g),
                       "mxfp4")  # fmt: skip
    q = torch.randn(B, 32, 128, device=DEV, generator=g).bfloat16()
    w = torch.randn(B, 32, device=DEV, generator=g)
    seq = torch.arange(B, device=DEV)
    vis = torch.randint(1, C + 1, (B,), device=DEV, generator=g)
    vis[0] = C - 37
    if B > 3:
        vis[1:4] = torch.tensor([0, P // r, C])
    out = torch.full((B, C), float("nan"), device=DEV)
    ix.indexer_scores_paged_triton(q, keys, ks, w, vis, seq, table, r, P, C, seq_start=seq,
                                   out=out, dequant=dequant)  # fmt: skip
    ref = ix.indexer_scores_paged_ref(q.float(), keys, ks, w, vis, seq, table, r, P, C)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out)) and bool((out[~fin] == float("-inf")).all())
    assert _rel(out[fin], ref[fin]) < 1e-5  # exact products, fp32 sums
    old = ix.indexer_scores_paged_triton(q, keys, ks, w, vis, seq, table, r, P, C,
                                         seq_start=seq, kernel="blocks")  # fmt: skip
    assert _rel(out[fin], old[fin]) < 1e-5


def test_token_kernel_float_keys_and_prefill_rows():
    """The token kernel (the deterministic mode's at every step) over bf16 keys and over
    prefill chunks (several tokens a sequence) equals the reference."""
    g = torch.Generator(device=DEV).manual_seed(9)
    P, r, B, n, C = 64, 2, 3, 40, 4096
    nb = C * r // P
    table = torch.randperm(B * nb + 3, device=DEV, generator=g)[: B * nb].view(B, nb)
    keys = torch.randn((B * nb + 4) * (P // r), 128, device=DEV, generator=g).bfloat16()
    q = torch.randn(B * n, 32, 128, device=DEV, generator=g).bfloat16()
    w = torch.randn(B * n, 32, device=DEV, generator=g)
    seq = torch.arange(B, device=DEV).repeat_interleave(n)
    vis = torch.randint(0, C + 1, (B * n,), device=DEV, generator=g)
    out = ix.indexer_scores_paged_triton(q, keys, None, w, vis, seq, table, r, P, C,
                                         seq_start=torch.arange(B, device=DEV) * n,
                                         kernel="token")  # fmt: skip
    ref = ix.indexer_scores_paged_ref(q.float(), keys.float(), None, w, vis, seq, table, r, P, C)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    assert _rel(out[fin], ref[fin]) < 1e-5


@pytest.mark.parametrize("T,k", [(1, 512), (64, 512), (300, 1024)])
def test_entry_rows_on_gpu(T, k):
    """The step's pool rows of selected entries in one launch = the reference, exactly
    (V4.1: ratio 2, 256-token blocks; -1 ids and ids past the table included)."""
    g = torch.Generator(device=DEV).manual_seed(T)
    B, nb, P, r = 8, 64, 256, 2
    table = torch.randperm(B * nb + 5, device=DEV, generator=g)[: B * nb].view(B, nb)
    seq = torch.randint(0, B, (T,), device=DEV, generator=g)
    ids = torch.randint(-1, nb * P // r + 40, (T, k), device=DEV, generator=g)
    got = ix.entry_rows_triton(ids, seq, table, r, P)
    assert torch.equal(got, ix.entry_rows_ref(ids, seq, table, r, P))
    assert torch.equal(ix.entry_rows(ids, seq, table, r, P), got)  # the dispatch takes it


@pytest.mark.parametrize("ratio,span,rows", [(2, 2, 2), (1, 1, 0), (128, 128, 128), (4, 8, 8)])
@pytest.mark.parametrize("B,n", [(64, 1), (2, 3000)])
def test_compressor_groups_on_gpu(ratio, span, rows, B, n):
    """The step's compressor groups in one launch = the reference, exactly: decode (one
    token per sequence) and prefill chunks (many tokens, the compaction over several
    blocks), with cached prefixes."""
    from kernels.compressor import compressor_groups, compressor_groups_ref

    g = torch.Generator(device=DEV).manual_seed(B + ratio)
    start = torch.randint(0, 20000, (B,), device=DEV, generator=g)
    cached = start // 64 * 32
    lens = torch.full((B,), n, device=DEV)
    seq = torch.arange(B, device=DEV).repeat_interleave(n)
    pos = start[seq] + torch.arange(B * n, device=DEV) - (seq * n)
    slots = torch.randperm(B + 8, device=DEV, generator=g)[:B]
    table = torch.randperm(B * 128 + 9, device=DEV, generator=g)[: B * 128].view(B, 128)
    args = (pos, seq, start[seq], lens[seq], slots[seq], cached, table, ratio, span, rows,
            256, B * 128 + 8, B + 7)  # fmt: skip
    got, want = compressor_groups(*args), compressor_groups_ref(*args)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert want[1].any() or ratio == 128


@pytest.mark.parametrize("T", [1, 64, 4096])
def test_norm_rope_pair_on_gpu(T):
    """wq_a | wkv halves (V4.1-Flash: 1280 | 512, RoPE on kv's last 64) normed in one launch
    = the two norm_rope launches (the same arithmetic; the row sum may add up in another order
    with another launch shape: within a bf16 rounding) and the reference."""
    from kernels.norm import norm_rope_pair, norm_rope_pair_ref, norm_rope_triton

    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(T, 1792, device=DEV, generator=g).bfloat16()
    w1 = torch.randn(1280, device=DEV, generator=g)
    w2 = torch.randn(512, device=DEV, generator=g)
    ang = torch.rand(T, 32, device=DEV, generator=g) * 100.0
    a, b = norm_rope_pair(x, 1280, w1, 1e-6, w2, 1e-6, ang.cos(), ang.sin())
    sa = norm_rope_triton(x[:, :1280], w1, 1e-6)
    sb = norm_rope_triton(x[:, 1280:], w2, 1e-6, ang.cos(), ang.sin())
    for got, sep in ((a, sa), (b, sb)):  # at most one bf16 step apart
        step = (got.float() - sep.float()).abs() / sep.float().abs().clamp_min(1e-30)
        assert step.max() <= 2**-7
    ra, rb = norm_rope_pair_ref(x, 1280, w1, 1e-6, w2, 1e-6, ang.cos(), ang.sin())
    assert _rel(a.float(), ra.float()) < 1e-2 and _rel(b.float(), rb.float()) < 1e-2


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
def test_kv_pack_bit_exact_on_gpu(fmt):
    """The cache packers on the GPU = the torch references, bit for bit (V4.1 row widths)."""
    from kernels.kv_quant import KV_BLOCKS, kv_pack_ref, kv_pack_triton, kv_qdq_ref, kv_qdq_triton

    g = torch.Generator(device=DEV).manual_seed(3)
    d = 128 if fmt == "mxfp4" else 512
    for scale in (1e-6, 1.0, 300.0):
        x = (torch.randn(4096, d, device=DEV, generator=g) * scale).bfloat16()
        a, sa = kv_pack_ref(x, fmt)
        b, sb = kv_pack_triton(x, fmt)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8))
        assert torch.equal(kv_qdq_ref(x, fmt, KV_BLOCKS[fmt]), kv_qdq_triton(x, fmt))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("n", [1, 3, 600])
def test_kv_pack_into_cache_rows_on_gpu(fmt, n):
    """Pack + store into cache rows in one launch (the engine's KV writes) = the reference's
    pack and index_copy, bit for bit; the other rows keep their bytes."""
    from kernels.kv_quant import kv_pack_into_ref, kv_pack_into_triton, kv_storage

    g = torch.Generator(device=DEV).manual_seed(n)
    d = 128 if fmt == "mxfp4" else 512
    x = (torch.randn(n, d, device=DEV, generator=g) * 5).bfloat16()
    rows = torch.randperm(2048, device=DEV, generator=g)[:n]
    want = kv_storage(fmt, 2048, d, torch.bfloat16, DEV)
    for t in want:
        t.view(torch.uint8).random_(0, 256, generator=g)
    got = tuple(t.clone() for t in want)
    kv_pack_into_ref(x, rows, *want, fmt)
    kv_pack_into_triton(x, rows, *got, fmt)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_norm_rope_on_gpu():
    from kernels.norm import norm_rope_ref, norm_rope_triton

    g = torch.Generator(device=DEV).manual_seed(4)
    x = torch.randn(64, 64, 512, device=DEV, generator=g).bfloat16()
    ang = torch.rand(64, 32, device=DEV, generator=g) * 1e4
    w = torch.randn(512, device=DEV, generator=g)
    for wt, eps in ((w, 1e-6), (None, None)):
        ref = norm_rope_ref(x.float(), wt, eps, ang.cos(), ang.sin())
        assert _rel(norm_rope_triton(x, wt, eps, ang.cos(), ang.sin()), ref) < 1e-2


@pytest.mark.gpu_mem(8)  # the V4.1 head in fp32 and bf16, and the fp32 reference's copy
@pytest.mark.parametrize("M", [1, 64, 256])
def test_head_gemm_fp32_out(M):
    """The LM head's bf16 x bf16 -> fp32 GEMM (V4.1 vocab x hidden) = fp32 GEMM of the same
    bf16 values (sum order aside)."""
    from kernels.linear import linear_f32_ref, linear_f32_triton

    g = torch.Generator(device=DEV).manual_seed(M)
    x = torch.randn(M, 5120, device=DEV, generator=g).bfloat16()
    w = (torch.randn(129280, 5120, device=DEV, generator=g) * 0.02).bfloat16()
    out = linear_f32_triton(x, w)
    assert out.dtype == torch.float32 and _rel(out, linear_f32_ref(x, w)) < 1e-5


WS_LAUNCHES = [None, {"block_n": 32, "stages": 3}, {"block_n": 16, "stages": 4}]


@pytest.mark.parametrize("launch", WS_LAUNCHES)
@pytest.mark.parametrize("splits", [1, 3])
def test_ws_kernel_edges(launch, splits):
    """The warp-specialized kernel where its blocking shows: 128 heads (two head blocks),
    key counts off the block size, int32 ids, e8m0 window scales, a token whose keys are all
    empty (its output is 0: only the sink is left), no RoPE; against the torch reference."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(11)
    T, H, D, K, K2 = 5, 128, 512, 77, 301
    q = torch.randn(T, H, D, device=DEV, generator=g).bfloat16()
    ring, s1 = kv_pack(torch.randn(T * K, D, device=DEV, generator=g), "fp8")
    comp, s2 = kv_pack(torch.randn(900, D, device=DEV, generator=g), "nvfp4")
    assert s1.dtype == torch.uint8  # e8m0 codes
    win = torch.arange(T * K, device=DEV, dtype=torch.int32).view(T, K)
    sel = torch.randint(0, 900, (T, K2), device=DEV, generator=g, dtype=torch.int32)
    win[2], sel[2] = -1, -1
    sel[4, 200:] = -1
    sink = torch.randn(H, device=DEV, generator=g)
    kw = dict(kv_scale=s1, kv2=comp, idx2=sel, kv2_scale=s2)
    out = attn.sparse_attention_triton(
        q, ring, win, sink, D**-0.5, splits=splits, kernel="ws", launch=launch, **kw
    )
    ref = attn.sparse_attention_ref(q.double(), ring, win.long(), sink.double(), D**-0.5,
                                    **{**kw, "idx2": sel.long()})  # fmt: skip
    assert out[2].abs().max() == 0
    assert _rel(out, ref) < 1e-2
    tl_out = attn.sparse_attention_triton(
        q, ring, win, sink, D**-0.5, splits=splits, kernel="tl", **kw
    )
    assert _rel(out, tl_out) < 1e-2


@pytest.mark.parametrize("splits", [1, 3])
def test_ws_rising_scores(splits):
    """Scores whose row max keeps rising along the keys by far more than the sink (key norms
    growing with their index, q x 4): the online softmax rescales O and l in almost every
    block; e8m0 fp8 rows (the engine's format). Against the torch reference and the tl
    kernel."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(5)
    T, H, D, K = 4, 64, 512, 600
    q = (torch.randn(T, H, D, device=DEV, generator=g) * 4).bfloat16()
    grow = 1 + torch.arange(T * K, device=DEV).remainder(K).float().unsqueeze(1) / 16
    kv, sc = kv_pack(torch.randn(T * K, D, device=DEV, generator=g) * grow, "fp8")
    idx = torch.arange(T * K, device=DEV).view(T, K)
    idx[1, ::3] = -1
    sink = torch.randn(H, device=DEV, generator=g)
    out = attn.sparse_attention_triton(q, kv, idx, sink, D**-0.5, kv_scale=sc, splits=splits,
                                       kernel="ws")  # fmt: skip
    ref = attn.sparse_attention_ref(q.double(), kv, idx, sink.double(), D**-0.5, kv_scale=sc)
    assert _rel(out, ref) < 1e-2
    tl_out = attn.sparse_attention_triton(q, kv, idx, sink, D**-0.5, kv_scale=sc,
                                          splits=splits, kernel="tl")  # fmt: skip
    assert _rel(out, tl_out) < 1e-2


@pytest.mark.parametrize("second", [None, "fp8", "nvfp4"])
@pytest.mark.parametrize("splits", [1, 2])
def test_ws_e8m0_integer_decode_is_exact(splits, second):
    """fp8 rows with e8m0 codes through the ws producer's integer decode (PRMT, shift, AND
    and one bf16 multiply per pair) give the conversion path's output bit for bit (the same
    rows with their scales as fp32 powers of two: e4m3 -> fp32 x scale -> bf16): groups
    with e4m3 subnormals and zeros, zero rows, token 0's first rows with codes past 134
    (scales past 2^7: the second multiply is not 1), masked keys; the window source alone,
    with an fp8 second source (also e8m0) and with nvfp4 entries (the engine's)."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(17)
    T, H, D, K, N2, K2 = 6, 64, 512, 200, 700, 160
    x = torch.randn(T * K, D, device=DEV, generator=g)
    x[:, ::5] *= 1e-4  # e4m3 subnormals beside each group's largest value
    x[7::13] = 0.0
    x[:40:3] *= 2.0**16  # token 0's first rows: codes past 134
    q = torch.randn(T, H, D, device=DEV, generator=g)
    q[0] *= 2.0**-16
    q = q.bfloat16()
    ring, s1 = kv_pack(x, "fp8")
    assert int(s1[:K].max()) > 134 >= int(s1[K:].max())
    b = ring[K:].view(torch.uint8)
    assert (b.bitwise_and(0x78).eq(0) & b.bitwise_and(7).ne(0)).any()  # e4m3 subnormals
    win = torch.arange(T * K, device=DEV).view(T, K)
    win[2, ::4] = -1
    sink = torch.randn(H, device=DEV, generator=g)
    kw = {"kv_scale": s1}
    if second:
        kv2, s2 = kv_pack(torch.randn(N2, D, device=DEV, generator=g), second)
        kw.update(kv2=kv2, kv2_scale=s2,
                  idx2=torch.randint(-1, N2, (T, K2), device=DEV, generator=g))  # fmt: skip
    kw32 = {k: torch.exp2(v.float() - 127) if k.endswith("scale") and v.dtype == torch.uint8
            else v for k, v in kw.items()}  # fmt: skip
    outs = [attn.sparse_attention_triton(q, ring, win, sink, D**-0.5, splits=splits,
                                         kernel="ws", **a) for a in (kw, kw32)]  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    ref = attn.sparse_attention_ref(q.double(), ring, win, sink.double(), D**-0.5, **kw)
    assert _rel(outs[0], ref) < 1e-2


def test_ws_kernel_refuses_what_it_cannot_take():
    q = torch.randn(2, 32, 512, device=DEV).bfloat16()  # 32 heads: not a block of 64
    kv = torch.randn(10, 512, device=DEV).bfloat16()
    idx = torch.zeros(2, 4, device=DEV, dtype=torch.long)
    with pytest.raises(ValueError, match="warp-specialized"):
        attn.sparse_attention_triton(q, kv, idx, torch.zeros(32, device=DEV), 0.1, kernel="ws")


@pytest.mark.parametrize("launch", WS_LAUNCHES)
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_ws_bf16_partials_against_fp32(launch, splits, monkeypatch):
    """The ws kernel's split partials in bf16, staged through the key ring (both consumers
    wait for its last blocks, then store their halves row-contiguously), against the same
    kernel with fp32 partials stored straight from the accumulators: each split's O is
    rounded once to bf16, so the outputs agree to a few bf16 steps. Two head blocks, a token
    whose keys are nearly all masked, and at 5 splits of 32-key blocks a split with no key
    block of either source (its consumers never touch the ring). At 1 split the output
    itself goes out through the ring (RoPE'd in consumer 1), held to the tl kernel row by
    row. Repeated launches are bit-equal: a race on the ring would show as a changed row."""
    from kernels.kv_quant import kv_pack

    g = torch.Generator(device=DEV).manual_seed(21)
    T, H, D, K, K2 = 6, 128, 512, 128, 512
    q = torch.randn(T, H, D, device=DEV, generator=g).bfloat16()
    ring, s1 = kv_pack(torch.randn(T * K, D, device=DEV, generator=g), "fp8")
    comp, s2 = kv_pack(torch.randn(4096, D, device=DEV, generator=g), "nvfp4")
    win = torch.arange(T * K, device=DEV, dtype=torch.int32).view(T, K)
    sel = torch.randint(0, 4096, (T, K2), device=DEV, generator=g, dtype=torch.int32)
    win[3, 16:], sel[3] = -1, -1
    sink = torch.randn(H, device=DEV, generator=g)
    ang = torch.rand(T, 32, device=DEV, generator=g) * 100
    kw = dict(kv_scale=s1, kv2=comp, idx2=sel, kv2_scale=s2, inv_rope_angles=ang,
              splits=splits, kernel="ws", launch=launch)  # fmt: skip
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(attn, "WS_PARTIALS", dt)
        out[dt] = attn.sparse_attention_triton(q, ring, win, sink, D**-0.5, **kw).float()
    a, b = out[torch.bfloat16], out[torch.float32]
    for _ in range(3):
        again = attn.sparse_attention_triton(q, ring, win, sink, D**-0.5, **kw)
        assert torch.equal(again.float(), a)
    assert torch.isfinite(a).all() and _rel(a, b) < 4e-3
    assert ((a - b).abs().amax(-1) <= 2**-6 * b.abs().amax(-1)).all()
    c = attn.sparse_attention_triton(q, ring, win, sink, D**-0.5,
                                     **{**kw, "kernel": "tl", "launch": None}).float()  # fmt: skip
    assert ((a - c).abs().amax(-1) <= 2**-6 * c.abs().amax(-1)).all()
    ref = attn.sparse_attention_ref(q.double(), ring, win.long(), sink.double(), D**-0.5,
                                    kv_scale=s1, kv2=comp, idx2=sel.long(), kv2_scale=s2,
                                    inv_rope_angles=ang)  # fmt: skip
    assert _rel(a, ref) < 1e-2
