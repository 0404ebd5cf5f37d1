"""Step inputs: scheduled chunks (host numbers) -> one :class:`ForwardBatch` on the device.

Everything is computed with vectorized numpy into one pinned int64 buffer and moved in one
``non_blocking`` copy; the batch's tensors are views of that device buffer. Each build takes
its staging buffer from torch's caching host allocator, which hands a block out again only
after the copies that read it have run: builds may run any number of steps ahead of the
device (a fixed pair of buffers, alternated, was overwritten while the GPU -- running behind
-- had yet to copy it, and a graph step then read another build's rows). Input tokens
sampled by the previous step and not yet seen by the host are -1 on the host and filled on
the device from the sampler's output (``pending`` rows).

    lens [3, 1], starts [5, 9]  ->  token_seq [0 0 0 1], positions [5 6 7 9],
                                    seq_start [0 3]

A CUDA-graph step passes ``dst``: the views then alias the graph's static input buffer, with
padding sequences (the trash slot and block) up to the graph's batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.model.forward_batch import DecoderRows, ForwardBatch
from app.model.kv_store import PagedKV


@dataclass
class StepSpec:
    """One step's chunks as host arrays (B sequences, T tokens)."""

    slots: np.ndarray  # [B]
    starts: np.ndarray  # [B] first position of each chunk
    lens: np.ndarray  # [B] tokens of each chunk
    floors: np.ndarray  # [B] window floors
    cached: np.ndarray  # [B] max(start, prefix-cache hit)
    decoder_floors: np.ndarray  # [B] V4.1 decoder replay floor (0: none)
    history: np.ndarray  # [B, n_back] ids before each chunk, newest first, -1 none
    ids: np.ndarray  # [T] input ids, -1 where pending
    pending: np.ndarray  # [T] row of the previous step's samples (-1: known on the host)
    logit_rows: np.ndarray  # [S] flat rows whose logits are wanted
    tables: np.ndarray  # [B, NB] block ids (the trash block past each sequence's blocks)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.slots.shape[0])


def pad_spec(spec: StepSpec, num_seqs: int, trash_slot: int, trash_block: int) -> StepSpec:
    """``spec`` (every chunk of the same length q) padded to ``num_seqs`` sequences of q
    tokens each: padding chunks start at 0 in the trash slot with trash blocks; every row
    produces logits (a graph computes them all)."""
    B, extra = spec.num_seqs, num_seqs - spec.num_seqs
    q = int(spec.lens[0]) if B else 1
    if extra < 0 or (B and not (spec.lens == q).all()):
        raise ValueError("padding needs chunks of one length and a larger batch")

    def grow(a: np.ndarray, value: int) -> np.ndarray:
        pad = np.full((extra, *a.shape[1:]), value, dtype=a.dtype)
        return np.concatenate((a, pad))

    return StepSpec(
        slots=grow(spec.slots, trash_slot),
        starts=grow(spec.starts, 0),
        lens=grow(spec.lens, q),
        floors=grow(spec.floors, 0),
        cached=grow(spec.cached, 0),
        decoder_floors=grow(spec.decoder_floors, 0),
        history=grow(spec.history, -1),
        ids=np.concatenate((spec.ids, np.zeros(extra * q, dtype=np.int64))),
        pending=np.concatenate((spec.pending, np.full(extra * q, -1, dtype=np.int64))),
        logit_rows=np.arange(num_seqs * q, dtype=np.int64),
        tables=grow(spec.tables, trash_block),
    )


