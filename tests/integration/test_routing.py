"""Prefix-aware routing, autoscaling and the prefix index's failure handling on the real Serve
app (CPU, tiny V4.1, 2..3 autoscaled DP ranks): a shared prefix lands on the rank holding it,
a flood of unrelated requests spreads and scales the ranks up, idle scales them down without a
failed request, a killed rank leaves the index, a restarted Router resyncs from snapshots."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from app.builder import build_app  # noqa: E402
from tests.integration.serve_util import deploy, wait_until  # noqa: E402

P = 64  # the tiny model's KV block (app.cache.layout.block_size_for)
rng = random.Random(7)
PREFIX = [rng.randrange(3, 500) for _ in range(16 * P)]  # 1024 tokens: 16 blocks


@pytest.fixture(scope="module")
def base(tmp_path_factory, cluster):
    args = {
        "model": "tiny-v41",
        "cache_dir": str(tmp_path_factory.mktemp("cache")),
        "rank_num_cpus": 0.5,
        "engine": {
            "kv_cache_bytes": 1 << 24,
            "max_model_len": 4096,
            "max_num_seqs": 32,
            "max_num_batched_tokens": 512,
        },  # fmt: skip
        "api": {"request_timeout_s": 120, "max_pending_per_rank": 64},
        "routing": {"balance_abs": 8},
        "autoscaling": {
            "min_ranks": 2,
            "max_ranks": 3,
            "target_ongoing_requests": 4,
            "upscale_delay_s": 1,
            "downscale_delay_s": 6,
            "metrics_interval_s": 0.5,
            "look_back_period_s": 2,
        },  # fmt: skip
    }
    with deploy(build_app(args)):
        wait_until(lambda: len(_index()["ranks"]) == 2, 120, "two ranks reporting")
        yield cluster.base


def _router():
    return serve.get_deployment_handle("Router", app_name="fathom")


def _index() -> dict:
    return _router().index_stats.remote().result(timeout_s=30)


def _ranks() -> dict[str, dict]:
    return _router().ranks_stats.remote().result(timeout_s=30)


async def _aranks() -> dict[str, dict]:
    return await _router().ranks_stats.remote()


async def _complete(c: httpx.AsyncClient, url: str, prompt: list[int], n: int = 2) -> dict:
    body = {"model": "tiny-v41", "prompt": prompt, "max_tokens": n, "ignore_eos": True}
    r = await c.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def _holders(min_blocks: int = 16) -> set[str]:
    return {k for k, v in _index()["ranks"].items() if v["blocks"] >= min_blocks}


async def _reported(n: int) -> None:
    """Until the ranks' reports (every 0.5 s) count ``n`` received requests: the Router counts
    a request in its rank's load until a report shows it arrived, so requests that finished
    before the next report still weigh on the bound (fast ones on an idle machine)."""
    deadline = time.monotonic() + 10
    while sum(v.get("received_requests", 0) for v in (await _aranks()).values()) < n:
        assert time.monotonic() < deadline, f"the ranks never reported {n} requests"
        await asyncio.sleep(0.1)


def test_shared_prefix_lands_on_the_rank_holding_it(base):
    async def main() -> tuple[dict, list[dict], list[dict]]:
        async with httpx.AsyncClient(timeout=120) as c:
            first = await _complete(c, base, PREFIX + [11, 12, 13])
            seq = [await _complete(c, base, PREFIX + [20 + i, 7]) for i in range(4)]
            await _reported(5)  # the burst is routed on the ranks' real load
            together = await asyncio.gather(
                *(_complete(c, base, PREFIX + [40 + i, 9]) for i in range(6))
            )
            return first, seq, list(together)

    first, seq, together = asyncio.run(main())
    assert _cached(first) == 0
    # every later request of the group was sent to the rank holding the prefix: a hit of all
    # 16 blocks (the router matches the engine's block hashes, not text)
    assert [_cached(r) for r in seq + together] == [16 * P] * 10
    wait_until(lambda: len(_holders()) == 1, 10, "the index to show the holder")
    others = [v["blocks"] for k, v in _index()["ranks"].items() if k not in _holders()]
    assert others == [0]  # nothing else was cached anywhere: no request went elsewhere


def test_flood_spreads_scales_up_and_idle_scales_down_without_failures(base):
    time.sleep(1.5)  # the ranks' reports (every 0.5 s) include the previous test's requests
    before = {k: v.get("prompt_tokens", 0) for k, v in _ranks().items()}
    assert len(before) == 2
    statuses: list[int] = []

    async def flood(c: httpx.AsyncClient, k: int) -> None:
        body = {"model": "tiny-v41", "prompt": [3 + k % 400, 5, 7, 9 + k % 50],
                "max_tokens": 16, "ignore_eos": True}  # fmt: skip
        r = await c.post(f"{base}/v1/completions", json=body)
        statuses.append(r.status_code)

    async def main() -> dict[str, int]:
        async with httpx.AsyncClient(timeout=180) as c:
            await asyncio.gather(*(flood(c, k) for k in range(32)))
            await asyncio.sleep(1.5)  # reports with the flood in them
            first = {
                k: v.get("prompt_tokens", 0) - before.get(k, 0)
                for k, v in (await _aranks()).items()
            }
            # keep the load up until Serve adds the third rank (queue depth 16 per rank > 4)
            deadline, k = time.time() + 150, 32
            while len(await _aranks()) < 3:
                assert time.time() < deadline, "no third rank under load"
                await asyncio.gather(*(flood(c, k + i) for i in range(16)))
                k += 16
            new = set(await _aranks()) - set(before)
            assert len(new) == 1
            (rank3,) = new
            base3 = (await _aranks())[rank3].get("prompt_tokens", 0)
            await asyncio.gather(*(flood(c, 1000 + i) for i in range(24)))
            await asyncio.sleep(1.5)
            got = (await _aranks())[rank3].get("prompt_tokens", 0) - base3
            # idle: Serve goes back to two ranks; a trickle of requests all succeed meanwhile
            deadline = time.time() + 150
            while len(await _aranks()) > 2:
                assert time.time() < deadline, "no scale-down when idle"
                await flood(c, 5000 + k)
                k += 1
                await asyncio.sleep(1.0)
            return {"rank3_prompt_tokens": got, **{f"first:{r}": n for r, n in first.items()}}

    out = asyncio.run(main())
    assert statuses and set(statuses) == {200}, statuses
    # the unrelated flood spread over both ranks (all misses: cost by queue and load):
    # neither took more than 3/4 of its prompt tokens. Not an even split: `make test` runs
    # the unit suite beside this one, so the two ranks get unequal CPU and drain their
    # queues at different speeds (seen: 40 / 88). Herding (requests on their way to a rank
    # forgotten at its next report, fixed since) gave 24 / 104.
    shares = [v for k, v in out.items() if k.startswith("first:")]
    assert len(shares) == 2 and min(shares) >= sum(shares) / 4, out
    assert out["rank3_prompt_tokens"] > 0, out  # the new rank registered and got traffic


def test_killed_rank_leaves_the_index_and_routing_goes_on(base):
    async def warm() -> None:
        async with httpx.AsyncClient(timeout=120) as c:
            await _complete(c, base, PREFIX + [1])

    asyncio.run(warm())
    wait_until(lambda: len(_holders()) >= 1, 10, "a holder of the prefix")
    (victim, *_) = sorted(_holders())
    actor = next(
        a for a in ray.util.list_named_actors(all_namespaces=True)
        if "DPRank" in a["name"] and a["name"].endswith(victim)
    )  # fmt: skip
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))

    async def after() -> tuple[list[dict], list[dict]]:
        """Requests until the router no longer lists the victim (a request that fails on
        it before a token is retried elsewhere and drops it at once; else its reports stop
        and it goes after STALE_S), then more: none may fail."""
        async with httpx.AsyncClient(timeout=120) as c:
            during, deadline = [], time.time() + 60
            while victim in (await _router().index_stats.remote())["ranks"]:
                assert time.time() < deadline, "the dead rank was never dropped"
                during.append(await _complete(c, base, PREFIX + [60 + len(during), 3]))
                await asyncio.sleep(0.2)
            return during, [await _complete(c, base, PREFIX + [80 + i, 3]) for i in range(3)]

    during, outs = asyncio.run(after())  # _complete asserts every status is 200
    # the prefix is served from (or rebuilt once on) a live rank, then hit there
    assert [_cached(r) for r in outs] == [16 * P] * 3
    assert victim not in _holders() and len(during) >= 1


def test_restarted_router_resyncs_from_the_ranks_snapshots(base):
    wait_until(lambda: len(_holders()) >= 1, 30, "a holder of the prefix")
    holders = _holders()
    actor = next(
        a for a in ray.util.list_named_actors(all_namespaces=True) if "#Router#" in a["name"]
    )
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)
    # the new router starts empty; the ranks' first reports get "resync" and send snapshots
    wait_until(lambda: _holders() == holders, 120, "the restarted router to reload the index")

    async def again() -> dict:
        async with httpx.AsyncClient(timeout=120) as c:
            return await _complete(c, base, PREFIX + [99, 98])

    assert _cached(asyncio.run(again())) == 16 * P
