"""W7: routing across DP ranks on the real Serve app (CPU, tiny V4.1, 4 ranks), comparing in one
run and one deployment: Fathom's prefix-aware router; round-robin; least-loaded (the previous
Fathom router); Ray Serve's own ``PrefixCacheAffinityRouter`` as the DPRank handle's request
router. Plus the router's decision latency over an index of 1M blocks and 16 ranks.

    python -m bench.routing                       # both workloads, every policy (~15 min)
    python -m bench.routing --quick               # smaller workloads (a smoke run)

Workloads (open-loop Poisson arrivals, streamed completions with token-id prompts):
  shared_prefix  G groups x M prompts: a 1024-token group prefix + a 16-token question
  multi_turn     S sessions x T turns: each turn's prompt is the previous prompt + 32
                 (assistant) + 16 (user) tokens, sent 0.3 s after the previous turn ended

Each rank's KV pool holds about a quarter of the shared prefixes (the regime where where a
prefix lives decides the hit rate). "Ideal" hit tokens = what one infinite cache would hit:
the longest whole-block prefix (of prompt[:-1]) shared with any earlier request. Before each
run every rank's prefix cache is cleared (and Ray's prefix tree reset), so runs start cold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import log_path, record, write

P = 64  # the tiny model's KV block
POLICIES = ("prefix", "round_robin", "least_loaded", "ray_prefix")


# ---- workloads ------------------------------------------------------------------------------
# Prompts are text (sglang-router's cache-aware policy takes text, not token ids): random
# words of a small syllable alphabet, tokenized by the server; ``tokens()`` tokenizes the same
# way (BOS + the text, no special tokens) for the ideal-hit count.
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "po", "de", "zu", "ha", "qi", "ber")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n)
    )


def tokenizer():
    from tokenizers import Tokenizer

    from app.engine.model_path import resolve_model

    tok = Tokenizer.from_file(str(resolve_model("tiny-v41", "~/.cache/fathom") / "tokenizer.json"))
    bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
    return lambda text: [bos, *tok.encode(text, add_special_tokens=False).ids]


def _text_of(rng: random.Random, n_tokens: int, tokens) -> str:
    text = _words(rng, n_tokens // 5)
    while len(tokens(text)) < n_tokens:
        text += " " + _words(rng, 4)
    return text


def shared_prefix(groups: int, per_group: int, rate: float, tokens, seed: int = 0) -> list[dict]:
    """G groups x M prompts: a ~1024-token group prefix + a ~16-token question."""
    rng = random.Random(seed)
    prefixes = [_text_of(rng, 16 * P, tokens) for _ in range(groups)]
    reqs = [
        {"prompt": prefixes[g] + " " + _words(rng, 8) + "?", "session": ""}
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(reqs)
    t = 0.0
    for r in reqs:
        t += rng.expovariate(rate)
        r["at"] = t
    return reqs


def multi_turn(sessions: int, turns: int, rate: float, tokens, seed: int = 1) -> list[list[dict]]:
    """Per session: its turns (each sent after the previous finished); ``at`` of turn 0. A turn
    is the previous prompt + ~48 tokens (an assistant answer and the next user line)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for s in range(sessions):
        t += rng.expovariate(rate / turns)
        prompt = _text_of(rng, 8 * P, tokens)
        chain = []
        for k in range(turns):
            if k:
                prompt = prompt + "\n" + _words(rng, 12)
            chain.append({"prompt": prompt, "session": f"s{s}", "at": t})
        out.append(chain)
    return out


def ideal_hits(prompts: list[list[int]]) -> list[int]:
    """Hit tokens of one infinite cache, in arrival order (token ids of each prompt)."""
    from app.cache.radix import chain_hashes

    seen: set[bytes] = set()
    hits = []
    for p in prompts:
        hs = chain_hashes(p[:-1], P)
        n = 0
        while n < len(hs) and hs[n] in seen:
            n += 1
        hits.append(n * P)
        seen.update(chain_hashes(p, P))  # the engine caches the prompt's last full block too
    return hits


