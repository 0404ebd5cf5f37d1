"""Choosing a DP rank: the Router deployment (rank loads + the global prefix index, fed by the
ranks' KV events) and the request router that pins a call to the chosen replica.

    rank --report(stats, meta, KV event batch)--> Router   (every REPORT_S, sooner with events)
         <------------- {"resync": True} --------          (gap, new epoch, unknown rank)
    rank --snapshot(every cached hash)-----------> Router   (then events after its seq)
    ingress --choose(RouteQuery)--> Router --> Decision (replica id + why)
    ingress --generate(req, target=replica id)--> DPRank   (PinnedRequestRouter: tokens never
                                                            pass through the Router)

A rank that stops reporting for ``STALE_S`` (or that the ingress saw fail) leaves the choice
and the index at once; a restarted router has no state and rebuilds it from the snapshots the
ranks send when it answers their first report with ``resync``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app.cache.events import KVEventBatch, KVSnapshot
from app.deployments.routing import (
    Decision,
    EngramPlan,
    RankView,
    RouteQuery,
    RoutingConfig,
    RoutingPolicy,
)
from app.logs import setup_logging
from app.observability import ObservabilityConfig, setup_tracing

logger = logging.getLogger(__name__)

REPORT_S = 0.5  # stats period of a rank
EVENTS_S = 0.05  # a rank with new KV events reports this soon
STALE_S = 10.0
IN_FLIGHT_S = 10.0  # a routed request not seen at its rank by then never got there


def pinned_target(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[RunningReplica] | None:
    """The replica a call names with ``target=<replica id>`` (None: no target, or it is gone).
    Also makes Serve back off between attempts when the chosen replica is full or its
    queue-length probe times out; without it Serve retries in a busy loop that starves the
    caller's event loop (the probes then time out too: a livelock)."""
    if pending_request is None:
        return None
    pending_request.routing_context.should_backoff = True
    target = pending_request.kwargs.get("target")
    if target:
        pinned = [r for r in candidates if r.replica_id.unique_id == target]
        if pinned:
            return pinned
    return None


class PinnedRequestRouter(RequestRouter):
    """Routes a call with ``target=<replica id>`` to that replica; other calls (and a target
    that is gone) go to the replica with the shortest queue."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pinned = pinned_target(candidate_replicas, pending_request)
        return [pinned or candidate_replicas]


@dataclass
class RankState:
    """What the Router knows of one rank."""

    stats: dict[str, float]
    seen: float
    meta: dict[str, object] = field(default_factory=dict)
    # routed to it and not yet seen arriving there (the rank's ``received_requests``):
    # (time, predicted prefill tokens), oldest first; entries expire after IN_FLIGHT_S
    in_flight: deque[tuple[float, float]] = field(default_factory=deque)
    received: float = -1.0  # the rank's received_requests at its last report (-1: none)
    epoch: str = ""  # KV event stream applied so far: epoch and last sequence number
    seq: int = -1
    indexed: bool = False  # same block size and hash namespace as the router

    def sent(self, tokens: float) -> None:
        self.in_flight.append((time.monotonic(), tokens))

    def arrived(self, received: float) -> None:
        """A report: the requests the rank received since the last one are no longer in
        flight (oldest first); entries older than IN_FLIGHT_S never arrived (the client went
        away, the call failed) and are dropped."""
        if self.received >= 0:
            for _ in range(max(0, int(received - self.received))):
                if not self.in_flight:
                    break
                self.in_flight.popleft()
        self.received = received
        old = time.monotonic() - IN_FLIGHT_S
        while self.in_flight and self.in_flight[0][0] < old:
            self.in_flight.popleft()

    def view(self, rank: str) -> RankView:
        s = self.stats
        flying = sum(t for _, t in self.in_flight)
        return RankView(
            rank,
            queued_tokens=s.get("queued_prefill_tokens", 0.0) + flying,
            outstanding=int(s.get("num_waiting", 0) + s.get("num_running", 0))
            + len(self.in_flight),
            kv_usage=s.get("kv_usage", 0.0),
            window=int(self.meta.get("window", 0)),  # type: ignore[call-overload]
            replay=str(self.meta.get("replay", "encoder+decoder")),
            indexed=self.indexed and self.seq >= 0,
        )


class _Metrics:
    """Ray metrics of the Router (exported by every node's metrics agent)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self.decisions = Counter(
            "fathom_router_decisions_total",
            "Routing decisions by policy and reason",
            tag_keys=("policy", "reason"),
        )
        self.resyncs = Counter(
            "fathom_router_resyncs_total", "KV index snapshot resyncs asked of ranks"
        )
        self.index_blocks = Gauge("fathom_router_index_blocks", "Entries of the prefix index")
        self.ranks = Gauge("fathom_router_ranks", "Live DP ranks the router routes to")


