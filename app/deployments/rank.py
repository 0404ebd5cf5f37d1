"""DPRank: one replica = one data-parallel rank = one engine. Streams token deltas to the
ingress and reports its load to the Router."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.api.client import LocalEngineClient, Refusal
from app.config import EngineConfig
from app.deployments.router import REPORT_S
from app.engine.engine import AsyncEngine
from app.engine.metrics import install_engine_metrics
from app.engine.request import EngineRequest, RequestOutput
from app.logs import setup_logging
from app.observability import TracingConfig, rank_span, setup_tracing, shutdown_tracing

logger = logging.getLogger(__name__)


class DPRank:
    """Holds an :class:`AsyncEngine` (built from ``engine_cfg``) on this replica's devices."""

    def __init__(
        self,
        engine_cfg: EngineConfig,
        router: DeploymentHandle,
        max_pending: int | None = None,
        max_queued_tokens: int | None = None,
        step_timeout_s: float | None = None,
        tracing: TracingConfig | None = None,
        metrics_interval_s: float | None = 1.0,
    ) -> None:
        setup_logging()
        setup_tracing(tracing, "DPRank")
        self.step_timeout_s = step_timeout_s
        self.engine = AsyncEngine(engine_cfg)
        self.client = LocalEngineClient(self.engine, max_pending, max_queued_tokens)
        self.router = router
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.metrics = metrics_interval_s and install_engine_metrics(
            self.engine.core, metrics_interval_s
        )  # app.engine.metrics: Ray's metrics export, one series per rank
        self._stop = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, daemon=True)
        self._reporter.start()
        logger.info(
            "DP rank %s ready (max_model_len %d)", self.replica_id, self.engine.core.max_model_len
        )

    def _report_loop(self) -> None:
        meta = {"max_model_len": self.engine.core.max_model_len}
        while not self._stop.wait(REPORT_S):
            try:
                adm = self.client.admission
                stats = {
                    **self.engine.stats(),
                    "num_unfinished": self.engine.num_unfinished,
                    "queued_prefill_tokens": adm.queued_tokens,
                    "healthy": int(self.engine.problem(self.step_timeout_s) is None),
                }
                self.router.report.remote(self.replica_id, stats, meta)
            except Exception:  # the router may be restarting; report again next period
                logger.debug("rank report failed", exc_info=True)

    async def generate(
        self, req: EngineRequest, target: str | None = None
    ) -> AsyncIterator[RequestOutput | Refusal]:
        """Stream ``req``'s deltas (an empty ack first, then tokens; the last is finished), or
        one :class:`Refusal` (invalid, overloaded, unavailable) instead of the ack."""
        del target  # consumed by PinnedRequestRouter
        # the engine adds the phase events (app.engine.lifecycle) to the span
        with rank_span(req, self.engine.core, rank=self.replica_id) as span:
            started = False
            try:
                async for out in self.client.generate(req):
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

    async def stats(self, target: str | None = None) -> dict:
        del target
        return {**self.engine.stats(), "replica_id": self.replica_id}

    def check_health(self) -> None:
        """Serve restarts the rank when this raises: after a failed step (the engine stopped
        taking work), when the loop thread died, or when a step is stuck (watchdog)."""
        problem = self.engine.problem(self.step_timeout_s)
        if problem is not None:
            logger.error("DP rank %s unhealthy: %s", self.replica_id, problem)
            raise RuntimeError(problem)

    def __del__(self) -> None:
        self._stop.set()
        shutdown_tracing()  # export the spans still queued
