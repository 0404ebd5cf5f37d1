"""The engine core's speculation: after each step the proposer drafts up to k tokens per
decoding request on the device (from the step's accept decision, which the host has not seen
yet); the host copies tokens, accept flags and drafts in one transfer; the next step
verifies the drafts as known tokens of their requests, and ``verify`` rolls back what the
rejected ones wrote (``app.engine.spec.verify``).

    launch   (device) accepted lengths m, the drafter's context of committed rows, the next
             drafts: the tensors the host copies beside the sampled tokens
    verify   (host) m of one verify chunk, counted; rejected positions computed again
    take     (host) the drafts the next step verifies, within max_tokens and the context

With the checkpoint's drafter, ``launch`` of a step that sampled is one static-shape draft
step (``app.engine.spec.step``) run by ``DraftGraphs``: a CUDA graph per batch bucket on
CUDA, the same function eagerly elsewhere. Proposers without it (test proposers) and steps
with a logit bias run the protocol's ``observe`` and ``propose`` eagerly.

Constrained requests (a grammar) decode one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from app.cache.manager import CacheManager
from app.config import SpeculativeConfig
from app.engine.flight import Flight, LiveRows
from app.engine.metrics import EngineStats
from app.engine.runner import StepInputs
from app.engine.sampler import PickKind, SampleOutput, proposal_arrays, to_device
from app.engine.scheduler import Scheduled
from app.engine.sequence import Sequence
from app.engine.spec.graphs import DraftGraphs
from app.engine.spec.proposer import DrafterProposer, Proposer, make_proposer
from app.engine.spec.step import BIG, CTX_ROWS, REQ_ROWS, DraftInputs
from app.engine.spec.verify import accepted_lengths, accepted_prefix
from app.model.dspark import DraftBlock
from app.model.model import DeepseekModel

# called with each step's proposed blocks: (request ids, anchors [R], the block)
OnDraft = Callable[[list[str], torch.Tensor, DraftBlock], None]


class Speculator:
    """Drafts with ``proposer`` over ``cache`` (module doc); counts into ``stats``."""

    def __init__(
        self, proposer: Proposer, num_drafts: int, cache: CacheManager, max_model_len: int,
        stats: EngineStats, vocab: int,
    ) -> None:  # fmt: skip
        self.proposer, self.num_drafts, self.cache = proposer, num_drafts, cache
        self.max_model_len, self.stats, self.vocab = max_model_len, stats, vocab
        # the static draft step of the checkpoint's drafter (None: the protocol's calls)
        self.steps: DraftGraphs | None = None
        if isinstance(proposer, DrafterProposer):
            self.steps = DraftGraphs(proposer, num_drafts, cache.kv.max_slots,
                                     cache.pools.trash_slot, cache.kv.device,
                                     cache.layout.dtype)  # fmt: skip

    @classmethod
    def build(
        cls, spec: SpeculativeConfig | None, model: DeepseekModel, proposer: Proposer | None,
        cache: CacheManager, max_model_len: int, stats: EngineStats,
    ) -> Speculator | None:  # fmt: skip
        """The speculator of ``spec`` (None: speculation off), drafting with ``proposer`` or
        else the checkpoint's drafter over ``cache``."""
        if spec is None:
            return None
        proposer = proposer or make_proposer(spec, model, cache.pools)
        return cls(proposer, spec.num_draft_tokens, cache, max_model_len, stats,
                   model.cfg.vocab_size)

    def use_graphs(self, pool) -> None:
        """Run the draft step as CUDA graphs in ``pool`` (the decode graphs')."""
        if self.steps is not None:
            self.steps.use_pool(pool)

    @staticmethod
    def speculates(seq: Sequence) -> bool:
        """Whether ``seq`` drafts (constrained requests decode one token at a time)."""
        return seq.matcher is None

    def launch(
        self, flight: Flight, live: LiveRows | None, res: SampleOutput | None,
        on_draft: OnDraft | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Device side of a step's verify: accepted lengths, the drafter's context of committed
        rows, the next drafts. Returns the tensors the host copies (m, and the drafts). With
        nothing sampled (a step of prefill chunks) the rows still feed the drafter."""
        if live is None or res is None:
            none = np.zeros(0, np.int64)
            self._observe(flight, [], none, none, none, None, None)
            return []
        if self.steps is not None and self.steps.proposer is self.proposer:  # (not replaced)
            step = self.draft_inputs(flight, live)
            if step is not None:
                return self._launch_step(flight, live, res, *step, on_draft)
        items, bases, counts = live.items, live.bases, live.counts
        dev, inp = res.tokens.device, flight.inputs
        m = accepted_lengths(res.accepted, bases, counts, dev)
        ends = np.asarray([it.start + it.num_tokens for it in items], dtype=np.int64)
        anchors = to_device(ends - counts, dev) + m  # last committed position
        bonus = res.tokens[to_device(bases, dev) + m]
        feats, where = self._observe(flight, items, ends, bases, counts, anchors, res.tokens)
        sel = [k for k, it in enumerate(items) if self.speculates(it.seq)]
        if not sel:
            return [m]
        idx = to_device(np.asarray(sel, dtype=np.int64), dev)
        seqs = [items[k].seq for k in sel]
        prompt = to_device(np.asarray([s.num_prompt for s in seqs], dtype=np.int64), dev)
        slots = to_device(np.asarray([self.cache.slot_of(s.request_id) for s in seqs]), dev)
        anchor_feats = None
        if feats is not None:  # the anchor's feature row: its item's rows are contiguous
            it_of = where[sel]
            first_row = np.searchsorted(inp.feat_item, it_of)
            first_pos = inp.feat_pos[first_row]
            host = first_row + (ends[sel] - counts[sel]) - first_pos
            anchor_feats = feats[to_device(host, dev) + m[idx]]
        block = self.proposer.propose(
            [s.request_id for s in seqs], slots, anchors[idx], bonus[idx], self.num_drafts,
            [s.req.params for s in seqs], anchors[idx] + 2 - prompt, anchor_feats,
        )  # fmt: skip
        if on_draft is not None:
            on_draft([s.request_id for s in seqs], anchors[idx], block)
        flight.draft_rows = {s.request_id: r for r, s in enumerate(seqs)}
        flight.drafts = block.logits
        return [m, block.ids]

    def draft_inputs(
        self, flight: Flight, live: LiveRows
    ) -> tuple[DraftInputs, np.ndarray] | None:
        """The host half of the draft step of a sampled step (``app.engine.spec.step``): its
        requests are the speculating sampled ones (-> their indices among ``live``); a
        sampled request that does not speculate has no drafts, so its rows are committed up
        to its first sampled position, decided here. None when no request speculates, or
        one has a logit bias (its draws add it on the host)."""
        items, bases, counts = live.items, live.bases, live.counts
        seqs = [it.seq for it in items]
        on = np.fromiter((self.speculates(s) for s in seqs), bool, count=len(seqs))
        sel = np.flatnonzero(on)
        params = [seqs[k].req.params for k in sel]
        if not sel.size or (counts[~on] > 1).any() or any(p.logit_bias for p in params):
            return None
        inp = flight.inputs
        ends = np.fromiter((it.start + it.num_tokens for it in items), np.int64, count=len(seqs))
        starts = ends - counts
        prompt = np.fromiter((seqs[k].num_prompt for k in sel), np.int64, count=sel.size)
        slots = np.fromiter((self.cache.slot_of(seqs[k].request_id) for k in sel), np.int64,
                            count=sel.size)  # fmt: skip
        index = {id(it): k for k, it in enumerate(inp.items)}
        where = np.asarray([index[id(it)] for it in items], np.int64)
        anchor_rows = np.full(sel.size, -1, np.int64)
        ctx = np.zeros((len(CTX_ROWS), 0), np.int64)
        if flight.features is not None and inp.feat_rows.size:
            pos, item = inp.feat_pos, inp.feat_item
            req_of = np.full(len(inp.items), -1, np.int64)
            req_of[where[sel]] = np.arange(sel.size)
            last = np.full(len(inp.items), BIG, np.int64)  # committed up to (host-known)
            last[where[~on]] = starts[~on]
            trash = self.cache.pools.trash_slot
            ctx_slots = np.where(pos <= last[item], inp.spec.slots[item], trash)
            nxt_host = np.zeros(pos.size, np.int64)
            nxt_row = np.full(pos.size, -1, np.int64)
            if self.proposer.needs_next_tokens:
                nxt_host, nxt_row = _next_token_rows(inp, where, ends, bases, counts)
            ctx = np.stack((pos, ctx_slots, req_of[item], nxt_host, nxt_row))
            # the feature row of each request's first sampled position (its rows are
            # contiguous): + m is its anchor's
            first_row = np.searchsorted(item, where[sel])
            anchor_rows = first_row + starts[sel] - pos[np.minimum(first_row, pos.size - 1)]
        pick_ints, floats = proposal_arrays(params, self.vocab)
        cols = {"slots": slots, "starts": starts[sel], "bases": bases[sel],
                "counts": counts[sel], "first_output": starts[sel] + 2 - prompt,
                "anchor_rows": anchor_rows}  # fmt: skip
        req = np.stack([cols[f] for f in REQ_ROWS[:6]] + list(pick_ints))
        return DraftInputs(req, floats, ctx, int(counts.sum()), PickKind.of(params)), sel

    def _launch_step(
        self, flight: Flight, live: LiveRows, res: SampleOutput, inputs: DraftInputs,
        sel: np.ndarray, on_draft: OnDraft | None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """:meth:`launch` through the draft step over the speculating requests ``sel``: m of
        every sampled request (0 for the others), the drafts. The proposal logits are
        copied out of the shared outputs when a random row reads them (a request may verify
        its drafts steps later)."""
        out = self.steps.run(inputs, res.tokens, res.accepted, flight.features)
        seqs = [live.items[k].seq for k in sel]
        m = out.m
        if sel.size < len(live.items):
            m = torch.zeros(len(live.items), dtype=out.m.dtype, device=out.m.device)
            m[to_device(sel, m.device)] = out.m
        if inputs.kind.random:
            out.logits = out.logits.clone()
        block = DraftBlock(out.ids, out.logits, out.confidence)
        if on_draft is not None:
            on_draft([s.request_id for s in seqs], out.anchors, block)
        flight.draft_rows = {s.request_id: r for r, s in enumerate(seqs)}
        flight.drafts = block.logits
        return [m, block.ids]

    def _observe(
        self, flight: Flight, items: list[Scheduled], ends: np.ndarray, bases: np.ndarray,
        counts: np.ndarray, anchors: torch.Tensor | None, sampled: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, np.ndarray]:  # fmt: skip
        """Feed the drafter the committed rows of a step: a sampling chunk's rows above its
        anchor are not committed (written to the trash slot). -> (the step's features or
        None, the step item of each sampled item)."""
        inp = flight.inputs
        index = {id(it): k for k, it in enumerate(inp.items)}
        where = np.asarray([index[id(it)] for it in items], np.int64)
        if flight.features is None or not inp.feat_rows.size:
            return None, where
        feats, dev = flight.features, flight.features.device
        big = np.iinfo(np.int64).max
        thr = torch.full((len(inp.items),), big, dtype=torch.int64, device=dev)
        if where.size:
            thr[to_device(where, dev)] = anchors
        item = to_device(inp.feat_item, dev)
        pos = to_device(inp.feat_pos, dev)
        slots = to_device(inp.spec.slots[inp.feat_item], dev)
        slots = torch.where(pos <= thr[item], slots, self.cache.pools.trash_slot)
        nxt = None
        if self.proposer.needs_next_tokens:
            nxt = _next_tokens(inp, where, ends, bases, counts, sampled, dev)
        self.proposer.observe(slots, pos, feats, nxt)
        return feats, where

    def verify(self, seq: Sequence, it: Scheduled, accepted: list[bool]) -> int:
        """m, the leading accepted drafts of ``seq``'s verify chunk ``it`` (``accepted``: one
        flag per draft), counted; positions past the accepted ones are computed again."""
        m = accepted_prefix(accepted)
        self.stats.count_verify(len(accepted), m)
        seq.num_computed = seq.num_done = it.start + it.num_tokens - len(accepted) + m
        return m

    def take(self, seq: Sequence, ids: list[int], flight: Flight) -> None:
        """The next step verifies up to k drafts: as many as max_tokens and the context
        limit leave room for after them (a verify emits up to drafts + 1 tokens)."""
        k = self.num_drafts
        n_out = len(seq.tokens) - seq.num_prompt
        if seq.req.params.max_tokens is not None:
            k = min(k, seq.req.params.max_tokens - n_out - 1)
        k = min(k, self.max_model_len - len(seq.tokens) - 1)
        if k > 0:
            seq.drafts = list(ids[:k])
            seq.draft_logits = flight.drafts[flight.draft_rows[seq.request_id]]


def _next_token_rows(
    inp: StepInputs, where: np.ndarray, ends: np.ndarray, bases: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The token after each feature row, as (the token where the host knows it, else -1;
    the sampled row that holds it, else -1): a sampled row's own sample (for an accepted
    draft row that is the draft itself), else the next input token of the chunk, or of the
    prompt after a mid-prefill chunk."""
    spec, pos, item = inp.spec, inp.feat_pos, inp.feat_item
    B = spec.num_seqs
    flat0 = np.concatenate(([0], np.cumsum(spec.lens)[:-1]))
    first_sampled = spec.starts + spec.lens  # per step item; sampled items below
    base = np.zeros(B, np.int64)
    first_sampled[where] = ends - counts
    base[where] = bases
    is_s = pos >= first_sampled[item]
    sidx = np.where(is_s, base[item] + pos - first_sampled[item], -1)
    nxt_pos = pos + 1 - spec.starts[item]  # index of the next token within the chunk
    inside = nxt_pos < spec.lens[item]
    host = np.full(pos.size, -1, np.int64)
    ok = ~is_s & inside
    host[ok] = spec.ids[flat0[item[ok]] + nxt_pos[ok]]
    for r in np.flatnonzero(~is_s & ~inside):  # the last row of a mid-prefill chunk
        it = inp.items[item[r]]
        host[r] = it.seq.tokens[it.start + it.num_tokens]
    return host, sidx.astype(np.int64)


def _next_tokens(
    inp: StepInputs, where: np.ndarray, ends: np.ndarray, bases: np.ndarray,
    counts: np.ndarray, sampled: torch.Tensor | None, dev: torch.device,
) -> torch.Tensor:  # fmt: skip
    """The token after each feature row (device [N]; :func:`_next_token_rows`)."""
    host, sidx = _next_token_rows(inp, where, ends, bases, counts)
    out = to_device(host, dev)
    rows = np.flatnonzero(sidx >= 0)
    if rows.size:
        out[to_device(rows, dev)] = sampled[to_device(sidx[rows], dev)]
    return out
