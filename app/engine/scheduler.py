"""The scheduler: one token-budget rule over running and waiting requests.

Every step each request's computed tokens catch up to its known tokens (prompt + output +
tokens sampled on the device but not yet seen, under overlap scheduling), within
``max_num_batched_tokens`` and ``max_num_seqs``. Chunked prefill, decode, prefix hits and
bounded replay all fall out of it: a hit or a replay plan only moves where computing starts.

Order: running requests first (by priority, then arrival), then waiting ones; long prefills
draw on a share of the budget while other requests are present (``app.engine.fairness``), and
a waiting long prompt whose share is spent lets the short ones behind it in. When the KV pool
runs out, the lowest-priority, latest running request is preempted (recompute: its cache is
freed, it returns to the waiting queue with its output so far, and resumes later with the same
output; a prefix hit usually brings most of its blocks back).

A request whose prefix hit is being loaded back from the host KV tier (``app.cache.host_tier``)
waits in ``loading`` (holding its slot and blocks, spending no budget) until its own blocks
are in device memory, then runs like any admitted request; nobody else waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.cache.block_pool import NoFreeBlocks
from app.cache.manager import CacheManager
from app.config import SchedulerConfig
from app.engine.fairness import LongPrefillShare
from app.engine.sequence import SeqStatus, Sequence


@dataclass
class Scheduled:
    """``num_tokens`` positions of ``seq`` from ``start``; ``samples``: the chunk reaches the
    last known token, so the step samples a new one (it becomes a pending token).
    ``num_drafts``: the chunk ends with that many draft tokens to verify."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    num_drafts: int = 0


@dataclass
class SchedulerOutput:
    items: list[Scheduled]
    preempted: list[Sequence]
    admitted: list[Sequence] = field(default_factory=list)  # moved from waiting to running

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    def trace(self, t0: float) -> None:
        """Phase events of the traced requests in this schedule, made at ``t0``
        (``app.engine.lifecycle``)."""
        for seq in self.admitted:
            if seq.trace is not None:
                seq.trace.event("scheduled", cached_tokens=seq.num_cached,
                                queue_wait_s=round(t0 - seq.arrived, 6))  # fmt: skip
        for it in self.items:
            seq = it.seq
            if seq.trace is not None and it.start < seq.num_prompt:
                seq.trace.event("prefill_chunk", start=it.start,
                                tokens=min(it.num_tokens, seq.num_prompt - it.start),
                                cached_tokens=seq.num_cached)  # fmt: skip
        for seq in self.preempted:
            if seq.trace is not None:
                seq.trace.event("preempted", preemptions=seq.num_preemptions)


