"""The typed input of one model step: several sequences of different lengths, flattened.

    seq_lens   [3, 1, 2]
    cu_seqlens [0, 3, 4, 6]
    input_ids  [a0 a1 a2 | b0 | c0 c1]          (T = 6 tokens)
    positions  [p+0 p+1 p+2 | q+0 | r+0 r+1]    (p, q, r = prefix_lens: tokens computed before)

Full-sequence forward has ``prefix_lens == 0`` and no store. With a :class:`KVStore`
(``app.cache`` binds the block table and request slots into one) the same batch type
carries chunked prefill and decode; the model never reads module-global context.

Per sequence, for bounded replay after a prefix-cache hit ending at H:

    window_floors  lowest position whose window KV may be read (H - window; else 0)
    cached_lens    compressed entries / index keys of groups ending at or before this
                   position are already stored and are never rewritten (H; else 0)
    decoder_floors V4.1 decoder replay: decoder layers run only on positions >= this
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from app.model.kv_store import KVStore


@dataclass(eq=False)
class ForwardBatch:
    """Flat tokens + positions + per-sequence lengths for one forward pass."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: tuple[int, ...]  # new tokens per sequence
    prefix_lens: tuple[int, ...]  # tokens of each sequence computed before this step
    kv: KVStore | None = None
    window_floors: tuple[int, ...] = ()  # default: 0 for every sequence
    cached_lens: tuple[int, ...] = ()  # default: prefix_lens
    decoder_floors: tuple[int, ...] = ()  # default: 0 (decoder layers see every row)
    # Engram: ids of the (max_ngram - 1) tokens before each sequence's first new token,
    # most recent first, -1 where none: [B, n-1]; default: none.
    history: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        n = len(self.seq_lens)
        if not self.window_floors:
            self.window_floors = (0,) * n
        if not self.cached_lens:
            self.cached_lens = tuple(self.prefix_lens)
        if not self.decoder_floors:
            self.decoder_floors = (0,) * n
        for name in ("window_floors", "cached_lens", "decoder_floors"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must have one entry per sequence")
        if any(p and self.kv is None for p in self.prefix_lens):
            raise ValueError("a batch continuing sequences (prefix_lens > 0) needs a KV store")
        if self.input_ids.dim() != 1 or self.positions.shape != self.input_ids.shape:
            raise ValueError("input_ids and positions must be 1-D tensors of equal length")
        if len(self.seq_lens) != len(self.prefix_lens):
            raise ValueError("seq_lens and prefix_lens must have one entry per sequence")
        if sum(self.seq_lens) != self.input_ids.numel() or min(self.seq_lens, default=1) <= 0:
            raise ValueError("seq_lens must be positive and sum to the number of tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def seq_slices(self) -> list[slice]:
        """Token slice of each sequence in the flat layout."""
        out, start = [], 0
        for n in self.seq_lens:
            out.append(slice(start, start + n))
            start += n
        return out

    def last_token_index(self) -> torch.Tensor:
        """Flat index of each sequence's last token: [3, 1, 2] -> [2, 3, 5]."""
        idx = torch.tensor(self.seq_lens, dtype=torch.int64).cumsum(0) - 1
        return idx.to(self.input_ids.device)

    @classmethod
    def from_sequences(
        cls, seqs: Sequence[torch.Tensor | Sequence[int]], device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        """Full-sequence batch: every sequence starts at position 0."""
        ts = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in seqs]
        if not ts or any(t.numel() == 0 for t in ts):
            raise ValueError("every sequence needs at least one token")
        ids = torch.cat(ts).to(device)
        pos = torch.cat([torch.arange(t.numel()) for t in ts]).to(device)
        lens = tuple(t.numel() for t in ts)
        return cls(ids, pos, lens, (0,) * len(ts))
