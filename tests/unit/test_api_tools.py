"""Tool calls and structured output through the real HTTP front door and a real tiny engine,
with the model steered toward scripted answers (``tests.support.steering``): with
``tool_choice: "auto"`` and non-strict tools the DSML call syntax is grammar-constrained once
the model opens a call, so ``content`` never carries DSML and arguments always parse (the
peers' failure: DSML in content when guidance is off for auto); streamed arguments arrive
token by token, never with DSML in them (the peers': one burst at the end, or markup in the
arguments); ``parallel_tool_calls: false`` allows one call; with thinking on,
``response_format`` JSON lands in ``content``, not in the reasoning."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import anthropic
import deepseek_recipe as dr
import httpx
import pytest

from app.engine.tool_grammar import DSML
from app.model.tokenizer import EOS, SPECIAL_TOKENS
from tests.support.steering import Script, steered
from tests.unit.test_api import MODEL, NO_THINK, engine, oai, server  # noqa: F401 (fixtures)

jsonschema = pytest.importorskip("jsonschema")

EOS_ID, THINK_END_ID = SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index("</think>")
LT, SLASH = "<", "/"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLS = [
    {"city": "Paris and the whole Ile-de-France region", "days": 3},
    {"city": "Rome"},
]
ASK = [{"role": "user", "content": "Weather in Paris and Rome?"}]
TEXT = "Let me check."
THOUGHT = "I should look it up."


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer  # the tiny checkpoint's tokenizer


def rendered(content: str, calls: Sequence[dict[str, Any]]) -> str:
    """The assistant answer deepseek-recipe renders for ``content`` and ``calls`` (V4.1,
    thinking off): the text a model trained on this format emits."""
    tool_calls = [dr.ToolCall(f"c{i}", "get_weather", json.dumps(a)) for i, a in enumerate(calls)]
    answer = dr.AssistantMessage(content, tool_calls=tool_calls)
    conv = dr.Conversation([dr.UserMessage("hi"), answer], thinking_mode=False)
    prompt = dr.DeepseekV41Encoding().render_conversation(conv).prompt
    return prompt.split("<｜Assistant｜></think>")[1].split(EOS)[0]


def closing(tok) -> Callable[[Sequence[int]], dict[int, float]]:
    """Fallback once a request left its script (the grammar refused a scripted token): end
    the answer (EOS) where the grammar allows it, else close what is open: ``<``, ``/``,
    then the DSML token."""
    lt, slash, dsml = tok.token_to_id(LT), tok.token_to_id(SLASH), tok.token_to_id(DSML)

    def bias(out: Sequence[int]) -> dict[int, float]:
        nxt = {lt: slash, slash: dsml if out[-2:-1] == [lt] else lt}.get(out[-1], lt) if out else lt
        return {EOS_ID: 30.0, nxt: 20.0}  # the tiny model: |logit| < 5

    return bias


def script(tok, text: str, thought: str | None = None) -> Script:
    ids = tok.encode(text).ids
    if thought is not None:
        ids = [*tok.encode(thought).ids, THINK_END_ID, *ids]
    return Script([*ids, EOS_ID], fallback=closing(tok))


def thinking(on: bool) -> dict[str, Any]:
    return {} if on else NO_THINK


def has_dsml(text: str | None) -> bool:
    """The DSML marker, as the special token's text or spelled out, is in ``text``."""
    return DSML in (text or "")


def recipe_parse(tok, tokens: list[int], tools: list[dict]) -> dict[str, Any]:
    """What deepseek-recipe's parser makes of ``tokens`` (thinking off, tool_choice auto):
    the reply the front door would send had the grammar let the model emit them."""
    body = {"model": MODEL, "messages": ASK, "tools": tools, **NO_THINK}
    v41 = {MODEL: dr.ModelVersion.DeepseekV41Flash}
    opts = dr.ConversionOptions().with_model_versions_by_name(v41)
    conv = dr.ChatCompletionRequest(body).convert(opts)
    gen = dr.ChatCompletionRequest.chunk_generator(conv, "id", MODEL)
    sp = dr.StreamProcessor(gen, conv.parsing_options, dr.Tokenizer.from_str(tok.to_str()))
    resp = dr.ChatCompletionResponse("id", MODEL, 0, 1, 0)
    for chunk in (dr.InferenceChunk.ready(), dr.InferenceChunk.tokens(tokens),
                  dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)):  # fmt: skip
        for ev in sp.push(chunk):
            resp.accumulate(ev)
    for ev in sp.finish():
        resp.accumulate(ev)
    return json.loads(resp.to_json())["choices"][0]["message"]


