"""The model runner: scheduler decision -> ForwardBatch -> hidden states -> logits of the rows
that sample (and of prompt rows that want logprobs).

Step inputs are built with numpy into buffers allocated once (pinned on CUDA) and copied to the
device in one transfer each. Under overlap scheduling some input tokens are not known on the
host yet: they are -1 in the host buffer and filled on the device from the previous step's
sampled tokens (``pending``: flat row -> row of the previous sample output).

    items  [seq a: 3 tokens from position 5 | seq b: decode at 9 (pending token)]
    ids    [t5 t6 t7 | -1]  pending {3: <b's row in the last step's samples>}
    pos    [5 6 7 | 9]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.cache.manager import CacheManager
from app.engine.scheduler import Scheduled
from app.model.forward_batch import ForwardBatch
from app.model.model import DeepseekModel


@dataclass
class StepInputs:
    """One step's batch and which flat rows produce logits."""

    batch: ForwardBatch
    items: list[Scheduled]
    sample_rows: list[int]  # flat row of the last token of each sampling item
    sample_items: list[Scheduled]
    prompt_rows: dict[str, list[tuple[int, int]]]  # request -> [(flat row, position)]
    pending: dict[int, tuple[str, int]]  # flat row -> (request id, position) filled on device


class ModelRunner:
    """Builds step inputs and runs the model for one engine."""

    def __init__(
        self, model: DeepseekModel, cache: CacheManager, max_tokens: int, device: torch.device
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        hs = model.hash_spec
        self.n_back = hs.max_ngram - 1 if hs is not None else 0
        pin = device.type == "cuda"
        # Two sets, alternated: step N+1 is prepared while step N's copies may be in flight.
        self._bufs = [
            tuple(torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2))
            for _ in range(2)
        ]
        self._turn = 0

    def prepare(self, items: list[Scheduled], decoder_replay: bool) -> StepInputs:
        """Host-side step preparation (no device work)."""
        ids_t, pos_t = self._bufs[self._turn]
        self._turn ^= 1
        ids_np, pos_np = ids_t.numpy(), pos_t.numpy()
        n_tok = sum(it.num_tokens for it in items)
        if n_tok > ids_np.shape[0]:
            raise ValueError(f"step of {n_tok} tokens exceeds the runner's {ids_np.shape[0]}")
        lens = np.fromiter((it.num_tokens for it in items), dtype=np.int64, count=len(items))
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=len(items))
        offsets = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(items) else lens
        # positions: starts repeated per row + rank inside the chunk
        # e.g. lens [3, 1], starts [5, 9] -> [5, 6, 7, 9]
        rank = np.arange(n_tok) - np.repeat(offsets, lens)
        pos_np[:n_tok] = np.repeat(starts, lens) + rank
        pending: dict[int, tuple[str, int]] = {}
        hist, floors, cached, dec = [], [], [], []
        prompt_rows: dict[str, list[tuple[int, int]]] = {}
        sample_rows, sample_items = [], []
        for it, off, a in zip(items, offsets.tolist(), starts.tolist(), strict=True):
            seq, n = it.seq, it.num_tokens
            known = seq.tokens
            hi = min(a + n, len(known))
            ids_np[off : off + (hi - a)] = known[a:hi]
            for p in range(hi, a + n):  # tokens still on the device (overlap)
                ids_np[off + p - a] = -1
                pending[off + p - a] = (seq.request_id, p)
            rid = seq.request_id
            hist.append(
                [
                    known[a - 1 - k] if 0 <= a - 1 - k < len(known) else -1
                    for k in range(self.n_back)
                ]
            )
            floors.append(self.cache.window_floor(rid))
            # groups ending at or before the prefix hit are shared blocks: never rewritten
            cached.append(max(a, self.cache.num_cached(rid)))
            L = seq.num_prompt
            use_dec = decoder_replay and not seq.wants_prompt_logprobs and a < L
            dec.append(self.cache.decoder_floor(L, a) if use_dec else 0)
            if seq.wants_prompt_logprobs and a < L:
                prompt_rows[rid] = [(off + p - a, p) for p in range(a, min(a + n, L))]
            if it.samples:
                sample_rows.append(off + n - 1)
                sample_items.append(it)
        ids = ids_t[:n_tok].to(self.device, non_blocking=True)
        pos = pos_t[:n_tok].to(self.device, non_blocking=True)
        if self.device.type == "cpu":  # .to() on the same device aliases the buffer
            ids, pos = ids.clone(), pos.clone()
        batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            seq_lens=tuple(lens.tolist()),
            prefix_lens=tuple(starts.tolist()),
            kv=self.cache.store([it.seq.request_id for it in items]),
            window_floors=tuple(floors),
            cached_lens=tuple(cached),
            decoder_floors=tuple(dec),
            history=torch.tensor(hist, dtype=torch.int64).view(len(items), self.n_back),
        )
        return StepInputs(batch, items, sample_rows, sample_items, prompt_rows, pending)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward; returns (fp32 logits of the sampling rows [S, V], prompt-row logits per
        request [n, V])."""
        h, rows = self.model.hidden(inputs.batch)
        where = torch.full((inputs.batch.num_tokens,), -1, dtype=torch.int64, device=h.device)
        where[rows] = torch.arange(rows.numel(), device=h.device)
        want = torch.tensor(inputs.sample_rows, dtype=torch.int64, device=h.device)
        logits = self.model.compute_logits(h[where[want]])
        prompt = {}
        for rid, pairs in inputs.prompt_rows.items():
            r = torch.tensor([f for f, _ in pairs], dtype=torch.int64, device=h.device)
            prompt[rid] = self.model.compute_logits(h[where[r]])
        return logits, prompt
