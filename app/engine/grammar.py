"""Structured output with llguidance: constraints compiled once (LRU-cached by constraint),
one matcher per request, a token bitmask per step.

Per decode step, for the constrained rows of a batch (order matters)::

    fill_bitmasks(matchers, bitmask, rows)   # CPU; may overlap the forward pass
    apply_bitmask(logits, bitmask, rows)     # disallowed logits -> -inf, in place
    token = sample(logits)
    ok = matcher.accept(token)               # False: fail the request with matcher.error

Special tokens never appear inside constrained text (llguidance excludes them from every
lexeme); a grammar names them explicitly by id (``<[7]>`` for ``</think>``). EOS is allowed only
where the grammar may end; ids at or beyond the tokenizer's size are always masked.

``think_first`` wraps the constraint: free reasoning (no special tokens, no plain-text
``</think>``), the ``</think>`` token, then the answer grammar. Tool calls follow DeepSeek DSML
as ``deepseek-recipe`` renders and parses it (V4.1; V4 spells the tags ``｜DSML｜tool_calls``,
``｜DSML｜invoke``, ``｜DSML｜parameter``)::

    free text<｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

``tool_call_required`` starts after the ``<｜DSML｜ calls>\\n`` that the prompt already holds.
llguidance is imported lazily: the GPU machine runs the engine without it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    import llguidance
    from tokenizers import Tokenizer

    from app.engine.request import OutputConstraint

THINK_END = "</think>"
DSML = "｜DSML｜"  # deepseek-recipe SpecialToken.Dsml.default_str()
# DSML tag words per architecture (ModelConfig.arch): calls block, one call, one argument.
_DSML_TAGS = {
    "v41": {"calls": " calls", "invoke": " invoke", "parameter": " parameter"},
    "v4": {"calls": "tool_calls", "invoke": "invoke", "parameter": "parameter"},
}
# Compact JSON in the style deepseek-recipe renders tool arguments: {"a": 1, "b": [true]}.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """An output constraint that cannot be compiled (reject the request at admission)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar; ``template`` is a fresh matcher to copy per request."""

    key: tuple[str, str, bool]
    grammar: str
    template: llguidance.LLMatcher


def _lit(s: str) -> str:
    """A Lark string literal (llguidance reads JSON string escapes)."""
    return json.dumps(s, ensure_ascii=False)


def _free_text(forbidden: str) -> str:
    """Terminal expression: any text that does not spell ``forbidden`` as plain text (a parser
    reading decoded text would take it for the special token)."""
    return f"(ANY & ~(ANY {_lit(forbidden)} ANY))"


class _ToolGrammar:
    """Lark grammar for DSML tool calls whose arguments follow each tool's JSON schema.

    Parameters appear in schema order, required ones always, optional ones at most once, no
    others; a schema without "properties" (e.g. ``{"type": "object"}``) takes any names and
    values, a missing or empty one no parameters.
    """

    def __init__(self, tools: list[Any], arch: str, dsml_id: int):
        self.words = _DSML_TAGS[arch]
        self.dsml = f"<[{dsml_id}]>"
        self.rules: list[str] = []
        self.invokes = [self._invoke(i, t) for i, t in enumerate(tools)]

    def _tag(self, word: str, rest: str = ">") -> str:
        """The DSML token, then the tag word and ``rest`` as plain text."""
        return f"{self.dsml} {_lit(self.words[word] + rest)}"

    def lark(self, start: str) -> str:
        """``start``: "text" (free text, then optionally a calls block), "block" (inside the
        block the prompt opened) or "open" (the answer opens the block itself)."""
        opened = self._tag("calls", ">\n") + " calls"
        first = {
            "text": f"start: TEXT | TEXT_LT {opened}",
            "block": "start: calls",
            "open": f'start: "\\n\\n<" {opened}',
        }[start]
        return "\n".join(
            [
                first,
                f'calls: invoke+ "</" {self._tag("calls")}',
                "invoke: " + " | ".join(self.invokes),
                *self.rules,
                "ANY: /(?s:.*)/",
                f"TEXT: {_free_text(DSML)}",
                'TEXT_LT: TEXT "<"',
                'RAW: TEXT "</"',
                'NAME: /[^"<>\\n]+/',
            ]
        )

    def _invoke(self, i: int, tool: Any) -> str:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise GrammarError(f"tool {i}: expected a function tool with a name")
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise GrammarError(f"tool {fn['name']!r}: parameters must be a JSON schema object")
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        args = []
        for j, (name, schema) in enumerate(props.items()):
            self._param(f"p{i}_{j}", name, schema if isinstance(schema, dict) else {}, defs)
            args.append(f"p{i}_{j}" if name in required else f"p{i}_{j}?")
        if params and "properties" not in params and params.get("additionalProperties", True):
            self._param(f"p{i}_any", None, {}, defs)
            args.append(f"p{i}_any*")
        head = self._tag("invoke", f' name="{fn["name"]}">\n')
        body = " ".join(args)
        if not required.intersection(props):  # no arguments: V4.1 renders an empty line, V4 not
            body = f'("\\n" | {body})' if body else '"\\n"?'
        end = self._tag("invoke", ">\n")
        self.rules.append(f'i{i}: "<" {head} {body} "</" {end}')
        return f"i{i}"

    def _param(self, rule: str, name: str | None, schema: dict[str, Any], defs: dict) -> None:
        """One argument (``name`` None: any name): a string goes raw (``string="true"``, the
        text runs to ``</｜DSML｜ parameter>``), anything else as JSON (``string="false"``)."""
        key = "NAME" if name is None else _lit(name)
        open_ = '"<" ' + self._tag("parameter", ' name="') + " " + key
        close = self._tag("parameter", ">\n")
        alts = []
        raw = _raw_string(schema)
        if raw is not None:
            self.rules.append(f"{rule.upper()}_RAW: {raw}")
            alts.append(f'{open_} "\\" string=\\"true\\">" {rule.upper()}_RAW {close}')
        if raw is None or _admits_non_string(schema):
            self.rules.append(f"{rule}_json: %json {json.dumps(_tool_schema({**schema, **defs}))}")
            alts.append(f'{open_} "\\" string=\\"false\\">" {rule}_json "</" {close}')
        self.rules.append(f"{rule}: " + " | ".join(alts))


def _tool_schema(schema: dict[str, Any]) -> dict[str, Any]:
    # client tool schemas are loose: unsupported keywords are ignored rather than rejected
    return {**schema, "x-guidance": {**_JSON_OPTIONS, "lenient": True}}


def _raw_string(schema: dict[str, Any]) -> str | None:
    """Terminal for a raw (``string="true"``) value followed by ``</``, or None when the value
    must go as JSON (not a string, or string rules a raw regex cannot express here)."""
    values = (
        schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    )
    if values is not None:
        strs = [v for v in values if isinstance(v, str)]
        return f'({" | ".join(_lit(v) for v in strs)}) "</"' if strs else None
    types = schema.get("type")
    if types is None:
        composite = any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "not"))
        return None if composite else "RAW"
    if "string" not in ([types] if isinstance(types, str) else types):
        return None
    if "pattern" in schema or "format" in schema:
        return None
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if lo is None and hi is None:
        return "RAW"
    span = f"{{{int(lo or 0)},{'' if hi is None else int(hi)}}}"
    return f'(/(?s:.){span}/ & {_free_text(DSML)}) "</"'


def _admits_non_string(schema: dict[str, Any]) -> bool:
    if "enum" in schema or "const" in schema:
        vals = schema.get("enum", [schema.get("const")])
        return any(not isinstance(v, str) for v in vals)
    types = schema.get("type")
    if types is None:
        return True
    return any(t != "string" for t in ([types] if isinstance(types, str) else types))


class GrammarMatcher:
    """One request's grammar state: fill its mask row, accept each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int):
        self._m = matcher
        self._eos = eos_token_id
        self._ended = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask``: int32 [words], or row ``row`` of an
        int32 [B, words] batch (contiguous, on the CPU)."""
        _check_bitmask(bitmask)
        target = bitmask[row] if bitmask.dim() == 2 else bitmask
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if it violates the grammar (see ``error``)."""
        ok = self._m.consume_token(token_id)
        self._ended = self._ended or (ok and token_id == self._eos)
        return ok

    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (e.g. draft tokens) the grammar accepts in a row."""
        return self._m.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculation)."""
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.error}")
        self._ended = self._ended and num_tokens == 0

    def must_stop(self) -> bool:
        """The grammar is complete: only EOS is allowed next."""
        return self._m.is_stopped() and not self._m.is_error()

    def is_terminated(self) -> bool:
        """EOS was accepted: the constrained output is complete."""
        return self._ended

    @property
    def error(self) -> str:
        """Why the matcher rejected a token ("" if it has not)."""
        return self._m.get_error().replace("<non-verbose/>", "").strip()


