"""The KV cache tensors one batched model step reads and writes in place (the model's side of
the cache contract; ``app.cache`` allocates them, the model never imports the cache).

Every tensor is a flat array of rows; the step finds rows by arithmetic on its
:class:`~app.model.forward_batch.ForwardBatch` metadata (``app.model.attn_meta``):

    window ring   every layer       [(slots+1) * ring, D]     slot s, position p: s*ring + p % ring
    tail ring     compressor owner  [(slots+1) * rows, width] fp32; s*rows + p % rows, where
                                    rows >= span: a group completing later needs span - 1
                                    positions, one more lets a decode step run twice with the
                                    same result (CUDA-graph warm-up)
    entries       compressor owner  [(blocks+1) * P/r, D]     entry w (first position w*r):
                                    table[w*r // P] * (P/r) + (w*r % P) // r
    keys          index-key owner   [(blocks+1) * P/r, Di]    same rows as the entries

    P = 8, r = 2, block table [7, 3]:  entry 5 (positions 10, 11) -> block 3, row 3*4 + 1 = 13

The last slot and the last block are *trash*: padding tokens of a fixed-shape (graph) step and
masked writes land there, so no write needs a data-dependent shape.

Rows are stored in a :class:`KVRows` format: ``float`` (the compute dtype: exact mode) or the
released V4.1 formats (``kernels.kv_quant``: fp8 window, nvfp4 compressed KV, mxfp4 index keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.kv_quant import kv_pack, kv_pack_into, kv_unpack


@dataclass
class KVRows:
    """Rows of one cache tensor in their storage format (``data`` + ``scale``, see
    ``kernels.kv_quant``)."""

    data: torch.Tensor
    scale: torch.Tensor | None
    fmt: str  # "float" | "fp8" | "nvfp4" | "mxfp4"
    dim: int

    @property
    def num_rows(self) -> int:
        return self.data.shape[0]

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``values`` [n, dim] -> (data rows, scale rows) in this tensor's format."""
        if self.fmt == "float":
            return values.to(self.data.dtype), None
        return kv_pack(values, self.fmt)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values`` [n, dim] at ``rows`` [n] (int64; trash rows may repeat); packed
        formats are packed and stored by one kernel."""
        if self.fmt == "float":
            self.put(rows, *self.encode(values))
        else:
            kv_pack_into(values, rows, self.data, self.scale, self.fmt)

    def put(self, rows: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Store already encoded rows (see :meth:`encode`)."""
        _index_put(self.data, rows, data)
        if self.scale is not None:
            _index_put(self.scale, rows, scale)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` (any shape, int64, all valid) decoded to ``dtype`` [..., dim]."""
        flat = rows.reshape(-1)
        data = self.data[flat]
        scale = self.scale[flat] if self.scale is not None else None
        return kv_unpack(data, scale, self.fmt, dtype).view(*rows.shape, self.dim)

    def take(self, rows: torch.Tensor) -> KVRows:
        """A new KVRows holding rows ``rows`` [n] (same format, not decoded)."""
        scale = self.scale[rows] if self.scale is not None else None
        return KVRows(self.data[rows], scale, self.fmt, self.dim)

    def cat(self, other: KVRows) -> KVRows:
        """This tensor's rows followed by ``other``'s (same format)."""
        scale = None if self.scale is None else torch.cat((self.scale, other.scale))
        return KVRows(torch.cat((self.data, other.data)), scale, self.fmt, self.dim)


def _index_put(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype.itemsize == 1 and dst.dtype != torch.uint8:  # fp8: scatter the bytes
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, rows, src.to(dst.dtype))


@dataclass
class PagedKV:
    """All KV tensors of one engine (see the module docstring for the row arithmetic)."""

    block_size: int  # P: positions per block
    ring: int  # window rows per request slot (sliding window + verify headroom)
    num_slots: int  # request slots, the trash slot not counted
    num_blocks: int  # blocks, the trash block not counted
    window: list[KVRows]  # per backbone layer
    entries: dict[int, KVRows] = field(default_factory=dict)  # compressor owner -> pool
    keys: dict[int, KVRows] = field(default_factory=dict)  # index-key owner -> pool
    # (layer, "kv" | "idx") -> (kv, gate) fp32 [(slots + 1) * rows, width]; rows >= span
    tails: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # DSpark stage k's context KV [(slots + 1) * W, D] (speculation on; app.model.dspark)
    draft: list[KVRows] = field(default_factory=list)

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    @property
    def trash_block(self) -> int:
        return self.num_blocks

    def tail_rows(self, key: tuple[int, str]) -> int:
        """Tail ring rows per slot of compressor ``key``."""
        return self.tails[key][0].shape[0] // (self.num_slots + 1)
