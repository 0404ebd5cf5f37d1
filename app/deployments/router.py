"""Choosing a DP rank: the Router deployment (load now; the prefix-aware index joins here) and
the request router that pins a call to the chosen replica.

Ranks push their stats every ``REPORT_S``; ``choose`` scores each live rank by its queued work
(waiting + running requests, plus requests sent since its last report) and KV usage, and
returns the least loaded rank's replica id. The ingress then calls ``DPRank`` with
``target=<replica id>``; :class:`PinnedRequestRouter` sends it there, so streamed tokens never
pass through the Router.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app.logs import setup_logging
from app.observability import TracingConfig, setup_tracing

logger = logging.getLogger(__name__)

REPORT_S = 0.5
STALE_S = 10.0


class PinnedRequestRouter(RequestRouter):
    """Routes a call with ``target=<replica id>`` to that replica; other calls (and a target
    that is gone) go to the replica with the shortest queue."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = None
        if pending_request is not None:
            target = pending_request.kwargs.get("target")
            # back off between attempts when the chosen replica is full or its queue-length
            # probe times out; without it Serve retries in a busy loop that starves the
            # caller's event loop (the probes then time out too: a livelock)
            pending_request.routing_context.should_backoff = True
        if target:
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if pinned:
                return [pinned]
        return [candidate_replicas]


@dataclass
class RankLoad:
    stats: dict[str, float]
    seen: float
    sent_since_report: int = 0
    meta: dict[str, object] = field(default_factory=dict)

    def score(self) -> float:
        s = self.stats
        queued = s.get("num_waiting", 0) + s.get("num_running", 0) + self.sent_since_report
        return queued + 4.0 * s.get("kv_usage", 0.0)


# every request calls ``choose`` (and each rank reports twice a second): Serve's default of 5
# ongoing calls would queue a burst of arrivals behind queue-length probes. No access log: these
# control calls made ~4 lines/s at idle.
@serve.deployment(
    name="Router",
    num_replicas=1,
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0.05},
    logging_config={"enable_access_log": False},
)
class Router:
    """Global view of the DP ranks: load (and, later, their prefix-cache contents)."""

    def __init__(self, tracing: TracingConfig | None = None) -> None:
        setup_logging()
        setup_tracing(tracing, "Router")
        self.ranks: dict[str, RankLoad] = {}

    async def report(self, replica_id: str, stats: dict[str, float], meta: dict) -> None:
        """A rank's periodic report (stats of its engine)."""
        self.ranks[replica_id] = RankLoad(stats, time.monotonic(), 0, meta)

    async def drop(self, replica_id: str) -> None:
        """Forget a rank at once (the ingress saw it fail); a live rank that reports again
        comes back with its next report. A restarted rank has a new replica id."""
        if self.ranks.pop(replica_id, None) is not None:
            logger.warning("rank %s dropped: a request to it failed", replica_id)

    def _live(self) -> dict[str, RankLoad]:
        now = time.monotonic()
        for k in [k for k, v in self.ranks.items() if now - v.seen >= STALE_S]:
            logger.warning("rank %s dropped: no report for %.0f s", k, STALE_S)
            del self.ranks[k]
        return self.ranks

    async def choose(self, num_prompt_tokens: int, exclude: list[str] | None = None) -> str | None:
        """The replica id of the rank to serve a request (None when no rank is live, other
        than the ``exclude``d ones)."""
        live = {
            k: v
            for k, v in self._live().items()
            if v.stats.get("healthy", 1) and not (exclude and k in exclude)
        }
        if not live:
            return None
        rid = min(live, key=lambda k: (live[k].score(), k))
        live[rid].sent_since_report += 1
        return rid

    async def ranks_stats(self) -> dict[str, dict[str, float]]:
        return {k: dict(v.stats) for k, v in self._live().items()}