class Scheduler:
    """Decides which tokens of which requests the next step computes."""

    def __init__(self, cfg: SchedulerConfig, cache: CacheManager):
        self.cfg, self.cache = cfg, cache
        self.waiting: list[Sequence] = []
        self.loading: list[Sequence] = []  # admitted, waiting for host-tier load-backs
        self.running: list[Sequence] = []
        self.fair = LongPrefillShare(
            cfg.max_num_batched_tokens, cfg.long_prefill_share, cfg.long_prefill_threshold
        )

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        key = seq.sort_key()
        i = next((i for i, s in enumerate(self.waiting) if s.sort_key() > key), len(self.waiting))
        self.waiting.insert(i, seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its cache (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.loading:
            self.loading.remove(seq)
        self.cache.free(seq.request_id)
        seq.status = SeqStatus.FINISHED

    def retire(self, seq: Sequence) -> None:
        """Take a finished request out of the running batch, its cache kept until the step
        in flight that uses it is done (then :meth:`remove`)."""
        if seq in self.running:
            self.running.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running (queued, or waiting for their blocks to load)."""
        return len(self.waiting) + len(self.loading)

    def _loaded(self, out: SchedulerOutput) -> None:
        """Requests whose host-tier blocks arrived join the running batch."""
        self.cache.poll()
        if not self.loading:
            return
        for seq in [s for s in self.loading if self.cache.ready(s.request_id)]:
            self.loading.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        assert seq.num_in_flight == 0, "a request in a launched step cannot be preempted"
        self.running.remove(seq)
        self.cache.free(seq.request_id)
        seq.num_computed = seq.num_done = 0
        seq.drafts, seq.draft_logits = [], None
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for running ``seq``'s next ``n`` tokens, preempting running requests that
        rank below it (lowest priority, latest first) while the pool is short. False when
        none ranks below: ``seq`` itself must yield."""
        while True:
            try:
                self.cache.ensure(seq.request_id, seq.num_computed + n)
                return True
            except NoFreeBlocks:
                victims = [
                    s
                    for s in self.running
                    if s is not seq and s.num_in_flight == 0 and s.sort_key() > seq.sort_key()
                ]
                if not victims:
                    return False
                victim = max(victims, key=Sequence.sort_key)
                self._preempt(victim)
                out.preempted.append(victim)

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Commit ``n`` tokens of ``seq`` to this step: computed advances now (the step is
        in flight), a sampling chunk adds a pending token (a prefill-only one samples
        nothing)."""
        samples = seq.num_computed + n == seq.num_known and not seq.prefill_only
        drafts = len(seq.drafts) if samples else 0
        out.items.append(Scheduled(seq, seq.num_computed, n, samples, drafts))
        seq.num_computed += n
        seq.num_in_flight += 1
        if samples:
            seq.num_pending += 1

    @staticmethod
    def _trim_drafts(seq: Sequence, n: int) -> None:
        """Keep the drafts a chunk of ``n`` tokens from ``num_computed`` reaches."""
        keep = seq.num_computed + n - (seq.num_known - len(seq.drafts))
        del seq.drafts[max(0, keep) :]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        budget = self.cfg.max_num_batched_tokens
        self._loaded(out)
        self.running.sort(key=Sequence.sort_key)
        self.fair.start(self.running + self.waiting)
        for seq in list(self.running):
            if seq not in self.running:  # preempted by a higher-priority request this step
                continue
            n = self.fair.cap(seq, min(seq.num_known - seq.num_computed, budget))
            if n <= 0:
                continue
            if seq.drafts and seq.num_computed + n < seq.num_known:
                self._trim_drafts(seq, n)  # verify what fits the budget
            if seq.drafts and not self._reserve(seq, n, out):
                self._trim_drafts(seq, 1)  # the pool is short: decode without drafts
                n = 1
            if not self._reserve(seq, n, out):
                if seq.num_in_flight == 0:
                    self._preempt(seq)
                    out.preempted.append(seq)
                continue
            self._take(seq, n, out)
            budget -= n
        i = 0
        while (
            i < len(self.waiting)
            and budget > 0
            and len(self.running) + len(self.loading) < self.cfg.max_num_seqs
        ):
            seq = self.waiting[i]
            if self.cache.kv.num_free_slots == 0:
                break
            if self.fair.is_long(seq) and self.fair.left <= 0:
                i += 1  # its share of this step is spent: the short prompts behind it go
                continue
            use_prefix = not seq.wants_prompt_logprobs
            plan = self.cache.admit(
                seq.request_id, seq.tokens, seq.req.extra_key, use_prefix_cache=use_prefix
            )
            seq.num_computed, seq.num_cached = plan.start, min(plan.num_cached, seq.num_prompt)
            if not self.cache.ready(seq.request_id):  # its cached blocks are on the way
                self.waiting.pop(i)
                seq.status = SeqStatus.LOADING
                self.loading.append(seq)
                continue
            n = self.fair.cap(seq, min(seq.num_known - seq.num_computed, budget))
            try:  # n >= 1: a long prompt got here with some of the share left
                self.cache.ensure(seq.request_id, seq.num_computed + n)
            except NoFreeBlocks:  # wait for running requests to finish or be preempted
                self.cache.free(seq.request_id)
                break
            self.waiting.pop(i)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            self._take(seq, n, out)
            budget -= n
        out.items = self._dropped_last(out.items)
        return out

    def _dropped_last(self, items: list[Scheduled]) -> list[Scheduled]:
        """Chunks that V4.1 decoder replay drops whole (every row below the prompt's decoder
        floor: a long prefill's early chunk) go last in the batch. Workaround: the model's
        decoder layers read the KV store with the parent batch's sequence indices after a
        sequence was dropped (DeepseekModel.hidden passes ``store``, not the sub-batch's
        ``batch.kv``), so any chunk after a dropped one read another sequence's block table
        (an IndexError failing the step). Long prefills sharing a step made that common."""

        def dropped(it: Scheduled) -> bool:
            s, a = it.seq, it.start
            if s.wants_prompt_logprobs or a >= s.num_prompt:
                return False
            return a + it.num_tokens <= self.cache.decoder_floor(s.num_prompt, a)

        gone = [it for it in items if dropped(it)]
        return [it for it in items if not dropped(it)] + gone if gone else items
