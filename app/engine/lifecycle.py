"""A traced request's phases, recorded by the engine core as they happen.

The rank registers a :class:`RequestTrace` for a sampled request before it submits it
(``EngineCore.traces[request_id] = trace``, a dict write that is safe from another thread);
``add_request`` takes it onto the request's :class:`~app.engine.sequence.Sequence` and the
core calls :meth:`RequestTrace.event` at each phase:

    queued         the request entered the waiting queue (prompt_tokens)
    scheduled      admitted to the running batch (cached_tokens: prefix-cache hit, queue_wait_s)
    prefill_chunk  a prompt chunk went into a step (start, tokens, cached_tokens)
    first_token    the first output token was appended
    preempted      the KV pool ran short: blocks freed, back to waiting (preemptions so far)
    finished       done (reason: stop / length / abort / error, output_tokens, cached_tokens)

No OpenTelemetry here (the engine runs without it): ``emit(name, attributes, time_ns)`` is the
sink, e.g. a span's ``add_event``. An untraced request has ``seq.trace is None``, and the core
checks that (or that no traced request is live) before doing any of this work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Emit = Callable[[str, dict, int], None]


class RequestTrace:
    """Phase events of one request, handed to ``emit`` as they happen (engine thread)."""

    __slots__ = ("emit", "finished", "first_token", "open", "phase")

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.open = True  # False once the consumer (the rank's span) has ended
        self.first_token = False
        self.finished = False
        self.phase: str | None = None  # the last event's name

    def event(self, name: str, **attrs: object) -> None:
        self.phase = name
        if self.open:
            self.emit(name, attrs, time.time_ns())

    def finish(self, reason: str, output_tokens: int, cached_tokens: int) -> None:
        self.finished = True
        self.event("finished", reason=reason, output_tokens=output_tokens,
                   cached_tokens=cached_tokens)  # fmt: skip

    def close(self) -> None:
        """The consumer is gone: later events are dropped."""
        self.open = False
