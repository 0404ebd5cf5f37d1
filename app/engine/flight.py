"""A launched engine step (:class:`Flight`): its inputs, its logits on the device and, once
sampling is launched, the sampled rows and their copy to the host (:class:`HostSamples`).

Rows: a sampling item i has ``counts[i]`` logits rows (1, or 1 + drafts for a verify chunk),
laid out item after item. Items whose request finished meanwhile are not sampled; the rows
of the live ones are packed (``bases``: first row of each live item among them):

    counts [1, 3, 1], item 1 finished  ->  logits rows [0, 4], counts [1, 1], bases [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from app.engine.runner import StepInputs
from app.engine.sampler import SampleOutput, to_device
from app.engine.scheduler import Scheduled
from app.engine.sequence import Sequence


@dataclass
class LiveRows:
    """The sampled items of a step and their packed logits rows (module doc)."""

    items: list[Scheduled]
    counts: np.ndarray  # rows per item
    bases: np.ndarray  # first row of each item
    logits: torch.Tensor  # [sum(counts), V]

    def last_rows(self) -> dict[str, int]:
        """request -> its last row: where the next step reads its pending input token."""
        return {it.seq.request_id: int(b + c - 1)
                for it, b, c in zip(self.items, self.bases, self.counts, strict=True)}  # fmt: skip


@dataclass
class Flight:
    """A launched step: inputs, its logits on the device, and (once sampling is launched) the
    sampled rows and their host copy."""

    inputs: StepInputs
    logits: torch.Tensor
    features: torch.Tensor | None = None  # target features of inputs.feat_rows (DSpark)
    live: list[int] = field(default_factory=list)  # sample_items indices that were sampled
    host: HostSamples | None = None
    finished_while_in_flight: list[Sequence] = field(default_factory=list)
    draft_rows: dict[str, int] = field(default_factory=dict)  # request -> row of ``drafts``
    drafts: torch.Tensor | None = None  # [R, k] fp32 logits of the proposed blocks

    @property
    def items(self) -> list[Scheduled]:
        return self.inputs.items

    def holds(self, seq: Sequence) -> bool:
        return any(it.seq is seq for it in self.items)

    def live_rows(self) -> LiveRows | None:
        """Pick the sampling items whose request is still running (``live``) and their
        logits rows; None when none is."""
        items, counts = self.inputs.sample_items, self.inputs.sample_counts
        self.live = live = [i for i, it in enumerate(items) if it.seq.finish_reason is None]
        if not live:
            return None
        offs = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        rows = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in live])
        lc = np.asarray([counts[i] for i in live], dtype=np.int64)
        bases = np.concatenate(([0], np.cumsum(lc)[:-1])).astype(np.int64)
        logits = self.logits[: int(offs[-1])]
        if rows.size < offs[-1]:
            logits = logits[to_device(rows, logits.device)]
        return LiveRows([items[i] for i in live], lc, bases, logits)

    def sampled_rows(self) -> dict[str, tuple[int, int]]:
        """request -> (its first row in the host samples, its rows)."""
        out, row = {}, 0
        for i in self.live:
            c = self.inputs.sample_counts[i]
            out[self.inputs.sample_items[i].seq.request_id] = (row, c)
            row += c
        return out


@dataclass
class HostResult:
    """A step's samples on the host: one entry per sampled row (``accepted``: the row's draft
    was accepted; ``accept_lengths`` / ``drafts``: per sampled request, speculation on)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    accepted: list[bool] | None = None
    accept_lengths: list[int] | None = None
    drafts: list[list[int]] | None = None


class HostSamples:
    """A step's sampled tokens (logprobs, accept flags, next drafts) copied to the host
    without blocking; ``wait`` blocks on the copy's event."""

    def __init__(self, res: SampleOutput, extra: list[torch.Tensor] | None = None) -> None:
        self._event = None
        extra = list(extra or []) + [None] * (2 - len(extra or []))
        parts = [res.tokens, res.logprobs, res.top_ids, res.top_logprobs, res.accepted, *extra]
        if res.tokens.is_cuda:
            parts = [p.to("cpu", non_blocking=True) if p is not None else None for p in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        self._parts = parts

    def wait(self) -> HostResult:
        if self._event is not None:
            self._event.synchronize()
        return HostResult(*(p.tolist() if p is not None else None for p in self._parts))
