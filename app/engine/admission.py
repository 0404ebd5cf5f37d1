"""Admission control: a bounded queue by requests and by queued prefill tokens (a rank's own
queue, and the ingress's in-flight bound), and how a refusal travels back to the front door.

    adm = Admission(max_requests=64, max_queued_tokens=131072)
    ticket = adm.admit(len(prompt))     # EngineOverloadedError when full (the API: 429)
    ...  ticket.prefilled()             # first token: the prompt left the prefill queue
    ...  ticket.release()               # finished, failed or aborted (idempotent)

Counts are taken when a request is admitted, before the engine thread sees it, so a burst of
arrivals cannot all pass a check that reads the engine's own (lagging) counters. A prompt is
always admitted into an empty token queue, so one long legal prompt is never refused forever;
a short prompt (``short_prompt_tokens``: one step's token budget) is bounded by the request
count only, so long prompts in the queue never shut out short requests (the scheduler serves
those beside them: ``app.engine.fairness``).

A rank sends a refusal to the ingress as a value (:class:`Refusal`), not a raised exception.
No torch here: the ingress replicas import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from app.engine.request import RequestError


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full; the API answers 429 with ``Retry-After``."""


class EngineUnavailableError(RuntimeError):
    """The engine is not ready (starting, draining or failed); the API answers 503."""


@dataclass(frozen=True)
class Refusal:
    """A request refused before it started, sent across a process boundary as a value (a
    raised exception there costs a logged traceback per 429); :meth:`error` raises it again."""

    kind: Literal["invalid", "overloaded", "unavailable"]
    message: str
    field: str = ""

    @classmethod
    def of(cls, e: Exception) -> Refusal | None:
        if isinstance(e, RequestError):
            return cls("invalid", e.message, e.field)
        if isinstance(e, EngineOverloadedError):
            return cls("overloaded", str(e))
        if isinstance(e, EngineUnavailableError):
            return cls("unavailable", str(e))
        return None

    def error(self) -> Exception:
        if self.kind == "invalid":
            return RequestError(self.field, self.message)
        if self.kind == "overloaded":
            return EngineOverloadedError(self.message)
        return EngineUnavailableError(self.message)


class Ticket:
    """One admitted request's share of the queue."""

    def __init__(self, adm: Admission, tokens: int) -> None:
        self._adm, self._tokens, self._held = adm, tokens, True

    def prefilled(self) -> None:
        self._adm.queued_tokens -= self._tokens
        self._tokens = 0

    def release(self) -> None:
        if self._held:
            self.prefilled()
            self._adm.requests -= 1
            self._held = False


class Admission:
    """``max_requests`` unfinished requests and ``max_queued_tokens`` prompt tokens waiting
    for their prefill; None = no bound."""

    def __init__(
        self,
        max_requests: int | None,
        max_queued_tokens: int | None,
        short_prompt_tokens: int = 0,
    ) -> None:
        for name, v in (("max_requests", max_requests), ("max_queued_tokens", max_queued_tokens)):
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        self.max_requests = max_requests
        self.max_queued_tokens = max_queued_tokens
        self.short_prompt_tokens = short_prompt_tokens
        self.requests = 0
        self.queued_tokens = 0

    def admit(self, num_prompt_tokens: int) -> Ticket:
        if self.max_requests is not None and self.requests >= self.max_requests:
            raise EngineOverloadedError(
                f"{self.requests} requests pending (limit {self.max_requests})"
            )
        cap, queued = self.max_queued_tokens, self.queued_tokens
        long = num_prompt_tokens > self.short_prompt_tokens
        if cap is not None and long and queued and queued + num_prompt_tokens > cap:
            raise EngineOverloadedError(
                f"{self.queued_tokens} prompt tokens queued for prefill (limit {cap})"
            )
        self.requests += 1
        self.queued_tokens += num_prompt_tokens
        return Ticket(self, num_prompt_tokens)
