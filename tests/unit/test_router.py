"""Choosing a DP rank: the Router's load score and the pinned request router (no Ray cluster;
the integration tests drive both through Serve)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from app.deployments.router import STALE_S, PinnedRequestRouter, Router  # noqa: E402


def _replica(rid: str) -> SimpleNamespace:
    """What ``choose_replicas`` reads of a ``RunningReplica``."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def _choose(kwargs: dict, replicas: list) -> tuple[list[list], PendingRequest]:
    async def run() -> tuple[list[list], PendingRequest]:
        pr = PendingRequest(args=[], kwargs=kwargs, metadata=RequestMetadata("r", "ir"))
        # the method reads no router state, so the router is built without a Serve handle
        router = object.__new__(PinnedRequestRouter)
        return await router.choose_replicas(replicas, pr), pr

    return asyncio.run(run())


def test_pinned_call_goes_to_its_rank_and_backs_off_when_full():
    a, b = _replica("a"), _replica("b")
    chosen, pr = _choose({"target": "b"}, [a, b])
    assert chosen == [[b]]
    # a pinned rank that is full (or slow to answer its queue-length probe) must be retried
    # with backoff: without it Serve retried in a busy loop that starved the ingress
    assert pr.routing_context.should_backoff


def test_unpinned_or_gone_target_may_go_anywhere():
    a, b = _replica("a"), _replica("b")
    assert _choose({}, [a, b])[0] == [[a, b]]
    chosen, pr = _choose({"target": "gone"}, [a, b])
    assert chosen == [[a, b]] and pr.routing_context.should_backoff


def test_router_picks_least_loaded_live_rank():
    async def run() -> None:
        router = Router.func_or_class()
        assert await router.choose(10) is None  # no rank reported yet
        await router.report("busy", {"num_running": 5, "num_waiting": 2, "kv_usage": 0.5}, {})
        await router.report("idle", {"num_running": 1, "num_waiting": 0, "kv_usage": 0.1}, {})
        # requests sent since the last report count as queued work: the idle rank takes
        # requests until its score passes the busy one's (1.4 + n vs 9.0)
        picks = [await router.choose(10) for _ in range(9)]
        assert picks == ["idle"] * 8 + ["busy"]
        # a rank that stopped reporting is not chosen and not listed
        router.ranks["idle"].seen = time.monotonic() - STALE_S - 1
        assert await router.choose(10) == "busy"
        assert set(await router.ranks_stats()) == {"busy"}

    asyncio.run(run())