class _Packer:
    """Named int64 arrays laid out back to back in one buffer."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, np.ndarray]] = []
        self.size = 0

    def add(self, name: str, a: np.ndarray) -> None:
        self.parts.append((name, np.ascontiguousarray(a, dtype=np.int64)))
        self.size += a.size

    def write(self, buf: np.ndarray) -> dict[str, tuple[int, tuple[int, ...]]]:
        where, off = {}, 0
        for name, a in self.parts:
            buf[off : off + a.size] = a.reshape(-1)
            where[name] = (off, a.shape)
            off += a.size
        return where


class BatchBuilder:
    """Builds the device :class:`ForwardBatch` of a :class:`StepSpec` (see module doc)."""

    def __init__(self, pools: PagedKV, device: torch.device) -> None:
        self.pools, self.device = pools, device
        self._pin = device.type == "cuda"

    def _staging(self, n: int) -> torch.Tensor:
        """A host buffer for one build (pinned on CUDA): never one whose copy may be pending."""
        return torch.empty(n, dtype=torch.int64, pin_memory=self._pin)

    def build(
        self,
        spec: StepSpec,
        last_tokens: torch.Tensor | None = None,
        dst: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The batch of ``spec``; ``last_tokens`` (device) fills pending ids; ``dst`` is a
        static device buffer to copy into (CUDA graphs; else a new one)."""
        pk = _Packer()
        B, T = spec.num_seqs, spec.num_tokens
        lens = spec.lens.astype(np.int64)
        seq_start = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if B else lens
        token_seq = np.repeat(np.arange(B, dtype=np.int64), lens)
        positions = np.repeat(spec.starts, lens) + np.arange(T) - np.repeat(seq_start, lens)
        # (decoder rows first: they renumber the logit rows)
        dec = _decoder_rows(spec, positions, seq_start) if spec.decoder_floors.any() else None
        logit_rows = dec.pop("logit_rows") if dec is not None else spec.logit_rows
        for name, a in (
            ("input_ids", spec.ids), ("positions", positions), ("token_seq", token_seq),
            ("pending", spec.pending), ("seq_start", seq_start), ("seq_lens", lens),
            ("prefix_lens", spec.starts), ("slots", spec.slots), ("window_floors", spec.floors),
            ("cached_lens", spec.cached), ("history", spec.history),
            ("block_table", spec.tables), ("logit_rows", logit_rows),
        ):  # fmt: skip
            pk.add(name, a)
        if dec is not None:
            for name, a in dec.items():
                pk.add("dec_" + name, a)
        host = self._staging(pk.size)
        where = pk.write(host.numpy())
        if dst is None:
            dst = torch.empty(pk.size, dtype=torch.int64, device=self.device)
        elif dst.numel() < pk.size:
            raise ValueError(f"static step buffer of {dst.numel()} < {pk.size} entries")
        dst[: pk.size].copy_(host, non_blocking=True)
        v = {n: dst[o : o + int(np.prod(s))].view(s) for n, (o, s) in where.items()}
        ids = v["input_ids"]
        if (spec.pending >= 0).any():
            if last_tokens is None:
                raise RuntimeError("pending input tokens without the previous step's samples")
            src = last_tokens[v["pending"].clamp_min(0)]
            ids.copy_(torch.where(v["pending"] >= 0, src, ids))
        max_len = int(lens.max()) if B else 1
        batch = ForwardBatch(
            input_ids=ids,
            positions=v["positions"],
            token_seq=v["token_seq"],
            seq_start=v["seq_start"],
            seq_lens=v["seq_lens"],
            prefix_lens=v["prefix_lens"],
            slots=v["slots"],
            block_table=v["block_table"],
            window_floors=v["window_floors"],
            cached_lens=v["cached_lens"],
            kv=self.pools,
            max_seq_len=max(1, max_len),
            history=v["history"] if spec.history.shape[1] else None,
            logit_rows=v["logit_rows"],
        )
        if dec is not None:
            batch.decoder = self._decoder(batch, v, dec)
        return batch

    def _decoder(self, parent: ForwardBatch, v: dict, dec: dict) -> DecoderRows:
        keep = v["dec_keep"]
        lens = dec["seq_lens"]
        sub = ForwardBatch(
            input_ids=parent.input_ids[keep],
            positions=v["dec_positions"],
            token_seq=v["dec_token_seq"],
            seq_start=v["dec_seq_start"],
            seq_lens=v["dec_seq_lens"],
            prefix_lens=v["dec_prefix_lens"],
            slots=v["dec_slots"],
            block_table=v["dec_block_table"],
            window_floors=v["dec_window_floors"],
            cached_lens=v["dec_cached_lens"],
            kv=self.pools,
            max_seq_len=max(1, int(lens.max()) if lens.size else 1),
        )
        return DecoderRows(keep, sub)


def _decoder_rows(spec: StepSpec, positions: np.ndarray, seq_start: np.ndarray) -> dict:
    """V4.1 decoder replay: rows at or above each chunk's decoder floor (a suffix of every
    chunk; chunks with no such row leave the decoder batch). Example: one chunk of positions
    0..9 with floor 6 -> rows 6..9, a decoder chunk of 4 tokens from prefix 6 whose window
    reads nothing below 6. The logit rows are renumbered to the kept rows."""
    a, n = spec.starts, spec.lens
    start = np.maximum(a, spec.decoder_floors)
    kept = np.maximum(a + n - start, 0)
    has = kept > 0
    keep = np.concatenate(
        [np.arange(o + s - p, o + m) for o, s, p, m, h in zip(seq_start, start, a, n, has,
                                                              strict=True) if h]
        or [np.zeros(0, dtype=np.int64)]
    )  # fmt: skip
    lens = kept[has]
    sub_start = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if lens.size else lens
    B2 = int(has.sum())
    where = np.full(spec.num_tokens, -1, dtype=np.int64)
    where[keep] = np.arange(keep.size)
    logit_rows = where[spec.logit_rows]
    if (logit_rows < 0).any():
        raise ValueError("a row that wants logits skips the decoder layers")
    return {
        "logit_rows": logit_rows,
        "keep": keep,
        "positions": positions[keep],
        "token_seq": np.repeat(np.arange(B2, dtype=np.int64), lens),
        "seq_start": sub_start,
        "seq_lens": lens,
        "prefix_lens": start[has],
        "slots": spec.slots[has],
        "block_table": spec.tables[has],
        "window_floors": np.maximum(spec.floors, spec.decoder_floors)[has],
        "cached_lens": np.maximum(spec.cached, start)[has],
    }
