"""KV events on the wire: what a rank tells the router about its prefix cache.

The engine's :class:`~app.cache.radix.PrefixIndex` emits ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``; the engine loop drains them after every step into a :class:`KVEventLog`,
which numbers them (1, 2, ...) within an *epoch* (one engine instance: a restarted rank starts a
new epoch). A reader keeps the last sequence number it applied and asks for what follows:

    log.since(seq)  -> KVEventBatch (events seq+1 .. log.seq), or None when the log no longer
                       holds seq+1 (the reader fell behind the bounded log: resync)
    log.snapshot(h) -> KVSnapshot (every cached hash at log.seq), taken between steps

On the wire an event is ``(kind, hashes)``: the router needs only the chained block hashes
(tokens and block ids stay on the rank), so a batch of stored blocks costs 16 bytes a block.
The kind carries the tier: ``STORED`` / ``LOADED`` (now in device memory), ``OFFLOADED`` (moved
to the host tier, still cached on the rank), ``REMOVED`` (gone from both tiers).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from app.cache.radix import (
    AllBlocksCleared,
    BlockHash,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

# what the hashes are: the engine's chained block hash (app.cache.radix.block_hash). A router
# and a rank that disagree on it (or on the block size) must not compare hashes.
HASH_NAMESPACE = "fathom-block/blake2b-128/v1"

STORED, REMOVED, CLEARED, OFFLOADED, LOADED = 0, 1, 2, 3, 4
WireEvent = tuple[int, tuple[BlockHash, ...]]


def to_wire(event: KVEvent) -> WireEvent:
    if isinstance(event, BlockStored):
        return (STORED, event.block_hashes)
    if isinstance(event, BlockRemoved):
        return (REMOVED, event.block_hashes)
    if isinstance(event, BlockMoved):
        return (OFFLOADED if event.tier == "host" else LOADED, event.block_hashes)
    if isinstance(event, AllBlocksCleared):
        return (CLEARED, ())
    raise TypeError(f"not a KV event: {event!r}")


@dataclass(frozen=True)
class KVEventBatch:
    """Events ``first_seq .. first_seq + len(events) - 1`` of one epoch, oldest first."""

    epoch: str
    first_seq: int
    events: tuple[WireEvent, ...]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.events) - 1


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a rank's prefix cache holds after event ``seq`` of ``epoch``
    (``host_hashes``: those of them in its host tier)."""

    epoch: str
    seq: int
    hashes: tuple[BlockHash, ...]
    host_hashes: tuple[BlockHash, ...] = ()


class KVEventLog:
    """Numbered, bounded log of one engine's KV events (thread-safe: the engine loop appends,
    the rank's reporter reads)."""

    def __init__(self, max_events: int = 65536) -> None:
        self.epoch = uuid.uuid4().hex
        self._events: deque[WireEvent] = deque(maxlen=max_events)
        self._seq = 0  # number of the newest event (0: none yet)
        self._lock = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    def append(self, events: Iterable[KVEvent]) -> None:
        wire = [to_wire(e) for e in events]
        if wire:
            with self._lock:
                self._events.extend(wire)
                self._seq += len(wire)

    def since(self, seq: int) -> KVEventBatch | None:
        """Events after ``seq`` (an empty batch when there are none), or None when the log
        dropped some of them (the reader must load a snapshot)."""
        with self._lock:
            oldest = self._seq - len(self._events) + 1
            if seq + 1 < oldest or seq > self._seq:
                return None
            n = self._seq - seq
            events = tuple(self._events)[len(self._events) - n :] if n else ()
            return KVEventBatch(self.epoch, seq + 1, events)

    def snapshot(
        self, hashes: Sequence[BlockHash], host: Sequence[BlockHash] = ()
    ) -> KVSnapshot:
        """A snapshot at the current sequence number; ``hashes`` must be the cache's content
        after every appended event (the engine takes it between steps, after a drain), and
        ``host`` the part of it in the host tier."""
        with self._lock:
            return KVSnapshot(self.epoch, self._seq, tuple(hashes), tuple(host))
