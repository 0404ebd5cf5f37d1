"""Fault handling without a cluster: the Router drops
failed, silent and unhealthy ranks; dead ranks lose their metric series; the watchdog sees a
stuck step; a client that goes away mid-stream is a debug line, not a traceback."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
from prometheus_client import generate_latest

from app import observability as obs
from app.api import build_api
from app.api.sse import SSEResponse
from app.config import EngineConfig
from app.engine.engine import AsyncEngine
from app.engine.request import (
    ENGINE_FAILED,
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
)
from tests.unit.test_api import api_config, engine  # noqa: F401 (fixture)

pytest.importorskip("ray")
from app.deployments.router import STALE_S, Router  # noqa: E402
from app.deployments.routing import RouteQuery  # noqa: E402


def test_router_drops_failed_silent_and_unhealthy_ranks():
    async def run() -> None:
        router = Router.func_or_class()

        async def choose(exclude: tuple[str, ...] = ()) -> str | None:
            d = await router.choose(RouteQuery(5, exclude=exclude))
            return None if d is None else d.target

        for r in ("a", "b", "c"):
            await router.report(r, {"num_running": 0}, {})
        await router.drop("a")  # the ingress saw a call to it fail
        assert set(await router.ranks_stats()) == {"b", "c"}
        assert await choose(("b",)) == "c"  # a retry excludes the rank that failed
        assert await choose(("b", "c")) is None
        await router.report("b", {"num_running": 0, "healthy": 0}, {})  # its engine stopped
        assert {await choose() for _ in range(4)} == {"c"}
        router.ranks["c"].seen = time.monotonic() - STALE_S - 1  # stopped reporting
        assert await choose() is None and "c" not in router.ranks
        await router.report("a", {"num_running": 0}, {})  # alive after all: back at once
        assert await choose() == "a"

    asyncio.run(run())


def test_gone_ranks_lose_their_metric_series():
    m = obs.RequestMetrics()
    m.set_ranks({"r1": {"num_running": 11}, "r2": {"num_running": 2}})
    m.set_ranks({"r2": {"num_running": 3}})  # r1 died
    text = generate_latest(m.registry).decode()
    assert 'rank="r1"' not in text
    assert 'fathom_rank_stat{rank="r2",stat="num_running"} 3.0' in text


def test_watchdog_sees_a_stuck_step(tiny_ckpt):
    eng = AsyncEngine(EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22))
    real, gate = eng.core.step, threading.Event()

    def stuck():
        gate.wait(30)
        return real()

    eng.core.step = stuck
    try:

        async def main() -> tuple[str | None, str | None, bool]:
            req = EngineRequest("s", (0, 5), SamplingParams(max_tokens=2, ignore_eos=True))
            task = asyncio.create_task(_drain(eng.generate(req)))
            deadline = time.monotonic() + 20
            while eng.step_running_s < 0.5:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            during = eng.problem(step_timeout_s=0.2)
            gate.set()
            await task
            return during, eng.problem(step_timeout_s=0.2), eng.healthy

        during, after, healthy = asyncio.run(main())
    finally:
        gate.set()
        eng.shutdown()
    assert during is not None and "running for" in during
    assert after is None and healthy


async def _drain(it) -> None:
    async for _ in it:
        pass


def test_disconnect_under_serve_is_one_debug_line(caplog):
    """Under Ray Serve, ``receive`` raises (TaskCancelledError) when the proxy cancels a
    disconnected call; that once escaped as an ExceptionGroup traceback per disconnect."""
    closed = asyncio.Event()

    async def events():
        try:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def receive():
        await asyncio.sleep(0.05)
        raise RuntimeError("Task was cancelled")  # what Serve's receive does

    async def send(message) -> None:
        return None

    async def main() -> None:
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await SSEResponse(events(), headers={})(scope, receive, send)

    with caplog.at_level(logging.DEBUG, logger="app.api.sse"):
        asyncio.run(main())
    assert closed.is_set()
    msgs = [r for r in caplog.records if r.name == "app.api.sse"]
    assert len(msgs) == 1 and msgs[0].levelno == logging.DEBUG


class _FailingEngine:
    """An EngineClient whose engine step fails under the request after one token (what a
    single-process server sees: there is no other rank to retry on)."""

    async def generate(self, req: EngineRequest):
        yield RequestOutput(req.request_id)
        yield RequestOutput(req.request_id, token_ids=[7])
        yield RequestOutput(req.request_id, finished=True, finish_reason=FinishReason.ERROR,
                            error=f"{ENGINE_FAILED}: RuntimeError('device lost')")  # fmt: skip

    async def abort(self, request_id: str) -> None:
        return None

    async def stats(self) -> dict:
        return {}

    async def ready(self) -> bool:
        return True


def test_a_failed_step_is_a_retriable_503_not_a_500(tiny_ckpt, engine):  # noqa: F811
    app = build_api(api_config(tiny_ckpt, engine), _FailingEngine())
    body = {"model": "tiny-v41", "prompt": "hi", "max_tokens": 4}

    async def main() -> tuple[httpx.Response, str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            plain = await c.post("/v1/completions", json=body)
            streamed = await c.post("/v1/completions", json={**body, "stream": True})
            return plain, streamed.text

    plain, streamed = asyncio.run(main())
    assert plain.status_code == 503 and plain.headers["retry-after"] == "5"
    assert "retry the request" in plain.json()["error"]["message"]
    assert '"service_unavailable"' in streamed and "device lost" in streamed
