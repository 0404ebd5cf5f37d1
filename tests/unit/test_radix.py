"""PrefixIndex: whole-block matches, namespaces, collisions, LRU eviction, KV event stream."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from app.cache import radix
from app.cache.block_pool import BlockPool, NoFreeBlocks
from app.cache.radix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    PrefixIndex,
    chain_hashes,
)
from tests.support.kv_events import EventMirror

P = 4


def make(num_blocks: int = 16) -> tuple[BlockPool, PrefixIndex]:
    pool = BlockPool(num_blocks, P)
    return pool, PrefixIndex(pool, P)


def run_request(pool: BlockPool, index: PrefixIndex, tokens: list[int], key: str = "") -> list[int]:
    """Match, hold, allocate the rest, insert, release: one finished request's life."""
    m = index.match(tokens, key)
    pool.incref(m.block_ids)
    table = m.block_ids + pool.allocate(-(-len(tokens) // P) - len(m.block_ids))
    index.insert(tokens, table, key)
    pool.decref(table)
    index.check_integrity()
    return table


def test_match_returns_whole_blocks_only():
    pool, index = make()
    seq = list(range(10))  # blocks [0..3] [4..7], partial [8, 9] never cached
    table = run_request(pool, index, seq)
    assert len(index) == 2
    m = index.match(seq + [42])
    assert m.block_ids == table[:2] and m.num_tokens == 8
    assert index.match(seq[:7]).block_ids == table[:1]
    assert index.match([0, 1, 2, 9]).num_tokens == 0
    assert index.stats.queries == 4 and index.stats.hits == 2 and index.stats.hit_tokens == 12


def test_extra_key_isolation():
    pool, index = make()
    seq = list(range(8))
    run_request(pool, index, seq, key="model-a")
    assert index.match(seq, "model-b").num_tokens == 0
    assert index.match(seq, b"model-a").num_tokens == 8
    assert chain_hashes(seq, P, "a") != chain_hashes(seq, P, "b")
    run_request(pool, index, seq, key="model-b")
    assert len(index) == 4  # no block shared across namespaces


def test_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(radix, "block_hash", lambda parent, tokens, key: b"collide")
    pool, index = make()
    run_request(pool, index, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(index) == 1  # block 2 collides with block 1: stays uncached
    assert index.match([9, 9, 9, 9]).num_tokens == 0
    assert index.match([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 4
    run_request(pool, index, [9, 9, 9, 9])
    assert index.match([9, 9, 9, 9]).num_tokens == 0
    index.check_integrity()


def test_duplicate_insert_keeps_first_and_returns_redundant():
    pool, index = make()
    seq = list(range(8))
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert index.insert(seq, a) == []
    assert index.insert(seq, b) == b
    assert index.match(seq).block_ids == a
    pool.decref(a + b)
    assert pool.num_free == 16 - 2  # b's blocks were never cached: freed
    index.check_integrity()


def test_lru_evicts_leaves_least_recent_first():
    pool, index = make(8)
    ta = run_request(pool, index, [1] * 8)  # chain A0 -> A1
    tb = run_request(pool, index, [2] * 8)  # chain B0 -> B1
    index.match([1] * 8)  # A is now more recent than B
    assert index.evict(1) == 1
    assert index.match([2] * 8).block_ids == tb[:1]  # B's leaf went first
    # touching B0 made it newest: A1 (leaf) is next, then A0, then B0
    assert index.evict(2) == 2
    assert index.match([1] * 8).num_tokens == 0
    assert len(index) == 1 and index.cached_hashes() == {chain_hashes([2] * 4, P)[0]}
    assert pool.num_free == 8 - 1 and ta[0] not in pool.cached_ids()
    index.check_integrity()


def test_eviction_never_frees_referenced_blocks():
    pool, index = make(4)
    seq = list(range(16))
    table = pool.allocate(4)
    index.insert(seq, table)
    assert index.evict(4) == 0 and pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.decref(table[2:])  # the request lets go of its last two blocks
    assert index.evict(4) == 2  # the leaf, then its parent; the held head stays
    assert pool.cached_ids() == set(table[:2]) and pool.num_free == 2
    index.check_integrity()


def test_allocate_evicts_on_demand_and_emits_events():
    pool, index = make(4)
    table = run_request(pool, index, list(range(16)))
    assert pool.num_free == 0 and pool.num_cached_unreferenced == 4
    got = pool.allocate(3)  # evicts the three deepest blocks
    assert sorted(got) == sorted(table[1:])
    events = index.drain_events()
    assert isinstance(events[0], BlockStored) and events[0].parent_hash is None
    assert events[0].block_ids == tuple(table)
    assert isinstance(events[1], BlockRemoved) and len(events[1].block_hashes) == 3
    index.clear()
    assert index.drain_events() == [AllBlocksCleared()]
    assert pool.num_free == 1 and len(index) == 0
    index.check_integrity()


def test_held_leaf_keeps_its_chain():
    pool, index = make(4)
    table = run_request(pool, index, list(range(12)))
    pool.incref(index.match(list(range(12))).block_ids)
    assert index.evict(3) == 0
    pool.decref(table)
    assert index.evict(3) == 3
    index.check_integrity()


def test_check_integrity_catches_broken_hash():
    pool, index = make()
    run_request(pool, index, list(range(8)))
    node = next(iter(index._by_hash.values()))
    node.tokens = (9, 9, 9, 9)
    with pytest.raises(AssertionError, match="hash"):
        index.check_integrity()


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random requests sharing prefixes over a small pool; every invariant after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, P)
        self.index = PrefixIndex(self.pool, P)
        self.mirror = EventMirror()
        self.running: list[tuple[list[int], str, list[int]]] = []  # (tokens, key, table)

    @precondition(lambda self: len(self.running) < 4)
    @rule(
        prefix=st.sampled_from([[], [1] * P, [1] * P + [2] * P, [3] * P]),
        tail=st.lists(st.integers(0, 3), max_size=3 * P),
        key=st.sampled_from(["", "lora"]),
        cut=st.integers(0, 4 * P),
    )
    def start(self, prefix: list[int], tail: list[int], key: str, cut: int) -> None:
        tokens = prefix + tail
        m = self.index.match(tokens, key)
        assert m.num_tokens % P == 0 and m.num_tokens <= len(tokens)
        self.pool.incref(m.block_ids)
        need = -(-len(tokens) // P) - len(m.block_ids)
        referenced = sum(self.pool.refcount(b) > 0 for b in range(self.pool.num_blocks))
        try:
            table = m.block_ids + self.pool.allocate(need)
        except NoFreeBlocks:
            now = sum(self.pool.refcount(b) > 0 for b in range(self.pool.num_blocks))
            assert now == referenced  # nothing was allocated
            self.pool.decref(m.block_ids)
            return
        self.index.insert(tokens[:cut], table, key)  # prefilled so far (chunked)
        self.running.append((tokens, key, table))

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def reinsert(self, i: int) -> None:
        tokens, key, table = self.running[i % len(self.running)]
        redundant = self.index.insert(tokens, table, key)
        assert not set(redundant) & self.pool.cached_ids()
        m = self.index.match(tokens, key)
        if m.block_ids == table[: len(m.block_ids)]:  # the chain is the request's own blocks
            assert m.num_tokens == len(tokens) // P * P
        else:  # another request cached this content first: ours past it stay uncached
            assert set(m.block_ids) - set(table) and redundant

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 10))
    def finish(self, i: int) -> None:
        self.pool.decref(self.running.pop(i % len(self.running))[2])

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        held = {b for *_, t in self.running for b in t}
        assert self.index.evict(n) <= n
        assert held <= {b for b in range(self.pool.num_blocks) if self.pool.refcount(b)}

    @rule()
    def clear(self) -> None:
        self.index.clear()

    @invariant()
    def consistent(self) -> None:
        self.index.check_integrity()
        for *_, t in self.running:
            assert all(self.pool.refcount(b) > 0 for b in t)
        self.mirror.apply(self.index.drain_events())
        assert self.mirror.hashes == self.index.cached_hashes()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
