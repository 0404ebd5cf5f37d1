"""Reliability figures against a running server (``make serve``): docs/reliability.md.

    python -m bench.reliability burst        [--n 1000]         # admission control
    python -m bench.reliability long-prompts [--tokens 100000]  # short TTFT beside long prefills
    python -m bench.reliability big-bodies   [--n 8 --mb 4]     # event loop under large bodies
    python -m bench.reliability isolation                       # findings 1-3 against the server

Each prints one JSON object (``--out FILE`` also writes it). ``--url`` / ``--grpc`` default to
serve_config.yaml's ports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from typing import Any

import httpx

MODEL = "tiny-v41"
NO_THINK = {"thinking": {"type": "disabled"}}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else float("nan")


async def burst(url: str, n: int) -> dict[str, Any]:
    """``n`` completions at once: how many are accepted (and complete) and how many get 429."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None, float, int]:
        t0 = time.monotonic()
        body = {"model": MODEL, "prompt": [0, 5 + i % 300], "max_tokens": 8, "ignore_eos": True}
        r = await c.post("/v1/completions", json=body)
        done = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
        return r.status_code, r.headers.get("retry-after"), time.monotonic() - t0, done

    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(c, i) for i in range(n)))
        took = time.monotonic() - t0
    ok = [r for r in res if r[0] == 200]
    busy = [r for r in res if r[0] == 429]
    return {
        "requests": n,
        "status": {str(s): sum(r[0] == s for r in res) for s in sorted({r[0] for r in res})},
        "accepted_complete": sum(r[3] == 8 for r in ok),
        "retry_after_on_429": sorted({r[1] for r in busy}),
        "latency_429_p50_s": _pct([r[2] for r in busy], 0.5),
        "latency_429_p99_s": _pct([r[2] for r in busy], 0.99),
        "latency_200_p50_s": _pct([r[2] for r in ok], 0.5),
        "latency_200_max_s": _pct([r[2] for r in ok], 1.0),
        "wall_s": round(took, 1),
    }


async def long_prompts(
    url: str, tokens: int, shorts: int, wait_s: float, short_timeout_s: float
) -> dict[str, Any]:
    """Two ``tokens``-token prompts (one per rank), then ``shorts`` small chat streams
    ``wait_s`` later: the short requests' TTFT. The long ones are dropped afterwards."""

    statuses: list[int] = []
    salt = random.randrange(400)  # no prefix-cache hits from an earlier run

    async def long(c: httpx.AsyncClient, i: int) -> None:
        prompt = [0, 5 + salt, 5 + i] + [5 + j % 400 for j in range(tokens - 3)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            async for _ in r.aiter_lines():
                pass

    async def short(c: httpx.AsyncClient, i: int) -> tuple[float | None, float]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 8, "stream": True, "ignore_eos": True, **NO_THINK}  # fmt: skip
        t0, ttft = time.monotonic(), None
        try:
            async with asyncio.timeout(short_timeout_s):
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if ttft is None and line.startswith("data: {"):
                            choices = json.loads(line[6:])["choices"]
                            if choices and choices[0]["delta"].get("content"):  # not the role
                                ttft = time.monotonic() - t0
        except TimeoutError:
            pass
        return ttft, time.monotonic() - t0

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        longs = [asyncio.create_task(long(c, i)) for i in range(2)]
        await asyncio.sleep(wait_s)
        res = await asyncio.gather(*(short(c, i) for i in range(shorts)))
        running = sum(not t.done() for t in longs)
        for t in longs:
            t.cancel()
        await asyncio.gather(*longs, return_exceptions=True)
    ttfts = [r[0] for r in res if r[0] is not None] or [float("nan")]
    return {
        "long_prompt_tokens": tokens,
        "long_status": statuses,
        "long_still_prefilling": running,
        "shorts_sent_after_s": wait_s,
        "short_requests": shorts,
        "short_timeout_s": short_timeout_s,
        "short_with_a_token": sum(r[0] is not None for r in res),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_max_s": _pct(ttfts, 1.0),
        "e2e_max_s": round(max(r[1] for r in res), 2),
    }


def _ingress_rss_mb() -> float | None:
    out = subprocess.run(["ps", "-eo", "rss,args"], capture_output=True, text=True).stdout
    rss = [
        int(line.split()[0]) for line in out.splitlines() if "ServeReplica:fathom:Ingress" in line
    ]
    return round(sum(rss) / 1024, 1) if rss else None


