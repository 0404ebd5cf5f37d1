"""Fairness between long prefills and everything else: a strategy of the scheduler.

A prefill is *long* while more than ``threshold`` of its prompt tokens are left to compute
(default: one step's token budget). While other requests are running or waiting, long
prefills together take at most ``share`` of each step's budget, so decodes and short prompts
keep being served beside a 100k-token prompt instead of waiting for it; when only long
prefills are present they use the whole budget (nothing is left idle).

    budget 512, share 0.5, a 100k prompt + 3 decodes:  prompt 256 tokens, decodes 1 each
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.engine.sequence import Sequence


class LongPrefillShare:
    """Per-step token allowance of long prefills (``start`` each step, then ``cap``)."""

    def __init__(self, budget: int, share: float, threshold: int = 0) -> None:
        self.budget = budget
        self.share = share
        self.threshold = threshold or budget
        self.left = budget

    def is_long(self, seq: Sequence) -> bool:
        return seq.num_prompt - seq.num_computed > self.threshold

    def start(self, seqs: Iterable[Sequence]) -> None:
        """Before a step: long prefills are capped only if some other request is present."""
        others = any(not self.is_long(s) for s in seqs)
        self.left = max(1, int(self.budget * self.share)) if others else self.budget

    def cap(self, seq: Sequence, n: int) -> int:
        """The tokens ``seq`` may take of the ``n`` it asks for (long prefills draw on the
        step's allowance; anything else is not limited here)."""
        if not self.is_long(seq):
            return n
        n = min(n, self.left)
        self.left -= n
        return n
