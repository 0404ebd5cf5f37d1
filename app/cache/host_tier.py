"""Host-memory KV tier: a pool of host blocks that device blocks are written back to when the
prefix index evicts them, and loaded back from on a hit.

A host block holds every paged group of one device block as one byte row (block-major), so a
request's blocks are a few contiguous runs of rows::

    device (group-major)                         host (block-major, pinned on CUDA)
    entries[l] rows b*P/r .. (b+1)*P/r - 1  ─┐   data[h] = [entries[2] | keys[2] | ... | scales]
    keys[l]    the same rows                 ├─> bytes_per_block bytes; the column range of each
    (data and scale tensors of each group)  ─┘   group is fixed (``HostTier.columns``)

    offload (device -> host): gather the blocks' rows of each group into a device staging
        buffer [n, bytes_per_block] (one index_select per group), one D2H copy per contiguous
        run of host ids; on the compute stream (ordered after the step in flight, before any
        step that reuses the freed device blocks).
    load (host -> device): one H2D copy per contiguous run of host ids into a staging buffer,
        then one index_copy_ per group into the device blocks; on a copy stream (overlapped
        with the running step), finished by an event. The blocks are *pending* until then: a
        request runs only once every block it holds is ready (``ready``); the scheduler asks.

On CPU every copy is synchronous (a load is ready when ``load`` returns); the contract is the
same. Hazards on CUDA, and what orders them:

    load reads a host row an offload is still writing     copy stream waits on that offload
    load writes a device block an offload still reads     copy stream waits on that offload
    offload reads / a freed block is reused while a load  compute stream waits on the load
      still writes it                                     (``before_reuse``)
    an offload reuses a host row a load still reads       the row is freed only when the load
                                                          is done (``poll``)
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.model.kv_store import PagedKV


@dataclass
class HostStats:
    """Counters of the host tier (cumulative since the engine started)."""

    hits: int = 0  # admissions that loaded at least one block back
    hit_tokens: int = 0  # prompt tokens served from the host tier
    load_blocks: int = 0
    load_bytes: int = 0
    load_s: float = 0.0  # sum over loads of issue -> ready (host clock)
    offload_blocks: int = 0
    offload_bytes: int = 0
    dropped_blocks: int = 0  # host blocks evicted (LRU) or forgotten
    fallbacks: int = 0  # load-backs that could not be issued: recomputed instead
    latencies: deque[float] = field(default_factory=deque)  # per load, drained by metrics


@dataclass
class _Load:
    """A load in flight: its device blocks, the host rows it reads, its event (CUDA)."""

    dev: list[int]
    host: list[int]
    t0: float
    event: torch.cuda.Event | None


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Contiguous runs of sorted ``ids`` as (first id, index of it, length):
    ``[3, 4, 5, 9, 10] -> [(3, 0, 3), (9, 3, 2)]``."""
    out: list[tuple[int, int, int]] = []
    for j, h in enumerate(ids):
        if out and h == out[-1][0] + out[-1][2]:
            first, at, n = out[-1]
            out[-1] = (first, at, n + 1)
        else:
            out.append((h, j, 1))
    return out


def block_views(pools: PagedKV) -> list[torch.Tensor]:
    """Every paged tensor (entries and index keys of each owner layer, data and scales) as a
    uint8 view [num_blocks + 1, bytes of one block] (the trash block last)."""
    out = []
    for rows in (*pools.entries.values(), *pools.keys.values()):
        for t in (rows.data, rows.scale):
            if t is not None:
                out.append(t.view(torch.uint8).view(pools.num_blocks + 1, -1))
    return out


