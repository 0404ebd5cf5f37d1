"""Chat Completions, Responses and Messages through deepseek-recipe.

    body --Request(body).convert(options)--> ConversationRequest
         --encoding.encode(conversation)-->  prompt token ids  --> EngineRequest
    deltas --InferenceChunk.ready/tokens/finish--> StreamProcessor --> protocol events

The ``ready`` chunk is pushed before the first token (the role / ``message_start`` event goes
out at once). The prefix-cache hit count is only known with the first delta, so usage in the
final events is corrected afterwards (:func:`patch_usage`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import deepseek_recipe as dr

from app.api.accepted import check_accepted
from app.api.client import EngineStream
from app.api.errors import ApiError, from_recipe_error
from app.api.limits import make_request
from app.engine.request import (
    EngineRequest,
    FinishReason,
    OutputConstraint,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    new_request_id,
)
from app.engine.validation import BODY, RECIPES, TYPED, RequestLimits, wire_fields

_VERSIONS = {"v41": dr.ModelVersion.DeepseekV41Flash, "v4": dr.ModelVersion.DeepseekV4Pro}
# Engine sampling fields a protocol reads from the raw body as is, beyond what the recipe
# extracts (the table's ``body`` endpoints, as vLLM / SGLang take them: e.g. ``ignore_eos``
# generates through EOS, ``min_tokens`` masks EOS / stop tokens until then).
_EXTRAS = {p: tuple(f.name for f in wire_fields(SamplingParams, p, BODY)) for p in RECIPES}

# Top-level field types checked before conversion, so a wrong type is reported by name (the
# recipe's parse errors do not say which field): name -> (accepted types, description). The
# protocol's own fields are listed here; the sampling fields it takes by name come from the
# table, typed by their kind.
_INT = ((int,), "an integer")
_BOOL = ((bool,), "a boolean")
_STR = ((str,), "a string")
_LIST = ((list,), "an array")
_OWN_FIELDS: dict[str, dict[str, tuple[tuple[type, ...], str]]] = {
    "chat": {
        "model": _STR,
        "stream": _BOOL,
        "messages": _LIST,
        "max_completion_tokens": _INT,
        "n": _INT,
        "logprobs": _BOOL,
        "top_logprobs": _INT,
        "parallel_tool_calls": _BOOL,
    },
    "responses": {
        "model": _STR,
        "stream": _BOOL,
        "max_output_tokens": _INT,
        "top_logprobs": _INT,
        "parallel_tool_calls": _BOOL,
    },
    "messages": {"model": _STR, "stream": _BOOL, "messages": _LIST},
}
_FIELDS = {
    p: {**own, **{f.name: f.spec.check.json for f in wire_fields(SamplingParams, p, BODY, TYPED)}}
    for p, own in _OWN_FIELDS.items()
}
_AT_LEAST_ONE = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n")


def session_key(raw: Mapping[str, Any]) -> str:
    """The router's session-affinity key: OpenAI ``prompt_cache_key`` (its key for grouping
    requests that share a prefix) or else ``user``, Anthropic ``metadata.user_id`` (a string
    of up to 256 characters; anything else is no key)."""
    key = raw.get("prompt_cache_key") or raw.get("user")
    meta = raw.get("metadata")
    if key is None and isinstance(meta, Mapping):
        key = meta.get("user_id")
    return key if isinstance(key, str) and len(key) <= 256 else ""


def check_fields(proto_name: str, raw: Mapping[str, Any]) -> None:
    """400 naming the field for a field the endpoint does not accept (``app.api.accepted``),
    a wrong JSON type or a count below 1."""
    check_accepted(proto_name, raw)
    for name, (types, what) in _FIELDS[proto_name].items():
        v = raw.get(name)
        if v is None:
            continue
        ok = isinstance(v, types) and (bool in types or not isinstance(v, bool))
        if not ok:
            got = type(v).__name__ if not isinstance(v, bool) else "boolean"
            raise ApiError(400, f"{name} must be {what}, got {got}", param=name)
        if name in _AT_LEAST_ONE and v < 1:
            raise ApiError(400, f"{name} must be >= 1, got {v}", param=name)
    if proto_name == "messages":
        _check_messages(raw)


def _check_messages(raw: Mapping[str, Any]) -> None:
    """What Anthropic's Messages API refuses and the recipe would accept: no ``max_tokens``,
    a ``system`` turn inside ``messages``."""
    if raw.get("max_tokens") is None:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    for i, m in enumerate(raw.get("messages") or ()):
        if isinstance(m, dict) and m.get("role") == "system":
            raise ApiError(
                400,
                f'messages.{i}.role: unexpected role "system"; the Messages API takes the '
                "system prompt as the top-level `system` field",
                param="messages",
            )


def parallel_tool_calls(proto_name: str, raw: Mapping[str, Any]) -> bool:
    """Whether one answer may make several tool calls (the recipe reads neither field):
    OpenAI ``parallel_tool_calls`` (default true), Anthropic
    ``tool_choice.disable_parallel_tool_use`` (default false)."""
    if proto_name == "messages":
        choice = raw.get("tool_choice")
        return not (isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use"))
    return raw.get("parallel_tool_calls") is not False


def _forces_a_tool(raw: Mapping[str, Any]) -> bool:
    """Anthropic ``tool_choice: {"type": "any"}``: the answer must call one of the tools."""
    choice = raw.get("tool_choice")
    return isinstance(choice, dict) and choice.get("type") == "any"


@dataclass(frozen=True)
class Protocol:
    """One recipe protocol: its request and response classes and response-id prefix."""

    name: str
    request_cls: Any
    response_cls: Any
    id_prefix: str


CHAT = Protocol("chat", dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl-")
RESPONSES = Protocol("responses", dr.ResponsesRequest, dr.ResponsesResponse, "resp_")
MESSAGES = Protocol("messages", dr.MessagesRequest, dr.MessagesResponse, "msg_")


@dataclass
class Prepared:
    """A converted request: the engine request plus what turns its deltas into events."""

    proto: Protocol
    engine_request: EngineRequest
    processors: list[dr.StreamProcessor]  # one per choice (chat's n)
    response_id: str  # the public id (x-request-id, the body's "id"), never an engine key
    model: str
    created: int
    stream: bool
    logprobs: bool
    in_reasoning: bool  # the answer starts inside reasoning content (thinking mode)
    # vLLM's prompt_logprobs (chat): the prompt tokens' logprobs as they come; None: not asked
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def processor(self) -> dr.StreamProcessor:
        """The processor of the (first) choice."""
        return self.processors[0]

    @property
    def n(self) -> int:
        return self.engine_request.params.n


def completion_tokens_as_max_tokens(body: bytes, raw: Mapping[str, Any]) -> bytes:
    """Chat's ``max_completion_tokens`` (OpenAI's name for ``max_tokens``, which the recipe
    reads) as ``max_tokens``: the body unchanged without it, a 400 when both are set and
    differ."""
    limit = raw.get("max_completion_tokens")
    if limit is None:
        return body
    other = raw.get("max_tokens")
    if other is not None and other != limit:
        raise ApiError(400, f"max_completion_tokens ({limit}) and max_tokens ({other}) differ: "
                            "send one of them", param="max_completion_tokens")  # fmt: skip
    return json.dumps({**raw, "max_tokens": limit}).encode()


def template_kwargs_as_thinking(body: bytes, raw: Mapping[str, Any]) -> bytes:
    """vLLM's / SGLang's ``chat_template_kwargs: {"thinking": bool}`` (how their clients turn
    DeepSeek's thinking on and off) as chat's ``thinking`` field; any other key, or a
    ``thinking`` field that says otherwise, gets a 400 naming it."""
    kwargs = raw.get("chat_template_kwargs")
    if kwargs is None:
        return body
    if not isinstance(kwargs, Mapping):
        raise ApiError(400, "chat_template_kwargs must be an object",
                       param="chat_template_kwargs")  # fmt: skip
    for key in kwargs:
        if key != "thinking":
            raise ApiError(400, f"chat_template_kwargs.{key}: not a template argument of this "
                                "model (it takes thinking: true / false)",
                           param="chat_template_kwargs")  # fmt: skip
    think = kwargs.get("thinking")
    if think is None:
        return body
    if not isinstance(think, bool):
        raise ApiError(400, "chat_template_kwargs.thinking must be a boolean",
                       param="chat_template_kwargs")  # fmt: skip
    mode = {"type": "enabled" if think else "disabled"}
    other = raw.get("thinking")
    if isinstance(other, Mapping) and other.get("type") not in (None, mode["type"]):
        raise ApiError(400, f"chat_template_kwargs.thinking ({think}) and thinking "
                            f"({other.get('type')}) differ: send one of them",
                       param="chat_template_kwargs")  # fmt: skip
    fields = {k: v for k, v in json.loads(body).items() if k != "chat_template_kwargs"}
    return json.dumps({**fields, "thinking": mode}).encode()


class RecipeFrontend:
    """Converts protocol bodies to engine requests for one served model."""

    def __init__(
        self,
        served_names: list[str],
        model_version: str,
        tokenizer_path: str,
        limits: RequestLimits,
        max_prompt_tokens: int,
        default_max_tokens: int | None,
    ) -> None:
        if model_version not in _VERSIONS:
            raise ValueError(f"model_version must be one of {sorted(_VERSIONS)}")
        version = _VERSIONS[model_version]
        self.served = list(served_names)
        self.options = dr.ConversionOptions().with_model_versions_by_name(
            {name: version for name in served_names}
        )
        self.tokenizer = dr.Tokenizer.from_file(tokenizer_path)
        enc = dr.DeepseekV41Encoding() if model_version == "v41" else dr.DeepseekV4Encoding()
        self.encoding = enc.with_tokenizer(self.tokenizer)
        self.limits = limits
        self.context_limit = limits.max_model_len
        self.max_prompt_tokens = max_prompt_tokens
        self.default_max_tokens = default_max_tokens
        eos = self.tokenizer.encode(dr.SpecialToken.Eos.default_str())
        self.stop_ids = frozenset(eos if len(eos) == 1 else ())
        end = self.tokenizer.encode(dr.SpecialToken.ThinkingEnd.default_str())
        self.think_end_id = end[0] if len(end) == 1 else None

    def set_limits(self, limits: RequestLimits, max_prompt_tokens: int) -> None:
        """Validate against new limits (the engines' lower context limit)."""
        self.limits, self.context_limit = limits, limits.max_model_len
        self.max_prompt_tokens = max_prompt_tokens

    def usage_fix(self, prep: Prepared) -> UsageFix:
        n = len(prep.engine_request.prompt_token_ids)
        return UsageFix(n, self.think_end_id if prep.in_reasoning else None)

    def prepare(self, proto: Protocol, body: bytes, raw: Mapping[str, Any]) -> Prepared:
        """Validate and convert; raises :class:`ApiError` saying what was wrong."""
        check_fields(proto.name, raw)
        if proto is CHAT:
            body = completion_tokens_as_max_tokens(body, raw)
            body = template_kwargs_as_thinking(body, raw)
            if raw.get("n") not in (None, 1):  # the recipe converts one choice; the engine
                body = json.dumps({**json.loads(body), "n": 1}).encode()  # forks n
        try:
            request = proto.request_cls(body)
            model = request.model
        except (dr.ConversionError, ValueError, TypeError) as e:
            raise from_recipe_error(e) from None
        if model not in self.served:
            raise ApiError(
                404,
                f"model {model!r} does not exist; served models: {', '.join(self.served)}",
                param="model",
                code="model_not_found",
            )
        echo = request.echo() if proto is RESPONSES else None
        try:
            conv = request.convert(self.options)
        except (dr.ConversionError, ValueError, TypeError) as e:
            raise from_recipe_error(e) from None
        conversation = conv.conversation
        if any(m.image_sources for m in conversation.messages):
            raise ApiError(400, "images are not supported by this server", param="messages")
        try:
            ids = self.encoding.encode(conversation)
        except (RuntimeError, ValueError) as e:
            raise ApiError(400, f"the conversation could not be encoded: {e}") from None
        n = len(ids)
        if n > self.max_prompt_tokens:
            raise ApiError(
                400,
                f"prompt is {n} tokens; the limit is {self.max_prompt_tokens}",
                param="messages",
                code="context_length_exceeded",
            )
        if conv.stream and raw.get("prompt_logprobs") is not None:  # as vLLM
            raise ApiError(400, "prompt_logprobs is not available with stream",
                           param="prompt_logprobs")  # fmt: skip
        io = conv.inference_options
        try:
            max_tokens = conv.resolve_max_tokens(n, self.context_limit)
        except (dr.ConversionError, ValueError, TypeError) as e:
            err = from_recipe_error(e)
            code = "context_length_exceeded"
            raise ApiError(400, err.message, param="max_tokens", code=code) from None
        if io.max_tokens is None and self.default_max_tokens is not None:
            max_tokens = min(max_tokens, self.default_max_tokens)
        parsing = conv.parsing_options
        stage = parsing.thinking_initial_stage
        rid = f"{proto.id_prefix}{uuid.uuid4().hex}"  # the response's id (public)
        sampling = self._sampling(proto, conv, raw, max_tokens, list(parsing.stop_sequences))
        engine_request = make_request(
            new_request_id(), ids, sampling, self.limits, arrival_time=time.time(),
            session=session_key(raw),
        )  # fmt: skip
        processors = []
        for _ in range(engine_request.params.n):
            gen = proto.request_cls.chunk_generator(conv, rid, model)
            if echo is not None:
                gen = gen.with_echo(echo)
            processors.append(dr.StreamProcessor(gen, parsing, self.tokenizer))
        return Prepared(
            proto=proto,
            engine_request=engine_request,
            processors=processors,
            response_id=rid,
            model=model,
            created=int(time.time()),
            stream=conv.stream,
            logprobs=io.logprobs,
            in_reasoning=stage is not None and stage.starts_in_reasoning(),
            prompt_logprobs=None if engine_request.params.prompt_logprobs is None else [],
        )

    @staticmethod
    def _sampling(
        proto: Protocol,
        conv: dr.ConversationRequest,
        raw: Mapping[str, Any],
        max_tokens: int,
        stop: list[str],
    ) -> dict[str, Any]:
        """The SamplingParams fields of a converted request (unset ones keep the table's
        defaults)."""
        io = conv.inference_options
        constraint = None
        if (oc := io.output_constraint) is not None:
            think = conv.conversation.thinking_mode
            kind = oc.kind
            if proto is MESSAGES and kind == "tool_call" and _forces_a_tool(raw):
                if think:  # as chat's tool_choice "required"
                    msg = 'tool_choice: thinking mode does not support {"type": "any"}'
                    raise ApiError(400, msg, param="tool_choice")
                kind = "tool_call_required"  # the recipe converts "any" as "auto"
            parallel = parallel_tool_calls(proto.name, raw) if kind.startswith("tool") else True
            constraint = OutputConstraint(kind, oc.schema, think_first=think,
                                          parallel_calls=parallel)  # fmt: skip
        # the recipe's resolution for the model and mode (thinking: temperature 1.0) is the
        # default; a temperature / top_p the body sets is taken as sent (below)
        recipe = {"temperature": io.temperature, "top_p": io.top_p}
        return {
            **{k: v for k, v in recipe.items() if v is not None},
            "seed": io.seed,
            "max_tokens": max_tokens,
            "stop": tuple(stop),
            "logprobs": (io.top_logprobs or 0) if io.logprobs else None,
            "constraint": constraint,
            **{k: raw[k] for k in _EXTRAS[proto.name] if raw.get(k) is not None},
        }


def finish_reason(out: RequestOutput) -> dr.InferenceFinishReason:
    if out.finish_reason is FinishReason.LENGTH:
        return dr.InferenceFinishReason.Length
    if out.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"the engine failed: {out.error or 'unknown error'}", code="engine")
    if out.finish_reason is FinishReason.ABORT:
        raise ApiError(503, "the engine aborted the request", code="aborted")
    return dr.InferenceFinishReason.Stop


def tokens_chunk(
    out: RequestOutput, stop_ids: frozenset[int], logprobs: bool
) -> dr.InferenceChunk | None:
    """The delta's tokens without EOS / stop tokens (the processor does not strip them)."""
    keep = [i for i, t in enumerate(out.token_ids) if t not in stop_ids]
    if not keep:
        return None
    ids = [out.token_ids[i] for i in keep]
    if not logprobs or out.logprobs is None or len(out.logprobs) != len(out.token_ids):
        return dr.InferenceChunk.tokens(ids)
    lps = [(out.logprobs[i].logprob, list(out.logprobs[i].top)) for i in keep]
    return dr.InferenceChunk.tokens(ids, lps)


class UsageFix:
    """Usage numbers from the engine rather than the recipe: the prompt-cache hit count (only
    known with the deltas, after the ``ready`` event went out), the generated token count and
    the reasoning token count (generated tokens before ``</think>``); the recipe re-counts
    decoded text, which drops leading newlines and over-counts broken UTF-8."""

    def __init__(self, prompt_tokens: int, think_end_id: int | None) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached = 0
        self.generated = 0
        self.reasoning: int | None = None if think_end_id is None else 0
        self._think_end = think_end_id

    def count(self, out: RequestOutput) -> None:
        self.cached = max(self.cached, out.num_cached_tokens)
        self.generated += len(out.token_ids)
        if self._think_end is None:
            return
        if self._think_end in out.token_ids:
            assert self.reasoning is not None
            self.reasoning += out.token_ids.index(self._think_end)
            self._think_end = None
        else:
            self.reasoning = (self.reasoning or 0) + len(out.token_ids)

    def apply(self, text: str) -> str:
        if '"usage"' not in text:
            return text
        return compact_json(patch_usage(json.loads(text), self))


def compact_json(obj: Any) -> str:
    """``obj`` as the responses' JSON: UTF-8 kept, no spaces."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def chat_logprobs_present(obj: dict) -> dict:
    """A non-streamed chat response (parsed, changed in place) whose request asked for
    logprobs carries a ``logprobs`` object in every choice, as OpenAI's does: ``{"content":
    []}`` when no generated token reached the content (all of them stop tokens kept by
    ``ignore_eos``; the recipe leaves ``null`` there)."""
    for c in obj.get("choices", []):
        if c.get("logprobs") is None:
            c["logprobs"] = {"content": [], "refusal": None}
    return obj


def patch_usage(obj: Any, fix: UsageFix) -> Any:
    """Set the token counts of every usage object in ``obj`` (in place): Chat
    ``completion_tokens``, ``prompt_cache_hit/miss_tokens`` and the ``*_details``; Responses
    ``output_tokens`` and the ``*_details``; Messages ``output_tokens`` and
    ``cache_read_input_tokens`` (its ``input_tokens`` counts the uncached prompt tokens)."""
    prompt_tokens, cached, reasoning = fix.prompt_tokens, fix.cached, fix.reasoning
    if isinstance(obj, list):
        for v in obj:
            patch_usage(v, fix)
    elif isinstance(obj, dict):
        for key in ("completion_tokens", "output_tokens"):
            if key in obj:
                obj[key] = fix.generated
        if "total_tokens" in obj:
            obj["total_tokens"] = prompt_tokens + fix.generated
        if "prompt_cache_hit_tokens" in obj:
            obj["prompt_cache_hit_tokens"] = cached
            obj["prompt_cache_miss_tokens"] = prompt_tokens - cached
        for key in ("prompt_tokens_details", "input_tokens_details"):
            if isinstance(obj.get(key), dict):
                obj[key]["cached_tokens"] = cached
        for key in ("completion_tokens_details", "output_tokens_details"):
            if reasoning is not None and isinstance(obj.get(key), dict):
                obj[key]["reasoning_tokens"] = reasoning
        if "cache_read_input_tokens" in obj:
            obj["cache_read_input_tokens"] = cached
            obj["input_tokens"] = prompt_tokens - cached
        for v in obj.values():
            if isinstance(v, dict | list):
                patch_usage(v, fix)
    return obj


async def run_events(
    prep: Prepared, stream: EngineStream, stop_ids: frozenset[int], usage: UsageFix
) -> AsyncIterator[Any]:
    """Protocol events of one request; raises :class:`ApiError` if the engine fails."""
    proc = prep.processor
    ready = dr.PromptUsage(prompt_tokens=usage.prompt_tokens, prompt_cache_hit_tokens=0)
    for ev in proc.push(dr.InferenceChunk.ready(prompt_usage=ready)):
        yield ev
    finish = dr.InferenceFinishReason.Stop
    async for out in stream:
        usage.count(out)
        if prep.prompt_logprobs is not None:
            prep.prompt_logprobs += out.prompt_logprobs or []
        chunk = tokens_chunk(out, stop_ids, prep.logprobs)
        if chunk is not None:
            for ev in proc.push(chunk):
                yield ev
        if proc.finished:  # a stop sequence ended the answer: stop the engine too
            return
        if out.finished:
            finish = finish_reason(out)
    if stream.timed_out:
        finish = dr.InferenceFinishReason.Length
    for ev in proc.push(dr.InferenceChunk.finish(finish)):
        yield ev
    for ev in proc.finish():
        yield ev
