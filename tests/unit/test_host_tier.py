"""Host KV tier: evicted blocks are demoted to host memory and loaded back on a hit (bytes
intact, both tiers' accounting exact, KV events carry the tier), and through the engine a
host-tier hit gives the device hit's output and counts as cached."""

from __future__ import annotations

import random

import pytest
import torch

from app.cache.block_pool import NoFreeBlocks
from app.cache.manager import CacheManager
from app.cache.radix import BlockRemoved, chain_hashes
from app.config import CacheConfig, EngineConfig
from app.engine.core import EngineCore
from app.engine.metrics import EngineMetrics
from app.engine.request import EngineRequest, SamplingParams
from app.model.loader import load_model
from tests.support.kv_events import EventMirror
from tests.unit.test_engine_observability import _Fake, _one


def _manager(model, num_blocks: int, host_blocks: int) -> CacheManager:
    bpb = CacheManager.layout_for(model, CacheConfig(), torch.float32).bytes_per_block
    cfg = CacheConfig(host_bytes=host_blocks * bpb, bounded_replay="off")
    return CacheManager(model, cfg, num_blocks, max_slots=4)


def _pattern(h: bytes, width: int) -> torch.Tensor:
    """The bytes block ``h`` holds in a tensor of ``width`` bytes per block."""
    return torch.tensor(list(h), dtype=torch.uint8).repeat(width // len(h) + 1)[:width]


def _write(cm: CacheManager, block: int, h: bytes) -> None:
    for v in cm.host.views:
        v[block] = _pattern(h, v.shape[1])


def _holds(cm: CacheManager, block: int, h: bytes) -> bool:
    return all(torch.equal(v[block], _pattern(h, v.shape[1])) for v in cm.host.views)


def _run(cm: CacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit, check the hit's bytes, 'compute' the rest (write each new block's pattern),
    commit; returns the request's blocks (still held)."""
    P = cm.block_size
    cm.admit(rid, tokens)
    cm.ensure(rid, len(tokens))
    assert cm.ready(rid)  # CPU: loads are synchronous
    hashes, blocks = chain_hashes(tokens, P), cm.blocks_of(rid)
    hit = cm.num_cached(rid) // P
    for i in range(hit):
        assert _holds(cm, blocks[i], hashes[i]), f"{rid}: cached block {i} has wrong bytes"
    for i in range(hit, len(hashes)):
        _write(cm, blocks[i], hashes[i])
    cm.commit(rid, tokens, len(tokens))
    return blocks


def test_evicted_blocks_go_to_host_and_come_back_intact(tiny_model):
    cm = _manager(tiny_model("v41"), num_blocks=4, host_blocks=3)
    P, mirror = cm.block_size, EventMirror()
    a = [5] * P + [6] * P + [7] * P + [1]  # 3 full blocks
    b = [8] * (3 * P + 1)
    _run(cm, "a", a)
    cm.free("a")
    _run(cm, "b", b)  # needs 4 blocks: a's 3 cached blocks are demoted, not dropped
    mirror.apply(cm.index.drain_events())
    ha = chain_hashes(a, P)
    assert mirror.host == set(ha) == cm.index.host_hashes()
    assert cm.host.stats.offload_blocks == 3 and cm.host.num_used == 3
    cm.check_integrity()
    cm.free("b")
    # a again: its three blocks are loaded back into device blocks taken from b
    blocks = _run(cm, "a2", a + [2, 3])
    assert cm.num_cached("a2") == 3 * P and cm.host.stats.hit_tokens == 3 * P
    assert [_holds(cm, blocks[i], ha[i]) for i in range(3)] == [True] * 3
    mirror.apply(cm.index.drain_events())
    assert mirror.hashes == cm.index.cached_hashes() and mirror.host == cm.index.host_hashes()
    assert not set(ha) & mirror.host  # back on the device
    cm.check_integrity()
    cm.free("a2")
    cm.check_integrity()
    assert cm.pool.num_available == cm.pool.num_blocks  # nothing leaked in either tier
    assert cm.host.num_used == cm.index.num_host_blocks


def test_full_host_tier_drops_lru_leaves_and_device_shortage_recomputes(tiny_model):
    cm = _manager(tiny_model("v41"), num_blocks=4, host_blocks=2)
    P = cm.block_size
    seqs = {k: [k] * (2 * P) + [0] for k in (1, 2, 3)}  # two full blocks each
    for k, toks in seqs.items():
        _run(cm, f"r{k}", toks)
        cm.free(f"r{k}")
    events = cm.index.drain_events()
    # two host rows: 1's leaf went to the host for 2, then 1's root and 2's leaf took the
    # rows (the host's least recently used leaf, 1's leaf, was dropped)
    h1, h2 = chain_hashes(seqs[1], P), chain_hashes(seqs[2], P)
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed == {h1[1]} and cm.index.host_hashes() == {h1[0], h2[1]}
    cm.check_integrity()
    # a running request takes every device block (demoting 2's root, the oldest)
    cm.admit("hog", [9] * (4 * P))
    cm.ensure("hog", 4 * P)
    assert h2[0] in cm.index.host_hashes()
    cm.admit("r2b", seqs[2])  # its host hit cannot be loaded: recompute
    assert cm.num_cached("r2b") == 0 and cm.host.stats.fallbacks == 1
    with pytest.raises(NoFreeBlocks):
        cm.ensure("r2b", 2 * P + 1)
    cm.free("r2b")
    cm.free("hog")
    cm.check_integrity()
    _run(cm, "r2c", seqs[2])  # room again: the host copy is used
    assert cm.num_cached("r2c") == P and cm.host.stats.hits == 1
    cm.free("r2c")
    cm.check_integrity()


def test_random_traffic_keeps_both_tiers_exact(tiny_model):
    """Random admits / frees over shared prefixes: every hit (device or host) reads the bytes
    its prefix wrote, the event mirror follows both tiers, no block leaks."""
    cm = _manager(tiny_model("v41"), num_blocks=6, host_blocks=5)
    P, rng, mirror = cm.block_size, random.Random(0), EventMirror()
    stems = [[rng.randrange(3, 99) for _ in range(4 * P)] for _ in range(4)]
    live: list[str] = []
    for step in range(120):
        if live and (len(live) >= 2 or rng.random() < 0.4):
            cm.free(live.pop(rng.randrange(len(live))))
        else:
            stem = stems[rng.randrange(len(stems))]
            n = rng.randrange(1, 4) * P + rng.randrange(P)
            toks = stem[:n] + [rng.randrange(3, 99) for _ in range(rng.randrange(2))]
            rid = f"q{step}"
            try:
                _run(cm, rid, toks)
                live.append(rid)
            except NoFreeBlocks:
                cm.free(rid)
        mirror.apply(cm.index.drain_events())
        assert mirror.hashes == cm.index.cached_hashes()
        assert mirror.host == cm.index.host_hashes()
        cm.check_integrity()
    st = cm.host.stats
    assert st.hits > 5 and st.offload_blocks > 10 and st.dropped_blocks > 0
    for rid in live:
        cm.free(rid)
    assert cm.pool.num_available == cm.pool.num_blocks
    assert cm.host.num_used == cm.index.num_host_blocks


# ---- through the engine ---------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


P = 16  # block size of the engine tests (short prompts: CPU time)


def _engine(path: str, model, num_blocks: int, host_blocks: int) -> EngineCore:
    """An engine of ``num_blocks`` device blocks (2 slots) and ``host_blocks`` host blocks."""
    lay = CacheManager.layout_for(model, CacheConfig(block_size=P), torch.float32)
    budget = 3 * lay.bytes_per_slot + (num_blocks + 1) * lay.bytes_per_block
    cfg = EngineConfig.from_options(
        path, kv_cache_bytes=budget, host_bytes=host_blocks * lay.bytes_per_block,
        max_num_seqs=2, block_size=P,
    )  # fmt: skip
    return EngineCore(cfg, model=model)


def _generate(eng: EngineCore, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    eng.add_request(EngineRequest(rid, tuple(prompt), GREEDY))
    toks, cached = [], 0
    while eng.has_unfinished:
        for o in eng.step():
            toks += o.token_ids
            cached = max(cached, o.num_cached_tokens)
    eng.cache.check_integrity()
    return toks, cached


def test_host_hit_gives_the_device_hits_output_and_counts_as_cached(tiny_ckpt):
    path = tiny_ckpt("v41")
    model = load_model(path)
    g = torch.Generator().manual_seed(3)
    prompt, other = (torch.randint(3, 500, (2 * P + 5,), generator=g).tolist() for _ in "ab")
    follow = prompt + [11, 12, 13]
    # device hit: a pool large enough to keep the prompt's blocks
    big = _engine(path, model, num_blocks=8, host_blocks=0)
    _generate(big, "p", prompt)
    dev_out, dev_cached = _generate(big, "f", follow)
    assert dev_cached == 2 * P
    # 3 device blocks: the other prompt pushes the prompt's 2 cached blocks to the host tier
    small = _engine(path, model, num_blocks=3, host_blocks=4)
    fake = _Fake()  # the engine metrics, exported to a recording stand-in of Ray's
    em = EngineMetrics(small, {"deployment": "DPRank", "rank": "0", "replica": "x"}, metrics=fake)
    _generate(small, "p", prompt)
    _generate(small, "o", other)
    assert set(chain_hashes(prompt, P)[:2]) <= small.cache.index.host_hashes()
    assert small.stats.host_hit_tokens == 0
    host_out, host_cached = _generate(small, "f", follow)
    assert host_cached == dev_cached and host_out == dev_out
    assert small.stats.host_hit_tokens == 2 * P and small.stats.host_load_bytes > 0
    em.flush()
    m = fake.made
    assert _one(m["fathom_engine_host_hit_tokens"]) == [2 * P]
    bpb = small.cache.layout.bytes_per_block
    assert _one(m["fathom_engine_host_load_bytes"]) == [2 * bpb]
    assert sum(_one(m["fathom_engine_host_offload_bytes"])) >= 2 * bpb
    (load_s,) = _one(m["fathom_engine_host_load_seconds"])  # one load-back
    assert 0 < load_s < 5
    assert _one(m["fathom_engine_host_blocks_used"]) == [small.cache.host.num_used]