def _added_tokens_special(tokenizer: Tokenizer) -> str:
    """The tokenizer's JSON with every added token marked special: llguidance keeps special
    tokens out of constrained text, and DeepSeek's added tokens are all control tokens."""
    spec = json.loads(tokenizer.to_str())
    for added in spec.get("added_tokens", []):
        added["special"] = True
    return json.dumps(spec, ensure_ascii=False)


class GrammarCompiler:
    """Compiles output constraints for one tokenizer; results are LRU-cached by constraint."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_id: int,
        think_end_token_id: int | None = None,
        *,
        arch: Literal["v4", "v41"] = "v41",
        cache_size: int = 256,
    ):
        import llguidance

        if vocab_size < tokenizer.get_vocab_size():
            raise ValueError(
                f"vocab_size {vocab_size} < tokenizer size {tokenizer.get_vocab_size()}"
            )
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.arch = arch
        self.think_end_id = (
            tokenizer.token_to_id(THINK_END) if think_end_token_id is None else think_end_token_id
        )
        self.dsml_id = tokenizer.token_to_id(DSML)
        self._tok = llguidance.LLTokenizer(
            _added_tokens_special(tokenizer), n_vocab=vocab_size, eos_token=eos_token_id
        )
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple[str, str, bool], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        """Compile (or fetch from the cache); raises GrammarError for an invalid constraint."""
        key = (constraint.kind, constraint.spec, constraint.think_first)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(key)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request."""
        return GrammarMatcher(compiled.template.deep_copy(), self.eos_token_id)

    def _compile(self, key: tuple[str, str, bool]) -> CompiledGrammar:
        import llguidance

        kind, spec, think_first = key
        answer = self._answer(kind, spec, think_first)
        if think_first:
            if self.think_end_id is None:
                raise GrammarError(f"think_first: the tokenizer has no {THINK_END} token")
            top = (
                f"start: THINK <[{self.think_end_id}]> @answer\nANY: /(?s:.*)/\n"
                f"THINK: {_free_text(THINK_END)}"
            )
            grammars = [{"lark_grammar": top}, {"name": "answer", **answer}]
        else:
            grammars = [answer]
        grammar = json.dumps({"grammars": grammars}, ensure_ascii=False)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=self._limits)
        if m.is_error():
            raise GrammarError(f"invalid {kind} constraint: {m.get_error().strip()}")
        return CompiledGrammar(key, grammar, m)

    def _answer(self, kind: str, spec: str, think_first: bool) -> dict[str, Any]:
        import llguidance

        if kind == "json":
            try:
                schema = json.loads(spec) if spec else {}
            except json.JSONDecodeError as e:
                raise GrammarError(f"json schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("json schema must be an object or a boolean")
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**_JSON_OPTIONS, "lenient": False}}
            return {"json_schema": schema}
        if kind == "regex":
            return {"lark_grammar": f"start: /{llguidance.regex_to_lark(spec)}/"}
        if kind == "grammar":
            return {"lark_grammar": spec}
        try:
            tools = json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"tool list is not valid JSON: {e}") from None
        if not isinstance(tools, list) or not tools:
            raise GrammarError("tool list must be a non-empty JSON array of function tools")
        if self.dsml_id is None:
            raise GrammarError(f"tool calls: the tokenizer has no {DSML} token")
        start = "text" if kind == "tool_call" else "open" if think_first else "block"
        return {"lark_grammar": _ToolGrammar(tools, self.arch, self.dsml_id).lark(start)}


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An int32 [batch, ceil(vocab/32)] bitmask, all tokens allowed; pinned when CUDA exists."""
    return torch.full(
        (batch, (vocab_size + 31) // 32),
        -1,
        dtype=torch.int32,
        pin_memory=torch.cuda.is_available(),
    )


@functools.cache
def _executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()


def fill_bitmasks(
    matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]
) -> None:
    """Fill ``bitmask[rows[i]]`` from ``matchers[i]``, in parallel threads without the GIL."""
    _check_bitmask(bitmask)
    if len(matchers) == 1:
        matchers[0].fill_bitmask(bitmask, rows[0])
    elif matchers:
        pairs = [(m._m, int(r)) for m, r in zip(matchers, rows, strict=True)]
        batch, words = bitmask.shape
        _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, batch)


def _check_bitmask(bitmask: torch.Tensor) -> None:
    # llguidance writes through a raw pointer: a wrong layout would corrupt memory
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not bitmask.is_contiguous():
        raise ValueError("bitmask must be a contiguous int32 CPU tensor")


@functools.cache
def _bit_index(device: torch.device) -> torch.Tensor:
    return torch.arange(32, dtype=torch.int32, device=device)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set ``logits[r, t] = -inf`` where bit t of ``bitmask[r]`` is 0, for r in ``rows`` (all
    rows if None). Columns beyond the bitmask's 32 * words are masked too.

    Bit t lives in word t // 32 at bit t % 32: word 0 = 0b101 allows tokens 0 and 2.
    """
    vocab = logits.shape[-1]
    idx = None if rows is None else torch.as_tensor(rows, dtype=torch.long).cpu()
    words = bitmask if idx is None else bitmask[idx.to(bitmask.device)]
    words = words.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> _bit_index(logits.device)) & 1).flatten(1).bool()
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    disallowed = ~allowed[:, :vocab]
    if idx is None:
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        idx = idx.to(logits.device, non_blocking=True)
        logits[idx] = logits[idx].masked_fill(disallowed, float("-inf"))
