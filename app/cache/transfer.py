"""KV export / import: one request's paged blocks and slot rows as one transferable object.

A :class:`KVState` holds every cache row a request owns, gathered out of the engine's pools,
with a :class:`LayoutHeader` that says how to read them::

    paged  (per block b of the request, in block-table order; rows b*R .. b*R + R - 1)
      entries.<layer>.data/.scale     compressed KV of every compressor owner
      keys.<layer>.data/.scale        index keys of every index-key owner
    slot   (the request slot s; rows s*R .. s*R + R - 1 of each slot tensor)
      window.<layer>.data/.scale      window ring (W + verify headroom rows)
      tail:kv.<layer>.k/.g            compressor tail (projections, gates; fp32)
      draft.<stage>.data/.scale       DSpark / MTP context ring (speculation on)

Rows are copied in their storage format (packed fp8 / nvfp4 / mxfp4 bytes or the compute
dtype), never decoded. Ring rows keep their ``p % ring`` positions, so a ring copied slot to
slot is the same ring. Import checks the header against the importing engine's and raises
:class:`KVTransferError` naming every difference (block size, ring, dtype, formats, model
fingerprint, draft configuration) before anything is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from app.cache.layout import CacheLayout, RowGroup
from app.model.kv_store import PagedKV

FORMAT_VERSION = 1


class KVTransferError(ValueError):
    """A KV state that this engine cannot import (layout header mismatch, bad shapes)."""


@dataclass(frozen=True)
class LayoutHeader:
    """What a KV state's rows mean: equal headers = rows that can be copied as they are."""

    version: int
    block_size: int
    ring: int
    dtype: str
    paged: tuple[tuple[int, str, str, int, int], ...]  # (layer, kind, fmt, dim, rows/block)
    slot: tuple[tuple[int, str, str, int, int], ...]  # (layer, kind, fmt, dim, rows/slot)
    model: str  # model fingerprint (model_fingerprint)
    draft: str  # speculative config ("dspark:3", "mtp:1", "" = off)

    @classmethod
    def of(cls, layout: CacheLayout, model: str, draft: str = "") -> LayoutHeader:
        def rows(gs: tuple[RowGroup, ...]) -> tuple[tuple[int, str, str, int, int], ...]:
            return tuple((g.layer, g.kind, g.fmt, g.dim, g.rows) for g in gs)

        dtype = str(layout.dtype).removeprefix("torch.")
        return cls(FORMAT_VERSION, layout.block_size, layout.ring, dtype, rows(layout.paged),
                   rows(layout.slot), model, draft)  # fmt: skip

    def mismatches(self, mine: LayoutHeader) -> list[str]:
        """Each field where this (received) header differs from ``mine``, as text."""
        out = []
        for name in self.__dataclass_fields__:
            got, want = getattr(self, name), getattr(mine, name)
            if got == want:
                continue
            if name in ("paged", "slot"):
                extra = sorted(set(got) - set(want))[:3]
                miss = sorted(set(want) - set(got))[:3]
                out.append(f"{name} groups differ (state has {extra}, this engine {miss})")
            else:
                out.append(f"{name} {got!r} (state) != {want!r} (this engine)")
        return out

    def check(self, mine: LayoutHeader) -> None:
        """Raise :class:`KVTransferError` unless this header equals ``mine``."""
        bad = self.mismatches(mine)
        if bad:
            raise KVTransferError("KV state layout mismatch: " + "; ".join(bad))


@dataclass
class KVState:
    """One request's cache rows (see the module doc) and where its computation stands."""

    header: LayoutHeader
    num_blocks: int
    num_computed: int  # positions whose KV is in these rows
    window_floor: int  # window rows below this position are never read
    num_cached: int  # prompt tokens the exporting engine found in its prefix cache
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def map_tensors(self, fn: Callable[[torch.Tensor], object]) -> KVState:
        """A copy whose tensors are ``fn(tensor)`` (to a device, to host buffers, back)."""
        return replace(self, tensors={k: fn(v) for k, v in self.tensors.items()})


