"""Property-based fuzzing of every HTTP endpoint and the gRPC service: the cases of
``bench.fuzz`` (mutated valid requests, junk bytes, deep nesting, hostile headers), drawn by
hypothesis, against a real uvicorn server and a real grpc.aio server over the tiny engine. No
answer is a 5xx, none hangs, errors have the protocol's shape; afterwards the server is
healthy and the KV pool is drained. The full soak (10,000 requests through Ray Serve) is
``python -m bench.fuzz`` against ``make serve`` (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import build_api
from app.deployments.engine_host import LocalEngineClient
from bench.fuzz import case, check_http, grpc_case
from tests.unit.test_api import Server, api_config, engine  # noqa: F401 (fixture)
from tests.unit.test_grpc import AUTH, METHOD, channel, client, service  # noqa: F401

SOAK = settings(
    max_examples=int(os.environ.get("FATHOM_FUZZ_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def fuzz_http(tiny_ckpt, engine):  # noqa: F811
    cfg = api_config(tiny_ckpt, engine, default_max_tokens=8, request_timeout_s=60,
                     vocab_size=engine.core.model.cfg.vocab_size)  # fmt: skip
    with (
        Server(build_api(cfg, LocalEngineClient(engine))) as srv,
        httpx.Client(base_url=srv.url, timeout=90) as c,
    ):
        yield c


@SOAK
@given(rng=st.randoms(use_true_random=False))
def test_http_fuzz(fuzz_http, rng):
    c = case(rng)
    t0 = time.monotonic()
    r = fuzz_http.request(c.method, c.path, content=c.body or None, headers=c.headers)
    why = check_http(c, r.status_code, r.headers.get("content-type", ""), r.content)
    assert why is None, f"{c.method} {c.path} {c.body[:300]!r}: {why}"
    assert time.monotonic() - t0 < 90


@SOAK
@given(rng=st.randoms(use_true_random=False))
def test_grpc_fuzz(channel, rng):  # noqa: F811
    raw = channel.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
    data = grpc_case(rng)
    try:
        list(raw(data, metadata=AUTH, timeout=90))
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.DEADLINE_EXCEEDED), (data, e)  # fmt: skip
        assert e.details() and "Traceback" not in e.details()


def test_after_the_fuzz_the_server_is_healthy_and_drained(fuzz_http, engine):  # noqa: F811
    """Runs after both fuzz tests (file order): nothing is left running, every KV block is
    free again, the pool's bookkeeping holds, and a plain request still works."""
    assert fuzz_http.get("/health").status_code == 200
    pool = engine.core.cache.pool

    async def settle() -> None:
        for _ in range(200):
            if engine.num_unfinished == 0 and pool.num_available == pool.num_blocks:
                return
            await asyncio.sleep(0.05)

    asyncio.run(settle())
    assert engine.num_unfinished == 0 and pool.num_available == pool.num_blocks
    engine.core.cache.check_integrity()
    ok = fuzz_http.post("/v1/completions", json={"model": "tiny-v41", "prompt": "hi",
                                                 "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    assert engine.healthy