# every request calls ``choose`` (and each rank reports twice a second, more with KV events):
# Serve's default of 5 ongoing calls would queue a burst of arrivals behind queue-length
# probes. No access log: these control calls made ~4 lines/s at idle.
@serve.deployment(
    name="Router",
    num_replicas=1,
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0.05},
    logging_config={"enable_access_log": False},
)
class Router:
    """Global view of the DP ranks: their load and their prefix-cache contents."""

    def __init__(
        self,
        cfg: RoutingConfig | None = None,
        tracing: ObservabilityConfig | None = None,
        engram: EngramPlan | None = None,
        block_size: int = 0,
        namespace: str = "",
    ) -> None:
        """``block_size`` / ``namespace``: how the engines hash prompt blocks (the builder
        resolves them from the engine config; 0 = caching off, no prefix index)."""
        setup_logging()
        setup_tracing(tracing, "Router")
        self.cfg = cfg or RoutingConfig()
        self.policy = RoutingPolicy(self.cfg, block_size, namespace)
        self.policy_name = self.cfg.policy
        self.ranks: dict[str, RankState] = {}
        self.metrics = _Metrics()
        self.engram = engram or EngramPlan()
        self.rendezvous_by_gang: dict[str, tuple[str, int]] = {}  # gang id -> rank 0's store

    # ---- gangs (expert parallelism) -------------------------------------------------------
    async def engram_placement(self) -> EngramPlan:
        """Where the ranks keep the Engram tables (decided here, from the config)."""
        return self.engram

    async def publish_rendezvous(self, gang_id: str, host: str, port: int) -> None:
        """Rank 0 of a gang announces its ``torch.distributed`` store (a fresh gang: new id)."""
        self.rendezvous_by_gang[gang_id] = (host, port)

    async def rendezvous(self, gang_id: str) -> tuple[str, int] | None:
        return self.rendezvous_by_gang.get(gang_id)

    # ---- rank reports ---------------------------------------------------------------------
    async def report(
        self,
        replica_id: str,
        stats: dict[str, float],
        meta: dict,
        events: KVEventBatch | None = None,
    ) -> dict[str, bool]:
        """A rank's periodic report (stats of its engine) with its KV events since the last
        one it sent. Answers ``{"resync": True}`` when the rank must send a snapshot."""
        st = self.ranks.get(replica_id)
        if st is None:
            st = self.ranks[replica_id] = RankState(stats, time.monotonic(), meta)
            st.arrived(stats.get("received_requests", 0.0))
            st.indexed = self._compatible(replica_id, meta)
            self.metrics.ranks.set(len(self.ranks))
        else:
            st.stats, st.seen, st.meta = stats, time.monotonic(), meta
            st.arrived(stats.get("received_requests", st.received + len(st.in_flight)))
        if not st.indexed:
            return {"resync": False}
        if events is None or events.epoch != st.epoch or events.first_seq != st.seq + 1:
            self.metrics.resyncs.inc()
            return {"resync": True}
        if events.events:
            self.policy.index.apply(replica_id, events.events)
            st.seq = events.last_seq
            self.metrics.index_blocks.set(len(self.policy.index))
        return {"resync": False}

    async def snapshot(self, replica_id: str, snap: KVSnapshot) -> None:
        """A rank's whole prefix cache (after a resync answer); its events follow from
        ``snap.seq``."""
        st = self.ranks.get(replica_id)
        if st is None or not st.indexed:
            return
        self.policy.index.load_snapshot(replica_id, snap)
        st.epoch, st.seq = snap.epoch, snap.seq
        self.metrics.index_blocks.set(len(self.policy.index))
        logger.info("rank %s: prefix index loaded (%d blocks)", replica_id, len(snap.hashes))

    def _compatible(self, replica_id: str, meta: dict) -> bool:
        """Whether a rank's block hashes can be compared with the router's (the same block
        size and hash namespace, prefix caching on)."""
        if not self.policy.block_size or not meta.get("prefix_caching", False):
            return False
        got = (meta.get("block_size"), meta.get("namespace"))
        want = (self.policy.block_size, self.policy.namespace)
        if got != want:
            logger.error(
                "rank %s announces block size / hash namespace %s, the router expects %s: its "
                "cache is not indexed and it is routed to by load alone", replica_id, got, want,
            )  # fmt: skip
            return False
        return True

    async def drop(self, replica_id: str) -> None:
        """Forget a rank at once (the ingress saw it fail, or it is draining); a live rank
        that reports again comes back with its next report (and a resync). A restarted rank
        has a new replica id."""
        if self.ranks.pop(replica_id, None) is not None:
            self.policy.index.drop_rank(replica_id)
            self.metrics.ranks.set(len(self.ranks))
            logger.warning("rank %s dropped from routing and the prefix index", replica_id)

    def _live(self) -> dict[str, RankState]:
        now = time.monotonic()
        for k in [k for k, v in self.ranks.items() if now - v.seen >= STALE_S]:
            logger.warning("rank %s dropped: no report for %.0f s", k, STALE_S)
            del self.ranks[k]
            self.policy.index.drop_rank(k)
            self.metrics.ranks.set(len(self.ranks))
        return self.ranks

    # ---- decisions ------------------------------------------------------------------------
    async def choose(self, q: RouteQuery) -> Decision | None:
        """The rank to serve a request (None when no rank is live, other than the excluded
        ones; a Decision with target None leaves the choice to the DPRank handle)."""
        live = {k: v for k, v in self._live().items() if v.stats.get("healthy", 1)}
        d = self.policy.decide(q, {k: v.view(k) for k, v in live.items()}, self.policy_name)
        if d is None:
            return None
        self.metrics.decisions.inc(tags={"policy": self.policy_name, "reason": d.reason})
        if d.target is not None:
            live[d.target].sent(d.compute_tokens)
        return d

    async def set_policy(self, name: str) -> None:
        """Switch the policy at run time (benchmarks compare policies on one deployment)."""
        replace(self.cfg, policy=name)  # validates the name
        self.policy_name = name

    async def ranks_stats(self) -> dict[str, dict[str, float]]:
        return {k: dict(v.stats) for k, v in self._live().items()}

    async def context_limit(self) -> int | None:
        """The live ranks' smallest ``max_model_len`` (their meta); None before any reports."""
        lens = [int(v.meta["max_model_len"]) for v in self._live().values()  # type: ignore[call-overload]
                if "max_model_len" in v.meta]  # fmt: skip
        return min(lens) if lens else None

    async def index_stats(self) -> dict[str, object]:
        """Per rank: indexed blocks, event sequence, whether indexed (tests, operators)."""
        idx = self.policy.index
        return {
            "entries": len(idx),
            "evicted": idx.evicted,
            "policy": self.policy_name,
            "ranks": {
                k: {"blocks": idx.blocks_of(k), "seq": v.seq, "indexed": v.indexed}
                for k, v in self._live().items()
            },
        }