def model_fingerprint(path: str | Path, sample_bytes: int = 4096) -> str:
    """A digest naming one checkpoint: config.json, the shard index, and each shard's size
    and ``sample_bytes`` read from its middle (two checkpoints of one layout but different
    weights differ; reading is O(shards), not O(weights))."""
    p = Path(path)
    h = hashlib.blake2b(digest_size=12, person=b"fathom-model")
    for name in ("config.json", "model.safetensors.index.json"):
        f = p / name
        h.update(f.read_bytes() if f.is_file() else b"-")
    index = p / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())) if (
        index.is_file()) else sorted(x.name for x in p.glob("*.safetensors"))  # fmt: skip
    for name in shards:
        f = p / name
        size = f.stat().st_size
        h.update(name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            fh.seek(max(0, size // 2 - sample_bytes // 2))
            h.update(fh.read(sample_bytes))
    return h.hexdigest()


def _storage(pools: PagedKV, layout: CacheLayout) -> Iterator[tuple[str, RowGroup, torch.Tensor]]:
    """Every cache tensor with its group: (name, group, tensor of rows)."""
    windows, drafts = iter(pools.window), iter(pools.draft)
    for g in layout.paged:
        rows = (pools.entries if g.kind == "entries" else pools.keys)[g.layer]
        yield f"{g.kind}.{g.layer}.data", g, rows.data
        if rows.scale is not None:
            yield f"{g.kind}.{g.layer}.scale", g, rows.scale
    for g in layout.slot:
        if g.kind.startswith("tail:"):
            kv, gate = pools.tails[(g.layer, g.kind.split(":")[1])]
            yield f"{g.kind}.{g.layer}.k", g, kv
            yield f"{g.kind}.{g.layer}.g", g, gate
            continue
        rows = next(windows) if g.kind == "window" else next(drafts)
        yield f"{g.kind}.{g.layer}.data", g, rows.data
        if rows.scale is not None:
            yield f"{g.kind}.{g.layer}.scale", g, rows.scale


def _rows(units: list[int], per: int, device: torch.device) -> torch.Tensor:
    """Row indices of ``units`` (blocks or one slot), ``per`` rows each:
    units [7, 3], per 4 -> [28 29 30 31 12 13 14 15]."""
    u = torch.tensor(units, dtype=torch.int64, device=device)
    return (u[:, None] * per + torch.arange(per, device=device)).reshape(-1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte dtypes (fp8) as uint8: indexing and index_copy_ take them."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def gather(
    pools: PagedKV, layout: CacheLayout, header: LayoutHeader, slot: int, blocks: list[int],
    num_computed: int, window_floor: int = 0, num_cached: int = 0,
) -> KVState:  # fmt: skip
    """Copy the rows of ``blocks`` and of request slot ``slot`` out of ``pools`` (new
    tensors on the pools' device; ordered on its stream before any later write)."""
    if header.block_size != layout.block_size:
        raise KVTransferError("the header does not describe this layout")
    out: dict[str, torch.Tensor] = {}
    for name, g, t in _storage(pools, layout):
        paged = g in layout.paged
        idx = _rows(blocks if paged else [slot], g.rows, t.device)
        out[name] = _bytes(t)[idx].view(t.dtype) if idx.numel() else t[:0].clone()
    return KVState(header, len(blocks), num_computed, window_floor, num_cached, out)


def scatter(pools: PagedKV, layout: CacheLayout, state: KVState, slot: int,
            blocks: list[int]) -> None:  # fmt: skip
    """Write ``state``'s rows into ``blocks`` and slot ``slot`` of ``pools`` (the caller
    checked the header; shapes are checked here before the first write)."""
    if len(blocks) != state.num_blocks:
        raise KVTransferError(f"{len(blocks)} blocks for a state of {state.num_blocks}")
    plan = []
    for name, g, t in _storage(pools, layout):
        src = state.tensors.get(name)
        units = blocks if g in layout.paged else [slot]
        want = (len(units) * g.rows, *t.shape[1:])
        if src is None or tuple(src.shape) != want or src.dtype != t.dtype:
            got = None if src is None else (tuple(src.shape), src.dtype)
            raise KVTransferError(f"KV state tensor {name}: {got} != {(want, t.dtype)}")
        plan.append((t, _rows(units, g.rows, t.device), src))
    for t, idx, src in plan:
        if idx.numel():
            _bytes(t).index_copy_(0, idx, _bytes(src.to(t.device, non_blocking=True)))


def copy_rows(
    pools: PagedKV, layout: CacheLayout, src_slot: int, dst_slot: int, src_blocks: list[int],
    dst_blocks: list[int],
) -> None:  # fmt: skip
    """Copy slot ``src_slot``'s rows to ``dst_slot`` and block ``src_blocks[i]``'s rows to
    ``dst_blocks[i]`` in place, in their storage format (a fork's copy-on-write: ordered on
    the pools' stream after every step launched before)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    for _, g, t in _storage(pools, layout):
        src, dst = (src_blocks, dst_blocks) if g in layout.paged else ([src_slot], [dst_slot])
        if src:
            b = _bytes(t)
            b.index_copy_(0, _rows(dst, g.rows, t.device), b[_rows(src, g.rows, t.device)])
