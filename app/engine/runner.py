"""The model runner: scheduler decision -> step spec (host, numpy) -> ForwardBatch (one copy)
-> logits of the rows that sample (and of prompt rows that want logprobs).

Under overlap scheduling the input token of a decoding request may still be on the device
(sampled by the step in flight): it is -1 on the host and read on the device from the last
sample output (``pending`` = its row there).

    items  [seq a: 3 tokens from position 5 | seq b: decode at 9 (pending token)]
    ids    [t5 t6 t7 | -1]   pending [-1 -1 -1 | b's row in the last samples]
    logit rows: sampling rows first (in item order), then prompt-logprob rows per request

Decode steps (one token per request, nothing else wanted) run as CUDA graphs on CUDA
(``app.engine.graphs``); everything else runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from app.cache.manager import CacheManager
from app.engine.batch import BatchBuilder, StepSpec
from app.engine.scheduler import Scheduled
from app.model.model import DeepseekModel
from app.model.moe import MoE, PackedExperts

logger = logging.getLogger(__name__)


def capturable(model: DeepseekModel) -> bool:
    """Whether a decode step of ``model`` can be captured in a CUDA graph: every MoE layer
    runs the packed-expert kernels (the dequantized reference loops over the experts a batch
    touches, a data-dependent host loop)."""
    return all(
        isinstance(m.experts, PackedExperts) for m in model.modules() if isinstance(m, MoE)
    )


@dataclass
class StepInputs:
    """One step's host inputs and which logits rows belong to whom."""

    items: list[Scheduled]
    spec: StepSpec
    sample_items: list[Scheduled]  # logits rows 0 .. S-1, in this order
    prompt_rows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # ^ request -> (first logits row, prompt positions of its rows)
    graph: bool = False  # a decode step the graph runner may take

    @property
    def num_sampling(self) -> int:
        return len(self.sample_items)


class ModelRunner:
    """Builds step inputs and runs the model for one engine."""

    def __init__(
        self,
        model: DeepseekModel,
        cache: CacheManager,
        max_tokens: int,
        device: torch.device,
        cuda_graphs: bool = False,
        max_graph_batch: int = 256,
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.max_tokens = max_tokens
        hs = model.hash_spec
        self.n_back = hs.max_ngram - 1 if hs is not None else 0
        self.builder = BatchBuilder(cache.pools, device)
        # The last step's sampled tokens (row k = its k-th sampling request): pending input
        # tokens of the next step are read from here on the device.
        self.sampled = torch.zeros(max(1, cache.kv.max_slots), dtype=torch.int64, device=device)
        self.graphs = None
        if cuda_graphs and device.type == "cuda":
            if capturable(model):
                from app.engine.graphs import CudaGraphRunner

                self.graphs = CudaGraphRunner(model, self.builder, max_graph_batch)
            else:
                logger.info("CUDA graphs off: dequantized routed experts run a per-expert loop "
                            "that synchronizes with the host (pack the experts: packed_experts)")

    def prepare(
        self, items: list[Scheduled], decoder_replay: bool, prev_rows: dict[str, int]
    ) -> StepInputs:
        """Host-side step preparation (numpy; no device work). ``prev_rows``: request ->
        its row in the last sample output (for input tokens not on the host yet)."""
        B, cache, nb = len(items), self.cache, self.n_back
        lens = np.fromiter((it.num_tokens for it in items), dtype=np.int64, count=B)
        n_tok = int(lens.sum())
        if n_tok > self.max_tokens:
            raise ValueError(f"step of {n_tok} tokens exceeds the runner's {self.max_tokens}")
        starts = np.fromiter((it.start for it in items), dtype=np.int64, count=B)
        slots = np.empty(B, dtype=np.int64)
        floors, cached, dec = np.zeros(B, np.int64), np.zeros(B, np.int64), np.zeros(B, np.int64)
        hist = np.full((B, nb), -1, dtype=np.int64)
        ids = np.empty(n_tok, dtype=np.int64)
        pending = np.full(n_tok, -1, dtype=np.int64)
        sample_rows, sample_items, prompt = [], [], []
        width, off = 1, 0
        for i, it in enumerate(items):
            seq, a, n = it.seq, it.start, it.num_tokens
            rid, known = seq.request_id, seq.tokens
            slots[i] = cache.slot_of(rid)
            width = max(width, cache.num_blocks_of(rid))
            hi = min(a + n, len(known))
            ids[off : off + hi - a] = known[a:hi]
            if hi < a + n:  # the last input token is still on the device
                ids[off + hi - a : off + n] = -1
                pending[off + n - 1] = prev_rows[rid]
            for k in range(min(nb, a)):
                hist[i, k] = known[a - 1 - k]
            floors[i] = cache.window_floor(rid)
            cached[i] = max(a, cache.num_cached(rid))
            L = seq.num_prompt
            if decoder_replay and not seq.wants_prompt_logprobs and a < L:
                dec[i] = cache.decoder_floor(L, a)
            if seq.wants_prompt_logprobs and a < L:
                prompt.append((rid, off, list(range(a, min(a + n, L)))))
            if it.samples:
                sample_rows.append(off + n - 1)
                sample_items.append(it)
            off += n
        rows = list(sample_rows)
        prompt_rows = {}
        for rid, o, pos in prompt:
            prompt_rows[rid] = (len(rows), pos)
            rows += [o + p - pos[0] for p in pos]
        spec = StepSpec(
            slots=slots, starts=starts, lens=lens, floors=floors, cached=cached,
            decoder_floors=dec, history=hist, ids=ids, pending=pending,
            logit_rows=np.asarray(rows, dtype=np.int64),
            tables=cache.tables[slots, :width],
        )  # fmt: skip
        graph = (
            self.graphs is not None
            and bool((lens == 1).all())
            and len(sample_items) == B
            and not prompt
            and self.graphs.fits(B, width)
        )
        return StepInputs(items, spec, sample_items, prompt_rows, graph)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Launch the step; fp32 logits [S, V] of its logit rows (device, not synced)."""
        if inputs.graph:
            return self.graphs.run(inputs.spec, self.sampled)[: inputs.spec.logit_rows.size]
        return self.model(self.builder.build(inputs.spec, self.sampled))

    def store_samples(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens on the device for the next step's pending inputs."""
        self.sampled[: tokens.numel()].copy_(tokens)
