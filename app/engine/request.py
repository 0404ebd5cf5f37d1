"""Requests and outputs of the engine: plain typed, picklable objects (they cross the Ray
boundary into a DP rank). Invalid values fail at construction with a message naming the field.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

ConstraintKind = Literal["json", "regex", "grammar", "tool_call", "tool_call_required"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json", "regex", "grammar", "tool_call", "tool_call_required")
MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    """A request parameter with an invalid value (``field`` names it)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # picklable across the Ray boundary (two-argument constructor)
        return (type(self), (self.field, self.message))


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


def _check_int(name: str, v: object, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(name, f"must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RequestError(name, f"must be {rng}, got {v}")


def _check_float(name: str, v: object, lo: float, hi: float | None = None,
                 lo_open: bool = False) -> None:  # fmt: skip
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(name, f"must be a finite number, got {v!r}")
    bad_lo = v <= lo if lo_open else v < lo
    if bad_lo or (hi is not None and v > hi):
        left = "(" if lo_open else "["
        rng = f"{left}{lo}, {hi}]" if hi is not None else f"{'>' if lo_open else '>='} {lo}"
        raise RequestError(name, f"must be in {rng}, got {v}")


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
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError("min_tokens", "must not exceed max_tokens")
        if not isinstance(self.stop_token_ids, tuple | list):
            raise RequestError("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0)
        if not isinstance(self.stop, tuple | list):
            raise RequestError("stop", "must be a list of strings")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop", "stop sequences must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _check_int(name, v, 0, MAX_TOP_LOGPROBS)
        if self.constraint is not None and not isinstance(self.constraint, OutputConstraint):
            raise RequestError("constraint", "must be an OutputConstraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(enum.StrEnum):
    """Why a request stopped producing tokens."""

    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. client disconnect)
    ERROR = "error"  # failed; ``RequestOutput.error`` says why


@dataclass(frozen=True)
class EngineRequest:
    """One generation request for a DP rank."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first; FCFS within a priority
    extra_key: str = ""  # prefix-cache namespace (model / adapter / salt)
    arrival_time: float = 0.0
    trace_context: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError("request_id", "must be a non-empty string")
        if not isinstance(self.prompt_token_ids, tuple | list):
            raise RequestError("prompt_token_ids", "must be a list of token ids")
        if not self.prompt_token_ids:
            raise RequestError("prompt_token_ids", "must not be empty")
        for t in self.prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise RequestError("prompt_token_ids", f"token ids must be ints >= 0, got {t!r}")
        if not isinstance(self.params, SamplingParams):
            raise RequestError("params", "must be SamplingParams")
        _check_int("priority", self.priority, -(2**31), 2**31 - 1)


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
