"""CUDA graphs of fixed-shape decode steps.

A graph is keyed by (batch bucket, tokens per request, block-table width bucket): the step's
spec is padded to the bucket with trash-slot requests (``app.engine.batch.pad_spec``), its
inputs are copied into the graph's static buffer (one copy, pending tokens filled on the
device), and the captured model step replays. Tokens per request above 1 are speculative
verify widths (1 + k tokens each, logits at every row). With ``features`` the graph also
returns the draft features of every row (a speculating engine's proposer reads them).

A key is captured on first use: two eager runs on a side stream (which also compile and
autotune every kernel; the step's KV writes are idempotent), the capture into one memory pool
shared by all graphs, and the first run's logits returned. Graphs are replayed one at a time
on one stream and their outputs are read before the next replay, which is what sharing the
pool needs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from app.engine.batch import BatchBuilder, StepSpec, pad_spec
from app.model.model import DeepseekModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # static int64 step buffer
    logits: torch.Tensor  # static output
    features: torch.Tensor | None  # static output: draft features of every row


class CudaGraphRunner:
    """Captures and replays decode steps (see module doc)."""

    def __init__(
        self, model: DeepseekModel, builder: BatchBuilder, max_batch: int, features: bool = False
    ) -> None:
        self.model, self.builder, self.features = model, builder, features
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.max_width = builder.pools.num_blocks
        self.graphs: dict[tuple[int, int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def key(self, spec: StepSpec) -> tuple[int, int, int]:
        B, q = spec.num_seqs, int(spec.lens[0])
        width = spec.tables.shape[1]
        return (
            self.buckets[bisect.bisect_left(self.buckets, B)],
            q,
            min(1 << max(0, width - 1).bit_length(), self.max_width),
        )

    def run(
        self, spec: StepSpec, last_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B_pad * q, V] of the padded step (rows of real requests first), and with
        ``features`` the draft features of its rows [B_pad * q, F] (else None)."""
        key = self.key(spec)
        pools = self.builder.pools
        tables = spec.tables
        if tables.shape[1] < key[2]:
            pad = np.full((tables.shape[0], key[2] - tables.shape[1]), pools.trash_block)
            tables = np.concatenate((tables, pad), axis=1)
        spec = StepSpec(**{**spec.__dict__, "tables": tables})
        spec = pad_spec(spec, key[0], pools.trash_slot, pools.trash_block)
        g = self.graphs.get(key)
        if g is None:
            return self._capture(key, spec, last_tokens)
        self.builder.build(spec, last_tokens, dst=g.inputs)
        g.graph.replay()
        return g.logits, g.features

    def _forward(self, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.features:
            return self.model(batch), None
        feats: list[torch.Tensor] = []
        logits = self.model(batch, feats)
        return logits, feats[0]

    def _capture(self, key, spec: StepSpec, last_tokens: torch.Tensor):
        size = _spec_size(spec)
        inputs = torch.zeros(size, dtype=torch.int64, device=last_tokens.device)
        batch = self.builder.build(spec, last_tokens, dst=inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                first = self._forward(batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, feats = self._forward(batch)
        self.graphs[key] = _Graph(graph, inputs, logits, feats)
        self.captures += 1
        return first


def _spec_size(spec: StepSpec) -> int:
    """Entries of the builder's packed buffer for ``spec`` (no decoder rows in a graph)."""
    B, T = spec.num_seqs, spec.num_tokens
    return 4 * T + 6 * B + spec.history.size + spec.tables.size + spec.logit_rows.size
