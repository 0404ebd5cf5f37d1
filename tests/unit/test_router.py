"""Choosing a DP rank: the Router's policy over loads and the prefix index fed by KV events
(resyncs, gaps, restarts, dead ranks), and the pinned request router (no Ray cluster; the
integration tests drive both through Serve)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from app.cache.events import HASH_NAMESPACE, KVEventBatch, KVEventLog  # noqa: E402
from app.cache.radix import BlockMoved, BlockRemoved, BlockStored, chain_hashes  # noqa: E402
from app.deployments.prefix_index import GlobalPrefixIndex  # noqa: E402
from app.deployments.router import STALE_S, PinnedRequestRouter, Router  # noqa: E402
from app.deployments.routing import RouteQuery, RoutingConfig  # noqa: E402

P = 4  # block size of these tests
META = {"block_size": P, "namespace": HASH_NAMESPACE, "prefix_caching": True, "window": 8,
        "replay": "encoder"}  # fmt: skip
IDLE = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}


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


def _router(**kw) -> Router:
    router = Router.func_or_class(RoutingConfig(**kw), block_size=P, namespace=HASH_NAMESPACE)
    router.metrics = SimpleNamespace(  # ray.util.metrics need a Ray worker: count locally
        decisions=SimpleNamespace(inc=lambda tags: None),
        resyncs=SimpleNamespace(inc=lambda: None),
        index_blocks=SimpleNamespace(set=lambda v: None),
        ranks=SimpleNamespace(set=lambda v: None),
    )
    return router


class FakeRank:
    """A rank's KV event log and the reporter's protocol (what DPRank._report_loop does)."""

    def __init__(self, router: Router, rid: str, meta: dict = META) -> None:
        self.router, self.rid, self.meta = router, rid, meta
        self.log, self.cached, self.sent = KVEventLog(max_events=8), set(), None
        self.host: set = set()  # of the cached hashes, those in the host tier

    def store(self, ids: list[int]) -> None:
        hs = chain_hashes(ids, P)
        new = tuple(h for h in hs if h not in self.cached)
        self.cached.update(new)
        self.log.append([BlockStored(new, None, (), (), b"")])

    def remove(self, ids: list[int]) -> None:
        hs = tuple(chain_hashes(ids, P))
        self.cached.difference_update(hs)
        self.host.difference_update(hs)
        self.log.append([BlockRemoved(hs)])

    def move(self, ids: list[int], tier: str) -> None:
        hs = tuple(chain_hashes(ids, P))
        (self.host.update if tier == "host" else self.host.difference_update)(hs)
        self.log.append([BlockMoved(hs, tier)])

    async def report(self, stats: dict = IDLE) -> bool:
        """One report; True when it had to resync."""
        batch = self.log.since(self.sent) if self.sent is not None else None
        reply = await self.router.report(self.rid, dict(stats), self.meta, batch)
        if reply["resync"]:
            snap = self.log.snapshot(sorted(self.cached), sorted(self.host))
            await self.router.snapshot(self.rid, snap)
            self.sent = snap.seq
            return True
        if batch is not None:
            self.sent = batch.last_seq
        return False


def q(ids: list[int], **kw) -> RouteQuery:
    return RouteQuery(len(ids), tuple(chain_hashes(ids[:-1], P)), P, **kw)


SYS = list(range(100, 132))  # a 32-token shared prefix: 8 blocks
LONG = list(range(1000, 1128))  # 32 blocks


def test_router_picks_least_loaded_live_rank():
    async def run() -> None:
        router = _router()
        assert await router.choose(RouteQuery(10)) is None  # no rank reported yet
        await router.report("busy", {"num_running": 5, "num_waiting": 2, "kv_usage": 0.5}, {})
        await router.report("idle", {"num_running": 1, "num_waiting": 0, "kv_usage": 0.1}, {})
        # cost = 16 x outstanding + queued prefill tokens + 4 x this prompt: busy 7*16+40 =
        # 152, idle 56 + 26 per request sent since its report: idle takes four, busy the fifth
        picks = [(await router.choose(RouteQuery(10))).target for _ in range(6)]
        assert picks == ["idle"] * 4 + ["busy", "idle"]
        # a rank that stopped reporting is not chosen and not listed
        router.ranks["idle"].seen = time.monotonic() - STALE_S - 1
        assert (await router.choose(RouteQuery(10))).target == "busy"
        assert set(await router.ranks_stats()) == {"busy"}

    asyncio.run(run())


def test_router_context_limit_is_the_live_ranks_smallest():
    async def run() -> None:
        router = _router()
        assert await router.context_limit() is None  # no rank reported yet
        await router.report("a", {}, {"max_model_len": 65536})
        await router.report("b", {}, {"max_model_len": 32768})
        assert await router.context_limit() == 32768
        router.ranks["b"].seen = time.monotonic() - STALE_S - 1  # b stopped reporting
        assert await router.context_limit() == 65536

    asyncio.run(run())


def test_shared_prefix_goes_to_the_rank_holding_it():
    async def run() -> None:
        router = _router()
        a, b = FakeRank(router, "a"), FakeRank(router, "b")
        assert await a.report() and await b.report()  # unknown ranks: resync (empty snapshot)
        b.store(SYS)
        assert not await b.report()  # events since the snapshot apply without a resync
        d = await router.choose(q(SYS + [7, 8, 9]))
        assert (d.target, d.reason, d.cached_tokens, d.confirmed_tokens) == ("b", "prefix", 32, 32)
        # a hit at H still replays the last window: 35 - 32 + min(32, 8) = 11 tokens
        assert d.compute_tokens == 11
        # an unrelated prompt is routed by load: a (b has one request sent since its report)
        d = await router.choose(q(list(range(500, 540))))
        assert (d.target, d.reason, d.cached_tokens) == ("a", "load", 0)
        # a removed block cuts b's match there
        b.remove(SYS[:20])  # blocks 0..4 gone (the engine evicts leaves first; here all)
        await b.report()
        d = await router.choose(q(SYS + [1]))
        assert d.cached_tokens == 0

    asyncio.run(run())


def test_a_new_prefix_follows_its_first_request_before_the_events_land():
    async def run() -> None:
        router = _router()
        for r in ("a", "b", "c"):
            await FakeRank(router, r).report()
        first = await router.choose(q(LONG + [1]))
        # nothing is cached yet: pending entries make the next requests of the group follow
        # the first (load alone would spread them over the three ranks). On the first's rank
        # the j-th costs 16 j + 129 + 9 (j - 1) (sent work) + 4 x (1 + 8) = 25 j + 156;
        # elsewhere 4 x 129 = 516: the first 14 follow, the 15th (531) goes elsewhere
        rest = [await router.choose(q(LONG + [i])) for i in range(2, 17)]
        assert [d.target == first.target for d in rest] == [True] * 14 + [False]
        assert all(d.cached_tokens == 128 and d.confirmed_tokens == 0 for d in rest[:14])

    asyncio.run(run())


def test_a_hot_prefix_spreads_past_the_balance_bound():
    async def run() -> None:
        router = _router(balance_abs=4, balance_rel=1.5)
        a, b = FakeRank(router, "a"), FakeRank(router, "b")
        await a.report(), await b.report()
        a.store(LONG)
        await a.report({"num_running": 4, "num_waiting": 0, "kv_usage": 0.2})
        await b.report({"num_running": 1, "num_waiting": 0, "kv_usage": 0.0})
        d = await router.choose(q(LONG + [6]))  # 4 <= 1 + 4: within the bound, the cache wins
        assert (d.target, d.reason) == ("a", "prefix")
        await a.report({"num_running": 6, "num_waiting": 0, "kv_usage": 0.2})
        await b.report({"num_running": 1, "num_waiting": 0, "kv_usage": 0.0})
        # a holds the prefix and costs less (16 x 6 + 4 x 9 = 132 vs 16 + 4 x 129 = 532) but
        # has 6 requests against b's 1 (> 1 + 4 and > 1.5 x 1): b takes it
        d = await router.choose(q(LONG + [5]))
        assert (d.target, d.reason, d.best_hit_tokens) == ("b", "balance", 128)

    asyncio.run(run())


def test_gap_new_epoch_and_router_restart_resync_from_snapshots():
    async def run() -> None:
        router = _router()
        a = FakeRank(router, "a")
        await a.report()
        a.store(SYS)
        for i in range(10):  # more events than the rank's log keeps (8): the router lags
            a.store([900 + i] * 8)
        assert await a.report()  # the log lost the next event: snapshot
        assert router.policy.index.blocks_of("a") == len(a.cached)
        assert not await a.report()
        # the rank restarts (a new engine: a new epoch, an empty cache)
        a.log, a.cached = KVEventLog(max_events=8), set()
        a.store(SYS[:8])
        assert await a.report()
        assert router.policy.index.blocks_of("a") == 2
        # the router restarts: it knows nothing and asks for a snapshot on the first report
        router2 = _router()
        a.router = router2
        assert await a.report()
        d = await router2.choose(q(SYS + [1]))
        assert (d.target, d.cached_tokens, d.confirmed_tokens) == ("a", 8, 8)
        # a batch that does not follow the last applied sequence number is refused
        stale = KVEventBatch(a.log.epoch, 1, ())
        assert (await router2.report("a", IDLE, META, stale))["resync"]

    asyncio.run(run())


def test_mismatched_block_size_or_namespace_is_routed_by_load_only():
    async def run() -> None:
        router = _router()
        good = FakeRank(router, "good")
        bad = FakeRank(router, "bad", {**META, "block_size": 8})
        other = FakeRank(router, "other", {**META, "namespace": "someone-else/v0"})
        assert await good.report()
        assert not await bad.report() and not await other.report()  # never indexed
        bad.store(SYS)
        await bad.report()
        assert router.policy.index.blocks_of("bad") == 0
        stats = await router.index_stats()
        assert {k: v["indexed"] for k, v in stats["ranks"].items()} == {
            "good": True, "bad": False, "other": False,
        }  # fmt: skip
        # a query hashed with another block size matches nothing
        d = await router.choose(RouteQuery(33, tuple(chain_hashes(SYS, 8)), 8))
        assert d.cached_tokens == 0 and d.reason == "load"

    asyncio.run(run())


def test_dropped_rank_leaves_choice_and_index():
    async def run() -> None:
        router = _router()
        a, b = FakeRank(router, "a"), FakeRank(router, "b")
        await a.report(), await b.report()
        a.store(SYS)
        await a.report()
        assert router.policy.index.blocks_of("a") == 8
        await router.drop("a")
        assert router.policy.index.blocks_of("a") == 0 and len(router.policy.index) == 0
        picks = {(await router.choose(q(SYS + [i]))).target for i in range(5)}
        assert picks == {"b"}
        # excluded ranks (failed for this request) are skipped; none left -> None
        assert await router.choose(q(SYS + [1], exclude=("b",))) is None

    asyncio.run(run())


def test_session_key_pins_a_session_within_the_bound():
    async def run() -> None:
        router = _router(balance_abs=2)
        for r in ("a", "b", "c"):
            await FakeRank(router, r).report()
        first = await router.choose(RouteQuery(10, session="alice"))
        again = [await router.choose(RouteQuery(10, session="alice")) for _ in range(2)]
        assert [d.target for d in again] == [first.target] * 2
        assert {d.reason for d in again} == {"session"}
        # past the balance bound (3 sent vs 0 elsewhere) the session moves
        moved = await router.choose(RouteQuery(10, session="alice"))
        assert moved.target != first.target and moved.reason == "load"

    asyncio.run(run())


def test_round_robin_and_delegated_policies():
    async def run() -> None:
        router = _router()
        for r in ("a", "b"):
            await FakeRank(router, r).report()
        await router.set_policy("round_robin")
        assert [(await router.choose(RouteQuery(5))).target for _ in range(4)] == [
            "a", "b", "a", "b",
        ]  # fmt: skip
        await router.set_policy("ray_prefix")
        d = await router.choose(RouteQuery(5))
        assert d.target is None and d.reason == "delegated"
        with pytest.raises(ValueError, match="routing policy"):
            await router.set_policy("random")

    asyncio.run(run())


def test_index_lru_bound_and_bit_reuse():
    idx = GlobalPrefixIndex(max_entries=16)
    hs = chain_hashes(list(range(80)), P)  # 20 blocks
    idx.apply("a", [(0, tuple(hs))])
    assert len(idx) == 16 and idx.evicted == 4
    # the chain's first blocks were evicted: a match starts at block 0, so it finds nothing
    assert idx.match(hs, ["a"])["a"] == (0, 0)
    assert idx.match(hs[4:], ["a"])["a"] == (16, 16)
    slot_a = idx.slot("a")
    idx.drop_rank("a")
    assert len(idx) == 0 and idx.slot("b") == slot_a  # the bit is reused, with no leftovers
    assert idx.match(hs[4:], ["b"])["b"] == (0, 0)


def test_event_log_since_and_overflow():
    log = KVEventLog(max_events=3)
    assert log.since(0) == KVEventBatch(log.epoch, 1, ())
    log.append([BlockStored((b"x",), None, (), (), b""), BlockRemoved((b"x",))])
    assert log.since(0).events == ((0, (b"x",)), (1, (b"x",)))
    assert log.since(1).first_seq == 2 and log.since(2).events == ()
    log.append([BlockRemoved((b"y",))] * 3)  # seq 5; the log keeps 3..5
    assert log.since(1) is None and log.since(2).first_seq == 3
    assert log.since(9) is None  # ahead of the log: another epoch's number


def test_autoscaling_policy_scales_on_queue_depth_and_kv_usage():
    from app.deployments.autoscaling import RankPolicy

    def ctx(n: int, ongoing: float, kv: list[float]) -> SimpleNamespace:
        return SimpleNamespace(
            current_num_replicas=n, target_num_replicas=n, total_num_requests=ongoing,
            aggregated_metrics={"kv_usage": dict(enumerate(kv))} if kv else {},
            config=SimpleNamespace(get_target_ongoing_requests=lambda: 16),
        )  # fmt: skip

    pol = RankPolicy(target_kv_usage=0.8)
    assert pol(ctx(2, 64, [0.1, 0.1]))[0] == 4  # 64 streams / 16 per rank
    assert pol(ctx(2, 8, [0.9, 0.7]))[0] == 2 * 0.8 / 0.8  # KV full: 2 ranks' worth at 0.8
    assert pol(ctx(2, 8, [1.0, 1.0]))[0] == 2.5  # few streams but full pools: scale up
    assert pol(ctx(4, 4, []))[0] == 0.25  # idle, no KV metrics yet: down (Serve bounds it)


def test_serve_args_routing_and_autoscaling_are_validated():
    from pydantic import ValidationError

    from app.serve_args import ServeArgs

    sa = ServeArgs.model_validate({"autoscaling": {"min_ranks": 1, "max_ranks": 3}})
    cfg = sa.autoscaling.serve_config()
    assert (cfg["min_replicas"], cfg["max_replicas"], cfg["initial_replicas"]) == (1, 3, 1)
    assert cfg["policy"]["policy_function"] == "app.deployments.autoscaling:RankPolicy"
    with pytest.raises(ValidationError, match="max_ranks"):
        ServeArgs.model_validate({"autoscaling": {"min_ranks": 3, "max_ranks": 2}})
    with pytest.raises(ValidationError, match="policy"):
        ServeArgs.model_validate({"routing": {"policy": "random"}})
    with pytest.raises(ValidationError, match="balance_rel"):
        ServeArgs.model_validate({"routing": {"balance_rel": 0.5}})


def test_a_new_prefix_goes_to_the_rank_holding_the_fewest_blocks():
    async def run() -> None:
        router = _router()
        a, b, c = (FakeRank(router, r) for r in ("a", "b", "c"))
        for r in (a, b, c):
            await r.report()
        a.store(LONG)
        a.store(SYS)
        b.store(SYS)
        for r in (a, b, c):
            await r.report()
        # all idle, no rank holds this prompt: c (0 blocks) rather than the first by name
        d = await router.choose(q(list(range(2000, 2100))))
        assert (d.target, d.reason) == ("c", "load")
        router.policy.index.check_counts()
        assert router.policy.index.held("c") == 24  # its pending claims: 99 tokens, 24 blocks

    asyncio.run(run())


def test_held_counts_follow_every_change():
    idx = GlobalPrefixIndex(max_entries=10, pending_ttl_s=1.0)
    hs = chain_hashes(list(range(48)), P)  # 12 blocks
    idx.note_routed("a", hs[:6], now=0.0)
    idx.apply("b", [(0, tuple(hs[:4]))])
    idx.apply("a", [(0, tuple(hs[:3]))])  # confirms 3 of a's 6 claims
    idx.check_counts()
    assert (idx.held("a"), idx.held("b")) == (6, 4)
    idx.apply("a", [(1, (hs[5],))])  # removed there: its claim ends too
    assert idx.held("a") == 5
    idx.apply("b", [(0, tuple(hs[4:]))])  # 12 entries > 10: LRU drops the oldest two
    idx.check_counts()
    idx.note_routed("c", hs[:1], now=5.0)  # a's old claims (t=0) expire
    idx.check_counts()
    assert idx.held("a") == len([h for h in hs[:3] if h in idx._entries])
    idx.drop_rank("b")
    idx.check_counts()
    assert idx.held("b") == 0


def test_host_tier_hits_weigh_below_device_hits():
    async def run() -> None:
        router = _router(compute_weight=1.0)
        a, b = FakeRank(router, "a"), FakeRank(router, "b")
        assert await a.report() and await b.report()
        a.store(SYS)
        b.store(SYS)
        a.move(SYS, "host")  # a demoted the prefix to its host tier
        await a.report()
        await b.report()
        idx = router.policy.index
        hs = chain_hashes(SYS, P)
        assert idx.host_blocks(hs, "a", 8) == 8 and idx.host_blocks(hs, "b", 8) == 0
        d = await router.choose(q(SYS + [7, 8, 9]))
        # both hold 32 tokens; a must load them back: 11 + 0.1 x 32 prefill tokens
        assert (d.target, d.cached_tokens, d.compute_tokens) == ("b", 32, 11)
        assert router.policy._prefix(q(SYS + [7, 8, 9]), [router.ranks["a"].view("a")]) \
            .compute_tokens == pytest.approx(11 + 0.1 * 32)  # fmt: skip
        # a restarted router learns the tiers from the snapshot
        fresh = _router()
        a.router = fresh
        a.sent = None
        assert await a.report()
        assert fresh.policy.index.host_blocks(hs, "a", 8) == 8
        a.router = router
        a.move(SYS, "device")  # loaded back: no longer host
        await a.report()
        assert idx.host_blocks(hs, "a", 8) == 0
        a.move(SYS[:16], "host")
        a.remove(SYS)  # gone from both tiers
        await a.report()
        assert idx.host_blocks(hs, "a", 8) == 0 and idx.blocks_of("a") == 0
        idx.check_counts()

    asyncio.run(run())


def test_requests_in_flight_count_until_their_rank_has_received_them(monkeypatch):
    """A report that does not include requests still on their way to the rank (the rank's
    received_requests has not moved) keeps them in the rank's load, so a burst between two
    reports does not herd onto one rank; they leave the load once received, or after
    IN_FLIGHT_S when they never arrive."""
    import app.deployments.router as rt

    async def run():
        router = _router(policy="least_loaded")
        a, b = FakeRank(router, "a"), FakeRank(router, "b")
        for r in (a, b):
            await r.report({**IDLE, "received_requests": 0.0})
        q = RouteQuery(10)
        picks = [(await router.choose(q)).target for _ in range(6)]
        assert sorted(picks) == ["a"] * 3 + ["b"] * 3  # alternates as the load grows
        await a.report({**IDLE, "received_requests": 0.0})  # stale: none arrived yet
        assert len(router.ranks["a"].in_flight) == 3
        # a still counts its three: the next two go one to each (not both to an "idle" a)
        assert sorted([(await router.choose(q)).target for _ in range(2)]) == ["a", "b"]
        assert len(router.ranks["a"].in_flight) == 4
        await a.report({**IDLE, "received_requests": 2.0})  # two arrived
        assert len(router.ranks["a"].in_flight) == 2
        now = time.monotonic()
        monkeypatch.setattr(rt.time, "monotonic", lambda: now + rt.IN_FLIGHT_S + 1)
        await b.report({**IDLE, "received_requests": 0.0})  # b's four never arrived
        assert not router.ranks["b"].in_flight

    asyncio.run(run())


def test_ingress_and_router_replicas_do_not_import_torch():
    """The front-door replicas (Ingress, Router, the prefix index) load no torch, kernels,
    model or engine core: their processes start seconds faster and stay small (the PD ingress client
    lives in ``app.deployments.pd_client`` for this)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import app.deployments.ingress, app.deployments.router, app.deployments.prefix_index\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels', 'triton')"
        " or m.startswith(('app.model', 'app.engine.engine', 'app.engine.core')))\n"
        "print(sorted({'.'.join(m.split('.')[:2]) for m in heavy})[:20])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
