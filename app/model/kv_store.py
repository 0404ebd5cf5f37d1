"""Where attention layers keep KV state across forward passes: the store interface.

The model defines what it needs; ``app.cache`` implements it over paged device pools and
per-request slots (the engine), and :class:`DenseKVStore` keeps everything in per-sequence
tensors (full-sequence forward, tests). Positions are absolute token positions; ``s`` is the
sequence's index in the current :class:`~app.model.forward_batch.ForwardBatch`.

Per layer the store holds:

    window   KV of the last ``sliding_window`` positions              (every layer)
    tail     compressor projections (kv, gate) of the last ``span``   (compressor owners;
             positions, for groups that are not complete yet           name "kv" or "idx")
    entries  compressed KV, one row per group w (first position w*r)  (compressor owners)
    keys     index keys, one row per group                            (index-key owners)
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVStore(ABC):
    """Read/write access to cached KV for the sequences of one batch."""

    @abstractmethod
    def read_window(self, layer: int, s: int, lo: int, hi: int) -> torch.Tensor:
        """Window KV of positions ``[lo, hi)`` -> [hi - lo, D]."""

    @abstractmethod
    def write_window(self, layer: int, s: int, pos0: int, kv: torch.Tensor) -> None:
        """Store window KV of positions ``pos0 .. pos0 + len(kv) - 1``."""

    @abstractmethod
    def read_tail(
        self, layer: int, name: str, s: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compressor projections (kv, gate) of positions ``[lo, hi)``."""

    @abstractmethod
    def write_tail(
        self, layer: int, name: str, s: int, pos0: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> None:
        """Store projections of positions ``pos0 ..``."""

    @abstractmethod
    def write_entries(
        self, layer: int, s: int, w0: int, entries: torch.Tensor, keys: torch.Tensor | None
    ) -> None:
        """Store compressed entries (and index keys) ``w0 .. w0 + len(entries) - 1``."""

    @abstractmethod
    def read_entries(self, layer: int, s: int, n: int) -> torch.Tensor:
        """Compressed entries ``0 .. n-1`` -> [n, D]."""

    @abstractmethod
    def read_keys(self, layer: int, s: int, n: int) -> torch.Tensor:
        """Index keys ``0 .. n-1`` -> [n, Di]."""


class DenseKVStore(KVStore):
    """Unpaged store: per (layer, sequence) tensors indexed by absolute position.

    Keeps every position (nothing is evicted), so it serves full-sequence forward and lets
    tests drive chunked prefill without the paged cache. Sequences are identified by their
    index in the batch, so reuse one store only across batches of the same sequences.
    """

    def __init__(self) -> None:
        self._win: dict[tuple[int, int], torch.Tensor] = {}
        self._tail: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._ent: dict[tuple[int, int], torch.Tensor] = {}
        self._keys: dict[tuple[int, int], torch.Tensor] = {}

    @staticmethod
    def _put(old: torch.Tensor | None, pos0: int, new: torch.Tensor) -> torch.Tensor:
        if old is None:
            old = new.new_zeros((0, *new.shape[1:]))
        if old.shape[0] < pos0 + new.shape[0]:
            grown = new.new_zeros((pos0 + new.shape[0], *new.shape[1:]))
            grown[: old.shape[0]] = old
            old = grown
        old[pos0 : pos0 + new.shape[0]] = new
        return old

    def read_window(self, layer: int, s: int, lo: int, hi: int) -> torch.Tensor:
        return self._win[(layer, s)][lo:hi]

    def write_window(self, layer: int, s: int, pos0: int, kv: torch.Tensor) -> None:
        self._win[(layer, s)] = self._put(self._win.get((layer, s)), pos0, kv)

    def read_tail(
        self, layer: int, name: str, s: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = self._tail[(layer, name, s)]
        return kv[lo:hi], gate[lo:hi]

    def write_tail(
        self, layer: int, name: str, s: int, pos0: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> None:
        old = self._tail.get((layer, name, s), (None, None))
        self._tail[(layer, name, s)] = (self._put(old[0], pos0, kv), self._put(old[1], pos0, gate))

    def write_entries(
        self, layer: int, s: int, w0: int, entries: torch.Tensor, keys: torch.Tensor | None
    ) -> None:
        self._ent[(layer, s)] = self._put(self._ent.get((layer, s)), w0, entries)
        if keys is not None:
            self._keys[(layer, s)] = self._put(self._keys.get((layer, s)), w0, keys)

    def read_entries(self, layer: int, s: int, n: int) -> torch.Tensor:
        return self._ent[(layer, s)][:n]

    def read_keys(self, layer: int, s: int, n: int) -> torch.Tensor:
        return self._keys[(layer, s)][:n]
