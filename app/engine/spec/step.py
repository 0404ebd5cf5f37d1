"""The draft step of a speculating engine as one static-shape function (:func:`draft_step`):
from a step's samples to the next drafts on the device, with no host sync and every shape
fixed by the step's sizes, so that a CUDA graph captures it per batch bucket
(``app.engine.spec.graphs``) and the CPU runs the very same function eagerly.

    host    DraftInputs (numpy): per sampled request its slot, first sampled position
            (``start``), first row in the samples (``base``) and rows (``count``, 1 + its
            drafts), the output index of its first draft at m = 0, its draw settings; per
            context row (the step's feature rows) its position, slot and request (-1:
            none, committed by the host)
    device  m       leading accepted drafts of each request (accept flags of its rows)
            anchor  start + m, its last committed position; bonus = tokens[base + m]
            observe context rows at or below their request's anchor (or without one) ->
                    the drafter's rings; the rest -> the trash slot
            block   the drafter's block at the anchors, each draft drawn on the device from
                    static per-row settings (``ProposalRows``)

    2 requests, k = 3: counts [4, 1] bases [0, 4], accept flags [1 1 0 . | .]
      -> m [2, 0], anchors [start0 + 2, start1], bonus [tokens[2], tokens[4]]

Padding (:meth:`DraftInputs.padded`): requests in the trash slot at anchor 0 (their context
is the trash slot's ring row of position 0: no attention row is without keys), one sampled
row (no draft: m = 0), greedy; context rows in the trash slot. No real row reads a padding
row: every op of the step is row-wise, or reads the rings through the request's own slot.

Its requests are the step's speculating ones: a sampled request that does not speculate
(constrained) has no drafts, so the host decides which of its context rows are committed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from app.engine.sampler import PickKind, ProposalRows
from app.engine.spec.proposer import DrafterProposer

BIG = np.iinfo(np.int64).max
# per-request int64 rows of DraftInputs.ints and per-context-row ones of .ctx, in order
REQ_ROWS = ("slots", "starts", "bases", "counts", "first_output", "anchor_rows",
            "greedy", "seeded", "seed", "top_k")  # fmt: skip
CTX_ROWS = ("pos", "slots", "req", "next_host", "next_row")


@dataclass
class DraftInputs:
    """The host half of a draft step (module doc): ``req`` int64 [len(REQ_ROWS), R] (the
    last four rows are ``proposal_arrays``' ints), ``floats`` float32 [3, R] (temperature,
    top_p, min_p), ``ctx`` int64 [len(CTX_ROWS), N]; ``num_sampled`` S rows of tokens and
    accept flags; ``kind``: the draws' paths."""

    req: np.ndarray
    floats: np.ndarray
    ctx: np.ndarray
    num_sampled: int
    kind: PickKind

    @classmethod
    def empty(cls) -> DraftInputs:
        """No request, no context row (what padding makes a capture's inputs of)."""
        return cls(np.zeros((len(REQ_ROWS), 0), np.int64), np.zeros((3, 0), np.float32),
                   np.zeros((len(CTX_ROWS), 0), np.int64), 0, PickKind())  # fmt: skip

    @property
    def num_requests(self) -> int:
        return self.req.shape[1]

    @property
    def num_context(self) -> int:
        return self.ctx.shape[1]

    def padded(self, R: int, N: int, S: int, trash_slot: int) -> DraftInputs:
        """These inputs padded to ``R`` requests, ``N`` context rows and ``S`` sampled rows
        (module doc)."""
        r, n = R - self.num_requests, N - self.num_context
        if r < 0 or n < 0 or self.num_sampled > S:
            raise ValueError(f"({self.num_requests}, {self.num_context}, {self.num_sampled}) "
                             f"does not pad to ({R}, {N}, {S})")  # fmt: skip
        def pad(a: np.ndarray, names: tuple[str, ...], values: dict, n: int) -> np.ndarray:
            col = np.array([values.get(f, 0) for f in names], dtype=a.dtype)
            return np.concatenate((a, np.repeat(col[:, None], n, axis=1)), axis=1)

        req = pad(self.req, REQ_ROWS, {"slots": trash_slot, "counts": 1, "greedy": 1}, r)
        floats = pad(self.floats, ("temp", "top_p", "min_p"), {"temp": 1, "top_p": 1}, r)
        ctx = pad(self.ctx, CTX_ROWS, {"slots": trash_slot, "req": -1, "next_row": -1}, n)
        return DraftInputs(req, floats, ctx, S, self.kind)


