"""A router's view of one rank's prefix cache, rebuilt from its KV event stream: what the
cache tests hold the emitted events to."""

from __future__ import annotations

from collections.abc import Sequence

from app.cache.radix import BlockHash, BlockMoved, BlockRemoved, BlockStored, KVEvent


class EventMirror:
    """The set of cached hashes, rebuilt from a KV event stream (a router's view of one rank)."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()
        self.host: set[BlockHash] = set()  # of those, in the host tier

    def apply(self, events: Sequence[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.hashes.difference_update(e.block_hashes)
                self.host.difference_update(e.block_hashes)
            elif isinstance(e, BlockMoved):
                (self.host.update if e.tier == "host" else self.host.difference_update)(
                    e.block_hashes
                )
            else:
                self.hashes.clear()
                self.host.clear()

    def match_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` (``radix.chain_hashes``) this mirror holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n
