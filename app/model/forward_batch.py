"""The typed input of one batched model step over the paged cache.

Several sequences of different lengths, flattened; every tensor is on the model's device and
built once per step by the engine's batch builder (``app.engine.batch``):

    seq_lens    [3, 1, 2]            prefix_lens [5, 9, 0]
    seq_start   [0, 3, 4]            token_seq   [0, 0, 0, 1, 2, 2]
    input_ids   [a5 a6 a7 | b9 | c0 c1]         (T = 6 tokens, B = 3 sequences)
    positions   [5  6  7  | 9  | 0  1 ]

Per sequence, for bounded replay after a prefix-cache hit ending at H:

    window_floors  lowest position whose window KV may be read (H - window; else 0)
    cached_lens    groups ending at or before this position are already stored and never
                   rewritten (max(prefix_len, H))

``decoder`` (V4.1 decoder replay): the rows that run the decoder layers and their own batch.
Shapes depend only on T, B, the block table's width and ``max_seq_len`` (host integers), so a
decode step of fixed (B, tokens per sequence, width) is one CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.kv_store import PagedKV


@dataclass(eq=False)
class DecoderRows:
    """V4.1 decoder replay: ``keep`` [T'] rows of the step that run the decoder layers, and
    ``batch``, those rows as a batch (their prefix starts at each sequence's decoder floor)."""

    keep: torch.Tensor
    batch: ForwardBatch


@dataclass(eq=False)
class ForwardBatch:
    """Flat tokens + per-sequence cache metadata for one forward pass (see module doc)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_seq: torch.Tensor  # [T] int64: sequence of each token
    seq_start: torch.Tensor  # [B] int64: flat row of each sequence's first token
    seq_lens: torch.Tensor  # [B] int64: new tokens
    prefix_lens: torch.Tensor  # [B] int64: positions computed before this step
    slots: torch.Tensor  # [B] int64: request slot (window and tail rings)
    block_table: torch.Tensor  # [B, NB] int64 (padded with the trash block)
    window_floors: torch.Tensor  # [B] int64
    cached_lens: torch.Tensor  # [B] int64
    kv: PagedKV
    max_seq_len: int  # longest chunk of the step (host); fixes padded shapes
    history: torch.Tensor | None = None  # [B, n-1] ids before each chunk, newest first, -1
    logit_rows: torch.Tensor | None = None  # [S] head rows whose logits are wanted (None: all)
    decoder: DecoderRows | None = None

    def __post_init__(self) -> None:
        T, B = self.input_ids.numel(), self.slots.numel()
        if self.input_ids.dim() != 1 or self.positions.shape != self.input_ids.shape:
            raise ValueError("input_ids and positions must be 1-D tensors of equal length")
        if self.token_seq.shape != (T,):
            raise ValueError("token_seq needs one entry per token")
        for name in ("seq_start", "seq_lens", "prefix_lens", "window_floors", "cached_lens"):
            if getattr(self, name).shape != (B,):
                raise ValueError(f"{name} needs one entry per sequence")
        if self.block_table.dim() != 2 or self.block_table.shape[0] != B:
            raise ValueError("block_table must be [num_seqs, width]")
        if self.history is not None and self.history.shape[0] != B:
            raise ValueError("history needs one row per sequence")
        if not self.max_seq_len > 0 or (T and self.max_seq_len > T):
            raise ValueError(f"max_seq_len {self.max_seq_len} does not fit {T} tokens")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.slots.numel()

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def direct_window(self, sliding_window: int) -> bool:
        """Whether every chunk fits the ring's headroom, so the step may write its window KV
        first and read every window key from the ring (decode; verify within the headroom);
        else new keys are read from the step's own rows (``app.model.attn_meta``)."""
        return self.max_seq_len <= self.kv.ring - sliding_window + 1
