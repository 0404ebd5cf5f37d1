"""Routing decisions: which DP rank serves a request (pure logic; the Router deployment holds
the state and :class:`RoutingPolicy` decides).

``prefix`` (the default) minimizes the predicted time to first token, in prefill-token units::

    cost(r) = queued(r) + compute_weight * compute(r)
    queued(r)  = prompt tokens waiting for prefill on r (its last report)
               + tokens the router sent r since that report
               + running_weight * requests running or waiting on r
    compute(r) = L - H(r) + replay(H(r))      L prompt tokens, H(r) cached on r (whole blocks)
               + host_hit_cost * H_host(r)     of which H_host(r) in r's host tier (a copy back)
    replay(H)  = min(H, W)   bounded replay recomputes the last window W before a hit
                 H           bounded_replay "off": a hit saves memory, not compute

``compute_weight`` (4) > 1 charges a request for the delay its own prefill adds to every
request queued after it on that rank, and allows for the engine sharing each step's token
budget between a long prefill and the short ones behind it (fairness.py), so a queue delays a
short hit less than its token count: a prefix is not recomputed on a second rank to save one
request a short wait (W7 at weight 2: hits spilled to non-holders behind two queued misses,
and each spill was a duplicated 1K-token prefill). The lowest cost wins, ties
to the least loaded rank (then the rank id). A request no
rank holds a prefix of goes, among the ranks within the balance bound, to the one holding the
fewest prefix blocks (the "smallest tenant", as Ray's and SGLang's routers place new
prefixes): a prefix's first request fixes where its later hits go, so placing it by the
queue of the moment leaves lasting imbalance. A balance
bound keeps a hot prefix from piling onto one rank: when the winner has more than
``balance_abs`` requests over the least loaded rank *and* more than ``balance_rel`` times its
count, the least loaded rank takes the request (and so becomes a second holder of the prefix).
An optional session key (the OpenAI ``user``) pins a session to the rank that served it last
while that rank stays within the balance bound.

``least_loaded`` and ``round_robin`` ignore the caches (baselines); ``ray_prefix`` leaves the
choice to Ray Serve's ``PrefixCacheAffinityRouter`` on the DPRank handle (the Router answers
with no target).
"""

from __future__ import annotations

import itertools
import typing
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from app.cache.radix import BlockHash
from app.config import check_fields
from app.deployments.prefix_index import GlobalPrefixIndex

Policy = Literal["prefix", "least_loaded", "round_robin", "ray_prefix"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)
MAX_SESSIONS = 100_000  # session keys the policy remembers (LRU)


@dataclass(frozen=True)
class RoutingConfig:
    """How the Router picks a DP rank (``ServeArgs.routing``). The block size and hash
    namespace the prefix index compares are the engine's, not options: the builder passes
    them to :class:`RoutingPolicy` (and every rank must announce the same)."""

    __pydantic_config__ = {"extra": "forbid"}

    policy: Policy = "prefix"
    balance_abs: int = field(default=16, metadata={"ge": 0})  # over the least loaded rank ...
    balance_rel: float = field(default=1.5, metadata={"ge": 1.0})  # ... and this ratio
    running_weight: float = field(default=16.0, metadata={"ge": 0})  # prefill tokens a request
    compute_weight: float = field(default=4.0, metadata={"ge": 0})  # own prefill vs the queue
    host_hit_cost: float = field(default=0.1, metadata={"ge": 0})  # a host-tier hit token
    max_index_blocks: int = field(default=4_000_000, metadata={"gt": 0})  # prefix index LRU
    pending_ttl_s: float = field(default=30.0, metadata={"gt": 0})  # routed = cached this long
    stream_interval_s: float = field(default=0.02, metadata={"ge": 0})  # rank delta batching

    def __post_init__(self) -> None:
        check_fields(self, "routing ")


@dataclass(frozen=True)
class RouteQuery:
    """What the ingress knows of a request when it asks for a rank."""

    num_prompt_tokens: int
    block_hashes: tuple[BlockHash, ...] = ()  # chain hashes of prompt[:-1] (engine blocks)
    block_size: int = 0  # what the ingress hashed with (must be the router's)
    session: str = ""  # session-affinity key ("" = none)
    exclude: tuple[str, ...] = ()  # ranks that already failed this request


@dataclass
class RankView:
    """A live rank as the policy sees it (from its last report, plus what was sent since)."""

    rank: str
    queued_tokens: float = 0.0
    outstanding: int = 0  # running + waiting (+ sent since its report)
    kv_usage: float = 0.0
    window: int = 0
    replay: str = "encoder+decoder"
    indexed: bool = True  # its events are in the index (same block size and namespace)


@dataclass(frozen=True)
class Decision:
    """The chosen rank (None: let the DPRank handle's own request router choose) and why."""

    target: str | None
    reason: str  # prefix | load | balance | session | round_robin | least_loaded | delegated
    cached_tokens: int = 0  # predicted prefix hit on the target
    confirmed_tokens: int = 0  # of which confirmed by the target's KV events
    predicted_tokens: float = 0.0  # cost(target)
    compute_tokens: float = 0.0  # of which this request's own prefill on the target
    best_hit_tokens: int = 0  # the largest hit on any live rank
    candidates: int = 0

    def attributes(self) -> dict[str, object]:
        """Span attributes (``routing.*``)."""
        return {
            "routing.target": self.target or "",
            "routing.reason": self.reason,
            "routing.cached_tokens": self.cached_tokens,
            "routing.confirmed_tokens": self.confirmed_tokens,
            "routing.predicted_tokens": round(self.predicted_tokens, 1),
            "routing.best_hit_tokens": self.best_hit_tokens,
            "routing.candidates": self.candidates,
        }


