"""``/v1/completions``: a plain text prompt or a list of token ids, no chat template.

The body is parsed with pydantic (strict types; the sampling fields and their defaults come
from the sampling-field table, their bounds are checked by the request validator); text is
detokenized incrementally, holding back an incomplete UTF-8 sequence and, while stop strings
are set, the tail that could still become one (the engine stops on the string; the text is cut
before it).

Scoring a prompt, as evaluation harnesses do: ``echo`` puts the prompt's text before the
completion and, with ``logprobs``, its tokens' logprobs before the generated ones (the first
prompt token has none); ``max_tokens: 0`` generates nothing (the engine samples one token,
which is dropped); vLLM's ``prompt_logprobs`` adds the prompt tokens' logprobs with ranks to the
choice (not with ``stream``, as in vLLM). A prompt may come as a batch of one (a list holding
one string or one list of ids), as clients that batch send it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from tokenizers import Tokenizer

from app.api.accepted import Only
from app.api.client import EngineStream
from app.api.errors import ApiError
from app.api.limits import make_request
from app.api.logprobs import legacy_logprobs, prompt_logprobs
from app.engine.request import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenLogprob,
    new_request_id,
)
from app.engine.validation import (
    BODY,
    COMPLETIONS,
    Bias,
    FieldSpec,
    RequestLimits,
    Stops,
    wire_fields,
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _Body(BaseModel):
    """The endpoint's own fields. Any other field gets a 400 naming it, as on the recipe
    endpoints (``app.api.accepted``); ``suffix`` is accepted only as null (:data:`_ONLY`),
    ``best_of`` only equal to ``n`` (the choices are all returned)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    user: str | None = None
    suffix: str | None = None
    best_of: int | None = None


_ONLY = {"suffix": Only((), "insertion (text after the completion) is not supported")}


def _number(x: float) -> float:
    return int(x) if float(x).is_integer() else x


def _wire(f: FieldSpec) -> tuple[Any, Any]:
    """A table field as a body field: its JSON type and default. A list of stop strings may
    be one string, or null for none; logit biases an object, or null for none; null is
    accepted where the engine's value may be None; an HTTP-only bound (``http_max``) is the
    one bound checked here."""
    check, s = f.spec.check, f.spec
    if isinstance(check, Stops):
        return str | list[str] | None, None
    if isinstance(check, Bias):  # token id -> bias (null: none), converted by make_request
        return dict | None, None
    kind: Any = check.py
    if s.http_max is not None:
        lo = _number(check.lo)
        low = {"gt": lo} if getattr(check, "lo_open", False) else {"ge": lo}
        kind = Annotated[kind, Field(**low, le=_number(s.http_max))]
    return (kind | None if s.optional else kind), f.default


_SAMPLING = wire_fields(SamplingParams, COMPLETIONS, BODY)
# The accepted fields: the endpoint's own, then the sampling fields it takes.
CompletionBody = create_model(
    "CompletionBody", __base__=_Body, **{f.name: _wire(f) for f in _SAMPLING}
)


def parse_body(raw: Mapping[str, Any]) -> CompletionBody:
    try:
        body = CompletionBody.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not isinstance(p, int) or p == 0)
        param = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            raise ApiError(400, f"unrecognized request argument supplied: {loc}",
                           param=param) from None  # fmt: skip
        raise ApiError(400, f"{loc}: {err['msg']}", param=param) from None
    for name, rule in _ONLY.items():
        rule.check(name, getattr(body, name))
    if body.best_of is not None and body.best_of != body.n:  # n choices, all returned
        raise ApiError(400, f"best_of: only best_of = n ({body.n}) is supported", param="best_of")
    if isinstance(body.prompt, list) and isinstance(body.prompt[0], str | list):
        if len(body.prompt) > 1:
            raise ApiError(400, f"prompt: a batch of {len(body.prompt)} prompts; this server "
                                "takes one prompt per request", param="prompt")  # fmt: skip
        body.prompt = body.prompt[0]
    if body.max_tokens is not None and body.max_tokens < 0:
        raise ApiError(400, f"max_tokens must be >= 0, got {body.max_tokens}", param="max_tokens")
    if body.stream and body.prompt_logprobs is not None:
        raise ApiError(400, "prompt_logprobs is not available with stream: use echo with "
                            "logprobs", param="prompt_logprobs")  # fmt: skip
    if body.n > 1 and (body.echo or body.prompt_logprobs is not None):
        raise ApiError(400, "n > 1 is not available with echo or prompt_logprobs (score the "
                            "prompt once, with n = 1)", param="n")  # fmt: skip
    return body


