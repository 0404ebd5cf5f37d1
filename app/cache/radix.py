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

With a host tier (:class:`~app.cache.host_tier.HostTier`) every node lives in one tier, and
along any path from the root the tiers read ``device* host*``::

      root ── A(dev, r=1) ── B(dev, r=0) ── C(host) ── D(host)
                         └── E(host)

Device eviction takes unreferenced device nodes without device children (B, then A once it is
unreferenced) and *demotes* them: the block is copied to a host block and the node stays in
the index (``BlockMoved(..., "host")``); only when the host tier is full do host leaves go, LRU
(``BlockRemoved``). A match returns the device prefix and the host nodes after it
(``Match.host``); :meth:`PrefixIndex.load_back` gives them device blocks the caller holds,
starts their copies and moves them back (``BlockMoved(..., "device")``). A block computed
again by a request while its prefix sits on the host is promoted in place at ``insert``.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from app.cache.block_pool import BlockPool, NoFreeBlocks, check
from app.cache.lru import LRUSet

if TYPE_CHECKING:
    from app.cache.host_tier import HostTier

logger = logging.getLogger(__name__)

BlockHash = bytes
Tier = Literal["device", "host"]


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
class BlockMoved:
    """Cached blocks now live in ``tier`` (demoted to the host tier, or loaded back)."""

    block_hashes: tuple[BlockHash, ...]
    tier: Tier


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | BlockMoved | AllBlocksCleared


# ---- index ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Match:
    """The cached device prefix (``block_ids``, ``num_tokens``) and the host-tier nodes that
    continue it (opaque; pass them to :meth:`PrefixIndex.load_back`)."""

    block_ids: list[int]
    num_tokens: int
    host: tuple[_Node, ...] = ()


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
    block_id: int  # device block, -1 while in the host tier
    extra_key: bytes
    last_access: int = 0
    children: dict[BlockHash, _Node] = field(default_factory=dict)
    host: int = -1  # host block while in the host tier
    locked: bool = False  # being loaded back: not evictable

    @property
    def on_device(self) -> bool:
        return self.block_id >= 0


