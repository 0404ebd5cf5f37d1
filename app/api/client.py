"""The engine as the HTTP layer sees it: :class:`EngineClient` (the Ray ingress implements it
over Serve handles, ``app.deployments.client``; an in-process rank engine over an
``AsyncEngine``, ``app.deployments.engine_host.LocalEngineClient``) and :class:`EngineStream`
(one request's deltas, with abort on close).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

import anyio

from app.api.errors import ApiError
from app.engine.admission import EngineOverloadedError, EngineUnavailableError
from app.engine.request import EngineRequest, RequestError, RequestOutput

OVERLOAD_RETRY_S = 1  # Retry-After of a 429 (queues turn over within seconds)
UNAVAILABLE_RETRY_S = 5  # Retry-After of a 503 (ranks starting or restarting)


@runtime_checkable
class EngineClient(Protocol):
    """What the API needs from an engine (local, or DP ranks behind Ray Serve).

    ``generate`` streams one request's :class:`RequestOutput` deltas; the last one has
    ``finished=True``. Before any delta it raises :class:`RequestError` for an invalid request
    (the API answers 400), :class:`EngineOverloadedError` (429) or
    :class:`EngineUnavailableError` (503). It may first yield an empty *ack* delta (no token ids,
    not finished) once the request is accepted, so a stream can start before the first token.
    Closing the iterator early, or ``abort``, cancels the request and frees its KV.
    """

    def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def stats(self) -> dict: ...

    async def ready(self) -> bool: ...

    async def context_limit(self) -> int | None:
        """The engines' ``max_model_len`` (the smallest over ranks); None until one reports."""
        ...


class ContextSync:
    """Adopts the engines' context limit once they report it. A rank sizes its KV pool at
    start-up (``gpu_memory_utilization`` of the card it finds), so its ``max_model_len`` can
    be below the one the front door was built with; ``apply`` gets the engines' limit when
    it is lower, once. Awaited before a front door answers with or checks against it."""

    def __init__(self, client: EngineClient, configured: int,
                 apply: Callable[[int], None]) -> None:  # fmt: skip
        self.client, self.configured, self.apply = client, configured, apply
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        try:
            limit = await self.client.context_limit()
        except Exception:  # not reachable yet: try again on the next request
            return
        if limit is None:
            return
        self.done = True
        if limit < self.configured:
            self.apply(limit)


async def open_stream(
    client: EngineClient, req: EngineRequest, timeout_s: float | None
) -> EngineStream:
    """Submit ``req`` and wait for its first delta (or ack), so request errors become statuses
    before any response goes out: :class:`ApiError` 400 (invalid), 429 (overloaded) or 503
    (unavailable), each with a message saying what was wrong."""
    stream = EngineStream(client, req, timeout_s)
    try:
        await stream.start()
    except BaseException as e:
        await stream.close()
        if isinstance(e, RequestError):
            raise ApiError(400, str(e), param=e.field) from None
        if isinstance(e, EngineOverloadedError):
            msg = f"the server is overloaded ({e}); retry later"
            raise ApiError(429, msg, headers={"Retry-After": str(OVERLOAD_RETRY_S)}) from None
        if isinstance(e, EngineUnavailableError):
            msg = f"the engine is not available: {e}"
            raise ApiError(503, msg, headers={"Retry-After": str(UNAVAILABLE_RETRY_S)}) from None
        raise
    return stream


class EngineStream:
    """One request's deltas: :meth:`start` waits for the first one (so request errors surface
    before any response is sent), iteration yields it and the rest, :meth:`close` aborts the
    request unless it finished."""

    def __init__(self, client: EngineClient, req: EngineRequest, timeout_s: float | None) -> None:
        self.client = client
        self.request_id = req.request_id
        self._it = aiter(client.generate(req))
        self._first: RequestOutput | None = None
        self._timeout = timeout_s
        self._deadline: float | None = None
        self.started = False  # the first delta arrived
        self.finished = False
        self.timed_out = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._deadline = None if self._timeout is None else loop.time() + self._timeout
        try:
            self._first = await self._next()
        except StopAsyncIteration:
            why = "within the request timeout" if self.timed_out else "at all"
            raise EngineUnavailableError(f"the engine gave no output {why}") from None

    async def _next(self) -> RequestOutput:
        try:
            if self._deadline is None:
                out = await anext(self._it)
            else:
                left = self._deadline - asyncio.get_running_loop().time()
                try:
                    out = await asyncio.wait_for(anext(self._it), max(left, 0.0))
                except TimeoutError:
                    self.timed_out = True
                    raise StopAsyncIteration from None
        except (EngineUnavailableError, EngineOverloadedError) as e:
            if not self.started:  # before the first delta: open_stream answers 503 / 429
                raise
            # after it (a retry on another rank found it down or full): the same, retriable
            busy = isinstance(e, EngineOverloadedError)
            wait = OVERLOAD_RETRY_S if busy else UNAVAILABLE_RETRY_S
            status, headers = (429 if busy else 503), {"Retry-After": str(wait)}
            msg = str(e) if "retry" in str(e) else f"{e}; retry the request"
            raise ApiError(status, msg, code="engine_unavailable", headers=headers) from None
        if out.engine_failed:  # the engine failed under this request (no rank to retry on)
            self.finished = True
            msg = f"{out.error}; retry the request"
            raise ApiError(503, msg, code="engine_unavailable",
                           headers={"Retry-After": str(UNAVAILABLE_RETRY_S)})  # fmt: skip
        self.started = True
        self.finished = out.finished
        return out

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        while not self.finished:
            try:
                out = await self._next()
            except StopAsyncIteration:
                return
            yield out

    async def close(self) -> None:
        """Close the engine iterator and abort the request if it has not finished (shielded:
        this runs while a disconnected client's task is being cancelled)."""
        with anyio.CancelScope(shield=True):
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                await aclose()
            if not self.finished:
                await self.client.abort(self.request_id)
