"""Cache regressions from review: reclaimable-block accounting with concurrent identical
prefixes; prefix hits shorter than the window; decoder replay then decode on a reused slot."""

from __future__ import annotations

import random

import pytest
import torch

from app.cache.block_pool import BlockPool, NoFreeBlocks
from app.cache.manager import CacheManager
from app.cache.radix import PrefixIndex
from app.config import CacheConfig
from bench.teacher import drive
from tests.support.reference import sequence_logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- block pool / prefix index ------------------------------------------------------------
def test_num_available_counts_only_blocks_allocate_can_hand_out():
    """Two requests compute the same prefix concurrently (both miss). The first commit caches
    A's block X_a; the second finds X_a already cached (B's X_b is redundant). B's next block
    Y_b must not be hung under X_a (B does not hold X_a): otherwise, once A finishes, X_a would
    be cached and unreferenced but not evictable, and ``num_available`` would overstate what
    ``allocate`` can hand out."""
    P = 2
    pool = BlockPool(4, P)
    index = PrefixIndex(pool, P)
    toks = [1, 2, 3, 4]
    a_blocks = pool.allocate(1)  # A: block for positions 0..1 (A's prompt is 3 tokens)
    b_blocks = pool.allocate(2)  # B: blocks for positions 0..3
    index.insert(toks[:2], a_blocks)  # A commits X_a
    redundant = index.insert(toks, b_blocks)  # B commits: X_b redundant, Y_b left uncached
    assert redundant == [b_blocks[0]]
    pool.decref(a_blocks)  # A finishes: X_a cached, unreferenced, has a held child
    index.check_integrity()
    avail = pool.num_available
    try:
        got = pool.allocate(avail)
    except NoFreeBlocks:
        got = None
    assert got is not None and len(got) == avail, (
        f"num_available={avail} but allocate({avail}) fails: a cached unreferenced block "
        "with a referenced descendant is counted as evictable"
    )


# ---- model / paged cache (checked; these pass) ----------------------------------------------
@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_prefix_hit_shorter_than_window_replays_from_zero_exactly(tiny_model, arch):
    """H <= W: replay starts at 0 and cached entries are reused; logits equal a cold run,
    for the hit request and for a fresh request batched with it."""
    model = tiny_model(arch)
    W = model.cfg.sliding_window
    P = 8 if arch == "v41" else 16
    cfg = CacheConfig(block_size=P, enable_prefix_caching=True, bounded_replay="encoder")
    mgr = CacheManager(model, cfg, num_blocks=64, max_slots=4)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 500, (P + 3,), generator=g)
    a = torch.cat((shared, torch.randint(3, 500, (5,), generator=g)))
    b = torch.cat((shared, torch.randint(3, 500, (9,), generator=g)))
    c = torch.randint(3, 500, (20,), generator=g)
    drive(model, mgr, {"a": a}, random.Random(1), max_chunk=7)
    mgr.free("a")
    out = drive(model, mgr, {"b": b, "c": c}, random.Random(2), max_chunk=7)
    assert mgr.num_cached("b") == P
    if P <= W:
        for rid, toks in (("b", b), ("c", c)):
            got = torch.stack([out[rid][p] for p in range(toks.numel())])
            assert _rel(got, sequence_logits(model, toks)) < 1e-5, rid
    else:  # replay from H - W: only the fresh request must be exact
        got = torch.stack([out["c"][p] for p in range(c.numel())])
        assert _rel(got, sequence_logits(model, c)) < 1e-5


@pytest.mark.parametrize("seed", [0, 3])
def test_decoder_replay_then_decode_reads_nothing_stale(tiny_model, seed):
    """Prompt with a prefix hit under encoder+decoder replay, then teacher-forced decode
    tokens, on a slot whose rings were poisoned: every logit stays finite."""
    model = tiny_model("v41")
    P = 8
    cfg = CacheConfig(block_size=P, enable_prefix_caching=True, bounded_replay="encoder+decoder")
    mgr = CacheManager(model, cfg, num_blocks=64, max_slots=2)
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 500, (2 * P + 3,), generator=g)
    a = torch.cat((shared, torch.randint(3, 500, (4,), generator=g)))
    b = torch.cat((shared, torch.randint(3, 500, (6 + seed,), generator=g)))
    drive(model, mgr, {"a": a}, random.Random(seed), max_chunk=6)
    mgr.free("a")
    for t in mgr.kv.window:
        t.fill_(float("nan"))
    for kv, gate in mgr.kv.tails.values():
        kv.fill_(float("nan"))
        gate.fill_(float("nan"))
    L = b.numel() - 3
    out = drive(model, mgr, {"b": b}, random.Random(seed + 10), max_chunk=6, prompt_lens={"b": L})
    assert min(out["b"]) == L - model.cfg.sliding_window
    assert all(torch.isfinite(v).all() for v in out["b"].values())
