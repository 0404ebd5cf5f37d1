"""One request's engine-side state (:class:`Sequence`), shared by the scheduler, its fairness
strategy, the runner, the output processor and the KV handoff."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.engine.lifecycle import RequestTrace
from app.engine.request import EngineRequest, FinishReason

if TYPE_CHECKING:
    from app.engine.grammar import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"  # admitted; its cached blocks are still being copied to the device
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request."""

    req: EngineRequest
    tokens: list[int]  # prompt + output tokens known on the host
    matcher: GrammarMatcher | None = None  # constrained output (app.engine.grammar)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # positions whose KV is in the cache or in the step in flight
    num_pending: int = 0  # sampled on the device, not yet appended to ``tokens``
    num_in_flight: int = 0  # launched steps that include this request
    num_cached: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_done: int = 0  # positions whose KV a completed step wrote (prefix-cache commits)
    prompt_logprobs_done: int = 0  # prompt positions whose logprobs were already emitted
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    order: int = field(default_factory=lambda: next(_arrivals))
    num_preemptions: int = 0
    drafts: list[int] = field(default_factory=list)  # proposed tokens after ``tokens``
    draft_logits: object | None = None  # their proposal logits [k, V] (device tensor)
    arrived: float = field(default_factory=time.perf_counter)  # made at add (queue wait)
    trace: RequestTrace | None = None  # phase events of a traced request (app.engine.lifecycle)
    # parallel sampling (app.engine.fork): a prefill-only sequence computes its tokens and
    # samples nothing; a choice's outputs carry its request's id (``group``) and its index
    prefill_only: bool = False
    group: str | None = None
    choice: int = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def output_id(self) -> str:
        """The request id its outputs carry (a choice's: its request's)."""
        return self.group if self.group is not None else self.req.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def num_known(self) -> int:
        return len(self.tokens) + self.num_pending + len(self.drafts)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.req.params.prompt_logprobs is not None

    def sort_key(self) -> tuple[int, int]:
        return (self.req.priority, self.order)

    def start_trace(self, trace: RequestTrace | None) -> bool:
        """Attach ``trace`` (if any) as the request enters the engine; True when traced."""
        if trace is None:
            return False
        self.trace = trace
        trace.event("queued", prompt_tokens=self.num_prompt)
        return True

    def trace_first_token(self) -> None:
        """The first output token arrived: its phase event, once (traced requests)."""
        if self.trace is not None and not self.trace.first_token:
            self.trace.first_token = True
            self.trace.event("first_token", output_tokens=len(self.tokens) - self.num_prompt)

    def end_trace(self) -> bool:
        """Close the request's trace with its finish event; False when it had none."""
        if self.trace is None:
            return False
        reason = self.finish_reason.value if self.finish_reason is not None else "unknown"
        self.trace.finish(reason, len(self.tokens) - self.num_prompt, self.num_cached)
        self.trace = None
        return True
