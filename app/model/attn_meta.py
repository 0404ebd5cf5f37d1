"""Row arithmetic of one batched step, derived on the device from its ForwardBatch, once per
step and shared by every layer (the "attention metadata" of the step). No host sync: every
size is a host integer of the batch (T, B, block-table width, longest chunk).

Window keys of token t (sequence s, position p, chunk [a, a+n), floor f, ring R >= W):
positions q = p-W+1 .. p, valid from max(f, 0).

    direct  (every n <= R - W + 1): the step writes its KV into the ring first; q -> s*R + q % R
    pooled  (longer chunks): keys come from the step pool  [new KV of all T tokens |
            B x (W-1) stored rows gathered from the ring before the write]:
            q >= a -> t - (p - q)          q < a -> T + s*(W-1) + (q - (a-W+1))

    W = 3, R = 3, one sequence a = 5, n = 2 (pooled): pool = [kv5 kv6 | ring(3) ring(4)]
    token 6 -> positions 4, 5, 6 -> rows [3, 0, 1]

Compressed entries (ratio r, P positions per block): entry w -> table[s, w*r // P] * (P/r) +
(w*r % P) // r; a token sees ``(p+1) // r`` entries. Compressor groups: the token that ends a
group (``(p+1) % r == 0``) is its candidate; a fixed number G of candidates per step (one per
token for r = 1, else T//r + B, compacted by a cumsum) keeps shapes fixed; invalid ones
(groups already cached, padding) write to the trash block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.forward_batch import ForwardBatch
from kernels.compressor import compressor_groups
from kernels.indexer import TokenBlocks, entry_rows, scores_token_blocks


@dataclass
class WindowRows:
    """Window addressing of one step (the same for every layer)."""

    rows: torch.Tensor  # [T, W] key rows (-1 empty) into the ring (direct) or the step pool
    write: torch.Tensor  # [T] ring row each new token's KV goes to (trash if overwritten)
    stored: torch.Tensor | None  # [B*(W-1)] ring rows gathered into the pool (pooled mode)


@dataclass
class GroupRows:
    """Compressor groups that may complete this step (one (ratio, span, tail rows) kind)."""

    token: torch.Tensor  # [G] flat token ending each candidate group (clamped; see valid)
    valid: torch.Tensor  # [G] bool
    entry: torch.Tensor  # [G] entry id w of the group
    dest: torch.Tensor  # [G] pool row the entry goes to (the trash block if invalid)
    first: torch.Tensor  # [G] bool: w == 0 (overlapping compressors mask window -1)
    from_new: torch.Tensor  # [G, span] bool: the slot's projection is this step's
    new_idx: torch.Tensor  # [G, span] flat token of the slot (where from_new)
    tail_idx: torch.Tensor  # [G, span] tail-ring row of the slot (elsewhere)
    tail_write: torch.Tensor  # [T] tail-ring row each token's projection goes to (or trash)


class StepMeta:
    """Derived rows of one step; each kind is computed on first use and cached."""

    def __init__(self, batch: ForwardBatch, sliding_window: int) -> None:
        self.batch, self.W = batch, sliding_window
        b = batch
        self.seq = b.token_seq
        self.pos = b.positions
        self.a = b.prefix_lens[self.seq]  # [T] chunk start of each token's sequence
        self.n = b.seq_lens[self.seq]
        self.slot = b.slots[self.seq]
        self.direct = b.direct_window(sliding_window)
        self._window: WindowRows | None = None
        self._groups: dict[tuple[int, int, int], GroupRows] = {}
        self._angles: dict[tuple, torch.Tensor] = {}
        self._cos_sin: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hca: dict[int, torch.Tensor] = {}
        self._visible: dict[int, torch.Tensor] = {}
        self._blocks: dict[int, TokenBlocks] = {}

    # ---- window ---------------------------------------------------------------------------
    def window(self) -> WindowRows:
        if self._window is None:
            self._window = self._build_window()
        return self._window

    def _build_window(self) -> WindowRows:
        b, W, R = self.batch, self.W, self.batch.kv.ring
        dev, T, _B = b.device, b.num_tokens, b.num_seqs
        k = torch.arange(W, device=dev)
        q = self.pos.unsqueeze(1) - W + 1 + k  # [T, W] key positions
        floor = b.window_floors[self.seq].clamp_min(0).unsqueeze(1)
        ok = q >= floor
        if self.direct:
            rows = self.slot.unsqueeze(1) * R + q.remainder(R)
            stored = None
        else:
            t = torch.arange(T, device=dev).unsqueeze(1)
            a = self.a.unsqueeze(1)
            new = t - (self.pos.unsqueeze(1) - q)
            old = T + self.seq.unsqueeze(1) * (W - 1) + (q - (a - W + 1))
            rows = torch.where(q >= a, new, old)
            # stored positions a-W+1 .. a-1 of every sequence -> their ring rows
            sq = b.prefix_lens.unsqueeze(1) - W + 1 + torch.arange(W - 1, device=dev)  # [B, W-1]
            keep = sq >= b.window_floors.clamp_min(0).unsqueeze(1)
            ring = b.slots.unsqueeze(1) * R + sq.remainder(R)
            stored = torch.where(keep, ring, b.kv.trash_slot * R).reshape(-1)
        rows = torch.where(ok, rows, -1)
        last = self.pos >= self.a + self.n - R  # only the chunk's last R positions survive
        trash = b.kv.trash_slot * R + self.pos.remainder(R)
        write = torch.where(last, self.slot * R + self.pos.remainder(R), trash)
        return WindowRows(rows, write, stored)

    # ---- compressed entries -----------------------------------------------------------------
    def visible(self, ratio: int) -> torch.Tensor:
        """[T] entries each token sees: ``(p + 1) // ratio`` (cached)."""
        if ratio not in self._visible:
            self._visible[ratio] = torch.div(self.pos + 1, ratio, rounding_mode="floor")
        return self._visible[ratio]

    def scores_blocks(self, n_heads: int) -> TokenBlocks:
        """The indexer scores kernel's token blocks for ``n_heads`` heads (cached: the same
        for every index layer of the step)."""
        if n_heads not in self._blocks:
            b = self.batch
            self._blocks[n_heads] = scores_token_blocks(b.token_seq, b.seq_start, n_heads)
        return self._blocks[n_heads]

    def num_entries(self, ratio: int) -> int:
        """Entry columns of the step (block-table width x P / ratio)."""
        return self.batch.block_table.shape[1] * self.batch.kv.block_size // ratio

    def entry_rows(self, entries: torch.Tensor, ratio: int, seq: torch.Tensor | None = None):
        """Pool rows of entry ids ``entries`` [T, k] of each token's sequence (-1 stays -1)."""
        seq = self.seq if seq is None else seq
        return entry_rows(entries, seq, self.batch.block_table, ratio, self.batch.kv.block_size)

    def all_visible_rows(self, ratio: int) -> torch.Tensor:
        """[T, C] pool rows of every visible entry (V4 HCA attends to all of them)."""
        if ratio not in self._hca:
            C = self.num_entries(ratio)
            cols = torch.arange(C, device=self.pos.device).unsqueeze(0)
            ids = torch.where(cols < self.visible(ratio).unsqueeze(1), cols, -1)
            self._hca[ratio] = self.entry_rows(ids, ratio)
        return self._hca[ratio]

    # ---- compressor groups ------------------------------------------------------------------
    def groups(self, ratio: int, span: int, tail_rows: int) -> GroupRows:
        key = (ratio, span, tail_rows)
        if key not in self._groups:
            self._groups[key] = self._build_groups(ratio, span, tail_rows)
        return self._groups[key]

    def _build_groups(self, r: int, span: int, rows: int) -> GroupRows:
        b = self.batch
        return GroupRows(*compressor_groups(
            self.pos, self.seq, self.a, self.n, self.slot, b.cached_lens, b.block_table, r,
            span, rows, b.kv.block_size, b.kv.trash_block, b.kv.trash_slot))  # fmt: skip

    # ---- rotary -----------------------------------------------------------------------------
    # Cached per rotary *kind* (``Rotary.key``: every layer of one type has an equal one), so
    # a step computes them once per kind, not once per layer (four to five launches a layer).
    def cos_sin(self, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope/2] of the step's positions for one :class:`Rotary` (cached)."""
        key = rotary.key
        if key not in self._cos_sin:
            a = self.angles(rotary)
            self._cos_sin[key] = (a.cos(), a.sin())
        return self._cos_sin[key]

    def angles(self, rotary) -> torch.Tensor:
        """[T, rope/2] angles of the step's positions for one :class:`Rotary` (cached)."""
        key = rotary.key
        if key not in self._angles:
            self._angles[key] = rotary.angles(self.pos)
        return self._angles[key]

    def group_cos_sin(self, rotary, ratio: int, span: int, tail_rows: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(cos, sin) [G, rope/2] at the entry positions of :meth:`groups` (cached)."""
        key = (rotary.key, ratio, span, tail_rows)
        if key not in self._cos_sin:
            a = rotary.angles(self.groups(ratio, span, tail_rows).entry * ratio)
            self._cos_sin[key] = (a.cos(), a.sin())
        return self._cos_sin[key]
