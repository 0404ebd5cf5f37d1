"""Tracing (OpenTelemetry: ingress -> router -> rank -> engine phases) and request metrics.

One request is one trace across processes: the ingress opens ``ingress.request`` for the whole
stream, ``ingress.dispatch`` / ``router.choose`` per attempt, and the W3C ``traceparent`` of
the dispatch span travels to the rank in ``EngineRequest.trace_context``; the rank continues
it with ``rank.generate`` and the engine's phase events (``app.engine.lifecycle``). Every
process that makes spans calls :func:`setup_tracing` once with the same
:class:`ObservabilityConfig` (the ``observability:`` section; the builder passes it to each
deployment).

Request metrics go to a process-local Prometheus registry served at ``/metrics`` by the
ingress, and to Ray's metrics (``ray.serve.metrics``) when running under Ray; the engine's
metrics are in ``app.engine.metrics``.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import AsyncIterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.config import check_fields
from app.engine.lifecycle import RequestTrace

__all__ = [
    "ObservabilityConfig",
    "RequestMetrics",
    "carrier",
    "extract",
    "rank_span",
    "setup_tracing",
    "shutdown_tracing",
    "span_from",
    "traced_client",
    "tracer",
    "tracing_enabled",
]

logger = logging.getLogger(__name__)
_provider: TracerProvider | None = None
_enabled = False  # the hot-path check: False = no span, no engine events

_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class ObservabilityConfig:
    """``observability:`` of the serve config (``ServeArgs.observability``), as every
    deployment gets it: tracing export (OpenTelemetry) and the ranks' engine metrics."""

    __pydantic_config__ = {"extra": "forbid"}

    tracing: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None  # OTLP/HTTP traces endpoint (None: the exporter's default)
    service_name: str = "fathom"
    # of new traces (root spans); children follow their parent
    sample_ratio: float = field(default=1.0, metadata={"ge": 0, "le": 1})
    export_delay_s: float = field(default=1.0, metadata={"gt": 0})  # batch export period
    engine_metrics: bool = True  # the ranks' engine metrics through Ray's metrics export
    engine_metrics_interval_s: float = field(default=1.0, metadata={"gt": 0})  # their period

    def __post_init__(self) -> None:
        check_fields(self)


def setup_tracing(
    cfg: ObservabilityConfig | None, deployment: str = "", **attributes: str | int
) -> bool:
    """Install this process's tracer provider once (mode ``console`` or ``otlp``); the
    resource is ``service.name`` plus ``fathom.deployment``, the Serve replica id
    (``service.instance.id``) and rank (``fathom.rank``) when running in a replica, and
    ``attributes``. Returns whether tracing is on."""
    global _provider, _enabled
    if _provider is not None or cfg is None or cfg.tracing == "none":
        return _enabled
    res: dict[str, Any] = {"service.name": cfg.service_name, "fathom.deployment": deployment}
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        res["service.instance.id"] = res["fathom.replica_id"] = ctx.replica_id.unique_id
        rank = getattr(getattr(ctx, "rank", None), "rank", None)
        if rank is not None:
            res["fathom.rank"] = rank
    except Exception:  # not in a Serve replica
        pass
    res.update(attributes)
    provider = TracerProvider(
        resource=Resource.create(res),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    if cfg.tracing == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=cfg.otlp_endpoint),
                schedule_delay_millis=cfg.export_delay_s * 1000,
            )
        )
    trace.set_tracer_provider(provider)
    atexit.register(shutdown_tracing)
    _provider, _enabled = provider, True
    return True


def shutdown_tracing() -> None:
    """Export the spans still queued and stop (replica shutdown; idempotent)."""
    global _provider, _enabled
    provider, _provider, _enabled = _provider, None, False
    if provider is not None:
        try:
            provider.shutdown()
        except Exception:
            logger.debug("tracer provider shutdown failed", exc_info=True)


def tracing_enabled() -> bool:
    return _enabled


tracer = trace.get_tracer("fathom")


def carrier() -> dict[str, str]:
    """The current span context as W3C headers (to put in ``EngineRequest.trace_context``)."""
    out: dict[str, str] = {}
    inject(out)
    return out


@contextmanager
def span_from(ctx: dict[str, str] | None, name: str, **attrs):
    """A span that continues the trace in ``ctx`` (a carrier from another process)."""
    with tracer.start_as_current_span(name, context=extract(ctx or {}), attributes=attrs) as s:
        yield s