class HostTier:
    """``num_blocks`` host blocks beside the device pools ``pools`` (the copies; which block
    holds what is the prefix index's business). Host ids are handed out lowest first."""

    def __init__(
        self, pools: PagedKV, num_blocks: int, device: torch.device | str = "cpu",
        pin: bool | None = None,
    ) -> None:  # fmt: skip
        if num_blocks <= 0:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.views = block_views(pools)
        self.columns: list[tuple[int, int]] = []  # (first byte, width) of each view
        off = 0
        for v in self.views:
            self.columns.append((off, v.shape[1]))
            off += v.shape[1]
        self.bytes_per_block = off
        self.num_blocks = num_blocks
        pin = self.cuda if pin is None else pin
        self.data = torch.empty(num_blocks, max(off, 1), dtype=torch.uint8, pin_memory=pin)
        self._free = list(range(num_blocks))  # a sorted list is a heap
        self._loads: list[_Load] = []
        self._pending: dict[int, _Load] = {}  # device block -> its load in flight
        self._offloads: list[tuple[torch.cuda.Event, set[int], set[int]]] = []  # CUDA only
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.stats = HostStats()

    @staticmethod
    def blocks_for(host_bytes: int, bytes_per_block: int) -> int:
        """Host blocks ``host_bytes`` buys: ``blocks_for(10_000, 3_000) == 3``."""
        return max(0, host_bytes) // max(1, bytes_per_block)

    # ---- host blocks --------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Host blocks holding KV or still being read by a load."""
        return self.num_blocks - len(self._free)

    def alloc(self) -> int | None:
        """One free host block (the lowest id), or None when every one is in use."""
        return heapq.heappop(self._free) if self._free else None

    def free(self, host_ids: Sequence[int]) -> None:
        """Host blocks whose content is no longer wanted."""
        for h in host_ids:
            heapq.heappush(self._free, h)

    def in_flight_rows(self) -> set[int]:
        """Host rows that loads in flight still read (not free, not held by the index)."""
        return {h for ld in self._loads for h in ld.host}

    # ---- copies -------------------------------------------------------------------------
    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        t = torch.tensor(list(ids), dtype=torch.int64)
        if self.cuda:  # pinned, so the copy does not synchronize the host with the stream
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def offload(self, dev_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """Copy device blocks ``dev_ids`` into host blocks ``host_ids`` (same length), on the
        current stream: done before any later step writes the device blocks."""
        if not dev_ids:
            return
        pairs = sorted(zip(host_ids, dev_ids, strict=True))
        hs, ds = [h for h, _ in pairs], [d for _, d in pairs]
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        if stream is not None:
            for d in ds:
                if d in self._pending:  # a load still writes it
                    stream.wait_event(self._pending[d].event)
        stage = torch.empty(len(ds), self.bytes_per_block, dtype=torch.uint8, device=self.device)
        idx = self._ids(ds)
        for (off, w), v in zip(self.columns, self.views, strict=True):
            stage[:, off : off + w] = v.index_select(0, idx)
        for h0, j, n in runs(hs):
            self.data[h0 : h0 + n].copy_(stage[j : j + n], non_blocking=self.cuda)
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._offloads.append((ev, set(hs), set(ds)))
        self.stats.offload_blocks += len(ds)
        self.stats.offload_bytes += len(ds) * self.bytes_per_block

    def load(self, host_ids: Sequence[int], dev_ids: Sequence[int]) -> None:
        """Copy host blocks into device blocks (asynchronously on CUDA). The device blocks
        are pending until the copy is done; the host rows are freed then (``poll``)."""
        if not dev_ids:
            return
        pairs = sorted(zip(host_ids, dev_ids, strict=True))
        hs, ds = [h for h, _ in pairs], [d for _, d in pairs]
        ld = _Load(ds, hs, time.perf_counter(), None)
        if self.cuda:
            assert self.copy_stream is not None
            with torch.cuda.stream(self.copy_stream):
                self._after_offloads(set(hs), set(ds))
                self._copy_in(hs, ds)
                ld.event = torch.cuda.Event()
                ld.event.record(self.copy_stream)
        else:
            self._copy_in(hs, ds)
        self._loads.append(ld)
        for d in ds:
            self._pending[d] = ld
        self.stats.load_blocks += len(ds)
        self.stats.load_bytes += len(ds) * self.bytes_per_block
        if not self.cuda:
            self.poll()

    def _after_offloads(self, hs: set[int], ds: set[int]) -> None:
        """Make the copy stream wait for offloads that touch these host rows or device
        blocks (dropping the ones that are done)."""
        live = []
        for ev, oh, od in self._offloads:
            if ev.query():
                continue
            live.append((ev, oh, od))
            if oh & hs or od & ds:
                self.copy_stream.wait_event(ev)  # type: ignore[union-attr]
        self._offloads = live

    def _copy_in(self, hs: list[int], ds: list[int]) -> None:
        stage = torch.empty(len(ds), self.bytes_per_block, dtype=torch.uint8, device=self.device)
        for h0, j, n in runs(hs):
            stage[j : j + n].copy_(self.data[h0 : h0 + n], non_blocking=self.cuda)
        idx = self._ids(ds)
        for (off, w), v in zip(self.columns, self.views, strict=True):
            v.index_copy_(0, idx, stage[:, off : off + w])

    # ---- completion ---------------------------------------------------------------------
    def poll(self) -> None:
        """Finish loads whose copies are done: their blocks are ready, their rows free."""
        if not self._loads:
            return
        now, left = time.perf_counter(), []
        for ld in self._loads:
            if ld.event is not None and not ld.event.query():
                left.append(ld)
                continue
            for d in ld.dev:
                if self._pending.get(d) is ld:
                    del self._pending[d]
            self.free(ld.host)
            self.stats.load_s += now - ld.t0
            self.stats.latencies.append(now - ld.t0)
            if len(self.stats.latencies) > 4096:
                self.stats.latencies.popleft()
        self._loads = left

    def ready(self, dev_ids: Sequence[int]) -> bool:
        """Whether none of ``dev_ids`` is still being loaded."""
        return not self._pending or not any(d in self._pending for d in dev_ids)

    def before_reuse(self, dev_ids: Sequence[int]) -> None:
        """Device blocks leave the cache (their next owner writes them on the compute
        stream): that stream waits for any load still writing them."""
        if not self._pending or not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for ev in {id(ld): ld.event for d in dev_ids if (ld := self._pending.get(d))}.values():
            stream.wait_event(ev)

    def synchronize(self) -> None:
        """Wait for every copy (tests, shutdown)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self.poll()