@dataclass
class DraftBuffers:
    """A draft step's device inputs at fixed sizes: the host inputs (``ints``: ``req`` then
    ``ctx`` flattened, one copy; ``floats``: the float rows flattened), and the step's device
    outputs copied in: ``tokens`` [S] int64, ``accepted`` [S] bool, ``features`` [N, F]
    (None: a drafter that reads none). :meth:`prefix` views the buffers of smaller sizes
    at the front of larger ones (the graphs of every bucket share one set)."""

    ints: torch.Tensor
    floats: torch.Tensor
    tokens: torch.Tensor
    accepted: torch.Tensor
    features: torch.Tensor | None
    R: int
    N: int

    @classmethod
    def allocate(cls, R: int, N: int, S: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> DraftBuffers:  # fmt: skip
        z = dict(device=device)
        n_int = len(REQ_ROWS) * R + len(CTX_ROWS) * N
        feats = torch.zeros(N, width, dtype=dtype, **z) if width else None
        return cls(torch.zeros(n_int, dtype=torch.int64, **z), torch.ones(3 * R, **z),
                   torch.zeros(S, dtype=torch.int64, **z), torch.zeros(S, dtype=torch.bool, **z),
                   feats, R, N)  # fmt: skip

    def prefix(self, R: int, N: int, S: int) -> DraftBuffers:
        """Buffers of ``R`` requests, ``N`` context and ``S`` sampled rows: views at the
        front of these."""
        if R > self.R or N > self.N or self.tokens.numel() < S:
            raise ValueError(f"({R}, {N}, {S}) beyond the buffers' sizes")
        n_int = len(REQ_ROWS) * R + len(CTX_ROWS) * N
        feats = self.features[:N] if self.features is not None else None
        return DraftBuffers(self.ints[:n_int], self.floats[: 3 * R], self.tokens[:S],
                            self.accepted[:S], feats, R, N)  # fmt: skip

    @property
    def nbytes(self) -> int:
        ts = [self.ints, self.floats, self.tokens, self.accepted, self.features]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def fill(
        self, inp: DraftInputs, tokens: torch.Tensor, accepted: torch.Tensor | None,
        features: torch.Tensor | None,
    ) -> None:  # fmt: skip
        """Copy ``inp`` (already padded to these sizes) and the step's device outputs in
        (no host sync: pinned staging, non-blocking)."""
        if (inp.num_requests, inp.num_context) != (self.R, self.N):
            raise ValueError("draft inputs not padded to the buffers' sizes")
        host = np.concatenate((inp.req.reshape(-1), inp.ctx.reshape(-1)))
        _copy_in(self.ints, host)
        _copy_in(self.floats, inp.floats)
        S = tokens.numel()
        self.tokens[:S].copy_(tokens)
        if accepted is None:
            self.accepted[:S].zero_()
        else:
            self.accepted[:S].copy_(accepted)
        if features is not None and features.shape[0]:
            if self.features is None or features.dtype != self.features.dtype:
                raise ValueError(f"features of {features.dtype} for a draft buffer of "
                                 f"{None if self.features is None else self.features.dtype}")
            self.features[: features.shape[0]].copy_(features)

    def rows(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Views of ``ints``: (per request, per context row), by name."""
        R, N = self.R, self.N
        req = self.ints[: len(REQ_ROWS) * R].view(len(REQ_ROWS), R)
        ctx = self.ints[len(REQ_ROWS) * R :].view(len(CTX_ROWS), N)
        return dict(zip(REQ_ROWS, req, strict=True)), dict(zip(CTX_ROWS, ctx, strict=True))


@dataclass
class DraftOutputs:
    """A draft step's results, one row per request: ``m`` [R] accepted drafts, ``anchors``
    [R], ``ids`` [R, k], ``logits`` [R, k, V] fp32 (the proposal), ``confidence`` [R, k]
    (None: the drafter has no confidence head)."""

    m: torch.Tensor
    anchors: torch.Tensor
    ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def head(self, R: int) -> DraftOutputs:
        """The first ``R`` rows (the real requests of a padded step)."""
        return DraftOutputs(*(t[:R] if t is not None else None for t in self.tensors()))


def draft_step(
    proposer: DrafterProposer, num_drafts: int, kind: PickKind, trash_slot: int,
    buf: DraftBuffers,
) -> DraftOutputs:  # fmt: skip
    """The draft step over ``buf`` (module doc): no host sync, every shape from ``buf``'s
    sizes, the paths from ``kind`` and the proposer."""
    req, ctx = buf.rows()
    dev = buf.ints.device
    j = torch.arange(num_drafts, device=dev)
    valid = j.unsqueeze(0) < (req["counts"] - 1).unsqueeze(1)  # [R, k]
    idx = torch.where(valid, req["bases"].unsqueeze(1) + j, 0)
    m = (buf.accepted[idx] & valid).long().cumprod(dim=1).sum(dim=1)
    anchors = req["starts"] + m
    bonus = buf.tokens[req["bases"] + m]
    if buf.N:
        r = ctx["req"]
        thr = torch.where(r >= 0, anchors[r.clamp_min(0)], BIG)
        slots = torch.where(ctx["pos"] <= thr, ctx["slots"], trash_slot)
        nxt = None
        if proposer.needs_next_tokens:
            nr = ctx["next_row"]
            nxt = torch.where(nr >= 0, buf.tokens[nr.clamp_min(0)], ctx["next_host"])
        proposer.observe(slots, ctx["pos"], buf.features, nxt)
    feats = None
    if proposer.anchor_features and buf.features is not None:
        feats = buf.features[req["anchor_rows"] + m]
    pick_ints = torch.stack([req[f] for f in ("greedy", "seeded", "seed", "top_k")])
    rows = ProposalRows(kind, pick_ints, buf.floats.view(3, buf.R))
    first = req["first_output"] + m

    def pick(k: int, logits: torch.Tensor) -> torch.Tensor:
        return rows.draw(logits, first + k)

    block = proposer.block(req["slots"], anchors, bonus, feats, num_drafts, pick)
    return DraftOutputs(m, anchors, block.ids, block.logits, block.confidence)


def _copy_in(dst: torch.Tensor, host: np.ndarray) -> None:
    """``host`` into the device buffer ``dst`` without blocking (pinned staging on CUDA)."""
    src = torch.from_numpy(np.ascontiguousarray(host).reshape(-1))
    if dst.is_cuda:
        src = src.pin_memory()
    dst.view(-1)[: src.numel()].copy_(src, non_blocking=True)