# ---- one request ----------------------------------------------------------------------------
async def one(c: httpx.AsyncClient, url: str, req: dict, max_tokens: int) -> dict:
    body = {"model": "tiny-v41", "prompt": req["prompt"], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if req["session"]:
        body["user"] = req["session"]
    t0 = time.perf_counter()
    ttft, cached, status = None, 0, 0
    async with c.stream("POST", f"{url}/v1/completions", json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if ttft is None and d.get("choices") and d["choices"][0].get("text") is not None:
                ttft = time.perf_counter() - t0
            if d.get("usage"):
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"status": status, "ttft": ttft, "e2e": time.perf_counter() - t0, "cached": cached}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ---- the app --------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(ranks: int, kv_bytes: int) -> str:
    import ray
    from ray import serve

    from app.builder import build_app

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port = _port()
    ray.init(num_cpus=2 * ranks + 4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {
        "model": "tiny-v41",
        "dp_size": ranks,
        "rank_num_cpus": 1,
        "engine": {
            "kv_cache_bytes": kv_bytes,
            "max_model_len": 4096,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 1024,
        },  # fmt: skip
        "api": {
            "request_timeout_s": 300,
            "max_pending_per_rank": 256,
            "max_queued_tokens_per_rank": 1 << 20,
        },  # fmt: skip
        # Ray's request router on the DPRank handle; the Router switches policies per run
        "routing": {"policy": "ray_prefix"},
    }
    serve.run(build_app(args), name="fathom", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    router = serve.get_deployment_handle("Router", app_name="fathom")
    deadline = time.time() + 300
    while len(router.ranks_stats.remote().result()) < ranks:
        assert time.time() < deadline, "ranks did not come up"
        time.sleep(1)
    return url


async def reset(ranks: list[str]) -> None:
    """Cold start: clear every rank's prefix cache and Ray's prefix tree."""
    import ray
    from ray import serve

    rank = serve.get_deployment_handle("DPRank", app_name="fathom")
    for rid in ranks:
        got = await rank.clear_prefix_cache.remote(target=rid)
        assert got == rid, (got, rid)
    try:
        tree = ray.get_actor("LlmPrefixTreeActor", namespace="serve::fathom::DPRank")
        tenants = list(ray.get(tree.getattr.remote("tenant_to_char_count")))
        ray.get(tree.remove_tenants.remote(tenants))
        ray.get(tree.add_tenants.remote(tenants, time.time()))
    except ValueError:  # no tree yet (Ray's router made it on first use)
        pass
    await asyncio.sleep(1.0)  # the ranks' CLEARED events reach the router


async def drive(url: str, workload: str, reqs: Any, max_tokens: int) -> tuple[list[dict], float]:
    """Send ``reqs`` open-loop (multi_turn: each session's turns one after another)."""
    results: list[dict] = []
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        t0 = time.perf_counter()

        async def at(req: dict) -> None:
            await asyncio.sleep(max(0.0, req["at"] - (time.perf_counter() - t0)))
            results.append({**await one(c, url, req, max_tokens), "i": req["i"]})

        async def session(chain: list[dict]) -> None:
            await asyncio.sleep(max(0.0, chain[0]["at"] - (time.perf_counter() - t0)))
            for req in chain:
                results.append({**await one(c, url, req, max_tokens), "i": req["i"]})
                await asyncio.sleep(0.3)

        if workload == "multi_turn":
            await asyncio.gather(*(session(ch) for ch in reqs))
        else:
            await asyncio.gather(*(at(r) for r in reqs))
        return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float, per_rank: dict[str, float]) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    loads = list(per_rank.values())
    return {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "hit_tokens": sum(r["cached"] for r in ok),
        "ttft_p50": _pct(ttft, 0.5),
        "ttft_p90": _pct(ttft, 0.9),
        "e2e_p50": _pct([r["e2e"] for r in ok], 0.5),
        "throughput_rps": len(ok) / wall,
        "wall_s": wall,
        "load_spread": (max(loads) / statistics.mean(loads)) if loads and sum(loads) else None,
        "per_rank_prompt_tokens": per_rank,
    }


async def run_policy(url: str, policy: str, workload: str, reqs: Any, max_tokens: int) -> dict:
    from ray import serve

    router = serve.get_deployment_handle("Router", app_name="fathom")
    await router.set_policy.remote(policy)
    stats0 = await router.ranks_stats.remote()
    await reset(sorted(stats0))
    stats0 = await router.ranks_stats.remote()
    results, wall = await drive(url, workload, reqs, max_tokens)
    await asyncio.sleep(1.0)
    stats1 = await router.ranks_stats.remote()
    per_rank = {k: stats1[k].get("prompt_tokens", 0) - stats0.get(k, {}).get("prompt_tokens", 0)
                for k in stats1}  # fmt: skip
    return summarize(results, wall, per_rank)


# ---- sglang-router in front of standalone Fathom ranks -----------------------------------
def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise TimeoutError(f"{url} did not come up")
        time.sleep(0.5)


def _prompt_tokens(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("fathom_prompt_tokens "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run_sglang(binary: str, ranks: int, kv_bytes: int, workload: str, reqs: Any,
               max_tokens: int) -> dict:  # fmt: skip
    """sglang-router's ``cache_aware`` policy (its defaults) over ``ranks`` standalone rank
    servers (bench/rank_server.py: the same engine and API, without Ray); cold caches."""
    import subprocess
    import sys

    ports = [_port() for _ in range(ranks)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.rank_server",
                "--port",
                str(p),
                "--kv-bytes",
                str(kv_bytes),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for p in ports
    ]
    rport = _port()
    log = open(log_path("sglang_router.log"), "ab")  # noqa: SIM115 (the child's log)
    try:
        for p in ports:
            _wait_http(f"http://127.0.0.1:{p}/health", 300)
        procs.append(subprocess.Popen(
            [binary, "launch", "--host", "127.0.0.1", "--port", str(rport), "--policy",
             "cache_aware", "--prometheus-port", str(_port()),
             "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports]],
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        _wait_http(f"http://127.0.0.1:{rport}/health", 60)
        before = {str(p): _prompt_tokens(p) for p in ports}
        results, wall = asyncio.run(drive(f"http://127.0.0.1:{rport}", workload, reqs, max_tokens))
        per_rank = {str(p): _prompt_tokens(p) - before[str(p)] for p in ports}
        return summarize(results, wall, per_rank)
    finally:
        for pr in procs:
            pr.terminate()
        for pr in procs:
            pr.wait(timeout=30)
        log.close()


# ---- decision latency -----------------------------------------------------------------------
def decision_latency(blocks: int = 1_000_000, ranks: int = 16, queries: int = 20_000) -> dict:
    """``RoutingPolicy.decide`` over an index of ``blocks`` entries spread over ``ranks``:
    prompts of 32 blocks, half of them sharing 24 blocks with an indexed chain."""
    import hashlib

    from app.deployments.routing import RankView, RouteQuery, RoutingConfig, RoutingPolicy

    pol = RoutingPolicy(RoutingConfig(max_index_blocks=2 * blocks), block_size=P, namespace="x")
    names = [f"rank{i}" for i in range(ranks)]
    chains = []
    per = 32
    for c in range(blocks // per):
        hs = tuple(hashlib.blake2b(f"{c}:{i}".encode(), digest_size=16).digest()
                   for i in range(per))  # fmt: skip
        chains.append(hs)
        pol.index.apply(names[c % ranks], [(0, hs)])
    views = {n: RankView(n, queued_tokens=100.0 * i, outstanding=i % 5, window=128)
             for i, n in enumerate(names)}  # fmt: skip
    rng = random.Random(3)
    lat = []
    for k in range(queries):
        base = chains[rng.randrange(len(chains))]
        if k % 2:
            hs = base[:24] + tuple(hashlib.blake2b(f"q{k}:{i}".encode(), digest_size=16).digest()
                                   for i in range(8))  # fmt: skip
        else:
            hs = tuple(hashlib.blake2b(f"m{k}:{i}".encode(), digest_size=16).digest()
                       for i in range(32))  # fmt: skip
        q = RouteQuery(33 * P, hs, P)
        t = time.perf_counter()
        pol.decide(q, views)
        lat.append(time.perf_counter() - t)
    return {"entries": len(pol.index), "p50_us": _pct(lat, 0.5) * 1e6,
            "p99_us": _pct(lat, 0.99) * 1e6}  # fmt: skip


async def rpc_latency(n: int = 500) -> dict:
    """A ``choose`` call through the Router's Serve handle, as the ingress makes it."""
    from ray import serve

    from app.cache.radix import chain_hashes
    from app.deployments.routing import RouteQuery

    router = serve.get_deployment_handle("Router", app_name="fathom")
    await router.set_policy.remote("prefix")
    rng = random.Random(5)
    lat = []
    for _ in range(n):
        ids = [rng.randrange(3, 500) for _ in range(2048)]
        q = RouteQuery(len(ids), tuple(chain_hashes(ids[:-1], P)), P)
        t = time.perf_counter()
        await router.choose.remote(q)
        lat.append(time.perf_counter() - t)
    return {"p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3}


# ---- main -----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0, help="arrivals per second")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workloads", default="shared_prefix,multi_turn")
    ap.add_argument("--sglang-router", default=shutil.which("sglang-router") or "",
                    help="the sglang-router binary (pip install sglang-router==0.3.2)")  # fmt: skip
    args = ap.parse_args()
    groups, per_group, sessions, turns = (8, 6, 8, 4) if args.quick else (16, 12, 24, 6)
    # per rank: ~110 blocks of 64 tokens = about 4 of the 16 group prefixes (16 blocks each)
    kv_bytes = 110 * 36864 + 16 * 17408
    lat = decision_latency()
    print("decision latency", lat, flush=True)
    tokens = tokenizer()
    workloads: dict[str, tuple[Any, int]] = {}
    for workload in args.workloads.split(","):
        if workload == "shared_prefix":
            reqs = shared_prefix(groups, per_group, args.rate, tokens)
            flat = reqs
        else:
            reqs = multi_turn(sessions, turns, args.rate, tokens)
            flat = [r for ch in reqs for r in ch]
        for i, r in enumerate(flat):
            r["i"] = i
        order = sorted(flat, key=lambda r: (r["at"], r["i"]))
        workloads[workload] = (reqs, sum(ideal_hits([tokens(r["prompt"]) for r in order])))
    params0 = {"index_blocks": lat["entries"], "ranks": 16, "prompt_blocks": 32}
    records: list[dict] = [
        record("routing.decision.p50", lat["p50_us"], "us", params0),
        record("routing.decision.p99", lat["p99_us"], "us", params0),
    ]
    table: dict[str, dict[str, dict]] = {}

    def add(policy: str, workload: str, res: dict) -> None:
        ideal = workloads[workload][1]
        res["ideal_hit_tokens"] = ideal
        res["hit_fraction_of_ideal"] = res["hit_tokens"] / ideal if ideal else None
        table.setdefault(workload, {})[policy] = res
        brief = {k: v for k, v in res.items() if k != "per_rank_prompt_tokens"}
        print(workload, policy, json.dumps(brief), flush=True)
        params = {"ranks": args.ranks, "rate_rps": args.rate, "requests": res["requests"]}
        for key, unit in (("hit_fraction_of_ideal", "fraction"), ("ttft_p50", "s"),
                          ("ttft_p90", "s"), ("throughput_rps", "req/s"),
                          ("load_spread", "max/mean"), ("failed", "requests")):  # fmt: skip
            records.append(record(f"routing.{policy}.{workload}.{key}", res[key], unit, params))

    url = start(args.ranks, kv_bytes)
    warm = shared_prefix(4, 4, args.rate, tokens, seed=99)  # every rank's first steps
    for i, r in enumerate(warm):
        r["i"] = i
    asyncio.run(run_policy(url, "round_robin", "shared_prefix", warm, max_tokens=4))
    rpc = asyncio.run(rpc_latency())
    print("choose RPC", rpc, flush=True)
    records += [
        record("routing.choose_rpc.p50", rpc["p50_ms"], "ms", {"prompt_tokens": 2048}),
        record("routing.choose_rpc.p99", rpc["p99_ms"], "ms", {"prompt_tokens": 2048}),
    ]
    for workload, (reqs, _) in workloads.items():
        for policy in args.policies.split(","):
            add(policy, workload, asyncio.run(run_policy(url, policy, workload, reqs, 4)))
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    if args.sglang_router:
        for workload, (reqs, _) in workloads.items():
            res = run_sglang(args.sglang_router, args.ranks, kv_bytes, workload, reqs, 4)
            add("sglang_cache_aware", workload, res)
    else:
        print("no sglang-router binary: its policy is not in this run")
    out = write("routing", records, table=table)  # the per-policy figures beside the records
    plot(table, out.with_suffix(".png"))
    print("wrote", out)


def plot(table: dict[str, dict[str, dict]], path: Path) -> None:
    """Hit fraction of ideal and p90 TTFT per policy and workload (skipped without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    workloads = list(table)
    policies = list(next(iter(table.values())))
    w = 0.8 / len(policies)
    for k, (metric, label) in enumerate((("hit_fraction_of_ideal", "hit tokens / ideal"),
                                         ("ttft_p90", "TTFT p90 (s)"))):  # fmt: skip
        ax = axes[k]
        for j, pol in enumerate(policies):
            vals = [table[wl][pol][metric] or 0 for wl in workloads]
            ax.bar([i + j * w for i in range(len(workloads))], vals, w, label=pol)
        ax.set_xticks([i + w * (len(policies) - 1) / 2 for i in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("W7 routing, tiny V4.1 on CPU, 4 DP ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
