"""Requests and outputs of the engine: plain typed, picklable objects (they cross the Ray
boundary into a DP rank). Invalid values fail at construction with a message naming the field.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Literal

from app.engine.validation import (
    MAX_TOP_LOGPROBS,
    RequestError,
    check_request_fields,
    check_sampling,
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
    ``</think>``, then the constraint applies.
    """

    kind: ConstraintKind
    spec: str = ""
    think_first: bool = False

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise RequestError("constraint.kind", f"must be one of {CONSTRAINT_KINDS}")
        if not isinstance(self.spec, str):
            raise RequestError("constraint.spec", "must be a string")
        if self.kind in ("regex", "grammar") and not self.spec:
            raise RequestError("constraint.spec", f"a {self.kind} constraint needs a pattern")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1``
    and ``min_p == 0`` disable those filters. ``logprobs``: None = none, 0 = the chosen token's,
    k = also the top k (<= 20). ``max_tokens`` None = up to the context limit."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    constraint: OutputConstraint | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_sampling(self)

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

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; FCFS within a priority
    extra_key: str = ""  # prefix-cache namespace (model / adapter / salt)
    arrival_time: float = 0.0
    trace_context: dict[str, str] | None = None
    client_request_id: str = ""
    session: str = ""  # session-affinity key for the router (the OpenAI ``user``), "" = none

    def __post_init__(self) -> None:
        check_request_fields(self)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a chosen token and the top alternatives ``[(id, logprob), ...]``."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A request's state after a step (streamed as deltas, or accumulated for the offline API).

    ``token_ids`` are new tokens of this delta (all tokens when accumulated); ``text`` is
    filled by the offline API and the ingress, which own the tokenizer.
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

    @property
    def engine_failed(self) -> bool:
        """Ended by a failed engine step (not by anything about this request): retriable."""
        return self.finish_reason is FinishReason.ERROR and (self.error or "").startswith(
            ENGINE_FAILED
        )

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by ``later`` of the same request, as one delta (streams batch
        the deltas that pile up while the previous one is in flight)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge deltas of {self.request_id!r} and {later.request_id!r}")
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = [*(logprobs or []), *later.logprobs]
        return RequestOutput(
            self.request_id,
            token_ids=[*self.token_ids, *later.token_ids],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
            num_cached_tokens=later.num_cached_tokens or self.num_cached_tokens,
            text=self.text + later.text,
            error=later.error,
            handoff=later.handoff,
        )
