"""Ingress limits on a real uvicorn server: depth-safe JSON, header
limits, JSON Content-Type, cross-origin refusal, body read timeout, and large bodies that no
longer stall the event loop while they are tokenized."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from app.api import build_api
from app.deployments.engine_host import LocalEngineClient
from tests.unit.test_api import (  # noqa: F401 (fixtures)
    HI,
    MODEL,
    Server,
    api_config,
    engine,
    server,
)

ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/responses")
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def http(server):  # noqa: F811
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


def deep(levels: int) -> bytes:
    return b'{"model": "tiny-v41", "x": ' + b"[" * levels + b"]" * levels + b"}"


@pytest.mark.parametrize("levels", [65, 2000, 100_000])
@pytest.mark.parametrize("route", ROUTES)
def test_deep_json_is_a_400(http, route, levels):
    """Nesting >= 2000 once raised a RecursionError: 500 on every endpoint."""
    r = http.post(route, content=deep(levels), headers=JSON)
    assert r.status_code == 400, r.text
    assert "nested deeper than 64" in r.text
    assert http.get("/health").status_code == 200


def test_shallow_json_passes_the_depth_check(http):
    body = {"model": MODEL, "messages": HI, "max_tokens": 1, "metadata": {"a": [[[1]]]}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    ("headers", "status", "words"),
    [
        ({"content-type": "text/plain"}, 415, "got text/plain"),
        ({}, 415, "got none"),
        ({"content-type": "application/x-www-form-urlencoded"}, 415, "application/json"),
        # a web page posting through a visitor's browser (no auth by default)
        ({"content-type": "text/plain", "origin": "http://evil.example"}, 403, "evil.example"),
        ({**JSON, "origin": "http://evil.example"}, 403, "cross-origin"),
    ],
)
def test_content_type_and_origin(http, headers, status, words):
    body = b'{"model": "tiny-v41", "prompt": "hi", "max_tokens": 1}'
    r = http.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == status and words in r.json()["error"]["message"], r.text
    ok = http.post("/v1/completions", content=body,
                   headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
    assert ok.status_code == 200


def test_header_limits(http):
    many = {f"x-h{i}": "v" for i in range(200)}
    r = http.get("/v1/models", headers=many)
    assert r.status_code == 431 and "the limit is 100" in r.json()["error"]["message"]
    big = http.get("/v1/models", headers={"x-big": "v" * (40 << 10)})
    assert big.status_code == 431 and "bytes" in big.json()["error"]["message"]
    assert http.get("/v1/models").status_code == 200


def test_messages_is_as_strict_as_anthropic(http):
    no_max = http.post("/v1/messages", json={"model": MODEL, "messages": HI})
    assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]
    sys_turn = [{"role": "system", "content": "be brief"}, *HI]
    r = http.post("/v1/messages", json={"model": MODEL, "messages": sys_turn, "max_tokens": 2})
    assert r.status_code == 400 and "system" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_allowed_origin_gets_cors_and_body_read_timeout(tiny_ckpt, engine):  # noqa: F811
    cfg = api_config(tiny_ckpt, engine, cors_allow_origins=["http://app.example"],
                     body_read_timeout_s=1.0)  # fmt: skip
    with Server(build_api(cfg, LocalEngineClient(engine))) as srv:
        pre = httpx.options(
            f"{srv.url}/v1/completions",
            headers={"origin": "http://app.example", "access-control-request-method": "POST"},
        )
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "http://app.example"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        r = httpx.post(f"{srv.url}/v1/completions", json=body,
                       headers={"origin": "http://app.example"})  # fmt: skip
        assert r.status_code == 200 and r.headers["access-control-allow-origin"]
        # a body that never finishes: 408 after the read timeout, not a connection held open
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                      b"\r\ncontent-length: 1000\r\n\r\n{\"model\":")  # fmt: skip
            t0 = time.monotonic()
            reply = s.recv(4096)
            waited = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in reply
        assert waited < 20  # generous: 1 s timeout on a loaded 2-core machine


def test_large_bodies_do_not_stall_other_requests(server):  # noqa: F811
    """Two ~3.9 MB prompts to /v1/completions (each tokenized for ~4-5 s, then refused: 400,
    over max_prompt_tokens) once froze every other request for that long: the tokenizer held
    the GIL on the event loop. Now /health keeps answering while they are tokenized."""
    srv, _ = server
    text = "hello world, this is some text 123. " * (3_900_000 // 36)
    big = {"model": MODEL, "prompt": text, "max_tokens": 1}

    async def main() -> tuple[list[int], float, int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            bigs = [asyncio.create_task(c.post("/v1/completions", json=big)) for _ in range(2)]
            gaps, t_end = [], time.monotonic() + 60
            while not all(b.done() for b in bigs) and time.monotonic() < t_end:
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                gaps.append(time.monotonic() - t0)
                await asyncio.sleep(0.05)
            codes = [(await b).status_code for b in bigs]
            return codes, max(gaps), len(gaps)

    codes, worst, n = asyncio.run(main())
    assert codes == [400, 400]
    assert n >= 5  # /health was polled throughout the tokenization
    assert worst < 2.0, f"/health took {worst:.2f} s while large bodies were tokenized"
