"""Async engine: a background thread runs the step loop of one :class:`EngineCore`; callers
add requests from asyncio code and iterate over their output deltas.

    engine = AsyncEngine(EngineConfig.from_options(path))
    async for out in engine.generate(EngineRequest("r1", ids, params)):
        ...                                  # RequestOutput deltas; the last one is finished
    engine.abort("r1")                        # from any thread; frees the request's KV

Adds and aborts are commands the loop thread applies between steps, so the core is only
touched by one thread. A generator that is closed early (client disconnect) aborts its request
(only its own: a rejected duplicate id never touches the request that holds the id).

Isolation: a bad request fails in ``add_request`` (validated there) and only its caller sees
the error; a sink that fails drops only its request. A step that raises is a broken device
step: every request ends with an error and the engine stops taking work (``healthy`` turns
False, so the deployment restarts the rank) rather than running on a suspect state.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from app.cache.events import KVEventLog, KVSnapshot
from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.handoff import Handoff
from app.engine.parallel import RankParallel
from app.engine.request import ENGINE_FAILED, EngineRequest, FinishReason, RequestOutput
from app.model.model import DeepseekModel

logger = logging.getLogger(__name__)


class AsyncEngine:
    """One DP rank's engine with a background step loop."""

    def __init__(
        self,
        cfg: EngineConfig,
        model: DeepseekModel | None = None,
        parallel: RankParallel | None = None,
    ) -> None:
        self.core = EngineCore(cfg, model, parallel=parallel)
        self._cmds: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._sinks: dict[str, Callable[[RequestOutput], None]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._step_started: float | None = None  # monotonic start of the running step
        # the prefix cache's KV events, numbered, for the router (drained after every step)
        self.kv_events = KVEventLog()
        self._thread = threading.Thread(target=self._loop, name="fathom-engine", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------
    async def generate(
        self, req: EngineRequest, stream_interval_s: float = 0.0, export: bool = False,
        handoff: Handoff | None = None, ack: bool = False,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Add ``req`` and yield its output deltas until it finishes. Raises
        :class:`app.engine.request.RequestError` before the first delta if it is invalid (the
        core validates it and compiles its constraint on the loop thread); ``ack``: first
        yield an empty delta once the core has accepted it.

        ``stream_interval_s`` > 0 batches deltas: the first delta with tokens goes out at
        once, later ones wait up to that long for the steps that follow and go out merged
        (fewer, larger messages to a remote consumer; the last delta is never held back;
        the deltas of a request with ``n`` > 1, one choice's each, are not merged).

        ``export``: end the request after its first token with its decode state (finish
        reason HANDOFF); ``handoff``: continue a request another engine prefilled
        (``app.engine.handoff``)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = req.request_id

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        finished = False
        try:
            add = self._add_handoff if handoff is not None else self._add
            arg = handoff if handoff is not None else export
            await asyncio.wrap_future(self._submit(lambda: add(req, sink, arg)))
            if ack:
                yield RequestOutput(rid, num_prompt_tokens=len(req.prompt_token_ids))
            first = True
            while not finished:
                out = await queue.get()
                if stream_interval_s > 0 and not first and req.params.n == 1:
                    out = await _gather(queue, out, loop.time() + stream_interval_s)
                first = first and not out.token_ids
                finished = out.finished
                yield out
        finally:
            if not finished:  # ours only: a rejected duplicate leaves the holder alone
                self._submit(lambda: self._abort_own(rid, sink))

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe, idempotent)."""
        self._submit(lambda: self._abort(request_id))

    def stats(self) -> dict[str, float | int]:
        """Current counters (running, waiting, KV usage, prefix-hit tokens, step time, and
        with speculation the acceptance: ``EngineStats.report``), flat numbers."""
        return self.core.stats.report()

    @property
    def block_size(self) -> int:
        """Positions per KV block (the unit the prefix cache and its events hash)."""
        return self.core.cache.block_size

    @property
    def prefix_caching(self) -> bool:
        return self.core.cache.index is not None

    def kv_snapshot(self, timeout_s: float = 10.0) -> KVSnapshot:
        """Every cached block hash, consistent with ``kv_events.seq`` (taken between steps;
        blocks the calling thread up to ``timeout_s``: not for the event loop)."""

        def take() -> KVSnapshot:
            self._drain_kv_events()
            index = self.core.cache.index
            if index is None:
                return self.kv_events.snapshot(())
            return self.kv_events.snapshot(
                sorted(index.cached_hashes()), sorted(index.host_hashes())
            )

        return self._submit(take).result(timeout_s)

    def clear_prefix_cache(self, timeout_s: float = 10.0) -> None:
        """Drop every cached block not in use (benchmarks start each run cold; blocking)."""

        def clear() -> None:
            if self.core.cache.index is not None:
                self.core.cache.index.clear()
            self._drain_kv_events()

        self._submit(clear).result(timeout_s)

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    @property
    def healthy(self) -> bool:
        """False once the loop thread died or a step failed (the rank should restart)."""
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def step_running_s(self) -> float:
        """How long the current step has been running (0 between steps)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def problem(self, step_timeout_s: float | None = None) -> str | None:
        """Why this engine should be restarted, or None: a failed step, a dead loop thread,
        or a step running longer than ``step_timeout_s`` (a watchdog)."""
        if self._error is not None:
            return f"a step failed: {self._error!r}"
        if not self._thread.is_alive():
            return "the engine loop thread died"
        running = self.step_running_s
        if step_timeout_s is not None and running > step_timeout_s:
            return f"a step has been running for {running:.0f} s (limit {step_timeout_s:g} s)"
        return None

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.core.close()

    # ---- loop thread -------------------------------------------------------------------
    def _submit(self, fn: Callable[[], object]) -> Future:
        fut: Future = Future()
        if self._error is not None:
            fut.set_exception(RuntimeError(f"engine stopped after an error: {self._error!r}"))
            return fut

        def run() -> None:
            if not fut.set_running_or_notify_cancel():  # the caller went away first
                return
            try:
                fut.set_result(fn())
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)

        self._cmds.append(run)
        self._wake.set()
        return fut

    def _add(self, req: EngineRequest, sink: Callable[[RequestOutput], None],
             export: bool = False) -> None:  # fmt: skip
        if self._error is not None:  # queued before the step failed
            raise RuntimeError(f"engine stopped after an error: {self._error!r}")
        self.core.add_request(req, export=export)
        self._sinks[req.request_id] = sink

    def _add_handoff(self, req: EngineRequest, sink: Callable[[RequestOutput], None],
                     handoff: Handoff) -> str | None:  # fmt: skip
        if self._error is not None:
            raise RuntimeError(f"engine stopped after an error: {self._error!r}")
        why = self.core.add_handoff(req, handoff)
        self._sinks[req.request_id] = sink
        return why

    def _abort(self, request_id: str) -> None:
        out = self.core.abort(request_id)
        sink = self._sinks.pop(request_id, None)
        if out is not None and sink is not None:
            self._deliver(sink, out)

    def _abort_own(self, request_id: str, sink: Callable[[RequestOutput], None]) -> None:
        if self._sinks.get(request_id) is sink:
            self._abort(request_id)

    def _deliver(self, sink: Callable[[RequestOutput], None], out: RequestOutput) -> None:
        """Hand ``out`` to its stream; a sink that fails (its event loop is gone) ends only
        its own request."""
        try:
            sink(out)
        except Exception as e:
            logger.warning("request %s: its stream is gone (%r); aborting it", out.request_id, e)
            self._sinks.pop(out.request_id, None)
            self.core.abort(out.request_id)

    def _drain_kv_events(self) -> None:
        index = self.core.cache.index
        if index is not None:
            self.kv_events.append(index.drain_events())

    def _loop(self) -> None:
        while not self._stopped:
            while self._cmds:
                self._cmds.popleft()()
            self._drain_kv_events()
            gang = self.core.parallel
            if not self.core.has_unfinished:
                if gang is None or not self.core.model.gang_exchanges:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                if wait := gang.idle_wait_s():  # a gang steps on: a peer may have work
                    self._wake.wait(timeout=wait)
                    self._wake.clear()
                    if self._cmds:
                        continue
            self._step_started = time.monotonic()
            try:
                outs = self.core.step()
            except Exception as e:  # a broken step: fail every request, stop taking work
                logger.exception("engine step failed; the engine stops (the rank restarts)")
                self._error = e
                self._fail_all(e)
                continue
            finally:
                self._step_started = None
                self._drain_kv_events()
            for out in outs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                self._deliver(sink, out)

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self._sinks):
            self.core.abort(rid)
            sink = self._sinks.pop(rid)
            msg = f"{ENGINE_FAILED}: {err!r}"
            self._deliver(
                sink, RequestOutput(rid, finished=True, finish_reason=FinishReason.ERROR, error=msg)
            )
        self.core.drain_after_error()


async def _gather(
    queue: asyncio.Queue[RequestOutput], out: RequestOutput, deadline: float
) -> RequestOutput:
    """``out`` merged with the deltas that arrive before ``deadline`` (or until the last)."""
    loop = asyncio.get_running_loop()
    while not out.finished:
        if queue.empty():
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                nxt = await asyncio.wait_for(queue.get(), left)
            except TimeoutError:
                break
        else:
            nxt = queue.get_nowait()
        out = out.merged(nxt)
    return out