def valid_calls(calls: list[Any] | None) -> bool:
    """Every call names a declared tool and its arguments parse and follow its schema."""
    for call in calls or ():
        fn = call["function"] if isinstance(call, dict) else call.function.model_dump()
        if fn["name"] != "get_weather":
            return False
        try:
            jsonschema.validate(json.loads(fn["arguments"]), WEATHER)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
    return True


@pytest.mark.parametrize("think", [False, True], ids=["no-think", "think"])
def test_auto_tool_calls_are_grammar_constrained(oai, server, tok, think):  # noqa: F811
    """Non-strict tools, tool_choice auto: the engine gets the tool-call grammar, and the
    scripted text + two calls come back as content and two parsed calls."""
    spy = server[1]
    with steered(script(tok, rendered(TEXT, CALLS), THOUGHT if think else None)):
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=400,
            temperature=0, extra_body=thinking(think),
        )  # fmt: skip
    constraint = spy.requests[-1].params.constraint
    assert constraint is not None and constraint.kind == "tool_call"
    assert constraint.parallel_calls and constraint.think_first == think
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TEXT
    assert choice.message.model_extra.get("reasoning_content") == (THOUGHT if think else None)
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == CALLS


# Malformed DSML a model may write; each one, let through, reaches the client as DSML in
# content or as arguments that break the tool's schema (checked on the recipe's parser).
MALFORMED = {
    # the DSML token without the "<" of its tag
    "no-lt": lambda: rendered(TEXT, CALLS[:1]).replace("<｜DSML｜ calls>", "｜DSML｜ calls>"),
    # a tool that was not declared
    "unknown-tool": lambda: rendered(TEXT, CALLS[:1]).replace("get_weather", "get_wether"),
    # a raw string for an integer parameter
    "string-for-integer": lambda: rendered(TEXT, CALLS[:1]).replace(
        'string="false">3<', 'string="true">three days<'
    ),
    # a parameter the tool does not have
    "unknown-parameter": lambda: rendered(TEXT, CALLS[:1]).replace('name="days"', 'name="when"'),
    # the DSML tag spelled in plain text, not the special token
    "plain-text-tag": lambda: TEXT + "\n\n<｜DS" + "ML｜ calls>",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_auto_grammar_keeps_malformed_dsml_out(oai, tok, case):  # noqa: F811
    text = MALFORMED[case]()
    if case == "plain-text-tag":  # the plain spelling, byte tokens (no special token)
        head, tail = text.split("｜DS")
        ids = [*tok.encode(head).ids, *tok.encode("｜DS").ids, *tok.encode(tail).ids]
        steer = Script([*ids, EOS_ID], fallback=closing(tok))
    else:
        ids = tok.encode(text).ids
        steer = script(tok, text)
    unguarded = recipe_parse(tok, ids, TOOLS)
    assert has_dsml(unguarded["content"]) or not valid_calls(unguarded["tool_calls"]), unguarded
    with steered(steer):
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=400, temperature=0,
            extra_body=NO_THINK,
        )  # fmt: skip
    msg = r.choices[0].message
    assert not has_dsml(msg.content), msg.content
    assert valid_calls(msg.tool_calls), msg.tool_calls
    assert r.choices[0].finish_reason == ("tool_calls" if msg.tool_calls else "stop")


def stream_chat(oai, **kw: Any) -> Iterator[Any]:  # noqa: F811
    return oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True,
                                       temperature=0, max_tokens=400, **kw)  # fmt: skip


