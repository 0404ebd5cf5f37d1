"""Tracing across the Ray boundary and request metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from app import observability as obs
from app.engine.request import EngineRequest, FinishReason, RequestOutput


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


@pytest.fixture
def spans(monkeypatch):
    """Tracing on, into memory (the module's tracer and its hot-path flag)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(obs, "tracer", provider.get_tracer("test"))
    monkeypatch.setattr(obs, "_enabled", True)
    return exporter


class _Core:
    def __init__(self) -> None:
        self.traces: dict = {}


REQ = EngineRequest("req-1", (1, 2, 3), trace_context=None, client_request_id="c1")


def test_tracing_off_is_a_non_recording_span_and_no_engine_work():
    core = _Core()
    assert not obs.tracing_enabled()
    with obs.rank_span(REQ, core) as span:
        assert not span.is_recording()
        assert core.traces == {}
    assert obs.traced_client("inner") == "inner"


def test_rank_span_carries_engine_events_and_says_aborted(spans):
    core = _Core()
    with obs.rank_span(REQ, core, rank="r0"):
        rec = core.traces["req-1"]  # what the engine takes at add_request
        core.traces.pop("req-1")
        rec.event("queued", prompt_tokens=3)
        rec.finish("length", 4, 0)
    with obs.rank_span(dataclasses.replace(REQ, request_id="req-2"), core):
        rec2 = core.traces.pop("req-2")
        rec2.event("queued", prompt_tokens=3)
        rec2.event("first_token")  # the stream closes here: a disconnect
    rec2.finish("abort", 1, 0)  # the engine's late abort: dropped, the span has ended
    with obs.rank_span(dataclasses.replace(REQ, request_id="req-3"), core):
        pass  # refused before the engine saw it: no engine events, not "aborted"
    assert core.traces == {}
    done, aborted, refused = spans.get_finished_spans()
    assert [e.name for e in done.events] == ["queued", "finished"]
    assert done.events[1].attributes["reason"] == "length"
    assert done.attributes["rank"] == "r0" and "fathom.aborted" not in done.attributes
    assert [e.name for e in aborted.events] == ["queued", "first_token", "aborted"]
    assert aborted.attributes["fathom.aborted"] is True
    assert refused.events == ()


class _Inner:
    def __init__(self, outs):
        self.outs = outs

    async def generate(self, req):
        with obs.tracer.start_as_current_span("ingress.dispatch"):
            pass
        for o in self.outs:
            yield o

    async def ready(self):
        return True


def test_traced_client_spans_the_stream(spans):
    outs = [
        RequestOutput("req-1"),
        RequestOutput("req-1", [5, 6]),
        RequestOutput("req-1", [7], finished=True, finish_reason=FinishReason.LENGTH),
    ]

    async def run(n_take):
        c = obs.TracedClient(_Inner(outs))
        assert await c.ready()
        got = []
        async with aclosing(c.generate(REQ)) as it:
            async for o in it:
                got.append(o)
                if len(got) == n_take:
                    break
        return got

    assert len(asyncio.run(run(99))) == 3
    assert len(asyncio.run(run(2))) == 2  # the client went away after its first token
    d1, full, d2, cut = spans.get_finished_spans()
    assert full.name == "ingress.request" and d1.parent.span_id == full.context.span_id
    assert [e.name for e in full.events] == ["first_token", "finished"]
    assert full.attributes["output_tokens"] == 3 and full.attributes["finish_reason"] == "length"
    assert d2.parent.span_id == cut.context.span_id
    assert [e.name for e in cut.events] == ["first_token", "aborted"]
    assert cut.attributes["fathom.aborted"] is True
