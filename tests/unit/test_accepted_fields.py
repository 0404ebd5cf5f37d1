"""Every body field an HTTP endpoint accepts takes effect, or is refused with a 400 naming it.

The walk: for each endpoint and each field it accepts (``app.api.accepted`` for chat, responses
and messages; the pydantic body of ``/v1/completions``), a request with the field set (to a
value of :data:`PROBES`, beside the context it needs) is converted as the server converts it,
and its fingerprint (the engine request's prompt, sampling params and session key, the stream
and logprobs switches, and the events its answer to one canned engine output makes, with the
Responses object's echo of the request settings left out) must differ from the same request
without the field, or the conversion must raise a 400 naming the field. A field accepted only
with some values is probed with each: those are accepted, any other value is refused. The
labels (tags for the caller's records) are an explicit short list. A field added to a table
without a probe fails here."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from app.api.accepted import LABEL, Only, accepted
from app.api.completions import _ONLY, CompletionBody, CompletionsFrontend, parse_body
from app.api.errors import ApiError
from app.api.protocols import CHAT, MESSAGES, RESPONSES, RecipeFrontend, run_events
from app.engine.request import FinishReason, RequestOutput
from app.engine.validation import RequestLimits
from app.model.tokenizer import write_tiny_tokenizer

HI = [{"role": "user", "content": "hi"}]
NO_THINK = {"thinking": {"type": "disabled"}}  # a forced tool call needs thinking off
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
R_TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
M_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
SCHEMA = {"name": "x", "schema": {"type": "object"}}
BASES = {
    "chat": {"model": "m", "messages": HI},
    "responses": {"model": "m", "input": "hi"},
    "messages": {"model": "m", "messages": HI, "max_tokens": 5},
    "completions": {"model": "m", "prompt": "hi"},
}
# the sampling-field table's fields, on any endpoint that takes them
TABLE = {
    "temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "repetition_penalty": 1.1,
    "presence_penalty": 1.0, "frequency_penalty": 1.0, "logit_bias": {"5": 3}, "seed": 3,
    "max_tokens": 3, "min_tokens": 2, "ignore_eos": True, "stop": ["x"], "logprobs": 2,
    "prompt_logprobs": 1,
}  # fmt: skip
# endpoint -> field -> (value, context the value needs, set on both sides)
PROBES: dict[str, dict[str, tuple[Any, dict[str, Any]]]] = {
    "chat": {
        "model": ("m2", {}),
        "messages": ([{"role": "user", "content": "hello there"}], {}),
        "stream": (True, {}),
        "stream_options": ({"include_usage": True}, {"stream": True}),
        "max_completion_tokens": (3, {}),
        "stop": (["x"], {}),
        "logprobs": (True, {}),
        "top_logprobs": (2, {"logprobs": True}),
        "response_format": ({"type": "json_schema", "json_schema": SCHEMA}, {}),
        "tools": (TOOLS, {}),
        "tool_choice": ("required", {"tools": TOOLS, **NO_THINK}),
        "reasoning_effort": ("max", {}),
        "thinking": ({"type": "disabled"}, {}),
        "chat_template_kwargs": ({"thinking": False}, {}),
        "user": ("u", {}),
        "prompt_cache_key": ("k", {}),
        "n": (2, {}),
        "parallel_tool_calls": (False, {"tools": TOOLS}),
        "store": (True, {}),
        "service_tier": ("flex", {}),
        "audio": ({"voice": "alloy", "format": "wav"}, {}),
        "modalities": (["text", "audio"], {}),
        "prediction": ({"type": "content", "content": "x"}, {}),
        "functions": ([{"name": "f", "parameters": {}}], {}),
        "function_call": ("auto", {}),
        "verbosity": ("low", {}),
        "web_search_options": ({}, {}),
        "metadata": ({"a": "b"}, {}),
        "safety_identifier": ("s", {}),
    },
    "responses": {
        "model": ("m2", {}),
        "input": ("hello there", {}),
        "instructions": ("be brief", {}),
        "stream": (True, {}),
        "max_output_tokens": (3, {}),
        "reasoning": ({"effort": "max"}, {}),
        "text": ({"format": {"type": "json_schema", **SCHEMA}}, {}),
        "tools": (R_TOOLS, {}),
        "tool_choice": ("required", {"tools": R_TOOLS, "reasoning": {"effort": "none"}}),
        "top_logprobs": (2, {}),
        "user": ("u", {}),
        "prompt_cache_key": ("k", {}),
        "parallel_tool_calls": (False, {"tools": R_TOOLS}),
        "store": (True, {}),
        "service_tier": ("priority", {}),
        "background": (True, {}),
        "conversation": ("conv_1", {}),
        "previous_response_id": ("resp_1", {}),
        "prompt": ({"id": "pmpt_1"}, {}),
        "include": (["message.output_text.logprobs"], {}),
        "max_tool_calls": (2, {}),
        "truncation": ("auto", {}),
        "stream_options": ({"include_obfuscation": True}, {"stream": True}),
        "metadata": ({"a": "b"}, {}),
        "safety_identifier": ("s", {}),
    },  # fmt: skip
    "messages": {
        "model": ("m2", {}),
        "messages": ([{"role": "user", "content": "hello there"}], {}),
        "system": ("be brief", {}),
        "stop_sequences": (["x"], {}),
        "stream": (True, {}),
        "thinking": ({"type": "disabled"}, {}),
        "tool_choice": ({"type": "any"}, {"tools": M_TOOLS, **NO_THINK}),
        "tools": (M_TOOLS, {}),
        "metadata": ({"user_id": "u"}, {}),
        "output_config": ({"effort": "low"}, {}),
        "service_tier": ("priority", {}),
        "container": ("c", {}),
        "context_management": ({"edits": []}, {}),
        "mcp_servers": ([{"type": "url", "url": "http://x", "name": "n"}], {}),
    },  # fmt: skip
    "completions": {
        "model": ("m2", {}),
        "prompt": ("hello there", {}),
        "n": (2, {}),
        "stream": (True, {}),
        "stream_options": ({"include_usage": True}, {"stream": True}),
        "echo": (True, {}),
        "user": ("u", {}),
        "suffix": ("tail", {}),
        "best_of": (2, {}),
    },
}
LABELS = {"chat": {"metadata", "safety_identifier"},
          "responses": {"metadata", "safety_identifier"}, "messages": set()}  # fmt: skip
PROTOS = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}


@pytest.fixture(scope="module")
def fronts(tmp_path_factory) -> tuple[RecipeFrontend, CompletionsFrontend]:
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(d)
    args = (RequestLimits(512, 4096), 4000, 16)
    return (RecipeFrontend(["m", "m2"], "v41", str(d / "tokenizer.json"), *args),
            CompletionsFrontend(str(d / "tokenizer.json"), ["m", "m2"], *args))  # fmt: skip


class _Canned:
    """An engine stream of one finished delta: three tokens and EOS."""

    timed_out = False

    def __init__(self, rid: str, n_prompt: int) -> None:
        stop = FinishReason.STOP
        self.out = RequestOutput(rid, token_ids=[83, 84, 85, 1], finished=True,
                                 finish_reason=stop, num_prompt_tokens=n_prompt)  # fmt: skip

    async def __aiter__(self):
        yield self.out


_IDS = re.compile(r'"(id|created_at|created|completed_at|item_id)":("[^"]*"|\d+)')
_ECHO_KEEP = {"output", "usage", "status", "incomplete_details", "error"}


def _events(texts: list[str]) -> tuple[str, ...]:
    """Events without ids and times, and without the Responses object's echo of the request
    settings (an echo is not an effect)."""
    out = []
    for t in texts:
        t = re.sub(r"\b(chatcmpl-|resp_|msg_|fc_|call_|rs_|toolu_|cmpl-)[0-9a-f]+", "ID", t)
        t = _IDS.sub("", t)
        try:
            obj = json.loads(t)
        except json.JSONDecodeError:
            out.append(t)
            continue
        if isinstance(obj, dict) and isinstance(obj.get("response"), dict):
            obj["response"] = {k: v for k, v in obj["response"].items() if k in _ECHO_KEEP}
        out.append(json.dumps(obj, sort_keys=True))
    return tuple(out)


def fingerprint(fronts, endpoint: str, raw: dict[str, Any]) -> tuple:
    """What a converted request is: raises :class:`ApiError` as the server would."""
    recipe, cmpl = fronts
    if endpoint == "completions":
        body = parse_body(raw)
        req, rid = cmpl.prepare(body)
        stream = _Canned(req.request_id, len(req.prompt_token_ids))

        async def collect() -> list[str]:
            return [json.dumps(c) async for c in cmpl.events(body, req, rid, stream)]

        flags: tuple = (body.stream, body.stream_options)
    else:
        prep = recipe.prepare(PROTOS[endpoint], json.dumps(raw).encode(), raw)
        req = prep.engine_request
        usage = recipe.usage_fix(prep)
        stream = _Canned(req.request_id, len(req.prompt_token_ids))

        async def collect() -> list[str]:
            evs = run_events(prep, stream, recipe.stop_ids, usage)  # type: ignore[arg-type]
            return [usage.apply(ev.to_json()) async for ev in evs]

        flags = (prep.stream, prep.logprobs, prep.in_reasoning)
    return (req.prompt_token_ids, req.params, req.session, flags,
            _events(asyncio.run(collect())))  # fmt: skip


def fields_of(endpoint: str) -> dict[str, Any]:
    if endpoint == "completions":
        return {name: _ONLY.get(name) for name in CompletionBody.model_fields}
    return dict(accepted(endpoint))


CASES = [(e, f) for e in BASES for f in fields_of(e)]


@pytest.mark.parametrize(("endpoint", "name"), CASES, ids=[f"{e}-{f}" for e, f in CASES])
def test_an_accepted_field_takes_effect_or_is_refused(fronts, endpoint, name):
    rule = fields_of(endpoint)[name]
    value, context = PROBES[endpoint].get(name, (TABLE.get(name), {}))
    assert value is not None, f"{endpoint}.{name} has no probe"
    base = {**BASES[endpoint], **context}
    if rule == LABEL:
        assert name in LABELS[endpoint]
        assert fingerprint(fronts, endpoint, {**base, name: value})  # accepted
        return
    if isinstance(rule, Only):
        for ok in rule.values:  # the values that ask for what the server does anyway
            assert fingerprint(fronts, endpoint, {**base, name: ok}) == fingerprint(
                fronts, endpoint, base
            ), (name, ok)
    try:
        got = fingerprint(fronts, endpoint, {**base, name: value})
    except ApiError as e:
        assert e.status == 400 and e.param == name, (e.status, e.param, e.message)
        return
    assert not isinstance(rule, Only), f"{endpoint}.{name}={value!r} was not refused"
    assert got != fingerprint(fronts, endpoint, base), f"{endpoint}.{name} had no effect"


def test_every_probe_is_of_an_accepted_field():
    for endpoint, probes in PROBES.items():
        assert set(probes) <= set(fields_of(endpoint)), endpoint
    assert {e: {f for f, r in fields_of(e).items() if r == LABEL} for e in LABELS} == LABELS


@pytest.mark.parametrize("endpoint", list(BASES))
def test_an_unknown_field_is_refused_by_name(fronts, endpoint):
    known = {"chat": {"chat_template_kwargs"}}.get(endpoint, set())  # vLLM's thinking switch
    for name in {"foo", "chat_template_kwargs", "chat_template", "guided_json"} - known:
        with pytest.raises(ApiError) as e:
            fingerprint(fronts, endpoint, {**BASES[endpoint], name: 1})
        assert e.value.status == 400 and e.value.param == name
        assert "unrecognized request argument" in e.value.message
