"""Parallel sampling (``n`` > 1): one prefill, then n forked decodes.

    add      a prefill-only parent computes the prompt's positions 0 .. L-2 (it samples
             nothing); the n choices wait for it
    fork     once the parent's last chunk is done, choices 0 .. n-2 are admitted with the
             parent's KV of those positions (``CacheManager.fork``: the full blocks shared,
             the block holding position L-1 and the slot rows copied) and the last choice
             takes the parent's own cache entry; a choice that finds no slot or block waits
             as a plain request (a prefix hit brings the shared blocks back when caching is on)
    decode   each choice computes position L-1 itself, so its first token is its own draw
             from its own logits row, then decodes as any request; choice i samples with
             ``seed + i`` (int64, wrapping) and unseeded choices draw independently
    outputs  a choice's deltas carry the request's id and ``index`` i; the request finishes
             with its last choice

    prompt L = 10, blocks of P = 4:   [0 1 2 3][4 5 6 7][8 9 . .]
    the parent computes 0 .. 8         shared   shared   copied per choice (it holds 8; the
                                                         choice writes 9, 10, ...)

A prompt of one token has nothing to share: its choices start as plain requests. The
parent's trace (if traced) goes on as choice 0's; its prompt logprobs (if asked) are the
request's, delivered as index 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from app.cache.block_pool import NoFreeBlocks
from app.engine.request import RequestOutput
from app.engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from app.cache.manager import CacheManager
    from app.engine.grammar import GrammarMatcher


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: ``seed + i`` wrapped into int64 (choice 0 keeps the request's
    seed; None stays None): ``choice_seed(2**63 - 1, 1) == -2**63``."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


@dataclass
class Group:
    """The choices of one request and, until they fork, its prefill-only parent."""

    request_id: str
    parent: Sequence | None
    choices: list[Sequence]
    live: set[int] = field(default_factory=set)  # choices not finished

    def members(self) -> list[Sequence]:
        return ([self.parent] if self.parent is not None else []) + self.choices


class Forks:
    """The engine's requests with ``n`` > 1 over its cache (module doc)."""

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.groups: dict[str, Group] = {}

    def add(self, seq: Sequence, matcher: Callable[[], GrammarMatcher | None]) -> list[Sequence]:
        """Split the sequence of a validated request with ``n`` > 1 into its parent (``seq``
        itself, made prefill-only) and its choices (``matcher`` compiles each one's
        constraint; choice 0 takes ``seq``'s). Returns what is queued now: the parent, or
        for a one-token prompt the choices."""
        req, p = seq.req, seq.req.params
        rid, prompt = req.request_id, list(req.prompt_token_ids)
        choices = []
        for i in range(p.n):
            params = replace(p, n=1, seed=choice_seed(p.seed, i), prompt_logprobs=None)
            creq = replace(req, request_id=f"{rid}/{i}", params=params)
            m = seq.matcher if i == 0 else matcher()
            choices.append(Sequence(creq, list(prompt), m, group=rid, choice=i))
        parent = None
        if len(prompt) > 1:
            parent = seq
            parent.tokens, parent.matcher, parent.prefill_only = prompt[:-1], None, True
        self.groups[rid] = Group(rid, parent, choices, set(range(p.n)))
        return [parent] if parent is not None else choices

    def ready(self) -> list[Group]:
        """Groups whose parent has computed its last chunk (none of it still in flight)."""
        return [
            g
            for g in self.groups.values()
            if (s := g.parent) is not None
            and s.status is SeqStatus.RUNNING
            and s.num_in_flight == 0
            and s.num_done >= len(s.tokens)
        ]

    def fork(self, group: Group) -> tuple[list[Sequence], list[Sequence]]:
        """Fork ``group``'s choices off its parent -> (choices now running from position
        L-1, choices left to wait as plain requests). The parent's cache entry passes to the
        last choice; the caller drops the parent (its request id, no longer in the cache)."""
        parent = group.parent
        assert parent is not None
        upto, pid = len(parent.tokens), parent.request_id
        running, waiting = [], []
        *copies, last = group.choices
        for c in copies:
            try:
                self.cache.fork(pid, c.request_id, upto)
            except (RuntimeError, NoFreeBlocks):
                waiting.append(c)
                continue
            running.append(c)
        self.cache.rename(pid, last.request_id)
        running.append(last)
        for c in running:
            c.num_computed = c.num_done = upto
            c.num_cached, c.status = parent.num_cached, SeqStatus.RUNNING
        group.choices[0].trace, parent.trace = parent.trace, None
        group.parent = None
        return running, waiting

    def settle(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        """``out`` of ``seq`` as its request's delta: a choice's last delta finishes the
        request only when no other choice is left."""
        group = self.groups.get(seq.group) if seq.group is not None else None
        if group is None or not out.finished:
            return out
        group.live.discard(seq.choice)
        out.finished = not group.live
        if out.finished:
            del self.groups[group.request_id]
        return out

    def abort(self, request_id: str) -> list[Sequence] | None:
        """Forget request ``request_id``'s group -> its sequences that have not finished
        (None: not a group)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        return [s for s in group.members() if s.finish_reason is None]
