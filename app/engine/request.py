"""Requests and outputs of the engine: plain typed, picklable objects (they cross the Ray
boundary into a DP rank). Each request field declares its bounds in its metadata
(``app.engine.validation``); invalid values fail at construction with a message naming the
field.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Literal

from app.engine.validation import (
    CHAT,
    COMPLETIONS,
    GRPC,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_BOUND,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MESSAGES,
    RECIPES,
    RESPONSES,
    Bias,
    Bool,
    Float,
    Instance,
    Int,
    RequestError,
    Stops,
    Text,
    TokenIds,
    check_fields,
    spec,
)

__all__ = [
    "ENGINE_FAILED",
    "MAX_TOP_LOGPROBS",
    "EngineRequest",
    "FinishReason",
    "OutputConstraint",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
    "new_request_id",
]

ConstraintKind = Literal["json", "regex", "grammar", "tool_call", "tool_call_required"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json", "regex", "grammar", "tool_call", "tool_call_required")


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must match (deepseek-recipe's kinds plus Lark grammars).

    ``json``: ``spec`` is a JSON schema (compact JSON; "" = any JSON value); ``regex``: a regular
    expression; ``grammar``: a Lark (EBNF-style) grammar; ``tool_call`` /
    ``tool_call_required``: a JSON array of function tools, the output is free text or
    (required: must be) DeepSeek DSML tool calls. ``think_first``: reasoning runs free until
    ``</think>``, then the constraint applies. ``parallel_calls`` (tool kinds only): False
    allows one call per answer (OpenAI ``parallel_tool_calls: false``).
    """

    kind: ConstraintKind
    spec: str = ""
    think_first: bool = False
    parallel_calls: bool = True

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise RequestError("constraint.kind", f"must be one of {CONSTRAINT_KINDS}")
        if not isinstance(self.spec, str):
            raise RequestError("constraint.spec", "must be a string")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise RequestError("constraint.spec", f"a {self.kind} constraint needs a pattern")
        if not self.parallel_calls and not self.kind.startswith("tool_call"):
            raise RequestError("constraint.parallel_calls", "applies to tool-call constraints only")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1``
    and ``min_p == 0`` disable those filters. ``logit_bias``: ``(token id, bias)`` pairs, each
    bias added to its token's logit (after the penalties, before the grammar mask).
    ``logprobs``: None = none, 0 = the chosen token's, k = also the top k (<= 20).
    ``max_tokens`` None = up to the context limit. ``n``: independent choices of one prompt
    (prefilled once; choice i samples with seed + i: ``app.engine.fork``).

    The sampling-field table: each field declares here, once, its type, default, bounds and
    which endpoints take it (``spec``: ``body`` = a body / SamplingOptions field of the same
    name, ``typed`` = the recipe converts the same-named body field, ``recipe`` = the recipe
    derives it from the protocol's own fields). The validator, the HTTP models, the recipe
    protocols' type table and the gRPC mapping derive from it; a unit test holds the proto's
    SamplingOptions to it."""

    temperature: float = field(
        default=1.0,
        metadata=spec(Float(0.0, 100.0), http_max=2.0, body=(*RECIPES, COMPLETIONS, GRPC)),
    )
    top_p: float = field(
        default=1.0,
        metadata=spec(Float(0.0, 1.0, lo_open=True), body=(*RECIPES, COMPLETIONS, GRPC)),
    )
    top_k: int = field(
        default=0, metadata=spec(Int(-1, INT32_MAX), body=(CHAT, MESSAGES, COMPLETIONS, GRPC))
    )
    min_p: float = field(
        default=0.0, metadata=spec(Float(0.0, 1.0), body=(CHAT, COMPLETIONS, GRPC))
    )
    repetition_penalty: float = field(
        default=1.0,
        metadata=spec(Float(0.0, 100.0, lo_open=True), body=(CHAT, COMPLETIONS, GRPC)),
    )
    presence_penalty: float = field(
        default=0.0, metadata=spec(Float(-2.0, 2.0), body=(CHAT, COMPLETIONS, GRPC))
    )
    frequency_penalty: float = field(
        default=0.0, metadata=spec(Float(-2.0, 2.0), body=(CHAT, COMPLETIONS, GRPC))
    )
    logit_bias: tuple[tuple[int, float], ...] = field(
        default=(),
        metadata=spec(Bias(MAX_LOGIT_BIAS, LOGIT_BIAS_BOUND), body=(CHAT, COMPLETIONS, GRPC)),
    )
    seed: int | None = field(
        default=None,
        metadata=spec(
            Int(INT64_MIN, INT64_MAX), optional=True, typed=(CHAT,), body=(COMPLETIONS, GRPC)
        ),
    )
    max_tokens: int | None = field(
        default=16,
        metadata=spec(
            Int(1, INT32_MAX),
            optional=True,
            typed=(CHAT, MESSAGES),
            recipe=(RESPONSES,),
            body=(COMPLETIONS, GRPC),
        ),
    )
    min_tokens: int = field(
        default=0, metadata=spec(Int(0, INT32_MAX), at_most="max_tokens", body=RECIPES)
    )
    stop_token_ids: tuple[int, ...] = field(
        default=(), metadata=spec(TokenIds(MAX_STOP_TOKEN_IDS), body=(GRPC,))
    )
    stop: tuple[str, ...] = field(
        default=(),
        metadata=spec(
            Stops(MAX_STOP_SEQUENCES, MAX_STOP_CHARS), recipe=RECIPES, body=(COMPLETIONS, GRPC)
        ),
    )
    logprobs: int | None = field(
        default=None,
        metadata=spec(
            Int(0, MAX_TOP_LOGPROBS, below_vocab=True),
            optional=True,
            recipe=(CHAT, RESPONSES),
            body=(COMPLETIONS,),
        ),
    )
    prompt_logprobs: int | None = field(
        default=None,
        metadata=spec(
            Int(0, MAX_TOP_LOGPROBS, below_vocab=True), optional=True, body=(CHAT, COMPLETIONS)
        ),
    )
    ignore_eos: bool = field(
        default=False, metadata=spec(Bool(), body=(*RECIPES, COMPLETIONS, GRPC))
    )
    n: int = field(default=1, metadata=spec(Int(1, MAX_N), body=(CHAT, COMPLETIONS)))
    constraint: OutputConstraint | None = field(
        default=None, metadata=spec(Instance(OutputConstraint), optional=True, recipe=RECIPES)
    )
    skip_special_tokens: bool = field(default=True, metadata=spec(Bool()))

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


ENGINE_FAILED = "the engine step failed"  # the error of every request a failed step ended


class FinishReason(enum.StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. client disconnect)
    ERROR = "error"  # failed; ``RequestOutput.error`` says why
    # a prefill rank handed the request to a decode rank after its first token
    # (``RequestOutput.handoff``); never a client-visible reason
    HANDOFF = "handoff"


def new_request_id() -> str:
    """A fresh internal request id: the only key a request is known by inside the server."""
    return f"req-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class EngineRequest:
    """One generation request for a DP rank. ``request_id`` is the server's own key
    (:func:`new_request_id` in serving: never a value a client chose, so no client can name
    another's request); ``client_request_id`` is what the client called it (logs, spans)."""

    request_id: str = field(metadata=spec(Text(1, MAX_REQUEST_ID_CHARS)))
    prompt_token_ids: tuple[int, ...] = field(metadata=spec(TokenIds(INT32_MAX, nonempty=True)))
    params: SamplingParams = field(
        default_factory=SamplingParams, metadata=spec(Instance(SamplingParams))
    )
    priority: int = field(  # lower runs first; FCFS within a priority
        default=0, metadata=spec(Int(-(2**31), INT32_MAX))
    )
    extra_key: str = ""  # prefix-cache namespace (model / adapter / salt)
    arrival_time: float = 0.0
    trace_context: dict[str, str] | None = None
    client_request_id: str = field(  # errors name it as the client knows it
        default="", metadata=spec(Text(0, MAX_REQUEST_ID_CHARS), param="request_id")
    )
    session: str = ""  # session-affinity key for the router (the OpenAI ``user``), "" = none

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token and the top alternatives ``[(id, logprob), ...]``
    (most likely first); ``rank``: the token's rank in the vocabulary (1 = most likely; set
    for prompt tokens)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass
class RequestOutput:
    """A request's state after a step (streamed as deltas, or accumulated for the offline API).

    ``token_ids`` are new tokens of this delta (all tokens when accumulated); ``text`` is
    filled by the offline API and the ingress, which own the tokenizer. With ``n`` > 1 each
    delta is one choice's (``index``): ``finish_reason`` is set on a choice's last delta,
    ``finished`` on the request's (its last choice's); with ``n`` = 1 they come together.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    text: str = ""
    error: str | None = None
    # finish reason HANDOFF: the request's decode state (app.engine.handoff.DecodeState in
    # the engine, a transport parcel across Ray; None when the export failed)
    handoff: object | None = None
    index: int = 0  # the choice this delta belongs to (n > 1)

    @property
    def engine_failed(self) -> bool:
        """Ended by a failed engine step (not by anything about this request): retriable."""
        return self.finish_reason is FinishReason.ERROR and (self.error or "").startswith(
            ENGINE_FAILED
        )

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by ``later`` of the same request, as one delta (streams batch
        the deltas that pile up while the previous one is in flight)."""
        if (later.request_id, later.index) != (self.request_id, self.index):
            raise ValueError(f"cannot merge deltas of {self.request_id!r} #{self.index} and "
                             f"{later.request_id!r} #{later.index}")  # fmt: skip
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or []), *later.logprobs]
        prompt_logprobs = self.prompt_logprobs  # a long prompt's come with each prefill chunk
        if later.prompt_logprobs is not None:
            prompt_logprobs = [*(prompt_logprobs or []), *later.prompt_logprobs]
        return RequestOutput(
            self.request_id,
            token_ids=[*self.token_ids, *later.token_ids],
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
            num_cached_tokens=later.num_cached_tokens or self.num_cached_tokens,
            text=self.text + later.text,
            error=later.error,
            handoff=later.handoff,
            index=self.index,
        )