class PrefixIndex:
    """Prefix cache of full blocks of ``pool``; attaches itself as the pool's listener.
    ``host``: a host tier that evicted blocks are demoted to (None: eviction drops them)."""

    def __init__(self, pool: BlockPool, block_size: int, host: HostTier | None = None):
        if block_size != pool.block_size:
            raise ValueError(f"block_size {block_size} != pool.block_size {pool.block_size}")
        self.pool = pool
        self.block_size = block_size
        self.host = host
        self.stats = PrefixStats()
        self._root = _Node(b"", None, (), -1, b"")
        self._by_hash: dict[BlockHash, _Node] = {}
        self._by_block: dict[int, _Node] = {}  # device tier
        self._by_host: dict[int, _Node] = {}  # host tier
        self._evictable = LRUSet()  # device block ids: unreferenced, no device children
        self._host_evictable = LRUSet()  # host block ids: host leaves, not locked
        self._clock = 0
        self._events: list[KVEvent] = []
        pool.attach(self)

    def __len__(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> set[BlockHash]:
        """Every cached hash, both tiers."""
        return set(self._by_hash)

    def host_hashes(self) -> set[BlockHash]:
        """The cached hashes in the host tier."""
        return {n.hash for n in self._by_host.values()}

    @property
    def num_host_blocks(self) -> int:
        return len(self._by_host)

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
        """Longest cached prefix in whole blocks (device blocks, then host-tier nodes);
        touches it for LRU. Does not take references. ``record=False`` leaves the hit
        statistics alone (see :meth:`record`)."""
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
        dev = [n for n in found if n.on_device]  # a prefix of found (device* host*)
        num_tokens = len(dev) * self.block_size
        if record:
            self.record(len(token_ids), num_tokens)
        return Match([n.block_id for n in dev], num_tokens, tuple(found[len(dev) :]))

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
        block the caller does not hold. A block cached in the host tier takes the caller's
        block instead (promoted: no copy). Insertion stops at a hash collision: the rest of the
        sequence simply stays uncached.
        """
        key, node = as_key(extra_key), self._root
        blocks = self._blocks(token_ids)[: len(block_ids)]
        self._clock += 1
        redundant: list[int] = []
        new: list[_Node] = []
        promoted: list[BlockHash] = []
        foreign = False  # walking blocks another request cached: the caller does not hold them
        try:
            for tokens, bid in zip(blocks, block_ids, strict=False):
                h = block_hash(node.hash or None, tokens, key)
                old = self._by_hash.get(h)
                if old is not None:
                    if not self._verified(old, node, tokens, key):
                        break  # collision: leave the rest uncached
                    if not old.on_device:
                        if foreign or old.locked:
                            break
                        self._check_new(bid)
                        self._promote(old, bid)
                        promoted.append(h)
                    elif old.block_id != bid:
                        redundant.append(bid)
                        foreign = True
                    node = old
                    self._touch(node)
                    continue
                if foreign:
                    # Never hang a new block under a parent the caller does not reference: an
                    # unreferenced cached block must stay reclaimable by leaf eviction.
                    break
                self._check_new(bid)
                self._evictable.discard(node.block_id)  # gains a device child
                child = _Node(h, node, tokens, bid, key, self._clock)
                node.children[h] = child
                self._by_hash[h] = child
                self._by_block[bid] = child
                self.pool.hold_cached(bid)
                new.append(child)
                node = child
        finally:
            if promoted:
                self._events.append(BlockMoved(tuple(promoted), "device"))
            self._emit_stored(new, key)
        return redundant

    def _check_new(self, bid: int) -> None:
        if self.pool.refcount(bid) <= 0 or bid in self._by_block:
            raise ValueError(f"block {bid} must be held by the caller and not yet cached")

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
        """Free up to ``n_blocks`` least-recently-used unreferenced device blocks (without
        device children); with a host tier they are demoted (copied there) rather than
        dropped while it has room. Returns how many device blocks were freed."""
        removed: list[BlockHash] = []
        demoted: list[tuple[_Node, int]] = []  # (node, the device block it leaves)
        keep: set[int] = set()  # id() of the demoted nodes
        freed = 0
        while freed < n_blocks:
            bid = self._evictable.pop()
            if bid is None:
                break
            node = self._by_block.pop(bid)
            h = self._host_block(keep) if self.host is not None else None
            if h is None:  # (its subtree may hold nodes demoted in this pass: dropped too)
                self._drop(node, removed)
            else:
                node.block_id, node.host = -1, h
                self._by_host[h] = node
                demoted.append((node, bid))
                keep.add(id(node))
            self.pool.release_cached(bid)
            freed += 1
            self._maybe_evictable(node.parent)
        demoted = [(n, b) for n, b in demoted if n.host >= 0]
        if demoted:
            assert self.host is not None
            self.host.offload([b for _, b in demoted], [n.host for n, _ in demoted])
            for n, _ in demoted:
                self._maybe_evictable(n)
            self._events.append(BlockMoved(tuple(n.hash for n, _ in demoted), "host"))
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return freed

    def _host_block(self, keep: set[int]) -> int | None:
        """A free host block, evicting LRU host leaves for it (never the nodes whose id() is
        in ``keep``: demoted in this pass, their copies not issued yet)."""
        assert self.host is not None
        h = self.host.alloc()
        if h is not None:
            return h
        removed: list[BlockHash] = []
        while h is None and (leaf := self._host_evictable.pop()) is not None:
            node = self._by_host[leaf]
            self._drop(node, removed)
            if id(node.parent) not in keep:
                self._maybe_evictable(node.parent)  # may be a host leaf now
            h = self.host.alloc()
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))
        return h

    def _drop(self, node: _Node, removed: list[BlockHash]) -> None:
        """Forget ``node`` and its (host-tier) subtree; a device node's block is released by
        the caller."""
        stack = [node]
        while stack:
            n = stack.pop()
            assert not n.locked, "a node being loaded back is never dropped"
            stack.extend(n.children.values())
            if not n.on_device:
                self._forget_host(n)
            elif n is not node:
                raise AssertionError(f"device block {n.block_id} under an evicted block")
            del self._by_hash[n.hash]
            removed.append(n.hash)
        assert node.parent is not None
        del node.parent.children[node.hash]
        if node.on_device and self.host is not None:
            self.host.before_reuse([node.block_id])

    def _forget_host(self, n: _Node, dropped: bool = True) -> None:
        assert self.host is not None
        del self._by_host[n.host]
        self._host_evictable.discard(n.host)
        self.host.free([n.host])
        self.host.stats.dropped_blocks += dropped
        n.host = -1

    def _promote(self, node: _Node, bid: int) -> None:
        """A host-tier node takes device block ``bid`` (held by the caller, same content)."""
        self._forget_host(node, dropped=False)
        node.block_id = bid
        self._by_block[bid] = node
        self.pool.hold_cached(bid)
        if node.parent is not None:
            self._evictable.discard(node.parent.block_id)  # gains a device child

    # ---- loading back ---------------------------------------------------------------------
    def load_back(self, nodes: Sequence[_Node]) -> list[int]:
        """Device blocks for the host-tier nodes of a match (as many as the pool can give,
        in chain order): allocated (refcount 1, owned by the caller), their copies started
        (pending in the host tier until done), the nodes moved to the device tier. Returns
        the blocks; [] when none could be loaded (the caller recomputes those tokens)."""
        host = self.host
        if host is None or not nodes:
            return []
        nodes = list(nodes[: self.pool.num_available])
        if not nodes:  # no device room at all: recompute
            host.stats.fallbacks += 1
            return []
        for n in nodes:  # allocation may demote other blocks: these must stay put
            n.locked = True
            self._host_evictable.discard(n.host)
        bids: list[int] = []
        try:
            bids = self.pool.allocate(len(nodes))
            host.load([n.host for n in nodes], bids)
        except (NoFreeBlocks, RuntimeError) as e:  # recompute instead
            logger.warning("host-tier load-back of %d blocks failed (%s): recomputing",
                           len(nodes), e)  # fmt: skip
            host.stats.fallbacks += 1
            if bids:
                self.pool.decref(bids)
            for n in nodes:
                n.locked = False
                self._maybe_evictable(n)
            return []
        for n, bid in zip(nodes, bids, strict=True):
            n.locked = False
            del self._by_host[n.host]  # its row is freed by the host tier once copied
            n.host, n.block_id = -1, bid
            self._by_block[bid] = n
            self.pool.hold_cached(bid)
            if n.parent is not None:
                self._evictable.discard(n.parent.block_id)
        host.stats.hits += 1
        host.stats.hit_tokens += len(bids) * self.block_size
        self._events.append(BlockMoved(tuple(n.hash for n in nodes), "device"))
        return bids

    def clear(self) -> None:
        """Forget every cached block (held blocks stay with their holders, uncached)."""
        if self.host is not None:
            self.host.before_reuse(list(self._by_block))
            for n in list(self._by_host.values()):
                if not n.locked:
                    self._forget_host(n)
        for bid in self._by_block:
            self.pool.release_cached(bid)
        self._by_hash.clear()
        self._by_block.clear()
        self._by_host.clear()
        self._root.children.clear()
        self._evictable.clear()
        self._host_evictable.clear()
        self._events.append(AllBlocksCleared())

    # ---- pool callbacks -------------------------------------------------------------------
    def on_referenced(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self._evictable.discard(bid)

    def on_unreferenced(self, block_ids: list[int]) -> None:
        self._clock += 1
        for bid in block_ids:
            node = self._by_block[bid]
            node.last_access = self._clock
            self._maybe_evictable(node)

    # ---- LRU bookkeeping ----------------------------------------------------------------
    def _touch(self, node: _Node) -> None:
        node.last_access = self._clock
        if node.on_device:
            if node.block_id in self._evictable:
                self._evictable.push(node.block_id, node.last_access)
        elif node.host in self._host_evictable:
            self._host_evictable.push(node.host, node.last_access)

    def _maybe_evictable(self, node: _Node | None) -> None:
        if node is None or node is self._root:
            return
        if not node.on_device:
            if not node.children and not node.locked:
                self._host_evictable.push(node.host, node.last_access)
        elif not self.pool.refcount(node.block_id) and not any(
            c.on_device for c in node.children.values()
        ):
            self._evictable.push(node.block_id, node.last_access)

    # ---- invariants -----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Tree links, hashes, tiers, pool bookkeeping and both LRU sets all agree."""
        self.pool.check_integrity()
        seen, stack = 0, [self._root]
        expect: dict[int, int] = {}
        expect_host: dict[int, int] = {}
        while stack:
            parent = stack.pop()
            for h, node in parent.children.items():
                seen += 1
                bid = node.block_id
                check(node.parent is parent, f"block {bid}: parent link broken")
                check(node.hash == h and self._by_hash.get(h) is node, f"block {bid}: hash map")
                check(len(node.tokens) == self.block_size, f"block {bid}: not a full block")
                same_key = parent is self._root or parent.extra_key == node.extra_key
                check(same_key, f"block {bid}: extra key differs from its parent's")
                recomputed = block_hash(parent.hash or None, node.tokens, node.extra_key)
                check(recomputed == h, f"block {bid}: hash does not recompute")
                check(node.last_access <= self._clock, f"block {bid}: last_access in the future")
                check(not node.locked, f"block {bid}: locked outside load_back")
                if node.on_device:
                    check(node.host < 0, f"block {bid}: in both tiers")
                    check(parent is self._root or parent.on_device,
                          f"device block {bid} under a host-tier block")  # fmt: skip
                    check(self._by_block.get(bid) is node, f"block {bid}: block map")
                    check(self.pool.is_cached(bid), f"block {bid} cached here but not in the pool")
                    dev_children = any(c.on_device for c in node.children.values())
                    if not dev_children and self.pool.refcount(bid) == 0:
                        expect[bid] = node.last_access
                else:
                    check(node.host >= 0 and self._by_host.get(node.host) is node,
                          f"host block {node.host}: host map")  # fmt: skip
                    if not node.children:
                        expect_host[node.host] = node.last_access
                stack.append(node)
        n_nodes = len(self._by_block) + len(self._by_host)
        check(seen == len(self._by_hash) == n_nodes, "unreachable cached nodes")
        check(self.pool.cached_ids() == set(self._by_block), "pool cached set != index blocks")
        n_idle = sum(self.pool.refcount(b) == 0 for b in self._by_block)
        check(n_idle == self.pool.num_cached_unreferenced, "unreferenced cached count differs")
        check(self._evictable.items() == expect, "LRU set != unreferenced device leaves")
        check(self._host_evictable.items() == expect_host, "host LRU set != host leaves")
        check(self._evictable.heap_holds_all() and self._host_evictable.heap_holds_all(),
              "LRU heap misses a leaf")  # fmt: skip
        if self.host is not None:
            used = set(self._by_host) | self.host.in_flight_rows()
            check(len(used) == self.host.num_used, "host blocks leaked or double-booked")
        else:
            check(not self._by_host, "host-tier nodes without a host tier")
