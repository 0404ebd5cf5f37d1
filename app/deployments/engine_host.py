"""What a DPRank needs of its engine: the :class:`RankEngine` protocol, and
:class:`LocalRankEngine`, the in-process engine behind it: an :class:`AsyncEngine` behind
:class:`LocalEngineClient`, which owns the rank's admission queue and its drain. A DPRank is
built with ``engine_cls`` (the Ray Serve LLM ``LLMServer`` pattern), so the deployment never
reaches into engine internals. No Ray here: ``LocalEngineClient`` also serves the HTTP API
in-process (tests, ``bench/rank_server.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from app.cache.events import HASH_NAMESPACE, KVEventBatch, KVSnapshot
from app.config import EngineConfig
from app.engine.admission import Admission, EngineUnavailableError
from app.engine.core import EngineCore
from app.engine.engine import AsyncEngine
from app.engine.handoff import Handoff
from app.engine.parallel import RankParallel
from app.engine.request import EngineRequest, RequestOutput


@dataclass(frozen=True)
class RankInfo:
    """What a rank announces to the router once (its ``meta``)."""

    max_model_len: int
    block_size: int
    namespace: str
    prefix_caching: bool
    window: int  # sliding window: the replay a prefix hit still costs
    replay: str  # bounded replay mode ("off": a hit saves memory only)

    def meta(self) -> dict[str, object]:
        return {
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "namespace": self.namespace,
            "prefix_caching": self.prefix_caching,
            "window": self.window,
            "replay": self.replay,
        }


class RankEngine(Protocol):
    """The engine of one DP rank as the deployment uses it. ``core`` is the engine core, for
    the observability hooks only (``EngineCore.traces`` and ``on_step``: app.engine.lifecycle,
    app.engine.metrics)."""

    info: RankInfo
    core: EngineCore

    def generate(
        self, req: EngineRequest, export: bool = False, handoff: Handoff | None = None
    ) -> AsyncIterator[RequestOutput]:
        """An empty ack, then the deltas (raises the admission / validation errors).
        ``export`` / ``handoff``: prefill / decode side of a PD handoff (app.engine.handoff)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> dict[str, float]:
        """Flat numbers for the router: running, waiting, queued prefill tokens, KV usage,
        health, and the engine's counters."""
        ...

    def kv_events_since(self, seq: int) -> KVEventBatch | None: ...

    def kv_snapshot(self) -> KVSnapshot: ...

    def clear_prefix_cache(self) -> None: ...

    def problem(self, step_timeout_s: float | None) -> str | None: ...

    def shutdown(self) -> None: ...


class LocalEngineClient:
    """An in-process :class:`AsyncEngine` as an ``app.api.client.EngineClient`` (a DP rank,
    tests): the rank's admission and drain in front of it.

    ``max_pending`` unfinished requests and ``max_queued_tokens`` prompt tokens waiting for
    prefill bound the queue (:class:`~app.engine.admission.Admission`, prompts up to one
    step's token budget count as short; beyond the bounds ``EngineOverloadedError``).
    :meth:`drain` stops taking requests (503) while running ones finish. A request is
    validated (and its constraint compiled) once, by the engine core on its own thread; the
    ack goes out when the core has accepted it, so an invalid request still gets its 4xx.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        max_pending: int | None = None,
        max_queued_tokens: int | None = None,
        stream_interval_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.stream_interval_s = stream_interval_s  # delta batching (AsyncEngine.generate)
        short = engine.core.cfg.scheduler.max_num_batched_tokens
        self.admission = Admission(max_pending, max_queued_tokens, short_prompt_tokens=short)
        self._draining = False

    @property
    def max_pending(self) -> int | None:
        return self.admission.max_requests

    @max_pending.setter
    def max_pending(self, v: int | None) -> None:
        self.admission.max_requests = v

    async def generate(
        self, req: EngineRequest, export: bool = False, handoff: Handoff | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The ack once the engine accepted ``req``, then its deltas. ``export`` /
        ``handoff``: prefill/decode disaggregation (``AsyncEngine.generate``)."""
        if self._draining:
            raise EngineUnavailableError("the engine is draining and takes no new requests")
        if not self.engine.healthy:
            raise EngineUnavailableError(f"the engine stopped: {self.engine.error!r}")
        ticket = self.admission.admit(len(req.prompt_token_ids))
        try:
            stream = self.engine.generate(req, self.stream_interval_s, export, handoff, ack=True)
            async for out in stream:
                if out.token_ids or out.finished:
                    ticket.prefilled()
                yield out
        except RuntimeError as e:  # the engine stopped (after a failed step)
            raise EngineUnavailableError(str(e)) from e
        finally:
            ticket.release()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def stats(self) -> dict:
        return {**self.engine.stats(), "num_unfinished": self.engine.num_unfinished}

    async def ready(self) -> bool:
        return not self._draining

    async def context_limit(self) -> int | None:
        return self.engine.core.max_model_len

    def drain(self, draining: bool = True) -> None:
        """Stop (or resume) taking new requests."""
        self._draining = draining


class LocalRankEngine:
    """:class:`RankEngine` over an in-process :class:`AsyncEngine` on this replica's devices."""

    def __init__(
        self,
        cfg: EngineConfig,
        max_pending: int | None = None,
        max_queued_tokens: int | None = None,
        stream_interval_s: float = 0.0,
        step_timeout_s: float | None = None,
        parallel: RankParallel | None = None,
    ) -> None:
        self.engine = AsyncEngine(cfg, parallel=parallel)
        self.parallel = parallel
        self.client = LocalEngineClient(
            self.engine, max_pending, max_queued_tokens, stream_interval_s
        )
        self.step_timeout_s = step_timeout_s
        self.core = core = self.engine.core
        self.info = RankInfo(
            max_model_len=core.max_model_len,
            block_size=self.engine.block_size,
            namespace=HASH_NAMESPACE,
            prefix_caching=self.engine.prefix_caching,
            window=core.model.cfg.sliding_window,
            replay=cfg.cache.bounded_replay,
        )

    def generate(
        self, req: EngineRequest, export: bool = False, handoff: Handoff | None = None
    ) -> AsyncIterator[RequestOutput]:
        return self.client.generate(req, export, handoff)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    def load(self) -> dict[str, float]:
        gang: dict[str, float] = {}
        if self.parallel is not None:  # its gang rank and what its Engram tables cost
            gang["ep_rank"] = self.parallel.group.rank
            if self.parallel.engram_bytes is not None:
                gang.update(self.parallel.engram_bytes.report())
        return {
            **gang,
            **self.engine.stats(),
            "num_unfinished": self.engine.num_unfinished,
            "queued_prefill_tokens": self.client.admission.queued_tokens,
            "healthy": int(self.problem(self.step_timeout_s) is None),
        }

    def kv_events_since(self, seq: int) -> KVEventBatch | None:
        return self.engine.kv_events.since(seq)

    def kv_snapshot(self) -> KVSnapshot:
        return self.engine.kv_snapshot()

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    def problem(self, step_timeout_s: float | None) -> str | None:
        return self.engine.problem(step_timeout_s)

    def shutdown(self) -> None:
        self.engine.shutdown()
