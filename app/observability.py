"""Tracing (OpenTelemetry: ingress -> router -> rank -> engine phases) and request metrics.

Spans cross the Ray boundary through ``EngineRequest.trace_context`` (W3C ``traceparent``).
Metrics go to a process-local Prometheus registry served at ``/metrics`` by the ingress, and to
Ray's metrics (``ray.serve.metrics``) when running under Ray.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["RequestMetrics", "carrier", "extract", "setup_tracing", "span_from", "tracer"]

logger = logging.getLogger(__name__)
_configured = False

_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def setup_tracing(mode: str, endpoint: str | None, service: str) -> None:
    """Install the process's tracer provider once: "none", "console" or "otlp"."""
    global _configured
    if _configured or mode == "none":
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if mode == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _configured = True


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
