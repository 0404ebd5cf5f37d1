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
    tests drive chunked prefill without the paged cache. Entries are keyed by the batch
    index ``s``, or by ``keys[s]`` in a :meth:`bind` view (a request id per sequence), so
    one store can follow requests across batches of changing composition.
    """

    def __init__(self) -> None:
        self._data: dict[tuple, torch.Tensor] = {}
        self._keys_of: list | None = None

    def bind(self, keys: list) -> DenseKVStore:
        """A view sharing this store's data whose sequence ``s`` is ``keys[s]``."""
        view = DenseKVStore()
        view._data, view._keys_of = self._data, list(keys)
        return view

    def _seq(self, s: int):
        return s if self._keys_of is None else self._keys_of[s]

    def _put(self, key: tuple, pos0: int, new: torch.Tensor) -> None:
        old = self._data.get(key)
        if old is None or old.shape[0] < pos0 + new.shape[0]:
            grown = new.new_zeros((pos0 + new.shape[0], *new.shape[1:]))
            if old is not None:
                grown[: old.shape[0]] = old
            old = self._data[key] = grown
        old[pos0 : pos0 + new.shape[0]] = new

    def read_window(self, layer: int, s: int, lo: int, hi: int) -> torch.Tensor:
        return self._data[("win", layer, self._seq(s))][lo:hi]

    def write_window(self, layer: int, s: int, pos0: int, kv: torch.Tensor) -> None:
        self._put(("win", layer, self._seq(s)), pos0, kv)

    def read_tail(
        self, layer: int, name: str, s: int, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._seq(s)
        return self._data[("tkv", layer, name, seq)][lo:hi], self._data[("tg", layer, name, seq)][
            lo:hi
        ]

    def write_tail(
        self, layer: int, name: str, s: int, pos0: int, kv: torch.Tensor, gate: torch.Tensor
    ) -> None:
        seq = self._seq(s)
        self._put(("tkv", layer, name, seq), pos0, kv)
        self._put(("tg", layer, name, seq), pos0, gate)

    def write_entries(
        self, layer: int, s: int, w0: int, entries: torch.Tensor, keys: torch.Tensor | None
    ) -> None:
        self._put(("ent", layer, self._seq(s)), w0, entries)
        if keys is not None:
            self._put(("keys", layer, self._seq(s)), w0, keys)

    def read_entries(self, layer: int, s: int, n: int) -> torch.Tensor:
        return self._data[("ent", layer, self._seq(s))][:n]

    def read_keys(self, layer: int, s: int, n: int) -> torch.Tensor:
        return self._data[("keys", layer, self._seq(s))][:n]
