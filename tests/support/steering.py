"""A scripted model for front-door tests: a random tiny model does not emit tool calls or
``</think>`` on its own, so the engine's logits are steered toward a token script before the
real sampler runs (penalties, grammar masks, sampling all as in serving). While a request's
output is a prefix of the script, the script's next token gets a large bias; once the output
left the script (the grammar refused a scripted token), ``fallback`` gives the biases. A grammar
still has the last word: a masked token is never sampled, however large its bias.

    with steered(Script(tok.encode(answer).ids + [EOS], fallback=lambda out: {EOS: 9.0})):
        client.chat.completions.create(...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch

from app.engine import core


@dataclass(frozen=True)
class Script:
    """The tokens every steered request should emit, in order; ``strength``: the bias of the
    next scripted token; ``fallback(output_ids)``: token -> bias once the output left the
    script (default: none, the model's own logits)."""

    tokens: Sequence[int]
    fallback: Callable[[Sequence[int]], Mapping[int, float]] = lambda out: {}
    strength: float = 50.0

    def bias(self, output_ids: Sequence[int]) -> Mapping[int, float]:
        """The logit biases of the next token after ``output_ids``."""
        n = len(output_ids)
        if n < len(self.tokens) and list(output_ids) == list(self.tokens[:n]):
            return {self.tokens[n]: self.strength}
        return self.fallback(output_ids)


@contextmanager
def steered(script: Script) -> Iterator[None]:
    """Every engine step sampled in this block (any engine in the process) adds ``script``'s
    biases to its logits rows, then samples them with the real ``sample_chunks``."""
    sample_chunks = core.sample_chunks

    def steer(items, counts, logits: torch.Tensor, eos_ids, vocab_size):  # noqa: ANN001
        row = 0
        for it, c in zip(items, counts, strict=True):
            for j in range(c):  # a verify chunk's row j sees its drafts before j as output
                seen = it.seq.output_ids + list(it.seq.drafts[:j])
                for t, b in script.bias(seen).items():
                    logits[row + j, t] += b
            row += c
        return sample_chunks(items, counts, logits, eos_ids, vocab_size)

    with mock.patch.object(core, "sample_chunks", steer):
        yield
