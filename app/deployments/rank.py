"""DPRank: one replica = one data-parallel rank = one engine. Streams token deltas to the
ingress and reports its load to the Router."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import EngineConfig, ParallelConfig
from app.deployments.engine_host import LocalRankEngine, RankEngine
from app.deployments.gang import join_gang
from app.deployments.router import EVENTS_S, REPORT_S
from app.engine.admission import Refusal
from app.engine.metrics import install_engine_metrics
from app.engine.request import EngineRequest, RequestOutput
from app.logs import setup_logging
from app.model.config import ModelConfig
from app.observability import ObservabilityConfig, rank_span, setup_tracing, shutdown_tracing

logger = logging.getLogger(__name__)
CONTROL_TIMEOUT_S = 5.0  # a report to the Router
SNAPSHOT_TIMEOUT_S = 30.0


class DPRank:
    """Holds a :class:`RankEngine` (``engine_cls``, built from ``engine_cfg``) on this
    replica's devices; reports its load and KV events to the Router."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        router: DeploymentHandle,
        max_pending: int | None = None,
        max_queued_tokens: int | None = None,
        step_timeout_s: float | None = None,
        stream_interval_s: float = 0.0,
        tracing: ObservabilityConfig | None = None,
        metrics_interval_s: float | None = 1.0,
        engine_cls: type[RankEngine] = LocalRankEngine,
        parallel: ParallelConfig | None = None,
    ) -> None:
        setup_logging()
        setup_tracing(tracing, "DPRank")
        self.step_timeout_s = step_timeout_s
        gang = {}
        if parallel is not None and parallel.ep_size > 1:  # app.deployments.gang
            experts = ModelConfig.from_file(engine_cfg.model).n_routed_experts
            gang = {"parallel": join_gang(parallel, experts, router, engine_cfg.device)}
        self.engine: RankEngine = engine_cls(  # type: ignore[call-arg]
            engine_cfg,
            max_pending,
            max_queued_tokens,
            stream_interval_s,
            step_timeout_s,
            **gang,
        )
        self.router = router
        self._queued_cost = 0.0  # predicted prefill tokens of requests before their 1st token
        self._received = 0  # requests that reached this rank (monotonic)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = metrics_interval_s and install_engine_metrics(
            self.engine.core, metrics_interval_s
        )  # app.engine.metrics: Ray's metrics export, one series per rank
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True)
        self._reporter.start()
        logger.info(
            "DP rank %s ready (max_model_len %d, KV blocks of %d)",
            self.replica_id, self.engine.info.max_model_len, self.engine.info.block_size,
        )  # fmt: skip

    def _report_loop(self) -> None:
        """Stats every ``REPORT_S``; KV events within ``EVENTS_S`` of their step. Blocking
        calls are fine here (a thread, not the replica's event loop)."""
        meta, info = self.engine.info.meta(), self.engine.info
        sent: int | None = None  # last KV event the router has (None: it needs a snapshot)
        last = 0.0
        while not self._stop.wait(EVENTS_S):
            try:
                batch = None
                if info.prefix_caching and sent is not None:
                    batch = self.engine.kv_events_since(sent)
                due = time.monotonic() - last >= REPORT_S
                if not due and not (batch is not None and batch.events):
                    continue
                last = time.monotonic()
                reply = self.router.report.remote(
                    self.replica_id, self._load(), meta, batch
                ).result(timeout_s=CONTROL_TIMEOUT_S)
                if reply.get("resync"):
                    snap = self.engine.kv_snapshot()
                    self.router.snapshot.remote(self.replica_id, snap).result(
                        timeout_s=SNAPSHOT_TIMEOUT_S
                    )
                    sent = snap.seq
                elif batch is not None:
                    sent = batch.last_seq
            except Exception:  # the router may be restarting; report again next period
                logger.debug("rank report failed", exc_info=True)

    async def generate(
        self, req: EngineRequest, target: str | None = None, cost: float | None = None
    ) -> AsyncIterator[RequestOutput | Refusal]:
        """Stream ``req``'s deltas (an empty ack first, then tokens; the last is finished), or
        one :class:`Refusal` (invalid, overloaded, unavailable) instead of the ack. ``cost``:
        the prefill tokens the Router predicted for it here (its cache hit taken off)."""
        del target  # consumed by PinnedRequestRouter
        async for out in self._respond(req, cost, self.engine.generate(req)):
            yield out

    async def _respond(
        self, req: EngineRequest, cost: float | None, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput | Refusal]:
        """``stream`` (the engine's deltas of ``req``) as :meth:`generate` answers."""
        # the engine adds the phase events (app.engine.lifecycle) to the span
        with rank_span(req, self.engine.core, rank=self.replica_id) as span:
            started = False
            try:
                async for out in self._costed(stream, cost, len(req.prompt_token_ids)):
                    started = True
                    yield out
            except Exception as e:
                refusal = None if started else Refusal.of(e)
                if refusal is None:
                    raise
                span.set_attribute("refused", refusal.kind)
                yield refusal
                return
            span.set_attribute("finish_reason", str(out.finish_reason))

    async def _costed(
        self, stream: AsyncIterator[RequestOutput], cost: float | None, prompt_len: int
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream, counting the request's predicted prefill in the queued work
        this rank reports until its first token (or its end)."""
        cost = float(prompt_len if cost is None else cost)
        self._queued_cost += cost
        self._received += 1  # the Router matches these against what it sent here
        try:
            async for out in stream:
                if cost and (out.token_ids or out.finished):
                    self._queued_cost -= cost
                    cost = 0.0
                yield out
        finally:
            self._queued_cost -= cost

    def _load(self) -> dict[str, float]:
        """The engine's load with the queued prefill work in the router's terms: prompt
        tokens not yet prefilled minus the prefix hits the router predicted (the engine's
        admission counts whole prompts: a rank holding a hot prefix would look busy)."""
        load = self.engine.load()
        return {
            **load,
            "queued_prompt_tokens": load.get("queued_prefill_tokens", 0.0),
            "queued_prefill_tokens": max(0.0, self._queued_cost),
            "received_requests": float(self._received),
        }

    async def stats(self, target: str | None = None) -> dict:
        del target
        return {**self._load(), "replica_id": self.replica_id}

    async def clear_prefix_cache(self, target: str | None = None) -> str:
        """Drop this rank's unused cached blocks (call pinned; benchmarks start cold)."""
        del target
        self.engine.clear_prefix_cache()
        return self.replica_id

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (``app.deployments.autoscaling.RankPolicy``)."""
        load = self._load()
        return {
            "kv_usage": float(load.get("kv_usage", 0.0)),
            "queued_prefill_tokens": float(load.get("queued_prefill_tokens", 0.0)),
        }

    def check_health(self) -> None:
        """Serve restarts the rank when this raises: after a failed step (the engine stopped
        taking work), when the loop thread died, or when a step is stuck (watchdog)."""
        problem = self.engine.problem(self.step_timeout_s)
        if problem is not None:
            logger.error("DP rank %s unhealthy: %s", self.replica_id, problem)
            raise RuntimeError(problem)

    def __del__(self) -> None:
        """Serve calls this when the replica stops (scale-down, redeploy), after its streams
        finished: leave the router's choice and index now rather than after ``STALE_S``."""
        self._stop.set()
        try:
            self.router.drop.remote(self.replica_id)
        except Exception:
            logger.debug("leaving the router failed", exc_info=True)
        shutdown_tracing()  # export the spans still queued
