"""Structured output, the one place the engine handles it: constraints compiled once with
llguidance (LRU-cached by constraint), one matcher per request, a token mask per step,
acceptance of each sampled token, and replay of a handed-off request's output.

    so = StructuredOutput(tokenizer, model_cfg, eos_id)   # the engine core's
    seq.matcher = so.matcher(constraint)       # compile; RequestError("constraint") if bad
    apply = mask(matchers, rows, vocab_size)   # CPU bitmask fill; may overlap the forward
    apply(logits)                              # disallowed logits -> -inf, in place
    error = accept(seq.matcher, token)         # None, or why the request fails
    replay(seq.matcher, output_ids)            # a handoff's tokens, on import

Special tokens never appear inside constrained text (llguidance excludes them from every
lexeme); a grammar names them explicitly by id (``<[7]>`` for ``</think>``). EOS is allowed only
where the grammar may end; ids at or beyond the tokenizer's size are always masked.

``think_first`` wraps the constraint: free reasoning (no special tokens, no plain-text
``</think>``), the ``</think>`` token, then the answer grammar. Tool calls follow DeepSeek DSML
(the Lark text: ``app.engine.tool_grammar``); ``tool_call_required`` starts after the
``<｜DSML｜ calls>\\n`` that the prompt already holds. llguidance, a heavy optional dependency,
is imported lazily where it is used: the GPU machine runs the engine without it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from app.engine.request import RequestError
from app.engine.tool_grammar import DSML, JSON_OPTIONS, GrammarError, ToolGrammar, free_text

if TYPE_CHECKING:
    import llguidance
    from tokenizers import Tokenizer

    from app.engine.request import OutputConstraint
    from app.model.config import ModelConfig

THINK_END = "</think>"


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar; ``template`` is a fresh matcher to copy per request."""

    key: OutputConstraint
    grammar: str
    template: llguidance.LLMatcher


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
        self._cache: OrderedDict[OutputConstraint, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        """Compile (or fetch from the cache); raises GrammarError for an invalid constraint."""
        with self._lock:
            if (hit := self._cache.get(constraint)) is not None:
                self._cache.move_to_end(constraint)
                return hit
        compiled = self._compile(constraint)
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: CompiledGrammar) -> GrammarMatcher:
        """A fresh matcher for one request."""
        return GrammarMatcher(compiled.template.deep_copy(), self.eos_token_id)

    def _compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        import llguidance

        kind, think_first = constraint.kind, constraint.think_first
        answer = self._answer(constraint)
        if think_first:
            if self.think_end_id is None:
                raise GrammarError(f"think_first: the tokenizer has no {THINK_END} token")
            top = (
                f"start: THINK <[{self.think_end_id}]> @answer\nANY: /(?s:.*)/\n"
                f"THINK: {free_text(THINK_END)}"
            )
            grammars = [{"lark_grammar": top}, {"name": "answer", **answer}]
        else:
            grammars = [answer]
        grammar = json.dumps({"grammars": grammars}, ensure_ascii=False)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=self._limits)
        if m.is_error():
            raise GrammarError(f"invalid {kind} constraint: {m.get_error().strip()}")
        return CompiledGrammar(constraint, grammar, m)

    def _answer(self, constraint: OutputConstraint) -> dict[str, Any]:
        import llguidance

        kind, spec = constraint.kind, constraint.spec
        if kind == "json":
            try:
                schema = json.loads(spec) if spec else {}
            except json.JSONDecodeError as e:
                raise GrammarError(f"json schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise GrammarError("json schema must be an object or a boolean")
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**JSON_OPTIONS, "lenient": False}}
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
        start = "text" if kind == "tool_call" else "open" if constraint.think_first else "block"
        grammar = ToolGrammar(tools, self.arch, self.dsml_id)
        return {"lark_grammar": grammar.lark(start, parallel=constraint.parallel_calls)}


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


# ---- the engine's side: one object per engine core, functions per step ----------------------
class StructuredOutput:
    """An engine's structured output: the compiler (built on first use, from the checkpoint's
    tokenizer) and a fresh matcher per constrained request."""

    def __init__(
        self, tokenizer: Tokenizer | None, model_cfg: ModelConfig, eos_token_id: int
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, model_cfg.vocab_size
        self.eos_token_id, self.arch = eos_token_id, model_cfg.arch
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise RequestError("constraint", "this model has no tokenizer.json")
            think = self.tokenizer.token_to_id(THINK_END)
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_id,
                                             think, arch=self.arch)  # fmt: skip
        return self._compiler

    def matcher(self, constraint: OutputConstraint | None) -> GrammarMatcher | None:
        """A request's matcher (None when unconstrained); raises :class:`RequestError` when
        the constraint does not compile."""
        if constraint is None:
            return None
        try:
            return self.compiler.matcher(self.compiler.compile(constraint))
        except GrammarError as e:
            raise RequestError("constraint", str(e)) from e


def mask(
    matchers: Sequence[GrammarMatcher], rows: Sequence[int], vocab_size: int
) -> Callable[[torch.Tensor], None]:
    """Fill the bitmask of ``matchers`` now (host); the returned hook masks logits row
    ``rows[i]`` by ``matchers[i]`` in place (the sampler calls it after the penalties)."""
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    own = list(range(len(matchers)))
    fill_bitmasks(matchers, bitmask, own)
    where = torch.from_numpy(np.asarray(rows, dtype=np.int64))

    def apply(logits: torch.Tensor) -> None:
        idx = (where.pin_memory() if logits.is_cuda else where).to(logits.device, non_blocking=True)
        sub = logits[idx]
        apply_bitmask(sub, bitmask.to(sub.device), own)
        logits[idx] = sub

    return apply


def accept(matcher: GrammarMatcher | None, token_id: int) -> str | None:
    """Advance a request's matcher by a sampled token: None, or the error that ends the
    request (the token violates its constraint)."""
    if matcher is None or matcher.accept(token_id):
        return None
    return f"token {token_id} violates the output constraint"


def replay(matcher: GrammarMatcher | None, token_ids: Sequence[int]) -> None:
    """Bring a request's matcher to the end of output it already has (a handoff); raises
    :class:`RequestError` when a token violates the constraint."""
    for tok in token_ids if matcher is not None else ():
        if not matcher.accept(tok):
            raise RequestError("constraint", f"output token {tok} violates the constraint")
