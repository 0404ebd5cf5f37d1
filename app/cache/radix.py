"""Prefix index over full blocks: chained block hashes -> block ids, LRU eviction, KV events.

Block ``i`` of a sequence hashes its tokens together with its parent's hash and an extra key
(model / adapter / salt namespace): ``h_i = H(h_{i-1}, tokens[i*P:(i+1)*P], extra_key)``, so a
hash names a whole prefix. Only full blocks are cached; a partial last block never is.
With P = 4, tokens ``[5,6,7,8, 9,9,9,9, 1,2]`` -> two cacheable blocks ``h_0, h_1``; ``[1,2]``
stays with the request.

The index is a tree (one node per cached block, children keyed by hash)::

      root ── A(r=0) ── B(r=1) ── C(r=1)        r = pool refcount
        │           └── D(r=0)                  evictable = {D, E}: unreferenced leaves
        └── E(r=0)                              (A has children, B and C are held)

Invariant: a node is evicted only when it is a leaf with refcount 0, so every cached block's
parent is cached too and a match walks an unbroken chain from the root. Evicting D makes A a
leaf; A then competes in LRU order with its own last-access time. ``_evictable`` holds exactly
the unreferenced leaves; a heap of ``(last_access, block_id)`` orders them (stale heap entries
are skipped and compacted).

A hash hit is verified against the stored parent, tokens and extra key: a hash collision reads
as a miss, never as another sequence's KV.

Reference counts live in :class:`BlockPool`; the index keeps "cached" blocks out of the free
list until it evicts them. Callers hold what they use: ``m = index.match(ids)`` then
``pool.incref(m.block_ids)`` before the next ``allocate`` (which may evict).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.cache.block_pool import BlockPool, check

BlockHash = bytes


def block_hash(parent: BlockHash | None, tokens: Sequence[int], extra_key: bytes) -> BlockHash:
    """Stable 128-bit hash of one block, chained on ``parent`` (None for the first block)."""
    h = hashlib.blake2b(digest_size=16, person=b"fathom-block")
    p = parent or b""
    h.update(struct.pack("<BI", len(p), len(extra_key)))
    h.update(p)
    h.update(extra_key)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def as_key(extra_key: str | bytes) -> bytes:
    return extra_key.encode() if isinstance(extra_key, str) else bytes(extra_key)


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: str | bytes = ""
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (what the router matches on)."""
    key, out, parent = as_key(extra_key), [], None
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], key)
        out.append(parent)
    return out