@pytest.mark.parametrize("think", [False, True], ids=["no-think", "think"])
def test_streamed_arguments_arrive_token_by_token(oai, tok, think):  # noqa: F811
    """Each call's arguments come in many deltas as the tokens are generated (one per value
    token at least, never one burst), none with DSML in it; joined, they are the arguments."""
    with steered(script(tok, rendered(TEXT, CALLS), THOUGHT if think else None)):
        chunks = list(stream_chat(oai, extra_body=thinking(think)))
    content, reasoning, parts = [], [], {}
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content.append(d.content or "")
        reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
        for tc in d.tool_calls or ():
            parts.setdefault(tc.index, []).append(tc.function.arguments or "")
    assert "".join(content) == TEXT and not any(has_dsml(c) for c in content)
    assert "".join(reasoning) == (THOUGHT if think else "")
    assert sorted(parts) == [0, 1]
    for i, expected in enumerate(CALLS):
        frags = [p for p in parts[i] if p]
        assert not any("DSML" in p or "<" in p for p in frags), frags
        assert json.loads("".join(frags)) == expected
        value_tokens = len(tok.encode(expected["city"]).ids)
        assert len(frags) >= value_tokens, f"arguments in {len(frags)} deltas: {frags}"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_messages_stream_input_json_deltas(server, tok):  # noqa: F811
    """Anthropic Messages: the tool_use input streams as many input_json_delta events."""
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    client = anthropic.Anthropic(base_url=server[0].url, api_key="unused", max_retries=0)
    with steered(script(tok, rendered(TEXT, CALLS[:1]))), client.messages.stream(
        model=MODEL, max_tokens=400, messages=ASK, tools=tools, thinking={"type": "disabled"},
        extra_body={"temperature": 0},
    ) as s:  # fmt: skip
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]  # fmt: skip
    assert len([d for d in deltas if d]) >= len(tok.encode(CALLS[0]["city"]).ids)
    assert not any(has_dsml(d) for d in deltas)
    assert json.loads("".join(deltas)) == CALLS[0]
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == TEXT and final.stop_reason == "tool_use"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(oai, server, tok, parallel):  # noqa: F811
    """The model tries two calls: ``parallel_tool_calls: false`` closes the block after the
    first (the grammar), true lets both through."""
    with steered(script(tok, rendered(TEXT, CALLS))):
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=parallel,
            max_tokens=400, temperature=0, extra_body=NO_THINK,
        )  # fmt: skip
    assert server[1].requests[-1].params.constraint.parallel_calls is parallel
    calls = [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls]
    assert calls == (CALLS if parallel else CALLS[:1])
    assert r.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_on_responses_and_messages(server, tok):  # noqa: F811
    srv, spy = server
    ask = "Weather in Paris and Rome?"
    rtools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    with steered(script(tok, rendered(TEXT, CALLS))), httpx.Client(base_url=srv.url) as http:
        body = {"model": MODEL, "input": ask, "tools": rtools, "temperature": 0,
                "parallel_tool_calls": False, "max_output_tokens": 400,
                "reasoning": {"effort": "none"}}  # fmt: skip
        resp = http.post("/v1/responses", json=body, timeout=120)
        assert spy.requests[-1].params.constraint.parallel_calls is False
        body = {"model": MODEL, "max_tokens": 400, "temperature": 0,
                "messages": [{"role": "user", "content": ask}], **NO_THINK,
                "tools": [{"name": "get_weather", "input_schema": WEATHER}],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}  # fmt: skip
        msg = http.post("/v1/messages", json=body, timeout=120)
        assert spy.requests[-1].params.constraint.parallel_calls is False
    calls = [o for o in resp.json()["output"] if o["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == CALLS[:1]
    uses = [b for b in msg.json()["content"] if b["type"] == "tool_use"]
    assert [u["input"] for u in uses] == CALLS[:1]


def test_parallel_tool_calls_wrong_type_is_named(server):  # noqa: F811
    with httpx.Client(base_url=server[0].url) as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "hi",
                                             "parallel_tool_calls": "no"})  # fmt: skip
    assert r.status_code == 400
    assert "parallel_tool_calls must be a boolean" in r.json()["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
ANSWER = {"n": 2, "ok": True}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_response_format_json_in_content_with_thinking(oai, server, tok, stream):  # noqa: F811
    """Thinking on: the reasoning runs free, then the JSON answer follows the schema and
    arrives in ``content``, the reasoning in ``reasoning_content`` (none of the JSON)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    with steered(script(tok, json.dumps(ANSWER), THOUGHT)):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt,
                                        max_tokens=200, temperature=0, stream=stream)  # fmt: skip
        if stream:
            deltas = [c.choices[0].delta for c in r if c.choices]
            content = "".join(d.content or "" for d in deltas)
            reasoning = "".join((d.model_extra or {}).get("reasoning_content") or ""
                                for d in deltas)  # fmt: skip
        else:
            content = r.choices[0].message.content
            reasoning = r.choices[0].message.model_extra.get("reasoning_content")
    assert server[1].requests[-1].params.constraint.think_first
    assert json.loads(content) == ANSWER
    assert reasoning == THOUGHT
