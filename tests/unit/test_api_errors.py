"""A table of bad requests against a real uvicorn server: each gets a 4xx in its protocol's
error shape with a message naming what was wrong, and the server stays healthy."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.unit.test_api import HI, MODEL, NO_THINK, engine, server  # noqa: F401 (fixtures)

CHAT, MSGS, CMPL, RESP = "/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/responses"
SCHEMA_TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": 4, **kw}


def msgs(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": HI, "max_tokens": 4, **kw}


def cmpl(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **kw}


LONG = "hello world " * 2000  # > max_prompt_tokens (2000)

# (id, path, body: dict | bytes, status, words the message must contain)
CASES: list[tuple[str, str, dict[str, Any] | bytes, int, str]] = [
    ("malformed-json", CHAT, b'{"model": "tiny-v41", "messages": [', 400, "malformed JSON"),
    ("not-an-object", CHAT, b"[1, 2, 3]", 400, "JSON object"),
    ("empty-body", CHAT, b"", 400, "empty"),
    ("bad-utf8", CHAT, b'{"model": "tiny-v41", "x": "\xff\xfe"}', 400, "UTF-8"),
    (
        "lone-surrogate",
        CHAT,
        b'{"model": "tiny-v41", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
        "surrogate",
    ),
    ("unknown-model", CHAT, chat(model="gpt-9"), 404, "gpt-9"),
    ("model-wrong-type", CHAT, chat(model=7), 400, "model must be a string"),
    ("max-tokens-string", CHAT, chat(max_tokens="5"), 400, "max_tokens must be an integer"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-1), 400, "max_tokens must be >= 1"),
    ("max-tokens-oversized", CHAT, chat(max_tokens=10**9), 400, "max_tokens"),
    ("max-tokens-over-context", CHAT, chat(max_tokens=300000), 400, "maximum context length"),
    ("temperature-5", CHAT, chat(temperature=5, **NO_THINK), 400, "temperature"),
    ("top-p-0", CHAT, chat(top_p=0), 400, "top_p"),
    ("stream-not-bool", CHAT, chat(stream="yes"), 400, "stream must be a boolean"),
    ("n-over-max", CHAT, chat(n=17), 400, "n: must be at most 16 (api.max_n)"),
    ("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=5.0), 400, "frequency_penalty"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "Empty input messages"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages-not-list", CHAT, chat(messages="hi"), 400, "messages must be an array"),
    ("bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "wizard"),
    (
        "invalid-json-schema",
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            }
        ),
        400,
        "json schema",
    ),
    (
        "invalid-regex",
        CHAT,
        chat(response_format={"type": "regex", "regex": "[a-"}),
        400,
        "regex",
    ),
    (
        "json-object-without-json-word",
        CHAT,
        chat(response_format={"type": "json_object"}),
        400,
        "json",
    ),
    (
        "tool-choice-missing-tool",
        CHAT,
        chat(
            tools=[SCHEMA_TOOL],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            **NO_THINK,
        ),
        400,
        "nope",
    ),
    (
        "tool-choice-required-thinking",
        CHAT,
        chat(tools=[SCHEMA_TOOL], tool_choice="required"),
        400,
        "tool_choice",
    ),
    ("prompt-too-long", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "prompt"),
    ("body-too-large", CHAT, b"{" + b" " * (5 << 20) + b"}", 413, "limit"),
    ("msg-unknown-model", MSGS, msgs(model="claude-9"), 404, "claude-9"),
    ("msg-bad-role", MSGS, msgs(messages=[{"role": "robot", "content": "x"}]), 400, "robot"),
    ("msg-temperature", MSGS, msgs(temperature=-1), 400, "temperature"),
    ("msg-max-tokens-type", MSGS, msgs(max_tokens=[1]), 400, "max_tokens must be an integer"),
    (
        "resp-max-output-tokens",
        RESP,
        {"model": MODEL, "input": "hi", "max_output_tokens": 0},
        400,
        "max_output_tokens",
    ),  # fmt: skip
    ("cmpl-prompt-type", CMPL, cmpl(prompt=5), 400, "prompt"),
    ("cmpl-empty-prompt", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("cmpl-token-out-of-vocab", CMPL, cmpl(prompt=[0, 10**6]), 400, "vocab"),
    ("cmpl-logprobs-21", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    ("cmpl-max-tokens-over-context", CMPL, cmpl(max_tokens=10**6), 400, "max_tokens"),
    ("cmpl-unknown-model", CMPL, cmpl(model="nope"), 404, "nope"),
    ("cmpl-prompt-too-long", CMPL, cmpl(prompt=LONG), 400, "prompt"),
    ("cmpl-stream-streaming-error", CMPL, cmpl(stream=1), 400, "stream"),
    ("unknown-route", "/v1/nothing", {}, 404, "no route"),
    # a top_k >= 2**63 once failed the step of every stream on its rank
    ("top-k-2^63", CHAT, chat(top_k=2**63), 400, "top_k"),
    ("msg-top-k-2^63", MSGS, msgs(top_k=2**63), 400, "top_k"),
    ("cmpl-top-k-2^63", CMPL, cmpl(top_k=2**63), 400, "top_k"),
    ("cmpl-seed-2^64", CMPL, cmpl(seed=2**64), 400, "seed"),
    ("min-tokens-2^40", CHAT, chat(min_tokens=2**40), 400, "min_tokens"),
    # scoring prompts: echo, max_tokens 0, prompt_logprobs
    ("cmpl-echo-unknown-model", CMPL, cmpl(model="nope", echo=True, logprobs=1), 404, "nope"),
    ("cmpl-echo-logprobs-21", CMPL, cmpl(echo=True, logprobs=21, max_tokens=0), 400, "logprobs"),
    ("cmpl-max-tokens-negative", CMPL, cmpl(max_tokens=-1), 400, "max_tokens must be >= 0"),
    ("cmpl-prompt-logprobs-21", CMPL, cmpl(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("cmpl-plp-stream", CMPL, cmpl(prompt_logprobs=0, stream=True), 400, "prompt_logprobs"),
    ("cmpl-prompt-batch-of-2", CMPL, cmpl(prompt=[[1, 2], [3]]), 400, "one prompt"),
    ("plp-string", CHAT, chat(prompt_logprobs="2"), 400, "prompt_logprobs"),
    ("plp-stream", CHAT, chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    # a field a route does not take, or takes with other values only, is refused by name
    ("unknown-field", CHAT, chat(foo=1), 400, "unrecognized request argument supplied: foo"),
    ("template-kwargs-other-key", CHAT, chat(chat_template_kwargs={"enable_thinking": True}), 400,
     "chat_template_kwargs.enable_thinking"),
    ("template-kwargs-not-bool", CHAT, chat(chat_template_kwargs={"thinking": "yes"}), 400,
     "chat_template_kwargs.thinking must be a boolean"),
    ("template-kwargs-disagree", CHAT, chat(chat_template_kwargs={"thinking": True},
                                            thinking={"type": "disabled"}), 400, "differ"),
    ("msg-unknown-field", MSGS, msgs(foo=1), 400, "unrecognized request argument supplied: foo"),
    ("cmpl-unknown-field", CMPL, cmpl(foo=1), 400, "unrecognized request argument supplied: foo"),
    (
        "resp-unknown-field",
        RESP,
        {"model": MODEL, "input": "hi", "foo": 1},
        400,
        "unrecognized request argument supplied: foo",
    ),
    ("store-true", CHAT, chat(store=True), 400, "store: stored completions"),
    (
        "resp-previous-response",
        RESP,
        {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
        400,
        "previous_response_id",
    ),
    ("cmpl-suffix", CMPL, cmpl(suffix="end"), 400, "suffix"),
    (
        "msg-any-tool-thinking",
        MSGS,
        msgs(
            tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "any"}
        ),
        400,
        "tool_choice",
    ),
]
# case -> the field its 400 names (``param``; the Anthropic shape has none)
NAMED = {
    "unknown-field": "foo",
    "cmpl-unknown-field": "foo",
    "resp-unknown-field": "foo",
    "store-true": "store",
    "resp-previous-response": "previous_response_id",
    "cmpl-suffix": "suffix",
    "n-over-max": "n",
}
POST_ROUTES = (CHAT, MSGS, CMPL, RESP)


@pytest.fixture(scope="module")
def http(server):  # noqa: F811 (the imported fixture)
    with httpx.Client(base_url=server[0].url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(("path", "body", "status", "words"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_request(http, path, body, status, words):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()
    if path == MSGS:
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}
    message = err["error"]["message"]
    assert words.lower() in message.lower(), message
    assert http.get("/health").status_code == 200


def test_refused_fields_are_named(http):
    """A refused field is the error's ``param`` (OpenAI shape), so a client can tell which."""
    for case_id, path, body, _, _ in (c for c in CASES if c[0] in NAMED):
        err = http.post(path, json=body).json()["error"]
        assert err["param"] == NAMED[case_id], (case_id, err)


