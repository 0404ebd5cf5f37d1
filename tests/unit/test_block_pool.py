"""BlockPool: deterministic allocation, ref counts, all-or-nothing, integrity checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.cache.block_pool import BlockPool, CacheIntegrityError, NoFreeBlocks


def test_allocate_lowest_ids_first_and_reuse():
    pool = BlockPool(8, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.decref([1, 3])
    assert pool.allocate(3) == [1, 3, 5]
    assert pool.num_free == 2 and pool.usage == pytest.approx(6 / 8)
    pool.check_integrity()


def test_no_free_blocks_is_all_or_nothing():
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks) as e:
        pool.allocate(2)
    assert (e.value.asked, e.value.free) == (2, 1)
    assert pool.num_free == 1
    assert pool.allocate(1) == [3]
    pool.check_integrity()


def test_refcounts_keep_blocks_until_last_decref():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.decref([b])
    assert pool.refcount(b) == 1 and pool.num_free == 3
    pool.decref([b])
    assert pool.refcount(b) == 0 and pool.num_free == 4
    with pytest.raises(ValueError):
        pool.decref([b])
    with pytest.raises(ValueError):
        pool.incref([b])


def test_cached_blocks_stay_out_of_the_free_list():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(2)
    pool.hold_cached(a)
    pool.decref([a, b])
    assert pool.num_free == 3 and pool.num_cached_unreferenced == 1 and pool.num_available == 4
    pool.check_integrity()
    pool.release_cached(a)
    assert pool.num_free == 4 and pool.num_cached_unreferenced == 0
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(4, 16)
    pool.allocate(2)
    pool._ref[0] = 0  # referenced-but-zero: neither free, held nor cached
    with pytest.raises(CacheIntegrityError, match="block 0"):
        pool.check_integrity()
    pool = BlockPool(4, 16)
    pool._free_heap.append(0)
    with pytest.raises(CacheIntegrityError, match="duplicate"):
        pool.check_integrity()


def test_blocks_for_budget():
    assert BlockPool.blocks_for_budget(1000, 300) == 3
    assert BlockPool.blocks_for_budget(-5, 300) == 0
    with pytest.raises(ValueError):
        BlockPool.blocks_for_budget(1000, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_random_allocate_free_keeps_partition(ops):
    pool = BlockPool(12, 4)
    held: list[int] = []
    for alloc, n in ops:
        if alloc:
            before = pool.num_free
            try:
                held += pool.allocate(n)
            except NoFreeBlocks:
                assert n > before and pool.num_free == before
        elif held:
            k = min(n, len(held))
            pool.decref(held[:k])
            del held[:k]
        pool.check_integrity()
        assert pool.num_free + len(held) == pool.num_blocks
