"""Token sampling for a batch of rows with per-request parameters, on the device, no host sync.

Order per row: penalties (repetition on prompt+output, presence/frequency on output) ->
logit bias -> grammar mask (no bias lets a masked token through) -> log-probabilities (of
these processed logits, before temperature) -> temperature -> min_p / top_k / top_p filters
-> draw. Greedy rows take the argmax (lowest id on ties). Random rows draw with the
exponential race ``argmax(p / q), q ~ Exp(1)``. A seeded request's ``q`` is a counter-based
hash of (seed, output index, token id): the same seed gives the same tokens whatever else is
in the batch, with no generator object per row.

Which paths run is decided on the host from the parameters (never from device values); the
per-row parameters travel as small tensors built with numpy.

Speculative verification (``drafts``): a row that carries a draft token d (proposed from the
distribution Q of ``draft_logits`` at the request's temperature and filters) returns
``accepted`` and the token it emits. Greedy rows accept iff d is the argmax (the token is the
argmax either way). Random rows accept with probability min(1, P(d) / Q(d)) and otherwise draw
from the residual max(P - Q, 0) (Leviathan et al. 2023): the emitted token is distributed as P,
whatever Q is. The logit bias is in both: in P as in any row, in Q because ``draw_proposal``
adds it to the draft logits it draws from. Seeded rows take the accept uniform and the draft
draw from their own counters (stream offsets of :data:`ACCEPT_STREAM` / :data:`DRAFT_STREAM`),
so a request's tokens stay independent of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from app.engine import grammar
from app.engine.request import SamplingParams

if TYPE_CHECKING:
    from app.engine.scheduler import Scheduled


@dataclass
class RowState:
    """What the sampler needs of one request besides its params."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    mask_eos: bool = False  # min_tokens not reached yet
    eos_ids: tuple[int, ...] = ()


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32 of the chosen tokens (None if no row asked)
    top_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] fp32
    accepted: torch.Tensor | None = None  # [B] bool: the row's draft token was accepted


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` without blocking the host (pinned staging on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# splitmix64 constants as signed int64 (torch multiplies int64 with wrap-around)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def seeded_exponential(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, vocab] from (seed, counter, token id) by splitmix64 (int64 wrap
    arithmetic; fp64 uniforms in (0, 1))."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (seeds * _GOLDEN + counters * _MIX1).unsqueeze(1) + v * _GOLDEN
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    x = x ^ _srl(x, 31)
    u = (_srl(x, 11).double() + 0.5) * 2.0**-53
    return -torch.log(u).float()


# counter streams of a seeded request: token draws use the output index itself
ACCEPT_STREAM = 1 << 40
DRAFT_STREAM = 2 << 40


def _uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """U(0, 1) [R] of (seed, counter): exp(-E) of the seeded Exp(1) noise of token 0."""
    return torch.exp(-seeded_exponential(seeds, counters, 1).squeeze(1).double()).float()


class _RowParams:
    """Per-row temperature and filters as device tensors (host-decided paths)."""

    def __init__(self, ps: Sequence[SamplingParams], V: int, dev: torch.device) -> None:
        temp = np.array([p.temperature if not p.greedy else 1.0 for p in ps], dtype=np.float32)
        top_k = np.array([min(max(p.top_k, 0), V) for p in ps], dtype=np.int64)
        top_p = np.array([p.top_p for p in ps], dtype=np.float32)
        min_p = np.array([p.min_p for p in ps], dtype=np.float32)
        t = to_device(np.stack((temp, top_p, min_p)), dev)
        self.temp, self.top_p, self.min_p = t[0], t[1], t[2]
        self.top_k = to_device(top_k, dev)
        self.use_min_p = bool((min_p > 0).any())
        self.use_sort = bool((top_k > 0).any() | (top_p < 1).any())

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Filtered, unnormalized probabilities of ``logits`` [R, V] at the rows' settings."""
        p = torch.softmax(logits / self.temp.unsqueeze(1), dim=-1)
        return _filter(p, self.top_k, self.top_p, self.min_p, self.use_min_p, self.use_sort)


def _noise(ps: Sequence[SamplingParams], counters: np.ndarray, shape, dev) -> torch.Tensor:
    """Exp(1) race noise [R, V]: seeded rows from (seed, counter), the rest unseeded."""
    q = torch.empty(shape, dtype=torch.float32, device=dev).exponential_()
    seeded = [i for i, p in enumerate(ps) if p.seed is not None]
    if seeded:
        idx = to_device(np.asarray(seeded, dtype=np.int64), dev)
        seeds = np.array([ps[i].seed for i in seeded], dtype=np.int64)
        q[idx] = seeded_exponential(to_device(seeds, dev), to_device(counters[seeded], dev),
                                    shape[1])  # fmt: skip
    return q


@dataclass(frozen=True)
class PickKind:
    """The paths a draw of drafts runs, decided on the host from the random rows' params
    (greedy rows take the argmax whatever their filters): a CUDA graph of the draw is
    captured per kind (``app.engine.spec.step``)."""

    random: bool = False  # some row samples
    min_p: bool = False  # some random row has min_p
    sort: bool = False  # some random row has top_k / top_p
    seeded: bool = False  # some random row is seeded

    @classmethod
    def of(cls, ps: Sequence[SamplingParams]) -> PickKind:
        rand = [p for p in ps if not p.greedy]
        return cls(bool(rand), any(p.min_p > 0 for p in rand),
                   any(p.top_k > 0 or p.top_p < 1 for p in rand),
                   any(p.seed is not None for p in rand))  # fmt: skip


def proposal_arrays(ps: Sequence[SamplingParams], V: int) -> tuple[np.ndarray, np.ndarray]:
    """The per-row settings of a draft draw as host arrays: (int64 [4, R]: greedy, seeded,
    seed, top_k; float32 [3, R]: temperature, top_p, min_p)."""
    ints = np.array([[p.greedy for p in ps], [p.seed is not None for p in ps],
                     [p.seed or 0 for p in ps], [min(max(p.top_k, 0), V) for p in ps]],
                    dtype=np.int64).reshape(4, len(ps))  # fmt: skip
    floats = np.array([[p.temperature if not p.greedy else 1.0 for p in ps],
                       [p.top_p for p in ps], [p.min_p for p in ps]],
                      dtype=np.float32).reshape(3, len(ps))  # fmt: skip
    return ints, floats


@dataclass
class ProposalRows:
    """A draft draw's per-row settings on the device (:func:`proposal_arrays`: ``ints``
    [4, R], ``floats`` [3, R]) and its :class:`PickKind`. :meth:`draw` reads nothing from
    the host: a CUDA graph captures it with these tensors as static inputs."""

    kind: PickKind
    ints: torch.Tensor
    floats: torch.Tensor

    @classmethod
    def of(cls, ps: Sequence[SamplingParams], V: int, dev: torch.device) -> ProposalRows:
        ints, floats = proposal_arrays(ps, V)
        return cls(PickKind.of(ps), to_device(ints, dev), to_device(floats, dev))

    def draw(self, logits: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """Draft tokens [R] from draft ``logits`` [R, V] (fp32): the argmax for greedy rows, a
        draw from Q = the filtered softmax at the row's temperature otherwise; ``counters``
        [R]: the output index each draft proposes (seeded rows draw from DRAFT_STREAM)."""
        tokens = logits.argmax(dim=-1)
        kind = self.kind
        if not kind.random:
            return tokens
        greedy, seeded, seeds, top_k = self.ints.unbind(0)
        temp, top_p, min_p = self.floats.unbind(0)
        probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
        probs = _filter(probs, top_k, top_p, min_p, kind.min_p, kind.sort)
        q = torch.empty_like(probs).exponential_()
        if kind.seeded:
            mine = seeded_exponential(seeds, counters + DRAFT_STREAM, logits.shape[1])
            q = torch.where(seeded.bool().unsqueeze(1), mine, q)
        return torch.where(greedy.bool(), tokens, (probs / q).argmax(dim=-1))


def draw_proposal(
    logits: torch.Tensor, ps: Sequence[SamplingParams], counters: torch.Tensor
) -> torch.Tensor:
    """Draft tokens [R] from draft ``logits`` [R, V] (fp32) with the rows' params
    (:meth:`ProposalRows.draw`). ``counters`` [R] (device): the output index each draft
    proposes. The rows' logit biases are added to ``logits`` in place: the drafts come from
    the biased logits, which the proposers keep as the proposal that verification reads as
    Q."""
    add_bias(logits, ps)
    return ProposalRows.of(ps, logits.shape[1], logits.device).draw(logits, counters)


def add_bias(logits: torch.Tensor, ps: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to its logits [R, V] in place: one scatter of the flat
    (row, token id, bias) lists built on the host.

        ps[0].logit_bias = ((7, 5.0),), ps[2].logit_bias = ((1, -1.0), (9, 2.0))
        -> rows [0, 2, 2], ids [7, 1, 9], biases [5.0, -1.0, 2.0]"""
    biased = [(i, p.logit_bias) for i, p in enumerate(ps) if p.logit_bias]
    if not biased:
        return
    dev = logits.device
    pairs = np.concatenate([np.asarray(b, dtype=np.float64) for _, b in biased])  # [N, 2]
    rows = np.repeat(
        np.asarray([i for i, _ in biased], dtype=np.int64), [len(b) for _, b in biased]
    )
    idx = to_device(np.stack((rows, pairs[:, 0].astype(np.int64))), dev)
    bias = to_device(pairs[:, 1].astype(np.float32), dev)
    logits.index_put_((idx[0], idx[1]), bias, accumulate=True)


def _penalize(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    """Penalties and min_tokens EOS masks, as flat (row, token) index lists built on the host."""
    dev, V = logits.device, logits.shape[1]
    rep_r, rep_t, rep_p = [], [], []
    cnt_r, cnt_t = [], []
    freq = np.zeros(len(rows), dtype=np.float32)
    pres = np.zeros(len(rows), dtype=np.float32)
    eos_r, eos_t = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = sorted(set(r.prompt_ids) | set(r.output_ids))
            rep_r += [i] * len(seen)
            rep_t += seen
            rep_p.append(p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(r.output_ids):
            cnt_r += [i] * len(r.output_ids)
            cnt_t += list(r.output_ids)
            freq[i], pres[i] = p.frequency_penalty, p.presence_penalty
        if r.mask_eos and r.eos_ids:
            eos_r += [i] * len(r.eos_ids)
            eos_t += list(r.eos_ids)
    if rep_r:
        pen = np.repeat(
            np.asarray(rep_p, dtype=np.float32),
            [len(set(r.prompt_ids) | set(r.output_ids)) for r in rows
             if r.params.repetition_penalty != 1.0],
        )  # fmt: skip
        ri = to_device(np.asarray(rep_r, dtype=np.int64), dev)
        ti = to_device(np.asarray(rep_t, dtype=np.int64), dev)
        pv = to_device(pen, dev)
        vals = logits[ri, ti]
        logits[ri, ti] = torch.where(vals > 0, vals / pv, vals * pv)
    if cnt_r:
        counts = torch.zeros_like(logits)
        ri = to_device(np.asarray(cnt_r, dtype=np.int64), dev)
        ti = to_device(np.asarray(cnt_t, dtype=np.int64), dev)
        counts.index_put_((ri, ti), torch.ones_like(ri, dtype=logits.dtype), accumulate=True)
        f, pr = to_device(freq, dev).unsqueeze(1), to_device(pres, dev).unsqueeze(1)
        logits -= f * counts + pr * (counts > 0)
    if eos_r:
        ri = to_device(np.asarray(eos_r, dtype=np.int64), dev)
        ti = to_device(np.asarray(eos_t, dtype=np.int64), dev).clamp(0, V - 1)
        logits[ri, ti] = float("-inf")


def _filter(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_min_p: bool,
    use_sort: bool,
) -> torch.Tensor:
    """Zero the probabilities outside min_p / top_k / top_p (rows: per-row parameters)."""
    V = probs.shape[1]
    if use_min_p:
        thresh = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < thresh, 0.0)
    if use_sort:
        k_on, p_on = top_k > 0, top_p < 1.0
        sorted_p, order = probs.sort(dim=1, descending=True, stable=True)
        rank = torch.arange(V, device=probs.device).unsqueeze(0)
        drop = k_on.unsqueeze(1) & (rank >= top_k.unsqueeze(1))
        cum = sorted_p.cumsum(dim=1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop |= p_on.unsqueeze(1) & (cum - sorted_p >= top_p.unsqueeze(1) * cum[:, -1:])
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return probs


def sample(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    bitmask_apply=None,
    drafts: np.ndarray | None = None,
    draft_logits: torch.Tensor | None = None,
) -> SampleOutput:
    """Sample one token per row of ``logits`` [B, V] (fp32; modified in place).

    ``bitmask_apply(logits)`` applies the grammar masks of constrained rows in place.
    ``drafts`` [B] (host; -1 = none) with ``draft_logits`` [B, V] (device; read on random rows
    that carry a draft): verify those drafts (module doc); ``accepted`` is then set.
    """
    dev, V = logits.device, logits.shape[1]
    ps = [r.params for r in rows]
    _penalize(logits, rows)
    add_bias(logits, ps)
    if bitmask_apply is not None:
        bitmask_apply(logits)
    want_lp = [p.logprobs for p in ps]
    logp = None
    if any(k is not None for k in want_lp):
        logp = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    has_draft = drafts is not None and bool((drafts >= 0).any())
    d_dev = to_device(np.maximum(drafts, 0), dev) if has_draft else None
    accepted = None
    if has_draft:
        accepted = (tokens == d_dev) & to_device(drafts >= 0, dev)
    rand = [i for i, p in enumerate(ps) if not p.greedy]
    if rand:
        rp = _RowParams(ps, V, dev)
        probs = rp.probs(logits)
        ctr = np.array([len(r.output_ids) for r in rows], dtype=np.int64)
        q = _noise(ps, ctr, probs.shape, dev)
        drawn = (probs / q).argmax(dim=-1)
        greedy = to_device(np.array([p.greedy for p in ps]), dev)
        verify = [i for i in rand if drafts is not None and drafts[i] >= 0]
        if verify:
            drawn, acc = _verify_random(probs, q, rp, draft_logits, d_dev, ps, ctr, verify)
            accepted = torch.where(greedy, accepted, acc)
        tokens = torch.where(greedy, tokens, drawn)
    out = SampleOutput(tokens, None, None, None, accepted)
    if logp is not None:
        out.logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max((v or 0) for v in want_lp)
        if k:
            top = torch.topk(logp, k, dim=-1)
            out.top_ids, out.top_logprobs = top.indices, top.values
    return out


def sample_chunks(
    items: Sequence[Scheduled], counts: np.ndarray, logits: torch.Tensor,
    eos_ids: tuple[int, ...], vocab_size: int,
) -> SampleOutput:  # fmt: skip
    """Sample the ``counts[i]`` rows of each chunk of ``items``: a verify chunk's row j sees
    its drafts before j as output (penalties, min_tokens, seeded counters) and checks draft
    j + 1; the last row of a constrained request is masked by its grammar."""
    rows, drafts, lookups, matchers, constrained = [], [], [], [], []
    for it, c in zip(items, counts, strict=True):
        s = it.seq
        p = s.req.params
        n_out = len(s.tokens) - s.num_prompt
        eos = (() if p.ignore_eos else eos_ids) + tuple(p.stop_token_ids)
        d = s.drafts[: c - 1]
        if c > 1 and not p.greedy:
            lookups.append((len(rows), s.draft_logits[: c - 1]))
        for j in range(c):
            out_ids = s.output_ids + d[:j] if j else s.output_ids
            rows.append(RowState(p, s.req.prompt_token_ids, out_ids,
                                 mask_eos=n_out + j < p.min_tokens, eos_ids=eos))  # fmt: skip
            drafts.append(d[j] if j < c - 1 else -1)
        if s.matcher is not None:
            matchers.append(s.matcher)
            constrained.append(len(rows) - 1)
    apply = grammar.mask(matchers, constrained, vocab_size) if matchers else None
    if not any(t >= 0 for t in drafts):
        return sample(logits, rows, apply)
    draft_logits = None
    if lookups:
        draft_logits = torch.zeros_like(logits)
        for r0, lg in lookups:
            draft_logits[r0 : r0 + lg.shape[0]] = lg
    return sample(logits, rows, apply, np.asarray(drafts, dtype=np.int64), draft_logits)


def _verify_random(probs, q, rp: _RowParams, draft_logits, d, ps, ctr, verify):
    """Rejection sampling of the random rows ``verify`` -> (tokens [B], accepted [B]); other
    rows keep their plain draw (and ``accepted`` False)."""
    dev = probs.device
    P = probs / probs.sum(-1, keepdim=True)
    Q = rp.probs(draft_logits.float())
    Q = Q / Q.sum(-1, keepdim=True).clamp_min(1e-30)
    pd = P.gather(1, d.unsqueeze(1)).squeeze(1)
    qd = Q.gather(1, d.unsqueeze(1)).squeeze(1)
    u = torch.rand(P.shape[0], device=dev)
    seeded = [i for i in verify if ps[i].seed is not None]
    if seeded:
        idx = to_device(np.asarray(seeded, dtype=np.int64), dev)
        seeds = to_device(np.array([ps[i].seed for i in seeded], dtype=np.int64), dev)
        u[idx] = _uniform(seeds, to_device(ctr[seeded] + ACCEPT_STREAM, dev))
    mask = np.zeros(P.shape[0], dtype=bool)
    mask[verify] = True
    on = to_device(mask, dev)
    acc = on & (u * qd < pd)
    residual = (P - Q).clamp_min(0.0)
    res_tok = (residual / q).argmax(dim=-1)
    plain = (probs / q).argmax(dim=-1)
    return torch.where(on, torch.where(acc, d, res_tok), plain), acc
