"""The request validator. Each request field declares its bounds once, as a :class:`Spec` in its
dataclass field's metadata (``SamplingParams`` holds the sampling-field table, which also says
which endpoints take each field); the checks walk those fields.

    SamplingParams(top_k=2**63)       # a constructor refuses a value outside its field's bounds
    check_request(req, RequestLimits(vocab_size=..., max_model_len=...))   # the validator

:func:`check_request` runs twice per request: at the ingress before it is sent
(``app.api.limits.make_request``) and in the engine (``EngineCore.new_sequence``), since a
request that crossed a process boundary was unpickled without running its constructor's checks.
Whatever passes can be sampled, masked and stopped on without an error inside a step, so one
request can never fail the step that serves every other request of its rank. A violation
raises :class:`RequestError` naming the field (the API answers 400 with it as ``param``).

Plain Python: the engine imports this module, and the GPU machine has no pydantic (the API
builds its pydantic models from the table).
"""

from __future__ import annotations

import functools
import math
import re
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_N = 128  # choices of one request (OpenAI's bound; ``api.max_n`` sets the served one)
LOGIT_BIAS_BOUND = 100.0  # a bias is in [-100, 100] (OpenAI's range)

# Where a sampling field can come from: the endpoints, and how each takes it.
CHAT, RESPONSES, MESSAGES = "chat", "responses", "messages"
COMPLETIONS, GRPC = "completions", "grpc"
RECIPES = (CHAT, RESPONSES, MESSAGES)  # the protocols converted by deepseek-recipe
BODY = "body"  # a body (gRPC: SamplingOptions) field of the same name, taken as is
TYPED = "typed"  # the recipe converts a body field of the same name (its JSON type checked first)
RECIPE = "recipe"  # the recipe derives it from the protocol's own fields


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
    ``max_model_len`` positions, at most ``max_n`` choices (None: the table's bound)."""

    vocab_size: int | None  # None: not known here (ids are checked by the engine)
    max_model_len: int
    max_n: int | None = None


def _finite(v: object) -> bool:
    """A finite number (an int of any size, not a bool; a float that is not inf / nan)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, int) or math.isfinite(v)


# ---- value kinds: each checks one value (``name`` is the field the error names) --------------
@dataclass(frozen=True)
class Int:
    """An int (not a bool) in ``[lo, hi]``; ``hi`` at most the vocabulary size with
    ``below_vocab`` (a count of alternatives)."""

    lo: int
    hi: int
    below_vocab: bool = False
    py: ClassVar[type] = int
    json: ClassVar[tuple[tuple[type, ...], str]] = ((int,), "an integer")

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        hi = self.hi if vocab_size is None or not self.below_vocab else min(self.hi, vocab_size)
        if isinstance(v, bool) or not isinstance(v, int):
            raise RequestError(name, f"must be an integer, got {type(v).__name__}")
        if not self.lo <= v <= hi:
            raise RequestError(name, f"must be in [{self.lo}, {hi}], got {v}")


@dataclass(frozen=True)
class Float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    lo: float
    hi: float
    lo_open: bool = False
    py: ClassVar[type] = float
    json: ClassVar[tuple[tuple[type, ...], str]] = ((int, float), "a number")

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not _finite(v):
            raise RequestError(name, f"must be a finite number, got {v!r}")
        if (v <= self.lo if self.lo_open else v < self.lo) or v > self.hi:
            bracket = "(" if self.lo_open else "["
            raise RequestError(name, f"must be in {bracket}{self.lo}, {self.hi}], got {v}")


@dataclass(frozen=True)
class Bool:
    py: ClassVar[type] = bool
    json: ClassVar[tuple[tuple[type, ...], str]] = ((bool,), "a boolean")

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not isinstance(v, bool):
            raise RequestError(name, f"must be a boolean, got {type(v).__name__}")


@dataclass(frozen=True)
class Text:
    """A string of ``lo..hi`` characters."""

    lo: int
    hi: int

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not isinstance(v, str) or not self.lo <= len(v) <= self.hi:
            what = f"{self.lo}..{self.hi}" if self.lo else f"at most {self.hi}"
            raise RequestError(name, f"must be a string of {what} chars")


@dataclass(frozen=True)
class TokenIds:
    """A list of at most ``max_len`` ints in ``[0, vocab_size)``, non-empty with ``nonempty``
    (C-speed: a prompt may hold 10^6)."""

    max_len: int
    nonempty: bool = False

    def __call__(self, name: str, ids: object, vocab_size: int | None) -> None:
        if not isinstance(ids, tuple | list):
            raise RequestError(name, "must be a list of token ids")
        if len(ids) > self.max_len:
            raise RequestError(name, f"holds {len(ids)} ids; the limit is {self.max_len}")
        if ids:
            if not all(type(t) is int for t in ids):
                bad = next(t for t in ids if type(t) is not int)
                raise RequestError(name, f"token ids must be integers, got {bad!r}")
            lo, hi = min(ids), max(ids)
            if lo < 0:
                raise RequestError(name, f"token ids must be >= 0, got {lo}")
            if vocab_size is not None and hi >= vocab_size:
                raise RequestError(name, f"token id {hi} >= vocab size {vocab_size}")
        elif self.nonempty:
            raise RequestError(name, "must not be empty")


@dataclass(frozen=True)
class Stops:
    """At most ``max_items`` non-empty stop strings of at most ``max_chars`` characters."""

    max_items: int
    max_chars: int

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not isinstance(v, tuple | list):
            raise RequestError(name, "must be a list of strings")
        if len(v) > self.max_items:
            raise RequestError(name, f"at most {self.max_items} stop sequences, got {len(v)}")
        for s in v:
            if not isinstance(s, str) or not s:
                raise RequestError(name, "stop sequences must be non-empty strings")
            if len(s) > self.max_chars:
                raise RequestError(name, f"a stop sequence is at most {self.max_chars} characters")


@dataclass(frozen=True)
class Instance:
    """An instance of ``cls`` (whose constructor checked its own fields)."""

    cls: type

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not isinstance(v, self.cls):
            raise RequestError(name, f"must be {self.cls.__name__}")


_DECIMAL = re.compile(r"-?[0-9]{1,12}")  # a token id as a JSON object's key


@dataclass(frozen=True)
class Bias:
    """Additive logit biases: at most ``max_items`` ``(token id, bias)`` pairs, the ids distinct
    and in ``[0, vocab_size)``, each bias finite in ``[-bound, bound]``. On the wire it is a
    JSON object (a gRPC map) of token id -> bias, its keys decimal strings; :meth:`from_wire`
    makes the pairs (sorted by id)."""

    max_items: int
    bound: float
    py: ClassVar[type] = dict
    json: ClassVar[tuple[tuple[type, ...], str]] = ((dict,), "an object of token id -> bias")

    def from_wire(self, name: str, v: object) -> object:
        """The pairs of a JSON object / gRPC map (None: no bias); anything else is left for
        :meth:`__call__` to refuse."""
        if v is None:
            return ()
        if not isinstance(v, Mapping):
            return v
        if len(v) > self.max_items:
            raise RequestError(name, f"biases {len(v)} tokens; the limit is {self.max_items}")
        pairs = []
        for key, bias in v.items():
            if isinstance(key, str) and _DECIMAL.fullmatch(key):
                tid = int(key)
            elif type(key) is int:
                tid = key
            else:
                raise RequestError(name, f"keys must be token ids (decimal integers), got {key!r}")
            pairs.append((tid, bias))
        return tuple(sorted(pairs, key=lambda p: p[0]))

    def __call__(self, name: str, v: object, vocab_size: int | None) -> None:
        if not isinstance(v, tuple | list):
            raise RequestError(name, "must be (token id, bias) pairs")
        if len(v) > self.max_items:
            raise RequestError(name, f"biases {len(v)} tokens; the limit is {self.max_items}")
        seen = set()
        for pair in v:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise RequestError(name, "must be (token id, bias) pairs")
            tid, bias = pair
            if type(tid) is not int or tid < 0:
                raise RequestError(name, f"token ids must be integers >= 0, got {tid!r}")
            if vocab_size is not None and tid >= vocab_size:
                raise RequestError(name, f"token id {tid} >= vocab size {vocab_size}")
            if tid in seen:
                raise RequestError(name, f"token id {tid} is biased twice")
            seen.add(tid)
            if not _finite(bias) or abs(bias) > self.bound:
                raise RequestError(
                    name, f"bias of token {tid} must be a number in [-{self.bound:g}, "
                          f"{self.bound:g}], got {bias!r}",
                )  # fmt: skip


Check = Int | Float | Bool | Text | TokenIds | Stops | Instance | Bias


# ---- the field table ------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One request field: its value's kind and bounds (``check``), None allowed (``optional``),
    a sibling field it must not exceed (``at_most``), the name errors give it (``param``, when
    not the field's), a tighter upper bound on the HTTP endpoints (``http_max``), and the
    endpoints that take it with how each does (``wire``: endpoint -> BODY / TYPED / RECIPE)."""

    check: Check
    optional: bool = False
    at_most: str | None = None
    param: str | None = None
    http_max: float | None = None
    wire: Mapping[str, str] = field(default_factory=dict)


_SPEC = "fathom.spec"


def spec(
    check: Check,
    *,
    optional: bool = False,
    at_most: str | None = None,
    param: str | None = None,
    http_max: float | None = None,
    body: Sequence[str] = (),
    typed: Sequence[str] = (),
    recipe: Sequence[str] = (),
) -> dict[str, Spec]:
    """A dataclass field's metadata declaring its :class:`Spec`; ``body`` / ``typed`` /
    ``recipe``: the endpoints taking it that way."""
    wire = {**dict.fromkeys(body, BODY), **dict.fromkeys(typed, TYPED)}
    wire |= dict.fromkeys(recipe, RECIPE)
    frozen = types.MappingProxyType(wire)
    return {_SPEC: Spec(check, optional, at_most, param, http_max, frozen)}


@dataclass(frozen=True)
class FieldSpec:
    """A declared field of a request dataclass: its name, default and :class:`Spec`."""

    name: str
    default: Any
    spec: Spec


@functools.cache
def specs(cls: type) -> tuple[FieldSpec, ...]:
    """The declared fields of dataclass ``cls``, in field order."""
    return tuple(
        FieldSpec(f.name, f.default, f.metadata[_SPEC]) for f in fields(cls) if _SPEC in f.metadata
    )


def wire_fields(cls: type, endpoint: str, *how: str) -> tuple[FieldSpec, ...]:
    """The declared fields of ``cls`` that ``endpoint`` takes (only those taken ``how``, if
    given)."""
    return tuple(
        f
        for f in specs(cls)
        if endpoint in f.spec.wire and (not how or f.spec.wire[endpoint] in how)
    )


# ---- the checks -----------------------------------------------------------------------------
def from_wire(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (fields of dataclass ``cls`` as a body carries them) in the dataclass's
    form: a field whose kind has a wire form (``from_wire``) converted, the rest as is."""
    kinds = {f.name: f.spec.check for f in specs(cls)}
    out = dict(values)
    for name, v in values.items():
        conv = getattr(kinds.get(name), "from_wire", None)
        if conv is not None:
            out[name] = conv(name, v)
    return out


def check_fields(obj: object, vocab_size: int | None = None) -> None:
    """Every declared field of dataclass ``obj`` within its bounds (token ids below
    ``vocab_size`` when given): what the constructors run."""
    for f in specs(type(obj)):
        s = f.spec
        v = getattr(obj, f.name)
        if v is None and s.optional:
            continue
        name = s.param or f.name
        s.check(name, v, vocab_size)
        if s.at_most is not None and (cap := getattr(obj, s.at_most)) is not None and v > cap:
            raise RequestError(name, f"must not exceed {s.at_most}")


class _Params(Protocol):
    @property
    def max_tokens(self) -> int | None: ...

    @property
    def n(self) -> int: ...


class _Request(Protocol):
    @property
    def prompt_token_ids(self) -> Sequence[int]: ...

    @property
    def params(self) -> _Params: ...


def check_request(req: _Request, limits: RequestLimits) -> None:
    """The request validator: every declared field of the request and of its sampling
    params, token ids within the model's vocabulary, prompt + ``max_tokens`` within
    ``max_model_len``, ``n`` within ``max_n``."""
    check_fields(req, limits.vocab_size)
    p = req.params
    check_fields(p, limits.vocab_size)
    if limits.max_n is not None and p.n > limits.max_n:
        raise RequestError("n", f"must be at most {limits.max_n} (api.max_n), got {p.n}")
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