@contextmanager
def rank_span(req: Any, core: Any, **attrs):
    """``rank.generate``: the rank's span of ``req`` (an ``EngineRequest``), continuing the
    ingress's trace; the engine ``core`` adds the request's phase events to it as they happen
    (``app.engine.lifecycle``). A stream that ends before the request finished (the client
    went away, the call was cancelled) gets an ``aborted`` event and ``fathom.aborted``.
    Tracing off: a non-recording span and no engine work."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    attrs = {"request_id": req.request_id, "prompt_tokens": len(req.prompt_token_ids), **attrs}
    parent = extract(req.trace_context or {})
    with tracer.start_as_current_span("rank.generate", context=parent, attributes=attrs) as span:
        rec = None
        if span.is_recording():
            rec = RequestTrace(span.add_event)
            core.traces[req.request_id] = rec
        try:
            yield span
        finally:
            if rec is not None:
                if core.traces.get(req.request_id) is rec:  # never reached the engine
                    del core.traces[req.request_id]
                rec.close()
                if rec.phase is not None and not rec.finished:
                    _aborted(span, f"the stream closed during {rec.phase}")


def _aborted(span: Any, why: str) -> None:
    span.add_event("aborted", {"reason": why})
    span.set_attribute("fathom.aborted", True)
    span.set_attribute("finish_reason", "abort")


class TracedClient:
    """Wraps the ingress's engine client: ``ingress.request`` spans a request's whole stream
    (the parent of its dispatch attempts, hence of the rank's span), with ``first_token``
    and ``finished`` (reason, output tokens) events, or ``aborted`` when the stream closes
    before the last delta (client disconnect)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # abort, stats, ready, ...
        return getattr(self.inner, name)

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        span = tracer.start_span(
            "ingress.request",
            attributes={
                "request_id": req.request_id,
                "client_request_id": req.client_request_id,
                "prompt_tokens": len(req.prompt_token_ids),
            },
        )
        ctx = trace.set_span_in_context(span)
        outs = self.inner.generate(req)
        n_gen, finished = 0, False
        try:
            while True:
                token = otel_context.attach(ctx)  # the inner client's spans are children
                try:
                    out = await outs.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                if out.token_ids and n_gen == 0:
                    span.add_event("first_token")
                n_gen += len(out.token_ids)
                if out.finished:
                    finished = True
                    reason = out.finish_reason.value if out.finish_reason else "unknown"
                    span.add_event("finished", {"reason": reason, "output_tokens": n_gen})
                    span.set_attribute("finish_reason", reason)
                    span.set_attribute("output_tokens", n_gen)
                    span.set_attribute("cached_tokens", out.num_cached_tokens)
                yield out
        except Exception as e:  # not GeneratorExit / CancelledError: those are aborts
            span.record_exception(e)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)[:200]))
            raise
        finally:
            try:
                await outs.aclose()
            finally:
                if not finished:
                    _aborted(span, "the stream closed before the request finished")
                span.end()


def traced_client(client: Any) -> Any:
    """``client`` wrapped in :class:`TracedClient` when tracing is on (else itself)."""
    return TracedClient(client) if _enabled else client


class RequestMetrics:
    """TTFT, TPOT, end-to-end latency, tokens and request outcomes, with rank gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "fathom_time_to_first_token_seconds",
            "TTFT",
            ["model"],
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fathom_time_per_output_token_seconds",
            "TPOT",
            ["model"],
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "fathom_e2e_latency_seconds",
            "request latency",
            ["model"],
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("fathom_prompt_tokens", "prompt tokens", ["model"], registry=r)
        self.gen_tokens = Counter(
            "fathom_generation_tokens", "generated tokens", ["model"], registry=r
        )
        self.cached_tokens = Counter(
            "fathom_prefix_hit_tokens", "prompt tokens from the prefix cache", ["model"], registry=r
        )
        self.requests = Counter(
            "fathom_requests", "finished requests", ["model", "reason"], registry=r
        )
        self.rank = Gauge(
            "fathom_rank_stat", "per-rank engine statistic", ["rank", "stat"], registry=r
        )
        self._rank_labels: set[tuple[str, str]] = set()
        self._ray = None
        try:
            from ray.serve import metrics as rm

            self._ray = {
                "ttft": rm.Histogram(
                    "fathom_ttft_s", "TTFT", boundaries=list(_LAT_BUCKETS), tag_keys=("model",)
                ),
                "tpot": rm.Histogram(
                    "fathom_tpot_s", "TPOT", boundaries=list(_LAT_BUCKETS), tag_keys=("model",)
                ),
                "tokens": rm.Counter("fathom_gen_tokens", "generated tokens", tag_keys=("model",)),
            }
        except Exception:  # not under Ray: Prometheus registry only
            logger.debug("ray metrics unavailable", exc_info=True)

    def observe(
        self,
        model: str,
        ttft: float | None,
        e2e: float,
        n_prompt: int,
        n_gen: int,
        n_cached: int,
        reason: str,
    ) -> None:
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(n_prompt)
        self.gen_tokens.labels(model).inc(n_gen)
        self.cached_tokens.labels(model).inc(n_cached)
        self.requests.labels(model, reason).inc()
        tpot = (e2e - ttft) / (n_gen - 1) if ttft is not None and n_gen > 1 else None
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if tpot is not None:
            self.tpot.labels(model).observe(tpot)
        if self._ray is not None:
            tags = {"model": model}
            if ttft is not None:
                self._ray["ttft"].observe(ttft, tags=tags)
            if tpot is not None:
                self._ray["tpot"].observe(tpot, tags=tags)
            if n_gen > 0:  # Ray counters reject 0
                self._ray["tokens"].inc(n_gen, tags=tags)

    def set_ranks(self, ranks: dict[str, dict[str, float]]) -> None:
        """The rank gauges: the live ranks' last reports; a rank that is gone (dead, or
        dropped by the Router) loses its series."""
        labels = {
            (rank, k): float(v)
            for rank, stats in ranks.items()
            for k, v in stats.items()
            if isinstance(v, int | float)
        }
        for gone in self._rank_labels - labels.keys():
            self.rank.remove(*gone)
        for key, v in labels.items():
            self.rank.labels(*key).set(v)
        self._rank_labels = set(labels)