def test_every_post_route_has_bad_request_cases():
    """The table exercises each POST route with field-level errors, and each model-taking
    route with an unknown model (a route added without cases, or a table trimmed to one
    protocol, fails here)."""
    for route in POST_ROUTES:
        assert any(c[1] == route and c[3] == 400 for c in CASES), route
    assert {c[1] for c in CASES if c[3] == 404} >= {CHAT, MSGS, CMPL}


def test_streaming_request_errors_before_the_stream(http):
    body = chat(stream=True, response_format={"type": "regex", "regex": "(unclosed"}, **NO_THINK)
    r = http.post(CHAT, json=body)
    assert r.status_code == 400 and "regex" in r.json()["error"]["message"]
    r = http.post(MSGS, json=msgs(stream=True, model="x"))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_wrong_method_and_server_still_serves(http):
    r = http.get(CHAT)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    ok = http.post(CHAT, json=chat(**NO_THINK))
    assert ok.status_code == 200 and json.loads(ok.text)["choices"][0]["finish_reason"]
    assert http.get("/health").status_code == 200


def test_bad_requests_leave_running_streams_alone(server, http):  # noqa: F811
    """Bad requests (top_k >= 2**63 on every protocol) while 4 streams run on the same
    engine: each bad one gets its 400, every stream completes with all its tokens."""
    import asyncio

    srv, _ = server
    bodies = [(c[1], c[2]) for c in CASES if c[0].endswith("top-k-2^63")]
    assert len(bodies) == 3

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:

            async def stream(i: int) -> int:
                msg = [{"role": "user", "content": f"hi {i}"}]
                body = chat(max_tokens=24, stream=True, temperature=0, ignore_eos=True,
                            messages=msg, **NO_THINK)  # fmt: skip
                n = 0
                async with c.stream("POST", CHAT, json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            d = json.loads(line[6:])
                            n += bool(d["choices"] and d["choices"][0]["delta"].get("content"))
                            assert "error" not in d, d
                return n

            tasks = [asyncio.create_task(stream(i)) for i in range(4)]
            await asyncio.sleep(0.5)
            for path, body in bodies * 3:
                r = await c.post(path, json=body)
                assert r.status_code == 400 and "top_k" in r.text, r.text
            return await asyncio.gather(*tasks)

    counts = asyncio.run(main())
    assert all(n > 0 for n in counts), counts
    assert http.get("/health").status_code == 200
