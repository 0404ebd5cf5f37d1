"""Proposers for tests and benchmarks (``app.engine.spec.proposer.Proposer``): the target's
own continuation at a set per-draft acceptance rate, and random tokens. They read the step's
anchors on the host (a synchronization the engine's own proposers never make)."""

from __future__ import annotations

import random

import torch

from app.model.dspark import DraftBlock


class OracleProposer:
    """Drafts the known continuation ``tokens[rid]`` (prompt + the target's greedy output):
    each draft is the true token with probability ``accept_rate`` (independently, seeded),
    else a wrong one. At 1.0 every draft of a greedy request is accepted."""

    needs_features = False
    needs_next_tokens = False

    def __init__(self, tokens: dict[str, list[int]], vocab: int, accept_rate: float = 1.0,
                 seed: int = 0) -> None:  # fmt: skip
        self.tokens, self.vocab, self.rate = tokens, vocab, accept_rate
        self.rng = random.Random(seed)
        self.calls = 0

    def observe(self, slots, positions, features, next_tokens) -> None:
        pass

    def propose(self, request_ids, slots, anchors, bonus, num_drafts, params, first_output,
                features=None):  # fmt: skip
        self.calls += 1
        rows = []
        for rid, a in zip(request_ids, anchors.tolist(), strict=True):
            true = self.tokens[rid][a + 2 : a + 2 + num_drafts]
            true += [0] * (num_drafts - len(true))
            rows.append([t if self.rng.random() < self.rate else (t + 1) % self.vocab
                         for t in true])  # fmt: skip
        ids = torch.tensor(rows, dtype=torch.int64, device=anchors.device)
        return _block(ids, self.vocab)


class RandomProposer:
    """Uniformly random drafts (their proposal distribution is uniform)."""

    needs_features = False
    needs_next_tokens = False

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def observe(self, slots, positions, features, next_tokens) -> None:
        pass

    def propose(self, request_ids, slots, anchors, bonus, num_drafts, params, first_output,
                features=None):  # fmt: skip
        ids = torch.randint(0, self.vocab, (len(request_ids), num_drafts), generator=self.gen)
        blk = _block(ids.to(anchors.device), self.vocab)
        blk.logits.zero_()  # uniform Q: the drafts were drawn from it
        return blk


def _block(ids: torch.Tensor, vocab: int) -> DraftBlock:
    """A block whose proposal puts (almost) all mass on ``ids``."""
    R, k = ids.shape
    logits = torch.full((R, k, vocab), -30.0, device=ids.device)
    logits.scatter_(2, ids.unsqueeze(-1), 30.0)
    return DraftBlock(ids, logits, None)
