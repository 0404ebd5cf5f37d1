"""Per-request cache bookkeeping: block tables, request slots, prefix hits and replay plans.

The engine's scheduler decides *what* runs; this manager owns *where* it lives:

    admit(req, tokens)        prefix match (whole blocks) + slot -> ReplayPlan
    adopt(req, n_blocks)      slot + fresh blocks for rows imported from another engine
    ensure(req, n_tokens)     grow the block table to cover positions < n_tokens
    commit(req, tokens, n)    register blocks whose positions are all computed
    fork(src, dst, upto)      dst shares src's KV of positions < upto (full blocks shared,
                              the block holding ``upto`` and the slot rows copied)
    rename(src, dst)          src's entry passes to dst
    free(req)                 drop references (cached blocks stay evictable), free the slot
    ready(req)                every block of the request is in device memory (host-tier
                              loads done; ``poll`` first, once per schedule)
    tables                    block table of every slot (numpy; the batch builder reads rows)

With ``CacheConfig.host_bytes`` the prefix index demotes evicted blocks to a host tier
(``app.cache.host_tier``); a hit continuing into it is loaded back at admission and counts as
cached like a device hit (replay is planned from the whole hit).

Bounded replay after a hit ending at H (MODEL_SPEC §3), window W:

    off       start 0,                 window floor 0         (exact; a hit saves memory only)
    encoder   start max(0, H - W),     window floor = start   (windows rebuilt from W tokens)
    +decoder  V4.1 prefill rows below L - W skip the decoder layers
Cached compressed entries / index keys (groups ending at or before H) are never rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from app.cache.block_pool import BlockPool, NoFreeBlocks
from app.cache.host_tier import HostTier
from app.cache.kv_cache import PagedKVCache
from app.cache.layout import CacheLayout, block_size_for
from app.cache.radix import PrefixIndex
from app.cache.transfer import copy_rows
from app.config import CacheConfig
from app.model.model import DeepseekModel


@dataclass(frozen=True)
class ReplayPlan:
    """Where a newly admitted request starts computing, and its replay bounds."""

    num_cached: int  # prompt tokens found in the prefix cache (H)
    start: int  # first position to compute
    window_floor: int  # window KV below this position is never read


@dataclass
class _Seq:
    slot: int
    blocks: list[int] = field(default_factory=list)
    extra_key: str = ""
    window_floor: int = 0
    num_cached: int = 0
    committed: int = 0  # blocks registered in the prefix index
    query_tokens: int = 0  # prefix-cache query not yet counted in the index statistics


class CacheManager:
    """Block tables, slots and prefix cache of one engine over a :class:`PagedKVCache`."""

    def __init__(
        self,
        model: DeepseekModel,
        cfg: CacheConfig,
        num_blocks: int,
        max_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_blocks_per_seq: int | None = None,
        ring_headroom: int = 0,
        draft_stages: int = 0,
    ) -> None:
        self.cfg, self.model_cfg = cfg, model.cfg
        self.block_size = block_size_for(model.cfg, cfg.block_size)
        self.layout = self.layout_for(model, cfg, dtype, ring_headroom, draft_stages)
        self.pool = BlockPool(num_blocks, self.block_size)
        self.kv = PagedKVCache(self.layout, num_blocks, max_slots, device)
        self.host: HostTier | None = None
        n_host = HostTier.blocks_for(cfg.host_bytes, self.layout.bytes_per_block)
        if cfg.enable_prefix_caching and n_host > 0:
            self.host = HostTier(self.kv.pools, n_host, device)
        self.index = (
            PrefixIndex(self.pool, self.block_size, self.host)
            if cfg.enable_prefix_caching
            else None
        )
        # Block table of every slot (the trash slot's row too), padded with the trash block.
        width = max_blocks_per_seq or num_blocks
        self.tables = np.full((max_slots + 1, width), num_blocks, dtype=np.int64)
        self._seqs: dict[str, _Seq] = {}

    @staticmethod
    def layout_for(
        model: DeepseekModel,
        cfg: CacheConfig,
        dtype: torch.dtype,
        ring_headroom: int = 0,
        draft_stages: int = 0,
    ) -> CacheLayout:
        """The cache layout ``model`` needs (packed formats when its attention rounds KV);
        ``ring_headroom`` / ``draft_stages`` as in :meth:`CacheLayout.build`."""
        quant = any(layer.attn.kv_quant for layer in model.layers)
        return CacheLayout.build(
            model.cfg, block_size_for(model.cfg, cfg.block_size), dtype, quant, ring_headroom,
            draft_stages,
        )  # fmt: skip

    @property
    def pools(self):
        """The device tensors the model step reads and writes (:class:`PagedKV`)."""
        return self.kv.pools

    # ---- lifecycle ---------------------------------------------------------------------
    def admit(
        self,
        req_id: str,
        token_ids: list[int],
        extra_key: str = "",
        use_prefix_cache: bool = True,
    ) -> ReplayPlan:
        """Take a slot and the cached prefix of ``token_ids`` (at least one token is left to
        compute; ``use_prefix_cache=False`` computes everything, e.g. for prompt logprobs).
        Raises RuntimeError when no slot is free."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        slot = self.kv.alloc_slot()
        seq = _Seq(slot=slot, extra_key=extra_key)
        if self.index is not None and use_prefix_cache and len(token_ids) > 1:
            # statistics count the admission once its blocks are reserved (see ensure)
            m = self.index.match(token_ids[:-1], extra_key, record=False)
            self.pool.incref(m.block_ids)
            seq.blocks = list(m.block_ids)
            if m.host:  # the hit continues in the host tier: load what fits back
                seq.blocks += self.index.load_back(m.host)
            self._table(seq, 0)
            seq.num_cached = len(seq.blocks) * self.block_size
            seq.committed = len(seq.blocks)
            seq.query_tokens = len(token_ids) - 1
        H, W = seq.num_cached, self.model_cfg.sliding_window
        start = 0 if self.cfg.bounded_replay == "off" else max(0, H - W)
        seq.window_floor = start
        self._seqs[req_id] = seq
        return ReplayPlan(num_cached=H, start=start, window_floor=start)

    def adopt(
        self, req_id: str, num_blocks: int, extra_key: str = "", window_floor: int = 0,
        num_cached: int = 0,
    ) -> tuple[int, list[int]]:  # fmt: skip
        """Take a slot and ``num_blocks`` fresh blocks for a request whose rows come from
        elsewhere (a KV import, ``app.cache.transfer``) -> (slot, block ids). All or nothing:
        raises RuntimeError (no slot) or :class:`NoFreeBlocks`."""
        if req_id in self._seqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        if num_blocks > self.tables.shape[1]:
            raise ValueError(f"request {req_id!r}: {num_blocks} blocks exceed the block table")
        slot = self.kv.alloc_slot()
        try:
            blocks = self.pool.allocate(num_blocks)
        except NoFreeBlocks:
            self.kv.free_slot(slot)
            raise
        seq = _Seq(slot, blocks, extra_key, window_floor, num_cached)
        self._seqs[req_id] = seq
        self._table(seq, 0)
        return slot, blocks

    def ensure(self, req_id: str, num_tokens: int) -> None:
        """Allocate blocks so positions ``< num_tokens`` have one (all or nothing; raises
        :class:`app.cache.block_pool.NoFreeBlocks`, after evicting cached blocks if needed)."""
        seq = self._seqs[req_id]
        need = -(-num_tokens // self.block_size) - len(seq.blocks)
        if need > 0:
            if len(seq.blocks) + need > self.tables.shape[1]:
                raise ValueError(
                    f"request {req_id!r}: {num_tokens} positions exceed the block table "
                    f"({self.tables.shape[1]} blocks of {self.block_size})"
                )
            old = len(seq.blocks)
            seq.blocks.extend(self.pool.allocate(need))
            self._table(seq, old)
        if seq.query_tokens and self.index is not None:  # the admission stuck: count its hit
            self.index.record(seq.query_tokens, seq.num_cached)
            seq.query_tokens = 0

    def fork(self, src: str, dst: str, upto: int) -> None:
        """Admit ``dst`` with ``src``'s cache state of positions ``< upto`` (``src`` computed
        them; ``dst`` goes on from ``upto``): the blocks wholly below ``upto`` shared (one more
        reference each), the block holding position ``upto`` copied into a fresh one (both
        write on into it: copy-on-write), the slot rows (window ring, compressor tails, draft
        rings) copied into a fresh slot. All or nothing: raises RuntimeError (no slot) or
        :class:`NoFreeBlocks`.

            P = 4, upto = 9:  src blocks [a: 0-3][b: 4-7][c: 8-11]  ->  dst [a][b][c']
                              (a, b shared; c' a copy of c, which holds position 8)"""
        if dst in self._seqs:
            raise ValueError(f"request {dst!r} is already admitted")
        s = self._seqs[src]
        full = upto // self.block_size
        partial = s.blocks[full : full + 1] if upto % self.block_size else []
        if upto % self.block_size and not partial:
            raise ValueError(f"request {src!r} has no block for position {upto - 1}")
        slot = self.kv.alloc_slot()
        try:
            fresh = self.pool.allocate(len(partial))
        except NoFreeBlocks:
            self.kv.free_slot(slot)
            raise
        self.pool.incref(s.blocks[:full])
        copy_rows(self.kv.pools, self.layout, s.slot, slot, partial, fresh)
        seq = _Seq(slot, s.blocks[:full] + fresh, s.extra_key, s.window_floor, s.num_cached,
                   committed=min(s.committed, full))  # fmt: skip
        self._seqs[dst] = seq
        self._table(seq, 0)

    def rename(self, src: str, dst: str) -> None:
        """Pass ``src``'s cache entry (slot, blocks, prefix state) to ``dst``."""
        if dst in self._seqs:
            raise ValueError(f"request {dst!r} is already admitted")
        self._seqs[dst] = self._seqs.pop(src)

    def commit(self, req_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register every block whose positions are all computed (their compressed entries
        and index keys are final) in the prefix index."""
        seq = self._seqs[req_id]
        full = min(num_computed, len(token_ids)) // self.block_size
        if self.index is None or full <= seq.committed:
            return
        # Blocks whose content another request cached first stay ours until free() (the
        # index keeps the first copy), so a table never changes under a running request.
        self.index.insert(token_ids[: full * self.block_size], seq.blocks[:full], seq.extra_key)
        seq.committed = full

    def free(self, req_id: str) -> None:
        """Release a finished, aborted or preempted request (idempotent)."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return
        self.pool.decref(seq.blocks)
        self.tables[seq.slot] = self.kv.num_blocks
        self.kv.free_slot(seq.slot)

    def poll(self) -> None:
        """Finish host-tier loads whose copies are done (once per schedule)."""
        if self.host is not None:
            self.host.poll()

    def ready(self, req_id: str) -> bool:
        """Whether every block of the request is in device memory (no load in flight)."""
        return self.host is None or self.host.ready(self._seqs[req_id].blocks)

    def _table(self, seq: _Seq, start: int) -> None:
        self.tables[seq.slot, start : len(seq.blocks)] = seq.blocks[start:]

    # ---- views -------------------------------------------------------------------------
    def slot_of(self, req_id: str) -> int:
        return self._seqs[req_id].slot

    def num_blocks_of(self, req_id: str) -> int:
        return len(self._seqs[req_id].blocks)

    def window_floor(self, req_id: str) -> int:
        return self._seqs[req_id].window_floor

    def num_cached(self, req_id: str) -> int:
        return self._seqs[req_id].num_cached

    def decoder_floor(self, prompt_len: int, position: int) -> int:
        """Decoder-replay floor for a row at ``position`` of a prompt of ``prompt_len``."""
        if self.cfg.bounded_replay != "encoder+decoder" or not self.model_cfg.is_v41:
            return 0
        return max(0, prompt_len - self.model_cfg.sliding_window) if position < prompt_len else 0

    def blocks_of(self, req_id: str) -> list[int]:
        return list(self._seqs[req_id].blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_available

    def check_integrity(self) -> None:
        """Pool and index invariants, and every live table's blocks referenced."""
        self.pool.check_integrity()
        if self.index is not None:
            self.index.check_integrity()
        for rid, seq in self._seqs.items():
            for b in seq.blocks:
                if self.pool.refcount(b) <= 0:
                    raise AssertionError(f"request {rid}: block {b} has no reference")
            if self.tables[seq.slot, : len(seq.blocks)].tolist() != seq.blocks:
                raise AssertionError(f"request {rid}: block table row differs from its blocks")
