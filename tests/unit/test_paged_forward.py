"""Incremental forward through the paged cache: chunked prefill + decode = full forward;
prefix hits with replay off = cold runs; replay on stays close (measured)."""

from __future__ import annotations

import random

import pytest
import torch

from app.cache.manager import CacheManager
from app.config import CacheConfig
from bench.teacher import drive
from tests.support.reference import sequence_logits

BLOCK = {"v41": 8, "v4": 16}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_chunked_prefill_and_decode_equal_full_forward(tiny_model, arch):
    model = tiny_model(arch)
    cfg = CacheConfig(block_size=BLOCK[arch], enable_prefix_caching=False, bounded_replay="off")
    mgr = CacheManager(model, cfg, num_blocks=64, max_slots=8)
    g = torch.Generator().manual_seed(11)
    seqs = {f"r{i}": torch.randint(3, 500, (n,), generator=g) for i, n in enumerate((45, 7, 30, 1))}
    out = drive(model, mgr, seqs, random.Random(0), max_chunk=9)
    for rid, toks in seqs.items():
        full = sequence_logits(model, toks)
        got = torch.stack([out[rid][p] for p in range(toks.numel())])
        assert _rel(got, full) < 1e-5, rid
    for rid in seqs:
        mgr.free(rid)
    mgr.check_integrity()
    assert mgr.pool.num_free == 64 and mgr.kv.num_free_slots == 8


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_prefix_hit_without_replay_equals_cold(tiny_model, arch):
    model = tiny_model(arch)
    P = BLOCK[arch]
    cfg = CacheConfig(block_size=P, enable_prefix_caching=True, bounded_replay="off")
    mgr = CacheManager(model, cfg, num_blocks=64, max_slots=4)
    g = torch.Generator().manual_seed(12)
    shared = torch.randint(3, 500, (3 * P + 3,), generator=g)
    a = torch.cat((shared, torch.randint(3, 500, (5,), generator=g)))
    b = torch.cat((shared, torch.randint(3, 500, (9,), generator=g)))
    drive(model, mgr, {"a": a}, random.Random(1), max_chunk=7)
    mgr.free("a")
    out = drive(model, mgr, {"b": b}, random.Random(2), max_chunk=7)
    assert mgr.num_cached("b") == 3 * P  # whole blocks only
    cold = sequence_logits(model, b)
    got = torch.stack([out["b"][p] for p in range(b.numel())])
    assert _rel(got, cold) < 1e-5
    stats = mgr.index.stats
    assert stats.hit_tokens >= 3 * P


@pytest.mark.parametrize(
    "arch,mode", [("v41", "encoder"), ("v41", "encoder+decoder"), ("v4", "encoder")]
)
def test_bounded_replay_reads_nothing_stale(tiny_model, arch, mode):
    """After a hit at H the prefill restarts at H - W and reads no window or compressor-tail
    row it did not write itself: every slot row is poisoned with NaN before the second
    request runs, and its logits stay finite. (How close replay stays to a cold run is
    measured by bench/replay_fidelity.py.)"""
    model = tiny_model(arch)
    P, W = BLOCK[arch], model.cfg.sliding_window
    cfg = CacheConfig(block_size=P, enable_prefix_caching=True, bounded_replay=mode)
    mgr = CacheManager(model, cfg, num_blocks=64, max_slots=2)
    g = torch.Generator().manual_seed(13)
    shared = torch.randint(3, 500, (2 * P + 3,), generator=g)
    a = torch.cat((shared, torch.randint(3, 500, (4,), generator=g)))
    b = torch.cat((shared, torch.randint(3, 500, (6,), generator=g)))
    drive(model, mgr, {"a": a}, random.Random(3), max_chunk=6)
    mgr.free("a")
    for t in mgr.kv.window:
        t.fill_(float("nan"))
    for kv, gate in mgr.kv.tails.values():
        kv.fill_(float("nan"))
        gate.fill_(float("nan"))
    out = drive(model, mgr, {"b": b}, random.Random(4), max_chunk=6, prompt_lens={"b": b.numel()})
    H = mgr.num_cached("b")
    assert H == 2 * P
    first = b.numel() - W if mode == "encoder+decoder" else H - W
    assert min(out["b"]) == first  # rows below the floor never reach the head
    assert all(torch.isfinite(v).all() for v in out["b"].values())
