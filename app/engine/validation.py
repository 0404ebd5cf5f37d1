"""Bounds of every request field, checked in one place: by the ingress before a request is
sent, and again by the engine (``EngineCore.add_request``), since a request that crossed a
process boundary was unpickled without running its constructor's checks.

    check_sampling(params)                          # context-free bounds (SamplingParams runs it)
    check_request(req, RequestLimits(vocab_size=..., max_model_len=...))   # + the model's limits

Whatever passes can be sampled, masked and stopped on without an error inside a step, so one
request can never fail the step that serves every other request of its rank. A violation raises
:class:`RequestError` naming the field (the API answers 400 with it as ``param``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.request import EngineRequest, SamplingParams

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256


class RequestError(ValueError):
    """A request parameter with an invalid value (``field`` names it)."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # picklable across the Ray boundary (two-argument constructor)
        return (type(self), (self.field, self.message))


@dataclass(frozen=True)
class RequestLimits:
    """What the serving model allows: token ids below ``vocab_size``, prompt + output within
    ``max_model_len`` positions."""

    vocab_size: int | None  # None: not known here (ids are checked by the engine)
    max_model_len: int


def check_int(name: str, v: object, lo: int, hi: int) -> None:
    """``v`` is an int (not a bool) in ``[lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(name, f"must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise RequestError(name, f"must be in [{lo}, {hi}], got {v}")


def check_float(name: str, v: object, lo: float, hi: float, lo_open: bool = False) -> None:
    """``v`` is a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(name, f"must be a finite number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise RequestError(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")


def check_bool(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise RequestError(name, f"must be a boolean, got {type(v).__name__}")


def check_token_ids(name: str, ids: object, max_len: int, vocab_size: int | None) -> None:
    """A non-empty list of ints in ``[0, vocab_size)`` (C-speed: a prompt may hold 10^6)."""
    if not isinstance(ids, tuple | list):
        raise RequestError(name, "must be a list of token ids")
    if len(ids) > max_len:
        raise RequestError(name, f"holds {len(ids)} ids; the limit is {max_len}")
    if not ids:
        return
    if not all(type(t) is int for t in ids):
        bad = next(t for t in ids if type(t) is not int)
        raise RequestError(name, f"token ids must be integers, got {bad!r}")
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise RequestError(name, f"token ids must be >= 0, got {lo}")
    if vocab_size is not None and hi >= vocab_size:
        raise RequestError(name, f"token id {hi} >= vocab size {vocab_size}")


def check_sampling(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Context-free bounds of every sampling field (plus token ids below ``vocab_size``)."""
    check_float("temperature", p.temperature, 0.0, 100.0)
    check_float("top_p", p.top_p, 0.0, 1.0, lo_open=True)
    check_int("top_k", p.top_k, -1, INT32_MAX)
    check_float("min_p", p.min_p, 0.0, 1.0)
    check_float("repetition_penalty", p.repetition_penalty, 0.0, 100.0, lo_open=True)
    check_float("presence_penalty", p.presence_penalty, -2.0, 2.0)
    check_float("frequency_penalty", p.frequency_penalty, -2.0, 2.0)
    if p.seed is not None:
        check_int("seed", p.seed, INT64_MIN, INT64_MAX)
    if p.max_tokens is not None:
        check_int("max_tokens", p.max_tokens, 1, INT32_MAX)
    check_int("min_tokens", p.min_tokens, 0, INT32_MAX)
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise RequestError("min_tokens", "must not exceed max_tokens")
    check_token_ids("stop_token_ids", p.stop_token_ids, MAX_STOP_TOKEN_IDS, vocab_size)
    if not isinstance(p.stop, tuple | list):
        raise RequestError("stop", "must be a list of strings")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise RequestError(
            "stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(p.stop)}"
        )
    for s in p.stop:
        if not isinstance(s, str) or not s:
            raise RequestError("stop", "stop sequences must be non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise RequestError("stop", f"a stop sequence is at most {MAX_STOP_CHARS} characters")
    top = MAX_TOP_LOGPROBS if vocab_size is None else min(MAX_TOP_LOGPROBS, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        v = getattr(p, name)
        if v is not None:
            check_int(name, v, 0, top)
    check_bool("ignore_eos", p.ignore_eos)
    check_bool("skip_special_tokens", p.skip_special_tokens)
    from app.engine.request import OutputConstraint

    if p.constraint is not None and not isinstance(p.constraint, OutputConstraint):
        raise RequestError("constraint", "must be an OutputConstraint")


def check_request_fields(req: EngineRequest, vocab_size: int | None = None) -> None:
    """The request's own fields: id, prompt token ids, priority (not its sampling params)."""
    rid = req.request_id
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID_CHARS:
        raise RequestError("request_id", f"must be a string of 1..{MAX_REQUEST_ID_CHARS} chars")
    check_token_ids("prompt_token_ids", req.prompt_token_ids, INT32_MAX, vocab_size)
    if not req.prompt_token_ids:
        raise RequestError("prompt_token_ids", "must not be empty")
    check_int("priority", req.priority, -(2**31), INT32_MAX)
    cid = req.client_request_id
    if not isinstance(cid, str) or len(cid) > MAX_REQUEST_ID_CHARS:
        raise RequestError(
            "request_id", f"a client request id is at most {MAX_REQUEST_ID_CHARS} chars"
        )
    from app.engine.request import SamplingParams

    if not isinstance(req.params, SamplingParams):
        raise RequestError("params", "must be SamplingParams")


def check_request(req: EngineRequest, limits: RequestLimits) -> None:
    """Everything :func:`check_request_fields` and :func:`check_sampling` check, against the
    model's vocabulary, and prompt + ``max_tokens`` within ``max_model_len``."""
    check_request_fields(req, limits.vocab_size)
    p = req.params
    check_sampling(p, limits.vocab_size)
    n, limit = len(req.prompt_token_ids), limits.max_model_len
    if n >= limit:
        raise RequestError(
            "prompt_token_ids", f"prompt of {n} tokens leaves no room under max_model_len {limit}"
        )
    if p.max_tokens is not None and n + p.max_tokens > limit:
        raise RequestError(
            "max_tokens",
            f"prompt ({n}) + max_tokens ({p.max_tokens}) exceeds max_model_len {limit}",
        )
