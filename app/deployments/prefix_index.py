"""The Router's global prefix index: which DP rank holds which prefix blocks.

Keyed by the engine's chained block hashes (:func:`app.cache.radix.chain_hashes`): a hash names
a whole prefix, so a rank holding block ``i`` of a prompt's chain holds blocks ``0..i`` too (the
engine evicts leaves first). Each entry is a bit mask of ranks (rank ``r`` = bit ``slot(r)``):

    hashes of a prompt:   h0    h1    h2    h3
    entries:              0b011 0b011 0b001 -         rank A = bit 0, rank B = bit 1
    match -> {A: 3 blocks, B: 2 blocks}

Fed by the ranks' KV events (:mod:`app.cache.events`): ``stored`` sets a rank's bit,
``removed`` clears it, ``cleared`` / a snapshot reload / a dead rank clear it everywhere.
``offloaded`` / ``loaded`` keep the bit and set / clear it in a second map of host-tier
blocks (``host_blocks``: a hit there is a copy, not a prefill, but not free either).
Requests the Router has just sent to a rank count as *pending* there (a short TTL) until the
rank's events confirm them, so a burst of a new prefix follows its first request instead of
scattering before the first prefill lands. Memory is bounded: beyond ``max_entries`` the least
recently used entry goes (the router then under-counts a hit, never invents one).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from app.cache.events import CLEARED, LOADED, OFFLOADED, REMOVED, STORED, KVSnapshot, WireEvent
from app.cache.radix import BlockHash


def bits(mask: int) -> Iterable[int]:
    """Set bit positions of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GlobalPrefixIndex:
    """Ranks -> cached prefix blocks, as one LRU map of block hash -> rank bit mask, plus
    pending claims (hash -> (mask, time)). ``held(rank)`` counts the hashes a rank holds or
    claims, kept up to date at every change (the policy places a new prefix on the emptiest
    rank)."""

    def __init__(self, max_entries: int = 4_000_000, pending_ttl_s: float = 30.0) -> None:
        self.max_entries = max_entries
        self.pending_ttl_s = pending_ttl_s
        self._entries: OrderedDict[BlockHash, int] = OrderedDict()
        self._pending: OrderedDict[BlockHash, tuple[int, float]] = OrderedDict()
        self._host: dict[BlockHash, int] = {}  # hash -> ranks holding it in their host tier
        self._slot: dict[str, int] = {}  # rank id -> bit
        self._free_slots: list[int] = []
        self._held: dict[int, int] = {}  # bit -> hashes held or claimed there
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
            self._held[s] = 0
        return s

    def held(self, rank: str) -> int:
        """Hashes ``rank`` holds or has just been sent (O(1))."""
        s = self._slot.get(rank)
        return self._held.get(s, 0) if s is not None else 0

    def clear_rank(self, rank: str) -> None:
        """Forget everything ``rank`` holds (its cache was cleared or is being reloaded)."""
        s = self._slot.get(rank)
        if s is not None:
            self._clear_bit(s)

    def drop_rank(self, rank: str) -> None:
        """Forget ``rank`` altogether (dead or drained); its bit is reused."""
        s = self._slot.pop(rank, None)
        if s is not None:
            self._clear_bit(s)
            self._free_slots.append(s)

    def _clear_bit(self, s: int) -> None:
        bit = 1 << s
        for h in [h for h, m in self._host.items() if m & bit]:
            self._set_host(h, bit, False)
        entries = self._entries
        for h in [h for h, m in entries.items() if m & bit]:
            m = entries[h] & ~bit
            if m:
                entries[h] = m
            else:
                del entries[h]
        for h in [h for h, (m, _) in self._pending.items() if m & bit]:
            m, t = self._pending[h]
            if m & ~bit:
                self._pending[h] = (m & ~bit, t)
            else:
                del self._pending[h]
        self._held[s] = 0

    def blocks_of(self, rank: str) -> int:
        """How many entries hold ``rank`` (confirmed only; O(entries): tests and reports)."""
        s = self._slot.get(rank)
        if s is None:
            return 0
        bit = 1 << s
        return sum(1 for m in self._entries.values() if m & bit)

    # ---- bookkeeping ------------------------------------------------------------------
    def _mask(self, h: BlockHash) -> int:
        p = self._pending.get(h)
        return self._entries.get(h, 0) | (p[0] if p is not None else 0)

    def _count(self, old: int, new: int) -> None:
        """A hash's ranks (confirmed | pending) went from ``old`` to ``new``."""
        held = self._held
        for s in bits(new & ~old):
            held[s] = held.get(s, 0) + 1
        for s in bits(old & ~new):
            held[s] = held.get(s, 0) - 1

    def _set(self, h: BlockHash, entry: int, pending: int, t: float = 0.0) -> None:
        """Set hash ``h``'s confirmed and pending masks (0 removes), keeping the counts."""
        old = self._mask(h)
        if entry:
            self._entries[h] = entry
            self._entries.move_to_end(h)
        else:
            self._entries.pop(h, None)
        if pending:
            self._pending[h] = (pending, t)
            self._pending.move_to_end(h)
        else:
            self._pending.pop(h, None)
        self._count(old, entry | pending)

    def _set_host(self, h: BlockHash, bit: int, on: bool) -> None:
        m = (self._host.get(h, 0) | bit) if on else (self._host.get(h, 0) & ~bit)
        if m:
            self._host[h] = m
        else:
            self._host.pop(h, None)

    def _pending_mask(self, h: BlockHash) -> tuple[int, float]:
        return self._pending.get(h, (0, 0.0))

    # ---- events -----------------------------------------------------------------------
    def apply(self, rank: str, events: Sequence[WireEvent]) -> None:
        """A rank's KV events, oldest first."""
        bit = 1 << self.slot(rank)
        for kind, hashes in events:
            if kind in (STORED, LOADED, OFFLOADED):
                if self._host or kind == OFFLOADED:
                    for h in hashes:
                        self._set_host(h, bit, kind == OFFLOADED)
                self._store(bit, hashes)
            elif kind == REMOVED:  # also ends a pending claim there: the rank said so
                for h in hashes:
                    pm, t = self._pending_mask(h)
                    self._set(h, self._entries.get(h, 0) & ~bit, pm & ~bit, t)
                    if self._host:
                        self._set_host(h, bit, False)
            elif kind == CLEARED:
                self.clear_rank(rank)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}")

    def load_snapshot(self, rank: str, snap: KVSnapshot) -> None:
        """Replace what ``rank`` holds by ``snap``'s hashes."""
        self.clear_rank(rank)
        bit = 1 << self.slot(rank)
        self._store(bit, snap.hashes)
        for h in snap.host_hashes:
            self._set_host(h, bit, True)

    def _store(self, bit: int, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:  # confirmed: no longer only pending there
            pm, t = self._pending_mask(h)
            self._set(h, self._entries.get(h, 0) | bit, pm & ~bit, t)
        while len(self._entries) > self.max_entries:
            h = next(iter(self._entries))
            pm, t = self._pending_mask(h)
            self._set(h, 0, pm, t)
            self.evicted += 1

    def note_routed(self, rank: str, hashes: Sequence[BlockHash], now: float | None = None) -> None:
        """``rank`` was just sent a prompt with ``hashes``: count them as held there until its
        events say so (or ``pending_ttl_s`` passes)."""
        now = time.monotonic() if now is None else now
        bit = 1 << self.slot(rank)
        for h in hashes:
            m = self._entries.get(h, 0)
            if not m & bit:  # not confirmed there yet
                pm, _ = self._pending_mask(h)
                self._set(h, m, pm | bit, now)
        expire, pending = now - self.pending_ttl_s, self._pending
        while pending:
            h, (pm, t) = next(iter(pending.items()))
            if t > expire and len(pending) <= self.max_entries:
                break
            self._set(h, self._entries.get(h, 0), 0)

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

    def host_blocks(self, hashes: Sequence[BlockHash], rank: str, n: int) -> int:
        """How many of the first ``n`` of ``hashes`` ``rank`` holds in its host tier."""
        if not self._host or not n:
            return 0
        bit = 1 << self.slot(rank)
        host = self._host
        return sum(1 for h in hashes[:n] if host.get(h, 0) & bit)

    def check_counts(self) -> None:
        """``held`` agrees with the tables (tests)."""
        want: dict[int, int] = dict.fromkeys(self._held, 0)
        for h in set(self._entries) | set(self._pending):
            for s in bits(self._mask(h)):
                want[s] = want.get(s, 0) + 1
        assert {k: v for k, v in want.items() if v} == {k: v for k, v in self._held.items() if v}, (
            want,
            self._held,
        )
