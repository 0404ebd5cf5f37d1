"""Tracing across the Ray boundary and request metrics."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from app import observability as obs


def test_trace_context_continues_in_another_process():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("ingress.dispatch") as parent:
        ctx = obs.carrier()  # what travels in EngineRequest.trace_context
    assert "traceparent" in ctx
    with provider.get_tracer("rank").start_as_current_span(
        "rank.generate", context=obs.extract(ctx)
    ) as child:
        child.add_event("prefill_done")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["rank.generate"].context.trace_id == parent.get_span_context().trace_id
    assert spans["rank.generate"].parent.span_id == parent.get_span_context().span_id


def test_request_metrics_export():
    m = obs.RequestMetrics()
    m.observe("tiny", 0.05, 0.5, n_prompt=10, n_gen=5, n_cached=4, reason="stop")
    m.observe("tiny", None, 0.1, n_prompt=3, n_gen=0, n_cached=0, reason="abort")
    m.set_ranks({"r1": {"num_running": 2, "kv_usage": 0.25}})
    text = generate_latest(m.registry).decode()
    assert 'fathom_requests_total{model="tiny",reason="stop"} 1.0' in text
    assert 'fathom_generation_tokens_total{model="tiny"} 5.0' in text
    assert 'fathom_prefix_hit_tokens_total{model="tiny"} 4.0' in text
    assert 'fathom_rank_stat{rank="r1",stat="kv_usage"} 0.25' in text
    assert "fathom_time_per_output_token_seconds_count" in text