@dataclass
class RoutingPolicy:
    """Decides over ``ranks`` with the prefix ``index`` (see the module docstring).
    ``block_size`` / ``namespace``: how the engines hash prompt blocks (0: no prefix index,
    caching is off: route by load)."""

    cfg: RoutingConfig
    block_size: int = 0
    namespace: str = ""
    index: GlobalPrefixIndex = field(init=False)
    _rr: itertools.count = field(default_factory=itertools.count, init=False)
    _sessions: OrderedDict[str, str] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        self.index = GlobalPrefixIndex(self.cfg.max_index_blocks, self.cfg.pending_ttl_s)

    def decide(
        self, q: RouteQuery, ranks: Mapping[str, RankView], policy: str | None = None
    ) -> Decision | None:
        """The rank for ``q`` among ``ranks`` (minus ``q.exclude``); None if there is none."""
        policy, L = policy or self.cfg.policy, q.num_prompt_tokens
        live = sorted(r for r in ranks if r not in q.exclude)
        if not live:
            return None
        if policy == "ray_prefix":
            return Decision(None, "delegated", candidates=len(live))
        if policy == "round_robin":
            rank = live[next(self._rr) % len(live)]
            return Decision(rank, "round_robin", compute_tokens=L, candidates=len(live))
        if policy == "least_loaded":
            best = min(live, key=lambda r: (ranks[r].outstanding, ranks[r].kv_usage, r))
            return Decision(best, "least_loaded", compute_tokens=L, candidates=len(live))
        return self._prefix(q, [ranks[r] for r in live])

    def _prefix(self, q: RouteQuery, views: Sequence[RankView]) -> Decision:
        cfg, L = self.cfg, q.num_prompt_tokens
        P = self.block_size
        usable = q.block_hashes if q.block_size == P and P else ()
        indexed = [v.rank for v in views if v.indexed]
        hits = self.index.match(usable, indexed) if usable and indexed else {}
        lo = min(v.outstanding for v in views)

        def cost(v: RankView) -> tuple[float, int, int, float]:
            blocks, confirmed = hits.get(v.rank, (0, 0))
            H = min(blocks * P, max(L - 1, 0))
            compute = L - H + (H if v.replay == "off" else min(H, v.window))
            if blocks:  # host-tier blocks are loaded back: cheaper than a prefill, not free
                compute += cfg.host_hit_cost * P * self.index.host_blocks(usable, v.rank, blocks)
            queued = v.queued_tokens + cfg.running_weight * v.outstanding
            return queued + cfg.compute_weight * compute, H, min(confirmed * P, H), compute

        costs = {v.rank: cost(v) for v in views}
        by_rank = {v.rank: v for v in views}
        best_hit = max((c[1] for c in costs.values()), default=0)

        def over_bound(v: RankView) -> bool:
            return v.outstanding > lo + cfg.balance_abs and v.outstanding > cfg.balance_rel * lo

        def decision(rank: str, reason: str) -> Decision:
            c, H, conf, compute = costs[rank]
            return Decision(rank, reason, H, conf, c, compute, best_hit, len(views))

        if q.session:
            held = self._sessions.get(q.session)
            if held in by_rank and not over_bound(by_rank[held]):
                self._sessions.move_to_end(q.session)
                out = decision(held, "session")
                self._routed(q, out)
                return out
        rank = min(costs, key=lambda r: (costs[r][0], by_rank[r].outstanding, r))
        reason = "prefix" if costs[rank][1] > 0 else "load"
        if reason == "load":
            # a new prefix: of the ranks within the balance bound, the one holding the fewest
            # prefix blocks, so groups (and the hits that follow them, for as long as they
            # last) are placed evenly, not on whichever rank's queue was short at this instant
            # (W7: placing new prefixes by queue left one rank with 25% more of the traffic)
            rank = min(
                (r for r in costs if not over_bound(by_rank[r])),
                key=lambda r: (self.index.held(r), costs[r][0], r),
            )
        if over_bound(by_rank[rank]):
            rank = min(costs, key=lambda r: (by_rank[r].outstanding, costs[r][0], r))
            reason = "balance"
        out = decision(rank, reason)
        if q.session:
            self._sessions[q.session] = rank
            self._sessions.move_to_end(q.session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._routed(q, out)
        return out

    def _routed(self, q: RouteQuery, d: Decision) -> None:
        if d.target is not None and q.block_hashes and q.block_size == self.block_size:
            self.index.note_routed(d.target, q.block_hashes)


@dataclass(frozen=True)
class EngramPlan:
    """The Engram placement the Router publishes: ``mode`` (replicated / host / sharded)
    and ``key``, the node-wide name of the host copies (one per model)."""

    mode: str = "replicated"
    key: str = "fathom-engram"
