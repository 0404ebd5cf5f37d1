"""CUDA graphs of fixed-shape decode steps.

A graph is keyed by (batch bucket, tokens per request, block-table width bucket): the step's
spec is padded to the bucket with trash-slot requests (``app.engine.batch.pad_spec``), its
inputs are copied into the graph's static buffer (one copy, pending tokens filled on the
device), and the captured model step replays. Tokens per request above 1 are speculative
verify widths (1 + k tokens each, logits at every row). With ``features`` the graph also
returns the draft features of every row (a speculating engine's proposer reads them).

Start-up captures every key the serving paths can reach (:meth:`CudaGraphRunner.keys`,
largest first: ``app.engine.startup``); a key met later is captured on first use. A capture
is two eager runs on a side stream (which also compile and autotune every kernel; the
step's KV writes are idempotent), then the capture into one memory pool shared by all
graphs. Each graph copies its logits (and features) into one output buffer shared by all
graphs, sized for the largest, and lets its own outputs go back to the pool, where the
next capture reuses them: the graphs hold the pool's high-water mark (the largest graph's
activations), the shared outputs and each graph's static input buffer. Graphs are replayed
one at a time on one stream and their outputs are read before the next replay, which is
what sharing the pool and the outputs needs.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from app.engine.batch import BatchBuilder, StepSpec, pad_spec
from app.model.model import DeepseekModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
Key = tuple[int, int, int]  # (batch bucket, tokens per request, block-table width bucket)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # static int64 step buffer
    rows: int  # its rows of the shared outputs


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a graph step is padded to, up to ``max_batch`` (max_num_seqs)."""
    return tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)


def width_bucket(width: int, max_width: int) -> int:
    """The graph width of a step whose block tables are ``width`` wide: the power of two
    that holds them, capped at ``max_width`` (the pool's blocks)."""
    return min(1 << max(0, width - 1).bit_length(), max_width)


def width_buckets(max_blocks_per_seq: int, max_width: int) -> list[int]:
    """Every :func:`width_bucket` of a table up to ``max_blocks_per_seq`` blocks wide."""
    top = max(0, max_blocks_per_seq - 1).bit_length()
    return sorted({min(1 << i, max_width) for i in range(top + 1)})


