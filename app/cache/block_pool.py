"""Ref-counted pool of KV blocks (pure Python, no device memory).

One block = ``block_size`` consecutive token positions of one sequence; a block id indexes every
paged cache group at once (compressed KV and index keys of every layer that owns them).

Every block is in exactly one of three states::

                 allocate                 decref to 0, not cached
      FREE ----------------> REFERENCED ------------------------> FREE
        ^                    (ref >= 1)
        |                       |    ^
        | evict                 |    | incref (prefix hit)
        | (release_cached)      v    |   decref to 0, cached
        +---------------- CACHED-UNREFERENCED ("evictable", owned by the prefix index)

"Cached" is a flag the prefix index sets on a referenced block (``hold_cached``, from
``PrefixIndex.insert``) and clears when it evicts or forgets the block (``release_cached``).

The free list hands out the **lowest free id first** (a heap): allocation is deterministic and
keeps the live set compact. A prefix index attaches itself as the pool's :class:`CacheListener`:
the pool tells it when a cached block gains or loses its last reference (so it can keep its LRU
structure exact), and asks it to evict when ``allocate`` finds too few free blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Protocol


class NoFreeBlocks(RuntimeError):
    """``allocate(n)`` could not find ``n`` blocks even after eviction; nothing was allocated."""

    def __init__(self, asked: int, free: int):
        super().__init__(f"asked for {asked} blocks, {free} free (after eviction)")
        self.asked = asked
        self.free = free


class CacheIntegrityError(AssertionError):
    """A cache invariant does not hold (raised by ``check_integrity``)."""


def check(cond: bool, msg: str) -> None:
    """Raise :class:`CacheIntegrityError` with ``msg`` unless ``cond``."""
    if not cond:
        raise CacheIntegrityError(msg)


class CacheListener(Protocol):
    """What a pool needs from the prefix index that caches some of its blocks."""

    def on_referenced(self, block_ids: list[int]) -> None:
        """Cached blocks went from 0 to 1 reference: no longer evictable."""

    def on_unreferenced(self, block_ids: list[int]) -> None:
        """Cached blocks lost their last reference: evictable (once they are leaves)."""

    def evict(self, n_blocks: int) -> int:
        """Free up to ``n_blocks`` cached, unreferenced blocks; return how many were freed."""
        ...


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with reference counts and a free list."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive: {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._cached = bytearray(num_blocks)  # 1 = registered in the prefix index
        self._is_free = bytearray(b"\x01" * num_blocks)
        self._free_heap = list(range(num_blocks))  # sorted list is a valid heap
        self._num_cached_unreferenced = 0
        self._listener: CacheListener | None = None

    @staticmethod
    def blocks_for_budget(bytes_budget: int, bytes_per_block: int) -> int:
        """How many whole blocks fit in ``bytes_budget``: ``blocks_for_budget(1000, 300) == 3``."""
        if bytes_per_block <= 0:
            raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
        return max(0, bytes_budget) // bytes_per_block

    def attach(self, listener: CacheListener) -> None:
        """Register the (single) prefix index that caches blocks of this pool."""
        if self._listener is not None:
            raise ValueError("a prefix index is already attached to this pool")
        self._listener = listener

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (cached-but-unreferenced blocks not included)."""
        return len(self._free_heap)

    @property
    def num_cached_unreferenced(self) -> int:
        """Cached blocks nobody references: reclaimable by eviction."""
        return self._num_cached_unreferenced

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out: free + evictable."""
        return len(self._free_heap) + self._num_cached_unreferenced

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as unused)."""
        return 1.0 - self.num_available / self.num_blocks

    def refcount(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return bool(self._cached[block_id])

    def cached_ids(self) -> set[int]:
        return {b for b in range(self.num_blocks) if self._cached[b]}

    # ---- requests -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1, lowest ids first; evicts cached blocks if needed.

        All-or-nothing: raises :class:`NoFreeBlocks` and allocates nothing when ``n`` blocks
        cannot be found. (If eviction ran first, the evicted blocks stay free, not lost.)
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available:
            raise NoFreeBlocks(n, self.num_available)
        short = n - len(self._free_heap)
        if short > 0 and self._listener is not None:
            self._listener.evict(short)
        if n > len(self._free_heap):
            raise NoFreeBlocks(n, len(self._free_heap))
        out = [heapq.heappop(self._free_heap) for _ in range(n)]
        for b in out:
            self._is_free[b] = 0
            self._ref[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more reference to each block; a block must be referenced or cached (not free)."""
        revived: list[int] = []
        for b in block_ids:
            if self._is_free[b]:
                raise ValueError(f"incref of free block {b}")
            if self._ref[b] == 0:  # cached and unreferenced -> held again
                self._num_cached_unreferenced -= 1
                revived.append(b)
            self._ref[b] += 1
        if revived and self._listener is not None:
            self._listener.on_referenced(revived)

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; at 0 a block is freed, or becomes evictable if cached."""
        idle: list[int] = []
        for b in block_ids:
            if self._ref[b] <= 0:
                raise ValueError(f"decref of unreferenced block {b}")
            self._ref[b] -= 1
            if self._ref[b]:
                continue
            if self._cached[b]:
                self._num_cached_unreferenced += 1
                idle.append(b)
            else:
                self._push_free(b)
        if idle and self._listener is not None:
            self._listener.on_unreferenced(idle)

    # ---- prefix index only --------------------------------------------------------------
    def hold_cached(self, block_id: int) -> None:
        """Mark a referenced block as cached: at refcount 0 it stays out of the free list."""
        if self._ref[block_id] <= 0 or self._cached[block_id]:
            raise ValueError(f"block {block_id} must be referenced and not yet cached")
        self._cached[block_id] = 1

    def release_cached(self, block_id: int) -> None:
        """Unmark a cached block; an unreferenced one goes back to the free list."""
        if not self._cached[block_id]:
            raise ValueError(f"block {block_id} is not cached")
        self._cached[block_id] = 0
        if self._ref[block_id] == 0:
            self._num_cached_unreferenced -= 1
            self._push_free(block_id)

    def _push_free(self, b: int) -> None:
        self._is_free[b] = 1
        heapq.heappush(self._free_heap, b)

    # ---- invariants ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Every block is in exactly one of free / referenced / cached-unreferenced."""
        free = set(self._free_heap)
        check(len(free) == len(self._free_heap), "duplicate block on the free list")
        n_idle = 0
        for b in range(self.num_blocks):
            ref, cached, is_free = self._ref[b], self._cached[b], self._is_free[b]
            check(ref >= 0, f"block {b} has refcount {ref}")
            check(bool(is_free) == (b in free), f"block {b}: free flag disagrees with free list")
            if is_free:
                check(ref == 0 and not cached, f"free block {b}: ref={ref} cached={cached}")
            else:
                check(ref > 0 or cached, f"block {b} is neither free, referenced nor cached")
                n_idle += ref == 0
        check(
            n_idle == self._num_cached_unreferenced,
            f"cached-unreferenced count {self._num_cached_unreferenced} != actual {n_idle}",
        )
