"""The model runner: scheduler decision -> step spec (host, numpy) -> ForwardBatch (one copy)
-> logits of the rows that sample (and of prompt rows that want logprobs).

Under overlap scheduling the input token of a decoding request may still be on the device
(sampled by the step in flight): it is -1 on the host and read on the device from the last
sample output (``pending`` = its row there).

    items  [seq a: 3 tokens from position 5 | seq b: decode at 9 (pending token)]
    ids    [t5 t6 t7 | -1]   pending [-1 -1 -1 | b's row in the last samples]
    logit rows: sampling rows first (in item order), then prompt-logprob rows per request

A verify chunk [last token, d1 .. dk] (speculative decoding) samples all of its k + 1 rows:
row j checks d_{j+1} and row k draws the bonus token. With a proposer that reads the target
features, ``forward`` also returns the features of the rows it may commit (the last window
of each chunk; ``StepInputs.feat_*``).

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
from app.engine.graphs import CudaGraphRunner, Key, width_buckets
from app.engine.sampler import to_device
from app.engine.scheduler import Scheduled
from app.model.layers import prepare_fp8_linears, stack_projections
from app.model.model import DeepseekModel
from app.model.moe import MoE, PackedExperts

logger = logging.getLogger(__name__)


def capturable(model: DeepseekModel) -> bool:
    """Whether a decode step of ``model`` can be captured in a CUDA graph: every MoE layer
    runs the packed-expert kernels (the dequantized reference loops over the experts a batch
    touches, a data-dependent host loop)."""
    return all(isinstance(m.experts, PackedExperts) for m in model.modules() if isinstance(m, MoE))


@dataclass
class StepInputs:
    """One step's host inputs and which logits rows belong to whom."""

    items: list[Scheduled]
    spec: StepSpec
    sample_items: list[Scheduled]  # logits rows 0 .. S-1, in this order
    prompt_rows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # ^ request -> (first logits row, prompt positions of its rows)
    graph: bool = False  # a decode step the graph runner may take
    sample_counts: list[int] = field(default_factory=list)  # rows per sample item (1 + drafts)
    # target-feature rows that may be committed: row in the step's features, position, item
    feat_rows: np.ndarray | None = None
    feat_pos: np.ndarray | None = None
    feat_item: np.ndarray | None = None

    @property
    def num_sampling(self) -> int:
        return len(self.sample_items)

    @property
    def num_sample_rows(self) -> int:
        return sum(self.sample_counts)


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
        features: bool = False,
    ) -> None:
        self.model, self.cache, self.device = model, cache, device
        self.features = features  # return the target features (a DSpark proposer reads them)
        self.max_tokens = max_tokens
        hs = model.hash_spec
        self.n_back = hs.max_ngram - 1 if hs is not None else 0
        self.builder = BatchBuilder(cache.pools, device)
        # The last step's sampled tokens (row k = its k-th sampling request): pending input
        # tokens of the next step are read from here on the device.
        self.sampled = torch.zeros(max(1, cache.kv.max_slots), dtype=torch.int64, device=device)
        self.graphs = None
        stack_projections(model)  # the stacked weights exist before any graph capture
        planned, refused = prepare_fp8_linears(model)  # and the fp8 projections' decode plans
        if planned or refused:
            logger.info("fp8 projections on the decode kernel: %d of %d%s", planned,
                        planned + len(refused),
                        f" (not: {', '.join(refused[:8])}{' ...' if len(refused) > 8 else ''})"
                        if refused else "")  # fmt: skip
        if cuda_graphs and device.type == "cuda":
            if capturable(model):
                max_q = 1 + cache.layout.ring - model.cfg.sliding_window  # verify headroom
                self.graphs = CudaGraphRunner(model, self.builder, max_graph_batch, features,
                                              max_q)  # fmt: skip
            else:
                logger.info(
                    "CUDA graphs off: dequantized routed experts run a per-expert loop "
                    "that synchronizes with the host (pack the experts: packed_experts)"
                )

    def graph_keys(self, qs: tuple[int, ...]) -> list[Key]:
        """Every CUDA-graph key a step with ``qs`` tokens per request can reach (none when
        graphs are off), largest first."""
        if self.graphs is None:
            return []
        max_q = 1 + self.cache.layout.ring - self.model.cfg.sliding_window
        widths = width_buckets(self.cache.tables.shape[1], self.graphs.max_width)
        return self.graphs.keys(tuple(q for q in qs if q <= max_q), self.max_tokens, widths)

    def capture_graph(self, key: Key) -> None:
        """Capture ``key``'s graph now (start-up; see ``app.engine.graphs``)."""
        self.graphs.capture(key, self.sampled)

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
        sample_rows, sample_items, counts, prompt = [], [], [], []
        width, off = 1, 0
        for i, it in enumerate(items):
            seq, a, n = it.seq, it.start, it.num_tokens
            rid, known = seq.request_id, seq.tokens
            if it.num_drafts:
                known = known + seq.drafts
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
                sample_rows += range(off + n - 1 - it.num_drafts, off + n)
                sample_items.append(it)
                counts.append(1 + it.num_drafts)
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
        # a graph: every request decodes (one token) or verifies (1 + k, every row sampled)
        # with the same width, within the rings' verify headroom; no row below its decoder
        # floor (decode chunks sit above it)
        q = int(lens[0]) if B else 0
        graph = (
            self.graphs is not None
            and B > 0
            and bool((lens == q).all())
            and q <= 1 + cache.layout.ring - self.model.cfg.sliding_window
            and len(sample_items) == B
            and sum(counts) == B * q
            and not prompt
            and not bool((dec > starts).any())
            and self.graphs.fits(B, width)
        )
        out = StepInputs(items, spec, sample_items, prompt_rows, graph, counts)
        if self.features:
            out.feat_rows, out.feat_pos, out.feat_item = self._feature_rows(starts, lens, dec)
        return out

    def _feature_rows(self, starts: np.ndarray, lens: np.ndarray, dec: np.ndarray):
        """The rows of the step's features (head rows: every row, or with decoder replay the
        rows at or above each chunk's floor) in each chunk's last window of positions."""
        W = self.model.cfg.sliding_window
        lo = np.maximum(starts, dec) if dec.any() else starts
        head = np.maximum(starts + lens - lo, 0)
        head_off = np.concatenate(([0], np.cumsum(head)[:-1]))
        first = np.maximum(lo, starts + lens - W)
        take = np.maximum(starts + lens - first, 0)
        item = np.repeat(np.arange(lens.size), take)
        within = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
        pos = np.repeat(first, take) + within
        rows = np.repeat(head_off, take) + pos - np.repeat(lo, take)
        return rows.astype(np.int64), pos.astype(np.int64), item.astype(np.int64)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Launch the step; fp32 logits [S, V] of its logit rows (device, not synced)."""
        return self.forward_with_features(inputs)[0]

    @torch.inference_mode()
    def forward_with_features(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, and the target features of ``inputs.feat_rows`` when the runner
        returns features (else None)."""
        if inputs.graph:
            logits, feats = self.graphs.run(inputs.spec, self.sampled)
            logits = logits[: inputs.spec.logit_rows.size]
            if not self.features:
                return logits, None
            return logits, feats[to_device(inputs.feat_rows, self.device)]
        batch = self.builder.build(inputs.spec, self.sampled)
        if not self.features:
            return self.model(batch), None
        feats: list[torch.Tensor] = []
        logits = self.model(batch, feats)
        return logits, feats[0][to_device(inputs.feat_rows, self.device)]

    def store_samples(self, tokens: torch.Tensor) -> None:
        """Keep a step's sampled tokens on the device for the next step's pending inputs."""
        self.sampled[: tokens.numel()].copy_(tokens)
