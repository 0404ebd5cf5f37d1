"""Device pools of the KV cache and the per-batch :class:`KVStore` view the model writes through.

Paged groups (shared by prefix caching): one block = ``block_size`` (P) positions; a block id
indexes every group at once. A layer that owns a compressor of ratio r keeps ``P // r``
entries per block (compressed KV, and index keys when it owns them):

    entry w of a sequence (first position w*r)  ->  block_table[w*r // P], row (w*r % P) // r

Per-request slots (not shared, rebuilt by bounded replay after a prefix hit):

    window ring   [slots, W, D]         position p at row p % W           (every layer)
    tail ring     [slots, span, width]  compressor projections, p % span  (owners; fp32)

    P = 8, r = 2, table [7, 3]:  entry 5 (positions 10, 11) -> block 3, row 1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from app.model.compressor import Compressor
from app.model.kv_store import KVStore
from app.model.model import DeepseekModel


@dataclass(frozen=True)
class _TailSpec:
    span: int
    width: int


class PagedKVCache:
    """All KV storage of one engine: paged compressed-KV / index-key pools + request slots."""

    def __init__(
        self,
        model: DeepseekModel,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        cfg = model.cfg
        ratios = [s.ratio for s in cfg.layers if s.owns_compressor]
        lcm = math.lcm(*ratios) if ratios else 1
        if block_size <= 0 or block_size % lcm:
            raise ValueError(f"block_size {block_size} must be a positive multiple of {lcm}")
        self.cfg, self.block_size, self.num_blocks = cfg, block_size, num_blocks
        self.max_slots, self.dtype, self.device = max_slots, dtype, torch.device(device)
        W, D = cfg.sliding_window, cfg.head_dim
        self.window = [torch.zeros(max_slots, W, D, dtype=dtype, device=device) for _ in cfg.layers]
        self.entries: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.tails: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for spec, layer in zip(cfg.layers, model.layers, strict=True):
            if not spec.owns_compressor:
                continue
            per_block = block_size // spec.ratio
            self.entries[spec.layer_id] = torch.zeros(
                num_blocks, per_block, D, dtype=dtype, device=device
            )
            comps: dict[str, Compressor] = {"kv": layer.attn.compressor}
            if spec.owns_index_keys:
                self.keys[spec.layer_id] = torch.zeros(
                    num_blocks, per_block, cfg.index_head_dim, dtype=dtype, device=device
                )
                if not cfg.is_v41:
                    comps["idx"] = layer.attn.indexer.compressor
            for name, comp in comps.items():
                shape = (max_slots, comp.span, comp.width)
                self.tails[(spec.layer_id, name)] = (
                    torch.zeros(shape, dtype=torch.float32, device=device),
                    torch.zeros(shape, dtype=torch.float32, device=device),
                )
        self._free_slots = list(range(max_slots - 1, -1, -1))

    # ---- request slots -----------------------------------------------------------------
    def alloc_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.max_slots} request slots are in use")
        return self._free_slots.pop()

    def free_slot(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not allocated")
        self._free_slots.append(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def view(self, block_tables: list[list[int]], slots: list[int]) -> PagedStore:
        """The store of one batch: sequence ``s`` uses ``block_tables[s]`` and ``slots[s]``."""
        return PagedStore(self, block_tables, slots)

    def nbytes(self) -> int:
        """Bytes of every pool and slot tensor."""
        return self.num_blocks * self.bytes_per_block() + self.max_slots * self.bytes_per_slot()

    def bytes_per_block(self) -> int:
        """Bytes one block takes across every paged group."""
        ts = [*self.entries.values(), *self.keys.values()]
        return sum(t[0].numel() * t.element_size() for t in ts)

    def bytes_per_slot(self) -> int:
        """Bytes one request slot takes (window rings and compressor tails)."""
        ts = [*self.window, *(t for pair in self.tails.values() for t in pair)]
        return sum(t[0].numel() * t.element_size() for t in ts)


class PagedStore(KVStore):
    """:class:`KVStore` over a :class:`PagedKVCache` for the sequences of one batch."""

    def __init__(self, cache: PagedKVCache, tables: list[list[int]], slots: list[int]):
        self.c, self.tables, self.slots = cache, tables, slots

    def _rows(self, layer: int, s: int, w0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, rows) of entries ``w0 .. w0+n-1`` of sequence ``s``."""
        r, P = self.c.cfg.layers[layer].ratio, self.c.block_size
        pos = (torch.arange(w0, w0 + n) * r).tolist()
        table = self.tables[s]
        if pos and pos[-1] // P >= len(table):
            raise IndexError(f"sequence {s}: position {pos[-1]} is beyond its block table")
        blocks = torch.tensor([table[p // P] for p in pos], dtype=torch.int64)
        rows = torch.tensor([(p % P) // r for p in pos], dtype=torch.int64)
        return blocks.to(self.c.device), rows.to(self.c.device)

    def read_window(self, layer: int, s: int, lo: int, hi: int) -> torch.Tensor:
        W = self.c.cfg.sliding_window
        if hi - lo > W:
            raise ValueError(f"window read of {hi - lo} positions exceeds the ring ({W})")
        idx = torch.arange(lo, hi, device=self.c.device) % W
        return self.c.window[layer][self.slots[s]][idx]

    def write_window(self, layer: int, s: int, pos0: int, kv: torch.Tensor) -> None:
        W = self.c.cfg.sliding_window
        keep = kv[-W:]
        start = pos0 + kv.shape[0] - keep.shape[0]
        idx = torch.arange(start, start + keep.shape[0], device=self.c.device) % W
        self.c.window[layer][self.slots[s], idx] = keep.to(self.c.dtype)

    def read_tail(
        self, layer: int, name: str, s: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self.c.tails[(layer, name)]
        span = kv.shape[1]
        if hi - lo > span:
            raise ValueError(f"tail read of {hi - lo} positions exceeds the ring ({span})")
        idx = torch.arange(lo, hi, device=self.c.device) % span
        slot = self.slots[s]
        return kv[slot][idx], gate[slot][idx]

    def write_tail(
        self, layer: int, name: str, s: int, pos0: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> None:
        tkv, tgate = self.c.tails[(layer, name)]
        span, n = tkv.shape[1], kv.shape[0]
        kv, gate = kv[-span:], gate[-span:]
        start = pos0 + n - kv.shape[0]
        idx = torch.arange(start, start + kv.shape[0], device=self.c.device) % span
        tkv[self.slots[s], idx] = kv.float()
        tgate[self.slots[s], idx] = gate.float()

    def write_entries(
        self, layer: int, s: int, w0: int, entries: torch.Tensor, keys: torch.Tensor | None
    ) -> None:
        blocks, rows = self._rows(layer, s, w0, entries.shape[0])
        self.c.entries[layer][blocks, rows] = entries.to(self.c.dtype)
        if keys is not None:
            self.c.keys[layer][blocks, rows] = keys.to(self.c.dtype)

    def read_entries(self, layer: int, s: int, n: int) -> torch.Tensor:
        blocks, rows = self._rows(layer, s, 0, n)
        return self.c.entries[layer][blocks, rows]

    def read_keys(self, layer: int, s: int, n: int) -> torch.Tensor:
        blocks, rows = self._rows(layer, s, 0, n)
        return self.c.keys[layer][blocks, rows]