async def big_bodies(url: str, n: int, mb: float) -> dict[str, Any]:
    """``n`` prompts of ``mb`` MB at once (each tokenized, then refused: over the prompt
    limit) while /health and a small completion are polled: the worst latency seen."""
    text = "hello world, this is some text 123. " * int(mb * 1e6 / 36)
    rss_before = _ingress_rss_mb()

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        bigs = [asyncio.create_task(c.post("/v1/completions",
                                           json={"model": MODEL, "prompt": text, "max_tokens": 1}))
                for _ in range(n)]  # fmt: skip
        lat, t0 = [], time.monotonic()
        while not all(b.done() for b in bigs):
            s = time.monotonic()
            r = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}
            )
            assert r.status_code == 200, r.text
            lat.append(time.monotonic() - s)
            await asyncio.sleep(0.1)
        took = time.monotonic() - t0
        codes = [(await b).status_code for b in bigs]
    await asyncio.sleep(5)
    return {
        "bodies": n,
        "mb_each": mb,
        "status": {str(s): codes.count(s) for s in set(codes)},
        "small_requests_during": len(lat),
        "small_latency_p50_s": _pct(lat, 0.5),
        "small_latency_max_s": _pct(lat, 1.0),
        "big_bodies_done_s": round(took, 1),
        "ingress_rss_mb_before": rss_before,
        "ingress_rss_mb_after": _ingress_rss_mb(),
    }


async def isolation(url: str, grpc_addr: str) -> dict[str, Any]:
    """Findings 1-3: a top_k >= 2**63 body beside 10 streams, gRPC with a running stream's id,
    gRPC malformed bytes."""
    import grpc

    from app.grpc import fathom_pb2 as pb

    async def stream(c: httpx.AsyncClient, i: int, ids: list[str]) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"s{i}"}], "stream": True,
                "max_tokens": 64, "ignore_eos": True, "stream_options": {"include_usage": True},
                **NO_THINK}  # fmt: skip
        n = 0
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if not ids or ids[-1] != d.get("id"):
                        ids.append(d.get("id", ""))
                    n = (d.get("usage") or {}).get("completion_tokens", n)
        return n

    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        ids: list[str] = []
        streams = [asyncio.create_task(stream(c, i, ids)) for i in range(10)]
        await asyncio.sleep(1.0)
        bad = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
               "max_tokens": 4, "top_k": 2**63}  # fmt: skip
        cmpl = {"model": MODEL, "prompt": "x", "top_k": 2**63}
        posts = (("/v1/chat/completions", bad), ("/v1/messages", bad), ("/v1/completions", cmpl))
        codes = [(await c.post(p, json=b)).status_code for p, b in posts]
        async with grpc.aio.insecure_channel(grpc_addr) as ch:
            call = ch.unary_stream(
                "/fathom.GenerateService/Generate",
                request_serializer=None,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            dup = pb.GenerateRequest(
                model=MODEL,
                token_ids=pb.TokenIds(ids=[0, 5]),
                sampling=pb.SamplingOptions(max_tokens=3, ignore_eos=True),
                request_id=ids[0] if ids else "x",
            ).SerializeToString()
            g = [m async for m in call(dup, metadata=[("application", "fathom")], timeout=60)]
            try:
                [m async for m in call(b"\x12\xff\xff\xff\xff\x0f", timeout=60)]
                malformed = "OK"
            except grpc.aio.AioRpcError as e:
                malformed = f"{e.code().name}: {e.details()}"
        done = await asyncio.gather(*streams)
    out["top_k_2^63_status"] = codes
    out["streams_beside_it_complete"] = f"{sum(n == 64 for n in done)}/10"
    out["grpc_duplicate_id"] = f"{g[-1].finish_reason}, {g[-1].completion_tokens} tokens"
    out["grpc_malformed"] = malformed
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["burst", "long-prompts", "big-bodies", "isolation"])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc", default="127.0.0.1:9000")
    ap.add_argument("--n", type=int)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--mb", type=float, default=4.0)
    ap.add_argument("--wait", type=float, default=3.0, help="long-prompts: shorts sent after")
    ap.add_argument("--short-timeout", type=float, default=120.0, help="long-prompts")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.what == "burst":
        res = asyncio.run(burst(a.url, a.n or 1000))
    elif a.what == "long-prompts":
        res = asyncio.run(long_prompts(a.url, a.tokens, a.n or 10, a.wait, a.short_timeout))
    elif a.what == "big-bodies":
        res = asyncio.run(big_bodies(a.url, a.n or 8, a.mb))
    else:
        res = asyncio.run(isolation(a.url, a.grpc))
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
