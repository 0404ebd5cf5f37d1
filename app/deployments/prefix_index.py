"""The Router's global prefix index: which DP rank holds which prefix blocks.

Keyed by the engine's chained block hashes (:func:`app.cache.radix.chain_hashes`): a hash names
a whole prefix, so a rank holding block ``i`` of a prompt's chain holds blocks ``0..i`` too (the
engine evicts leaves first). Each entry is a bit mask of ranks (rank ``r`` = bit ``slot(r)``):

    hashes of a prompt:   h0    h1    h2    h3
    entries:              0b011 0b011 0b001 -         rank A = bit 0, rank B = bit 1
    match -> {A: 3 blocks, B: 2 blocks}

Fed by the ranks' KV events (:mod:`app.cache.events`): ``stored`` sets a rank's bit,
``removed`` clears it, ``cleared`` / a snapshot reload / a dead rank clear it everywhere.
Requests the Router has just sent to a rank count as *pending* there (a short TTL) until the
rank's events confirm them, so a burst of a new prefix follows its first request instead of
scattering before the first prefill lands. Memory is bounded: beyond ``max_entries`` the least
recently used entry goes (the router then under-counts a hit, never invents one).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from app.cache.events import CLEARED, REMOVED, STORED, KVSnapshot, WireEvent
from app.cache.radix import BlockHash


def bits(mask: int) -> Iterable[int]:
    """Set bit positions of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GlobalPrefixIndex:
    """Ranks -> cached prefix blocks, as one LRU map of block hash -> rank bit mask."""

    def __init__(self, max_entries: int = 4_000_000, pending_ttl_s: float = 30.0) -> None:
        self.max_entries = max_entries
        self.pending_ttl_s = pending_ttl_s
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()
        self._pending: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self._slot: dict[str, int] = {}  # rank id -> bit
        self._free_slots: list[int] = []
        self.evicted = 0  # entries dropped by the LRU bound

    def __len__(self) -> int:
        return len(self._entries)

    # ---- ranks ------------------------------------------------------------------------
    def slot(self, rank: str) -> int:
        """The bit of ``rank`` (allocated on first use)."""
        s = self._slot.get(rank)
        if s is None:
            s = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[rank] = s
        return s

    def mask_of(self, ranks: Iterable[str]) -> int:
        m = 0
        for r in ranks:
            m |= 1 << self.slot(r)
        return m

    def rank_of_slot(self) -> dict[int, str]:
        return {s: r for r, s in self._slot.items()}

    def clear_rank(self, rank: str) -> None:
        """Forget everything ``rank`` holds (its cache was cleared or is being reloaded)."""
        s = self._slot.get(rank)
        if s is None:
            return
        self._clear_bit(~(1 << s))

    def drop_rank(self, rank: str) -> None:
        """Forget ``rank`` altogether (dead or drained); its bit is reused."""
        s = self._slot.pop(rank, None)
        if s is not None:
            self._clear_bit(~(1 << s))
            self._free_slots.append(s)

    def _clear_bit(self, keep: int) -> None:
        entries = self._entries
        changed = [(h, m & keep) for h, m in entries.items() if m & ~keep]
        for h, m in changed:
            if m:
                entries[h] = m
            else:
                del entries[h]
        for h, (m, t) in list(self._pending.items()):
            if m & keep:
                self._pending[h] = (m & keep, t)
            else:
                del self._pending[h]

    def blocks_of(self, rank: str) -> int:
        """How many entries hold ``rank`` (O(entries): for tests and reports)."""
        s = self._slot.get(rank)
        if s is None:
            return 0
        bit = 1 << s
        return sum(1 for m in self._entries.values() if m & bit)

    # ---- events -----------------------------------------------------------------------
    def apply(self, rank: str, events: Sequence[WireEvent]) -> None:
        """A rank's KV events, oldest first."""
        bit = 1 << self.slot(rank)
        for kind, hashes in events:
            if kind == STORED:
                self._store(bit, hashes)
            elif kind == REMOVED:  # also ends a pending claim there: the rank said so
                for table in (self._entries, self._pending):
                    for h in hashes:
                        v = table.get(h)
                        if v is None:
                            continue
                        m = v if isinstance(v, int) else v[0]
                        if not m & ~bit:
                            del table[h]
                        else:
                            table[h] = m & ~bit if isinstance(v, int) else (m & ~bit, v[1])
            elif kind == CLEARED:
                self.clear_rank(rank)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")

    def load_snapshot(self, rank: str, snap: KVSnapshot) -> None:
        """Replace what ``rank`` holds by ``snap``'s hashes."""
        self.clear_rank(rank)
        self._store(1 << self.slot(rank), snap.hashes)

    def _store(self, bit: int, hashes: Iterable[BlockHash]) -> None:
        entries, pending = self._entries, self._pending
        for h in hashes:
            entries[h] = entries.get(h, 0) | bit
            entries.move_to_end(h)
            p = pending.get(h)
            if p is not None:  # confirmed: no longer only pending there
                if p[0] & ~bit:
                    pending[h] = (p[0] & ~bit, p[1])
                else:
                    del pending[h]
        while len(entries) > self.max_entries:
            entries.popitem(last=False)
            self.evicted += 1

    def note_routed(self, rank: str, hashes: Sequence[BlockHash], now: float | None = None) -> None:
        """``rank`` was just sent a prompt with ``hashes``: count them as held there until its
        events say so (or ``pending_ttl_s`` passes)."""
        now = time.monotonic() if now is None else now
        bit, pending = 1 << self.slot(rank), self._pending
        for h in hashes:
            p = pending.get(h)
            pending[h] = ((p[0] if p else 0) | bit, now)
            pending.move_to_end(h)
        expire = now - self.pending_ttl_s
        while pending:
            h, (_, t) = next(iter(pending.items()))
            if t > expire and len(pending) <= self.max_entries:
                break
            pending.popitem(last=False)

    # ---- lookup -----------------------------------------------------------------------
    def match(
        self, hashes: Sequence[BlockHash], ranks: Iterable[str], now: float | None = None
    ) -> dict[str, tuple[int, int]]:
        """For each of ``ranks``: (leading blocks of ``hashes`` it holds, of which confirmed
        by its events). Touches the matched entries for the LRU."""
        now = time.monotonic() if now is None else now
        live = {self.slot(r): r for r in ranks}
        cur = 0
        for s in live:
            cur |= 1 << s
        out = {r: (0, 0) for r in live.values()}
        confirmed_cur = cur
        confirmed = {r: 0 for r in live.values()}
        entries, pending = self._entries, self._pending
        expire = now - self.pending_ttl_s
        depth = 0
        for h in hashes:
            m = entries.get(h, 0)
            if m:
                entries.move_to_end(h)
            p = pending.get(h)
            held = m | (p[0] if p is not None and p[1] > expire else 0)
            nxt_confirmed = confirmed_cur & m  # confirmed is a subset of held: first
            for s in bits(confirmed_cur & ~nxt_confirmed):
                confirmed[live[s]] = depth
            nxt = cur & held
            for s in bits(cur & ~nxt):
                out[live[s]] = (depth, confirmed[live[s]])
            cur, confirmed_cur = nxt, nxt_confirmed
            if not cur:
                break
            depth += 1
        for s in bits(confirmed_cur):
            confirmed[live[s]] = depth
        for s in bits(cur):
            out[live[s]] = (depth, confirmed[live[s]])
        return out
