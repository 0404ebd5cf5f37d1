"""The body fields each recipe endpoint (chat, responses, messages) accepts, and what each does.

A field that is not in its endpoint's table gets a 400 naming it ("unrecognized request
argument", as OpenAI's and Anthropic's APIs answer): nothing a client sends is dropped without
a word. A field in the table takes effect, or (:class:`Only`) is accepted only with the values
that describe what this server does anyway and refused, naming it, with any other:

    TAKEN       the recipe converts it, ``app.api.protocols`` reads it, or it is a field of the
                sampling-field table (``SamplingParams``: added from there, not listed here)
    Only(...)   e.g. ``store``: ``false`` is accepted (nothing is stored), ``true`` gets a 400
    LABEL       a tag for the caller's records (``metadata``, ``safety_identifier``): by the
                API's own definition it changes neither the output nor the response

``null`` always means "unset". ``/v1/completions`` declares its fields in its pydantic body
(``app.api.completions``: unknown fields are refused the same way). A test walks every table
and checks that each field changes the engine request or the response, or is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.api.errors import ApiError
from app.engine.request import SamplingParams
from app.engine.validation import BODY, TYPED, wire_fields


@dataclass(frozen=True)
class Only:
    """Accepted only with ``values`` (what the server does anyway); ``why`` says what any
    other value asks for that is not served."""

    values: tuple[Any, ...]
    why: str

    def check(self, name: str, v: Any) -> None:
        if v is not None and v not in self.values:
            raise ApiError(400, f"{name}: {self.why}", param=name)


TAKEN = "taken"
LABEL = "label"
Rule = str | Only


def _taken(names: str) -> dict[str, Rule]:
    return dict.fromkeys(names.split(), TAKEN)


_STORE = Only((False,), "stored completions are not supported (send store: false or omit it)")
_TIER = Only(("auto", "default"), "this server has one service tier (auto / default)")

# The protocols' own fields (the sampling-field table's fields are added by ``accepted``).
_OWN: dict[str, dict[str, Rule]] = {
    "chat": {
        **_taken(
            "model messages stream stream_options max_completion_tokens stop logprobs "
            "top_logprobs response_format tools tool_choice reasoning_effort thinking user "
            "prompt_cache_key parallel_tool_calls chat_template_kwargs"
        ),
        "store": _STORE,
        "service_tier": _TIER,
        "audio": Only((), "audio output is not supported"),
        "modalities": Only((["text"],), 'only ["text"] output is supported'),
        "prediction": Only((), "predicted outputs are not supported"),
        "functions": Only((), "deprecated: send tools"),
        "function_call": Only((), "deprecated: send tool_choice"),
        "verbosity": Only((), "not supported: ask for brevity in the messages"),
        "web_search_options": Only((), "web search is not supported"),
        "metadata": LABEL,
        "safety_identifier": LABEL,
    },
    "responses": {
        **_taken(
            "model input instructions stream max_output_tokens reasoning text tools "
            "tool_choice top_logprobs user prompt_cache_key parallel_tool_calls"
        ),
        "store": _STORE,
        "service_tier": _TIER,
        "background": Only((False,), "background responses are not supported"),
        "conversation": Only((), "stored conversations are not supported: send the input"),
        "previous_response_id": Only((), "stored responses are not supported: send the input"),
        "prompt": Only((), "stored prompt templates are not supported"),
        "include": Only(
            ([], ["reasoning.encrypted_content"]),
            "only reasoning.encrypted_content (always present) can be included",
        ),
        "max_tool_calls": Only((), "built-in tools are not supported"),
        "truncation": Only(("disabled",), "a prompt over the context is refused, not truncated"),
        "stream_options": Only(
            ({"include_obfuscation": False},), "stream obfuscation is not supported"
        ),
        "metadata": LABEL,
        "safety_identifier": LABEL,
    },
    "messages": {
        **_taken(
            "model messages system stop_sequences stream thinking tool_choice tools metadata "
            "output_config"
        ),
        "service_tier": Only(("auto", "standard_only"), "this server has one service tier"),
        "container": Only((), "containers are not supported"),
        "context_management": Only((), "server-side context management is not supported"),
        "mcp_servers": Only(([],), "MCP servers are not supported"),
    },
}


@functools.cache
def accepted(proto_name: str) -> Mapping[str, Rule]:
    """Every body field ``proto_name`` accepts: its own, then the sampling-field table's
    fields it takes by name."""
    table = {f.name: TAKEN for f in wire_fields(SamplingParams, proto_name, BODY, TYPED)}
    return {**_OWN[proto_name], **table}


def check_accepted(proto_name: str, raw: Mapping[str, Any]) -> None:
    """400 naming the first field ``proto_name`` does not accept, or accepts with other
    values only."""
    rules = accepted(proto_name)
    for name, v in raw.items():
        rule = rules.get(name)
        if rule is None:
            raise ApiError(400, f"unrecognized request argument supplied: {name}", param=name)
        if isinstance(rule, Only):
            rule.check(name, v)
