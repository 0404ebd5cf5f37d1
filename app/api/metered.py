"""Request metrics of a front door: :class:`MeteredClient` (TTFT, TPOT, latency and token
counts of every request) and :func:`metrics_app`, its ``/metrics`` with the engines' gauges
refreshed on each scrape. The Ray Ingress and the one-process server (``bench.rank_server``)
both serve them."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from prometheus_client import make_asgi_app

from app.api.client import EngineClient
from app.engine.request import EngineRequest, RequestOutput
from app.observability import RequestMetrics

logger = logging.getLogger(__name__)


class MeteredClient:
    """Wraps an engine client: records TTFT, TPOT, latency and token counts of every request
    (HTTP and gRPC alike) in :class:`app.observability.RequestMetrics`."""

    def __init__(self, inner: EngineClient, metrics: RequestMetrics, model: str) -> None:
        self.inner, self.metrics, self.model = inner, metrics, model

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        t0, ttft, n_gen, last = time.perf_counter(), None, 0, None
        try:
            async with aclosing(self.inner.generate(req)) as outs:
                async for out in outs:
                    if out.token_ids and ttft is None:
                        ttft = time.perf_counter() - t0
                    n_gen += len(out.token_ids)
                    last = out
                    yield out
        finally:
            reason = "disconnect"
            if last is not None and last.finished and last.finish_reason is not None:
                reason = last.finish_reason.value
            self._observe(
                self.model,
                ttft,
                time.perf_counter() - t0,
                len(req.prompt_token_ids),
                n_gen,
                last.num_cached_tokens if last else 0,
                reason,
            )

    def _observe(self, *args) -> None:
        try:  # metrics never fail a request
            self.metrics.observe(*args)
        except Exception:
            logger.exception("recording request metrics failed")

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def stats(self) -> dict:
        return await self.inner.stats()

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def context_limit(self) -> int | None:
        return await self.inner.context_limit()


RanksStats = Callable[[], Awaitable[dict[str, dict]]]


def metrics_app(metrics: RequestMetrics, ranks_stats: RanksStats) -> Callable[..., Any]:
    """``/metrics`` of ``metrics``' registry; each scrape first refreshes the rank gauges
    (``fathom_rank_stat``) from ``ranks_stats`` (the last values stay if that fails)."""
    inner = make_asgi_app(metrics.registry)

    async def app(scope, receive, send) -> None:
        try:
            metrics.set_ranks(await ranks_stats())
        except Exception as e:  # a scrape still answers (with the last rank gauges)
            logger.warning("rank stats for /metrics failed: %r", e)
        await inner(scope, receive, send)

    return app
