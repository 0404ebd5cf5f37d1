"""Device tensors of the KV cache (allocated from a :class:`~app.cache.layout.CacheLayout`) and
the request slots; the batched model step reads and writes them in place through
:class:`~app.model.kv_store.PagedKV` (row arithmetic in ``app.model.attn_meta``).

    block id b (P positions of one sequence; P a multiple of every ratio)
      owner layer l, ratio r:  entries[l] rows b*P/r .. (b+1)*P/r - 1   (keys[l] the same)
    request slot s:
      window[l] rows s*ring .. (s+1)*ring - 1      tails[(l, name)] rows s*rows .. (rows >= span)
      draft[k]  rows s*W .. (s+1)*W - 1 (DSpark stage k's context, position p at s*W + p % W)

One extra block and one extra slot at the end are the trash that padding and masked writes
land in; they are never handed out.
"""

from __future__ import annotations

import torch

from app.cache.layout import CacheLayout
from app.model.kv_store import KVRows, PagedKV
from kernels.kv_quant import kv_storage


class PagedKVCache:
    """All KV storage of one engine: paged pools + request slots, in the layout's formats."""

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: int,
        max_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1 or max_slots < 1:
            raise ValueError(f"need at least one block and one slot, got {num_blocks}, {max_slots}")
        self.layout, self.num_blocks, self.max_slots = layout, num_blocks, max_slots
        self.block_size, self.device = layout.block_size, torch.device(device)
        dt, dev = layout.dtype, self.device
        window, entries, keys, tails, draft = [], {}, {}, {}, []
        for g in layout.slot:
            n = (max_slots + 1) * g.rows
            if g.kind in ("window", "draft"):
                rows = KVRows(*kv_storage(g.fmt, n, g.dim, dt, dev), g.fmt, g.dim)
                (window if g.kind == "window" else draft).append(rows)
            else:
                name = g.kind.split(":")[1]
                pair = tuple(torch.zeros(n, g.dim, dtype=torch.float32, device=dev) for _ in "kg")
                tails[(g.layer, name)] = pair
        for g in layout.paged:
            n = (num_blocks + 1) * g.rows
            rows = KVRows(*kv_storage(g.fmt, n, g.dim, dt, dev), g.fmt, g.dim)
            (entries if g.kind == "entries" else keys)[g.layer] = rows
        self.pools = PagedKV(
            block_size=layout.block_size,
            ring=layout.ring,
            num_slots=max_slots,
            num_blocks=num_blocks,
            window=window,
            entries=entries,
            keys=keys,
            tails=tails,
            draft=draft,
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

    # ---- views for tests and tools -----------------------------------------------------
    @property
    def window(self) -> list[torch.Tensor]:
        """Window ring data per layer (tests poison it)."""
        return [w.data for w in self.pools.window]

    @property
    def tails(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        return self.pools.tails

    def nbytes(self) -> int:
        """Bytes of every pool and slot tensor (the trash block and slot included)."""
        lay = self.layout
        return (self.num_blocks + 1) * lay.bytes_per_block + (self.max_slots + 1) * (
            lay.bytes_per_slot
        )

    def bytes_per_block(self) -> int:
        return self.layout.bytes_per_block

    def bytes_per_slot(self) -> int:
        return self.layout.bytes_per_slot
