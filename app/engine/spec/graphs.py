"""CUDA graphs of the draft step (``app.engine.spec.step``), one per batch bucket and draw
kind.

A key is (R, kind): R requests (the decode graphs' batch buckets), N = S = R (k + 1)
context and sampled rows (a verify step of R requests: every row is a feature row and a
sampled one), the draws' :class:`~app.engine.sampler.PickKind`. A draft step is padded to
the smallest bucket that holds its requests and rows (a step beyond the largest runs
eagerly at its own sizes). Its host inputs go into the bucket's static buffers in one
copy, the step's sampled tokens, accept flags and features by device copies, and the graph
replays right after the step's sampling on the same stream: no host sync between the
verify graph and the draft.

The graphs share the decode graphs' memory pool (``CudaGraphRunner.pool``; one graph runs
at a time on one stream), one set of output buffers sized for the largest bucket and one
set of input buffers (the largest bucket's, which the smaller ones view), so each adds its
own nodes. Start-up captures the greedy and the plain random kind of every bucket
(:meth:`DraftGraphs.start_keys`); other kinds are captured on first use. Without a pool
(the CPU, graphs off) :meth:`DraftGraphs.run` calls the same function eagerly: on the same
padded buffers when ``pad`` is set, else at the step's own sizes (the default: padding rows
leave the other rows' bits alone only where the kernels are batch-invariant, as in the
deterministic mode).
"""

from __future__ import annotations

import bisect

import torch

from app.engine.graphs import SharedOutputs, batch_buckets, capture_graph
from app.engine.sampler import PickKind
from app.engine.spec.proposer import DrafterProposer
from app.engine.spec.step import DraftBuffers, DraftInputs, DraftOutputs, draft_step

DraftKey = tuple[int, PickKind]  # (batch bucket, draw kind)


class DraftGraphs:
    """Runs the draft step of ``proposer`` (``num_drafts`` per request) for up to
    ``max_batch`` requests, padded to batch buckets; captured and replayed once
    :meth:`use_pool` gave it a CUDA-graph pool (module doc). ``dtype``: the model's compute
    dtype, that of the target features a step returns (the streams: the cache layout's)."""

    def __init__(
        self, proposer: DrafterProposer, num_drafts: int, max_batch: int, trash_slot: int,
        device: torch.device, dtype: torch.dtype,
    ) -> None:  # fmt: skip
        self.proposer, self.k, self.trash_slot = proposer, num_drafts, trash_slot
        self.device, self.dtype = torch.device(device), dtype
        self.q = num_drafts + 1
        self.buckets = batch_buckets(max_batch)
        self.arena: DraftBuffers | None = None  # the largest bucket's; the others view it
        self.graphs: dict[DraftKey, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.pad = False  # pad to the buckets without graphs too (always with graphs)
        self.out = SharedOutputs(self.buckets[-1])  # m, anchors, ids, logits, confidence
        self.captures = self.replays = 0

    def use_pool(self, pool) -> None:
        """Capture and replay graphs in ``pool`` (the decode graphs')."""
        self.pool, self.pad = pool, True

    def bucket(self, inp: DraftInputs) -> int | None:
        """The batch bucket of ``inp`` (None: beyond the largest)."""
        q = self.q
        need = max(inp.num_requests, -(-inp.num_context // q), -(-inp.num_sampled // q), 1)
        i = bisect.bisect_left(self.buckets, need)
        return self.buckets[i] if i < len(self.buckets) else None

    def start_keys(self) -> list[DraftKey]:
        """The keys start-up captures, largest first: every bucket's greedy kind and plain
        random one (temperature only: the APIs' default sampling)."""
        return [(b, kind) for b in reversed(self.buckets)
                for kind in (PickKind(), PickKind(random=True))]  # fmt: skip

    def input_bytes(self) -> int:
        """Bytes of the static input buffers (the largest bucket's, which every graph
        views)."""
        return self._buffers(self.buckets[-1]).nbytes

    @torch.inference_mode()
    def run(
        self, inp: DraftInputs, tokens: torch.Tensor, accepted: torch.Tensor | None,
        features: torch.Tensor | None,
    ) -> DraftOutputs:  # fmt: skip
        """The draft step of ``inp`` over the step's ``tokens`` [S], ``accepted`` [S] (None:
        no row had a draft) and ``features`` [N, F]: outputs of its R requests (views of the
        shared outputs when a graph replayed: read before the next draft step)."""
        R, b = inp.num_requests, self.bucket(inp)
        if b is None or not self.pad:  # eagerly at its own sizes
            buf = DraftBuffers.allocate(R, inp.num_context, inp.num_sampled,
                                        *self._feature_spec(), self.device)  # fmt: skip
            buf.fill(inp, tokens, accepted, features)
            return self._step(inp.kind, buf)
        buf = self._buffers(b)
        buf.fill(inp.padded(b, b * self.q, b * self.q, self.trash_slot), tokens, accepted,
                 features)  # fmt: skip
        if self.pool is None:
            return self._step(inp.kind, buf).head(R)
        key = (b, inp.kind)
        graph = self.graphs.get(key)
        if graph is None:
            return DraftOutputs(*self._capture(key)).head(R)
        graph.replay()
        self.replays += 1
        return DraftOutputs(*self.out.bufs).head(R)  # type: ignore[misc]

    @torch.inference_mode()
    def capture(self, key: DraftKey) -> None:
        """Capture ``key``'s graph now (if missing) over padding requests only."""
        if key in self.graphs:
            return
        b = key[0]
        empty = DraftInputs.empty()
        buf = self._buffers(b)
        buf.fill(empty.padded(b, b * self.q, b * self.q, self.trash_slot),
                 torch.zeros(0, dtype=torch.int64, device=self.device), None, None)
        self._capture(key)

    def _capture(self, key: DraftKey):
        buf = self._buffers(key[0])
        graph, first = capture_graph(lambda: self._step(key[1], buf).tensors(), self.pool,
                                     self.out)  # fmt: skip
        self.graphs[key] = graph
        self.captures += 1
        return first

    def _step(self, kind: PickKind, buf: DraftBuffers) -> DraftOutputs:
        return draft_step(self.proposer, self.k, kind, self.trash_slot, buf)

    def _feature_spec(self) -> tuple[int, torch.dtype]:
        p = self.proposer
        return (p.feature_width if p.needs_features else 0), self.dtype

    def _buffers(self, b: int) -> DraftBuffers:
        if self.arena is None:
            top, q = self.buckets[-1], self.q
            with torch.inference_mode():
                self.arena = DraftBuffers.allocate(top, top * q, top * q, *self._feature_spec(),
                                                   self.device)  # fmt: skip
        return self.arena.prefix(b, b * self.q, b * self.q)
