"""A set of integer keys ordered by last-access time, popped oldest first (the prefix index's
eviction candidates: one set per tier).

A heap of ``(time, key)`` with lazy deletion: ``discard`` and re-``push`` leave stale heap
entries that ``pop`` skips (an entry is live when the set still maps its key to its time);
the heap is rebuilt when stale entries outnumber live ones::

    push(7, t=3); push(5, t=1); push(7, t=4)   heap (1,5) (3,7)* (4,7)   * stale
    pop() -> 5; pop() -> 7 (skips (3,7))
"""

from __future__ import annotations

import heapq


class LRUSet:
    """Keys with their last-access time; :meth:`pop` returns the least recently used."""

    def __init__(self) -> None:
        self._time: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._time)

    def __contains__(self, key: int) -> bool:
        return key in self._time

    def items(self) -> dict[int, int]:
        """key -> time of every member (a copy)."""
        return dict(self._time)

    def push(self, key: int, t: int) -> None:
        """Add ``key`` (or move it) at time ``t``."""
        self._time[key] = t
        heapq.heappush(self._heap, (t, key))
        if len(self._heap) > 2 * len(self._time) + 64:  # drop stale entries
            self._heap = [(t, k) for k, t in self._time.items()]
            heapq.heapify(self._heap)

    def discard(self, key: int) -> None:
        self._time.pop(key, None)

    def pop(self) -> int | None:
        """Remove and return the least recently used key (None when empty)."""
        while self._heap:
            t, key = heapq.heappop(self._heap)
            if self._time.get(key) == t:
                del self._time[key]
                return key
        return None

    def clear(self) -> None:
        self._time.clear()
        self._heap.clear()

    def heap_holds_all(self) -> bool:
        """Every member has its live heap entry (integrity checks)."""
        heap = set(self._heap)
        return all((t, k) in heap for k, t in self._time.items())