def prompt_top(body: CompletionBody) -> int | None:
    """The top alternatives the engine computes for each prompt token: the larger of
    ``prompt_logprobs`` and, with ``echo``, ``logprobs``; None: no prompt logprobs."""
    ks = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(ks, default=None)


@dataclass
class Detokenizer:
    """Incremental text of a growing token list (see module docstring)."""

    tokenizer: Tokenizer
    stop: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters already emitted

    def push(self, ids: list[int], final: bool, stop_hit: str | None) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if stop_hit is not None and stop_hit in text:
            text, final = text[: text.index(stop_hit)], True
        if not final:
            if text.endswith("\ufffd"):
                text = text[:-1]
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(text) - hold, self.sent)]
        new, self.sent = text[self.sent :], max(self.sent, len(text))
        return new


@dataclass
class _Choice:
    """One choice's stream state: its text so far, its finish reason, its text offset."""

    detok: Detokenizer
    finish: str | None = None
    offset: int = 0


class CompletionsFrontend:
    """Builds engine requests and OpenAI ``text_completion`` objects."""

    def __init__(
        self,
        tokenizer_path: str,
        served: list[str],
        limits: RequestLimits,
        max_prompt: int,
        default_max_tokens: int | None = None,
    ) -> None:
        self.tokenizer = Tokenizer.from_file(tokenizer_path)
        self.served = served
        self.limits = limits
        self.context_limit = limits.max_model_len
        self.default_max_tokens = default_max_tokens
        self.max_prompt = max_prompt
        self.bos = self.tokenizer.token_to_id("<｜begin▁of▁sentence｜>")

    def set_limits(self, limits: RequestLimits, max_prompt: int) -> None:
        """Validate against new limits (the engines' lower context limit)."""
        self.limits, self.context_limit, self.max_prompt = limits, limits.max_model_len, max_prompt

    def prepare(self, body: CompletionBody) -> tuple[EngineRequest, str]:
        """The engine request (internal id) and the response's public ``cmpl-`` id."""
        if body.model not in self.served:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; served models: {', '.join(self.served)}",
                param="model",
                code="model_not_found",
            )
        if isinstance(body.prompt, str):
            # encode_batch releases the GIL (encode holds it: 4.7 s for a 4 MB prompt, during
            # which no other request was served)
            ids = self.tokenizer.encode_batch([body.prompt], add_special_tokens=False)[0].ids
            ids = ([self.bos] if self.bos is not None else []) + ids
        else:
            ids = body.prompt
        n = len(ids)
        if n > self.max_prompt:
            raise ApiError(
                400, f"prompt is {n} tokens; the limit is {self.max_prompt}", param="prompt",
                code="context_length_exceeded",
            )
        room = self.context_limit - n
        max_tokens = body.max_tokens
        if max_tokens is None:  # null: the context left, capped by api.default_max_tokens
            max_tokens = (
                room if self.default_max_tokens is None else min(room, self.default_max_tokens)
            )
        if max_tokens > room:
            raise ApiError(
                400,
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context limit "
                f"{self.context_limit}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        sampling = {f.name: getattr(body, f.name) for f in _SAMPLING}
        # max_tokens 0 (the prompt scored only): one token is sampled and dropped
        sampling |= {"max_tokens": max(max_tokens, 1), "stop": stop,
                     "prompt_logprobs": prompt_top(body)}  # fmt: skip
        session = body.user if body.user is not None and len(body.user) <= 256 else ""
        req = make_request(
            new_request_id(), ids, sampling, self.limits, arrival_time=time.time(),
            session=session,
        )  # fmt: skip
        return req, f"cmpl-{uuid.uuid4().hex}"

    def _echo(
        self, body: CompletionBody, req: EngineRequest, plp: list[TokenLogprob | None]
    ) -> dict[str, Any]:
        """The choice of the echoed prompt: its text (a text prompt as sent, ids decoded) and,
        with ``logprobs``, its tokens' (those known: all but after a timeout)."""
        ids = list(req.prompt_token_ids)
        if isinstance(body.prompt, str):
            text = body.prompt
        else:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        lps = None
        if body.logprobs is not None:
            n = len(plp)
            lps = legacy_logprobs(self.tokenizer, ids[:n], plp, body.logprobs, 0)
        return {"index": 0, "text": text, "finish_reason": None, "logprobs": lps}

    async def events(
        self, body: CompletionBody, req: EngineRequest, rid: str, stream: EngineStream
    ) -> AsyncIterator[dict[str, Any]]:
        """``text_completion`` chunks with id ``rid``: with ``echo`` the echoed prompt first;
        each choice's last chunk has its ``finish_reason`` (and, when asked,
        ``prompt_logprobs``); with ``n`` > 1 the choices' chunks interleave, each with its
        ``index``; then the usage: the prompt once, the choices' tokens summed."""
        created = int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
        choices = [_Choice(Detokenizer(self.tokenizer, req.params.stop))
                   for _ in range(req.params.n)]  # fmt: skip
        n_prompt = len(req.prompt_token_ids)
        plp: list[TokenLogprob | None] = []  # the prompt tokens' logprobs, as they come
        echo = body.echo  # the echo is still to be sent (n = 1 only)
        generate = body.max_tokens != 0
        n_out, cached = 0, 0

        def done(choice: dict[str, Any]) -> dict[str, Any]:
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(
                    self.tokenizer, plp, body.prompt_logprobs
                )
            return choice

        async for out in stream:
            cached = max(cached, out.num_cached_tokens)
            plp += out.prompt_logprobs or []
            tokens, lps = (out.token_ids, out.logprobs) if generate else ([], None)
            n_out += len(tokens)
            c = choices[out.index]
            ended = out.finish_reason is not None  # the choice's last delta
            if ended:
                if out.finish_reason is FinishReason.ERROR:
                    raise ApiError(500, f"the engine failed: {out.error}", code="engine")
                if out.finish_reason is FinishReason.ABORT:
                    raise ApiError(503, "the engine aborted the request", code="aborted")
                c.finish = out.finish_reason.value if generate else FinishReason.LENGTH.value
            if echo and (body.logprobs is None or len(plp) >= n_prompt or ended):
                echoed = self._echo(body, req, plp)
                c.offset, echo = len(echoed["text"]), False
                yield {**head, "choices": [echoed]}
            stop_hit = out.stop_reason if isinstance(out.stop_reason, str) else None
            text = c.detok.push(tokens, ended, stop_hit)
            if not (text or ended or (body.logprobs is not None and tokens)):
                continue
            choice: dict[str, Any] = {"index": out.index, "text": text, "finish_reason": c.finish,
                                      "logprobs": None}  # fmt: skip
            if body.logprobs is not None:
                ids = [lp.token_id for lp in lps or ()]
                choice["logprobs"] = legacy_logprobs(
                    self.tokenizer, ids, lps or [], body.logprobs, c.offset
                )
            c.offset += len(text)
            yield {**head, "choices": [done(choice) if ended else choice]}
        if echo:  # timed out before the prompt's logprobs came
            yield {**head, "choices": [self._echo(body, req, plp)]}
        for i, c in enumerate(choices):
            if c.finish is None:  # timed out
                last = {"index": i, "text": c.detok.push([], True, None),
                        "finish_reason": "length", "logprobs": None}  # fmt: skip
                yield {**head, "choices": [done(last)]}
        yield {
            "usage": {
                "prompt_tokens": n_prompt,
                "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out,
                "prompt_tokens_details": {"cached_tokens": cached},
                "prompt_cache_hit_tokens": cached,
                "prompt_cache_miss_tokens": n_prompt - cached,
            }
        }


def accumulate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-streaming ``text_completion`` object from the streamed chunks (its choices in
    ``index`` order)."""
    head = next(c for c in chunks if "choices" in c)
    by_index: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for ch in c.get("choices", []):
            choice = by_index.setdefault(
                ch["index"],
                {"index": ch["index"], "text": "", "finish_reason": None, "logprobs": None},
            )
            choice["text"] += ch["text"]
            choice["finish_reason"] = ch["finish_reason"] or choice["finish_reason"]
            if ch["logprobs"] is not None:
                acc = choice["logprobs"] or {k: [] for k in ch["logprobs"]}
                for k, v in ch["logprobs"].items():
                    acc[k] += v
                choice["logprobs"] = acc
            if "prompt_logprobs" in ch:
                choice["prompt_logprobs"] = ch["prompt_logprobs"]
    usage = next((c["usage"] for c in chunks if "usage" in c), None)
    return {
        **{k: head[k] for k in ("id", "object", "created", "model")},
        "choices": [by_index[i] for i in sorted(by_index)],
        "usage": usage,
    }
