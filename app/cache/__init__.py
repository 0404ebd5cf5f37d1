"""Paged KV cache bookkeeping: block pool, prefix index with KV events, byte accounting."""

from __future__ import annotations

from app.cache.block_pool import BlockPool, CacheIntegrityError, NoFreeBlocks
from app.cache.radix import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Match,
    PrefixIndex,
    chain_hashes,
)

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheIntegrityError",
    "Match",
    "NoFreeBlocks",
    "PrefixIndex",
    "chain_hashes",
]