def graph_keys(
    buckets: tuple[int, ...], qs: tuple[int, ...], max_tokens: int, widths: list[int]
) -> list[Key]:
    """Every key a step of at most ``max_tokens`` tokens reaches with ``qs`` tokens per
    request, these batch ``buckets`` and ``widths``, largest first (a later capture reuses
    the pool's memory)."""
    out = []
    for q in qs:
        most = min(max_tokens // q, buckets[-1])
        if most < 1:
            continue
        top = buckets[bisect.bisect_left(buckets, most)]
        out += [(b, q, w) for b in buckets if b <= top for w in widths]
    return sorted(out, key=lambda k: (k[0] * k[1], k[2]), reverse=True)


def padding_spec(
    B: int, q: int, width: int, n_back: int, trash_slot: int, trash_block: int
) -> StepSpec:
    """A step of ``B`` padding requests of ``q`` tokens each (the trash slot, tables of
    ``width`` trash blocks): what ``pad_spec`` adds to a real step, here the whole step."""
    T, zeros = B * q, np.zeros(B, np.int64)
    return StepSpec(
        slots=np.full(B, trash_slot, np.int64), starts=zeros, lens=np.full(B, q, np.int64),
        floors=zeros, cached=zeros, decoder_floors=zeros,
        history=np.full((B, n_back), -1, np.int64), ids=np.zeros(T, np.int64),
        pending=np.full(T, -1, np.int64), logit_rows=np.arange(T, dtype=np.int64),
        tables=np.full((B, width), trash_block, np.int64),
    )  # fmt: skip


class SharedOutputs:
    """Output buffers shared by the graphs of one runner: one per output of its graphs,
    ``rows`` rows (its largest graph's), allocated like the first captured graph's outputs
    (a None output: none). A graph copies its outputs into their first rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.bufs: list[torch.Tensor | None] | None = None

    def take(self, first: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        if self.bufs is None:
            self.bufs = [t.new_empty((self.rows, *t.shape[1:])) if t is not None else None
                         for t in first]  # fmt: skip
        for t, b in zip(first, self.bufs, strict=True):
            if t is not None and (b is None or t.shape[0] > b.shape[0]):
                raise ValueError(f"a graph output of {t.shape[0]} rows exceeds the shared "
                                 f"outputs' {None if b is None else b.shape[0]}")  # fmt: skip
        return self.bufs


def capture_graph(
    fn: Callable[[], Sequence[torch.Tensor | None]], pool, outputs: SharedOutputs
) -> tuple[torch.cuda.CUDAGraph, Sequence[torch.Tensor | None]]:
    """Capture ``fn`` (static inputs, outputs of any rows) into ``pool`` (module doc): two
    eager runs on a side stream (they compile and autotune every kernel; ``fn``'s writes must
    be idempotent), then the capture, whose outputs are copied into ``outputs`` and go back
    to the pool. -> (the graph, the outputs of the last eager run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            first = fn()
    torch.cuda.current_stream().wait_stream(side)
    shared = outputs.take(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        got = fn()
        for buf, t in zip(shared, got, strict=True):
            if buf is not None:
                buf[: t.shape[0]].copy_(t)
    del got  # back to the pool: the next capture reuses their memory
    return graph, first


class CudaGraphRunner:
    """Captures and replays decode steps (see module doc). ``max_q``: the most tokens per
    request a graph step takes (1 + the verify headroom)."""

    def __init__(
        self, model: DeepseekModel, builder: BatchBuilder, max_batch: int, features: bool = False,
        max_q: int = 1,
    ) -> None:  # fmt: skip
        self.model, self.builder, self.features = model, builder, features
        self.buckets = batch_buckets(max_batch)
        self.max_width = builder.pools.num_blocks
        self.max_rows = self.buckets[-1] * max_q
        hs = model.hash_spec
        self.n_back = hs.max_ngram - 1 if hs is not None else 0
        self.graphs: dict[Key, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.out = SharedOutputs(self.max_rows)  # logits [rows, V], features [rows, F]
        self.captures = 0

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def key(self, spec: StepSpec) -> Key:
        B, q = spec.num_seqs, int(spec.lens[0])
        width = spec.tables.shape[1]
        return (
            self.buckets[bisect.bisect_left(self.buckets, B)],
            q,
            width_bucket(width, self.max_width),
        )

    def keys(self, qs: tuple[int, ...], max_tokens: int, widths: list[int]) -> list[Key]:
        """:func:`graph_keys` of this runner's batch buckets."""
        return graph_keys(self.buckets, qs, max_tokens, widths)

    def input_bytes(self, key: Key) -> int:
        """Bytes of the static input buffer of ``key``'s graph."""
        B, q, width = key
        T = B * q
        return 8 * (4 * T + 6 * B + B * self.n_back + B * width + T)

    def capture(self, key: Key, last_tokens: torch.Tensor) -> None:
        """Capture ``key``'s graph now (if missing) on a step of padding requests only."""
        if key in self.graphs:
            return
        pools = self.builder.pools
        spec = padding_spec(*key, self.n_back, pools.trash_slot, pools.trash_block)
        self._capture(key, spec, last_tokens)

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
        logits, feats = self.out.bufs  # type: ignore[misc]
        return logits[: g.rows], (feats[: g.rows] if feats is not None else None)

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
        graph, first = capture_graph(lambda: self._forward(batch), self.pool, self.out)
        self.graphs[key] = _Graph(graph, inputs, first[0].shape[0])
        self.captures += 1
        return first


def _spec_size(spec: StepSpec) -> int:
    """Entries of the builder's packed buffer for ``spec`` (no decoder rows in a graph)."""
    B, T = spec.num_seqs, spec.num_tokens
    return 4 * T + 6 * B + spec.history.size + spec.tables.size + spec.logit_rows.size