# ---- KV events ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockStored:
    """Consecutive new blocks of one chain; ``parent_hash`` None when the first is a root."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    extra_key: bytes


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventMirror:
    """The set of cached hashes, rebuilt from a KV event stream (a router's view of one rank)."""

    def __init__(self) -> None:
        self.hashes: set[BlockHash] = set()

    def apply(self, events: Sequence[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.hashes.difference_update(e.block_hashes)
            else:
                self.hashes.clear()

    def match_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` (from :func:`chain_hashes`) this mirror holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n


# ---- index ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    block_ids: list[int]
    num_tokens: int


@dataclass
class PrefixStats:
    queries: int = 0
    hits: int = 0  # queries that matched at least one block
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(eq=False)
class _Node:
    hash: BlockHash
    parent: _Node | None
    tokens: tuple[int, ...]
    block_id: int
    extra_key: bytes
    last_access: int = 0
    children: dict[BlockHash, _Node] = field(default_factory=dict)


class PrefixIndex:
    """Prefix cache of full blocks of ``pool``; attaches itself as the pool's listener."""

    def __init__(self, pool: BlockPool, block_size: int):
        if block_size != pool.block_size:
            raise ValueError(f"block_size {block_size} != pool.block_size {pool.block_size}")
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixStats()
        self._root = _Node(b"", None, (), -1, b"")
        self._by_hash: dict[BlockHash, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self._evictable: dict[int, int] = {}  # block id -> last_access of its heap entry
        self._heap: list[tuple[int, int]] = []  # (last_access, block_id), may hold stale entries
        self._clock = 0
        self._events: list[KVEvent] = []
        pool.attach(self)

    def __len__(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._by_hash)

    def drain_events(self) -> list[KVEvent]:
        """Events since the last drain, oldest first."""
        out, self._events = self._events, []
        return out

    # ---- lookup ---------------------------------------------------------------------------
    def _verified(self, node: _Node, parent: _Node, tokens: tuple[int, ...], key: bytes) -> bool:
        """A hash hit really is ``parent`` + ``tokens`` under ``key`` (not a collision)."""
        return node.parent is parent and node.tokens == tokens and node.extra_key == key

    def _blocks(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        P = self.block_size
        return [tuple(token_ids[i * P : (i + 1) * P]) for i in range(len(token_ids) // P)]

    def match(
        self, token_ids: Sequence[int], extra_key: str | bytes = "", record: bool = True
    ) -> Match:
        """Longest cached prefix in whole blocks; touches it for LRU. Does not take references.
        ``record=False`` leaves the hit statistics alone (see :meth:`record`)."""
        key, node, found = as_key(extra_key), self._root, []
        for tokens in self._blocks(token_ids):
            nxt = self._by_hash.get(block_hash(node.hash or None, tokens, key))
            if nxt is None or not self._verified(nxt, node, tokens, key):
                break
            node = nxt
            found.append(node)
        self._clock += 1
        for n in found:
            self._touch(n)
        num_tokens = len(found) * self.block_size
        if record:
            self.record(len(token_ids), num_tokens)
        return Match([n.block_id for n in found], num_tokens)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one query in the hit statistics."""
        self.stats.queries += 1
        self.stats.hits += bool(hit_tokens)
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit_tokens

    # ---- insertion ------------------------------------------------------------------------
    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], extra_key: str | bytes = ""
    ) -> list[int]:
        """Cache the full blocks of a sequence whose KV is written into ``block_ids``.

        The caller must hold a reference to each new block. Where a block with the same content
        is already cached under another id, the cached one is kept and the caller's id is
        returned as redundant (still owned by the caller; freed by its ``decref``); the caller's
        blocks after such a block stay uncached, since their parent in the index would be a
        block the caller does not hold. Insertion stops at a hash collision: the rest of the
        sequence simply stays uncached.
        """
        key, node = as_key(extra_key), self._root
        blocks = self._blocks(token_ids)[: len(block_ids)]
        self._clock += 1
        redundant: list[int] = []
        new: list[_Node] = []
        foreign = False  # walking blocks another request cached: the caller does not hold them
        try:
            for tokens, bid in zip(blocks, block_ids, strict=False):
                h = block_hash(node.hash or None, tokens, key)
                old = self._by_hash.get(h)
                if old is not None:
                    if not self._verified(old, node, tokens, key):
                        break  # collision: leave the rest uncached
                    if old.block_id != bid:
                        redundant.append(bid)
                        foreign = True
                    node = old
                    self._touch(node)
                    continue
                if foreign:
                    # Never hang a new block under a parent the caller does not reference: an
                    # unreferenced cached block must stay reclaimable by leaf eviction.
                    break
                if self.pool.refcount(bid) <= 0 or bid in self._by_block:
                    raise ValueError(f"block {bid} must be held by the caller and not yet cached")
                self._drop_evictable(node)  # gains a child: no longer a leaf
                child = _Node(h, node, tokens, bid, key, self._clock)
                node.children[h] = child
                self._by_hash[h] = child
                self._by_block[bid] = child
                self.pool.hold_cached(bid)
                new.append(child)
                node = child
        finally:
            self._emit_stored(new, key)
        return redundant

    def _emit_stored(self, new: list[_Node], key: bytes) -> None:
        if new:
            parent = new[0].parent
            self._events.append(
                BlockStored(
                    tuple(n.hash for n in new),
                    parent.hash if parent is not self._root else None,
                    tuple(t for n in new for t in n.tokens),
                    tuple(n.block_id for n in new),
                    key,
                )
            )

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, n_blocks: int) -> int:
        """Free up to ``n_blocks`` least-recently-used unreferenced leaves; return the count."""
        removed: list[BlockHash] = []
        while len(removed) < n_blocks and self._evictable:
            last, bid = heapq.heappop(self._heap)
            if self._evictable.get(bid) != last:
                continue  # stale entry
            del self._evictable[bid]
            node = self._by_block.pop(bid)
            del self._by_hash[node.hash]
            parent = node.parent
            assert parent is not None
            del parent.children[node.hash]
            self.pool.release_cached(bid)
            removed.append(node.hash)
            self._maybe_evictable(parent)
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return len(removed)

    def clear(self) -> None:
        """Forget every cached block (held blocks stay with their holders, uncached)."""
        for bid in self._by_block:
            self.pool.release_cached(bid)
        self._by_hash.clear()
        self._by_block.clear()
        self._root.children.clear()
        self._evictable.clear()
        self._heap.clear()
        self._events.append(AllBlocksCleared())

    # ---- pool callbacks -------------------------------------------------------------------
    def on_referenced(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self._drop_evictable(self._by_block[bid])

    def on_unreferenced(self, block_ids: list[int]) -> None:
        self._clock += 1
        for bid in block_ids:
            node = self._by_block[bid]
            node.last_access = self._clock
            self._maybe_evictable(node)

    # ---- LRU bookkeeping ----------------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        node.last_access = self._clock
        if node.block_id in self._evictable:
            self._push(node)

    def _maybe_evictable(self, node: _Node) -> None:
        if node is self._root or node.children or self.pool.refcount(node.block_id):
            return
        self._push(node)

    def _drop_evictable(self, node: _Node) -> None:
        self._evictable.pop(node.block_id, None)

    def _push(self, node: _Node) -> None:
        self._evictable[node.block_id] = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.block_id))
        if len(self._heap) > 2 * len(self._evictable) + 64:  # drop stale entries
            self._heap = [(t, b) for b, t in self._evictable.items()]
            heapq.heapify(self._heap)

    # ---- invariants -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Tree links, hashes, pool bookkeeping and the LRU set all agree."""
        self.pool.check_integrity()
        seen, stack = 0, [self._root]
        expect_evictable: dict[int, int] = {}
        while stack:
            parent = stack.pop()
            for h, node in parent.children.items():
                seen += 1
                bid = node.block_id
                check(node.parent is parent, f"block {bid}: parent link broken")
                check(node.hash == h and self._by_hash.get(h) is node, f"block {bid}: hash map")
                check(self._by_block.get(bid) is node, f"block {bid}: block map")
                check(len(node.tokens) == self.block_size, f"block {bid}: not a full block")
                same_key = parent is self._root or parent.extra_key == node.extra_key
                check(same_key, f"block {bid}: extra key differs from its parent's")
                recomputed = block_hash(parent.hash or None, node.tokens, node.extra_key)
                check(recomputed == h, f"block {bid}: hash does not recompute")
                check(self.pool.is_cached(bid), f"block {bid} cached here but not in the pool")
                check(node.last_access <= self._clock, f"block {bid}: last_access in the future")
                if not node.children and self.pool.refcount(bid) == 0:
                    expect_evictable[bid] = node.last_access
                stack.append(node)
        check(seen == len(self._by_hash) == len(self._by_block), "unreachable cached nodes")
        check(self.pool.cached_ids() == set(self._by_block), "pool cached set != index blocks")
        n_idle = sum(self.pool.refcount(b) == 0 for b in self._by_block)
        check(n_idle == self.pool.num_cached_unreferenced, "unreferenced cached count differs")
        check(self._evictable == expect_evictable, "LRU set != unreferenced leaves")
        heap = set(self._heap)
        check(all((t, b) in heap for b, t in self._evictable.items()), "LRU heap misses a leaf")
