"""Fuzzing the front door: hostile and malformed requests on every HTTP endpoint and the gRPC
service, with the properties every answer must have (docs/reliability.md).

    python -m bench.fuzz --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000 \\
        --requests 10000 --concurrency 16 [--seed 0] [--api-key KEY] [--out results.json]

Against a running server (``make serve``): each case is a valid request of a random endpoint,
mutated (fields replaced by random JSON of any type, extreme numbers, long or special-token
strings, deep nesting, dropped fields, truncated or flipped bytes, wrong content types). The
properties: no 5xx, no hang (every answer within ``--timeout``), errors are the protocol's
JSON shape, streams end properly; afterwards the server is healthy and every rank has drained
(no unfinished request). The unit test ``tests/unit/test_fuzz.py`` runs the same cases, drawn
by hypothesis, against an in-process server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MODEL = "tiny-v41"
ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions")
SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "｜DSML｜")
NUMBERS = (0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e308, 1e-320)
FIELDS = (
    "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "n", "stream", "logprobs", "top_logprobs", "min_tokens",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "tools",
    "tool_choice", "response_format", "thinking", "system", "stream_options", "prompt",
    "messages", "input", "model", "metadata",
)  # fmt: skip


@dataclass
class Case:
    """One request: ``path``, raw ``body`` and ``headers`` (the content type among them)."""

    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"

    @property
    def stream(self) -> bool:
        return b'"stream": true' in self.body or b'"stream":true' in self.body


def base_body(path: str, rng: random.Random) -> dict[str, Any]:
    """A valid request of ``path`` (small max_tokens, so the engine side stays cheap)."""
    n = rng.randint(1, 6)
    msgs = [{"role": "user", "content": rng.choice(["hi", "hello there", "Say something."])}]
    if path == "/v1/completions":
        prompt: Any = rng.choice(["hi", [0, 5, 9], "a b c"])
        return {"model": MODEL, "prompt": prompt, "max_tokens": n}
    if path == "/v1/responses":
        return {"model": MODEL, "input": "hi", "max_output_tokens": n}
    body = {"model": MODEL, "messages": msgs, "max_tokens": n}
    if rng.random() < 0.5:
        body["thinking"] = {"type": "disabled"}
    return body


def json_value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, biased to the edges: extreme numbers, odd strings, nesting."""
    r = rng.random()
    if r < 0.2:
        return rng.choice(NUMBERS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if r < 0.4:
        return text(rng)
    if r < 0.5:
        return rng.choice([None, True, False])
    if r < 0.6 and depth < 4:
        return [json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.7 and depth < 4:
        return {text(rng, 8): json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return rng.randint(-(2**40), 2**40)


def text(rng: random.Random, limit: int = 64) -> str:
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(SPECIAL) * rng.randint(1, 3)
    if pick < 0.4:
        return "x" * rng.choice([0, 1, 1000, 10_000])  # 100k-token prompts: bench.reliability
    alphabet = 'abc \n\t"\\{}[]<>|🙂é\u200b\x00\x7f'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, limit)))


def case(rng: random.Random) -> Case:
    """A random (mostly invalid) request."""
    path = rng.choice(ROUTES)
    body = base_body(path, rng)
    for _ in range(rng.randint(0, 3)):
        op = rng.random()
        name = rng.choice(FIELDS)
        if op < 0.6:
            body[name] = json_value(rng)
        elif op < 0.8:
            body.pop(rng.choice(list(body) or ["model"]), None)
        elif op < 0.9 and isinstance(body.get("messages"), list):
            body["messages"].append({"role": rng.choice(["system", "tool", "x", "assistant"]),
                                     "content": json_value(rng)})  # fmt: skip
        else:
            body["stream"] = True
    raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode()
    headers = {"content-type": "application/json"}
    r = rng.random()
    if r < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # truncated
    elif r < 0.1:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]  # a flipped byte
    elif r < 0.13:
        headers["content-type"] = rng.choice(["text/plain", "application/x-www-form-urlencoded"])
    elif r < 0.15:
        headers["origin"] = "http://evil.example"
    elif r < 0.17:
        raw = rng.randbytes(rng.randint(0, 64))
    elif r < 0.22 and raw.endswith(b"}"):  # deep nesting, up to far beyond any limit
        d = rng.choice([10, 63, 65, 500, 5000, 100_000])
        raw = raw[:-1] + b', "deep": ' + b"[" * d + b"]" * d + b"}"
    if rng.random() < 0.03:
        return Case(rng.choice([*ROUTES, "/v1/models", "/health", "/nope"]), b"", {}, "GET")
    return Case(path, raw, headers)


def grpc_case(rng: random.Random) -> bytes:
    """A serialized GenerateRequest with random fields, or random / truncated bytes."""
    from app.grpc import fathom_pb2 as pb

    s = pb.SamplingOptions()
    ints = (("max_tokens", 0, 12), ("top_k", -5, 2**31 - 1), ("seed", -(2**63), 2**63 - 1))
    for name, lo, hi in ints:
        if rng.random() < 0.4:
            setattr(s, name, rng.randint(lo, hi))
    for name, lo, hi in (("temperature", -1, 5), ("top_p", -1, 2)):
        if rng.random() < 0.4:
            setattr(s, name, rng.uniform(lo, hi))
    if not s.HasField("max_tokens"):
        s.max_tokens = rng.randint(1, 6)
    if rng.random() < 0.3:
        s.stop_token_ids.extend(rng.randint(0, 10**6) for _ in range(rng.randint(1, 3)))
    r = pb.GenerateRequest(model=rng.choice([MODEL, MODEL, "", "nope"]), sampling=s,
                           request_id=rng.choice(["", "dup", "x" * 300]))  # fmt: skip
    if rng.random() < 0.5:
        r.text = text(rng)
    else:
        r.token_ids.ids.extend(rng.randint(0, 2000) for _ in range(rng.randint(0, 8)))
    raw = r.SerializeToString()
    if rng.random() < 0.15:
        raw = rng.randbytes(rng.randint(1, 40))
    elif rng.random() < 0.1:
        raw = raw[: rng.randint(0, len(raw))]
    return raw


def check_http(c: Case, status: int, ctype: str, body: bytes) -> str | None:
    """What is wrong with an answer (None: nothing)."""
    if status >= 500:
        return f"{status}: {body[:200]!r}"
    if status >= 400 or not c.stream:
        try:
            obj = json.loads(body)
        except ValueError:
            return f"{status} with a non-JSON body {body[:80]!r}"
        if status >= 400 and "error" not in obj:
            return f"{status} without an error object"
        return None
    if "text/event-stream" not in ctype:
        return f"a stream answered {ctype}"
    if b'"server_error"' in body or b'"api_error"' in body:
        return f"a stream ended with an internal error: {body[-200:]!r}"
    return None


async def run_http(url: str, cases: list[Case], concurrency: int, timeout: float,
                   api_key: str | None) -> tuple[Counter, list[str]]:  # fmt: skip
    import httpx

    stats, bad = Counter(), []
    sem = asyncio.Semaphore(concurrency)
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(c: Case, client: httpx.AsyncClient) -> None:
        async with sem:
            try:
                async with asyncio.timeout(timeout):
                    r = await client.request(c.method, c.path, content=c.body or None,
                                             headers={**auth, **c.headers})  # fmt: skip
                stats[r.status_code] += 1
                why = check_http(c, r.status_code, r.headers.get("content-type", ""), r.content)
            except TimeoutError:
                stats["hang"] += 1
                why = "no answer within the timeout"
            except httpx.HTTPError as e:
                stats["transport"] += 1
                why = f"transport error {e!r}"
            if why is not None:
                bad.append(f"{c.method} {c.path} {c.body[:120]!r}: {why}")

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(one(c, client) for c in cases))
    return stats, bad


async def run_grpc(addr: str, cases: list[bytes], concurrency: int, timeout: float,
                   api_key: str | None) -> tuple[Counter, list[str]]:  # fmt: skip
    import grpc

    stats, bad = Counter(), []
    meta = [("application", "fathom")] + (
        [("authorization", f"Bearer {api_key}")] if api_key else []
    )
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(addr) as ch:
        call = ch.unary_stream("/fathom.GenerateService/Generate", request_serializer=None,
                               response_deserializer=None)  # fmt: skip

        async def one(raw: bytes) -> None:
            async with sem:
                try:
                    async for _ in call(raw, metadata=meta, timeout=timeout):
                        pass
                    stats["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    stats[e.code().name] += 1
                    if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):  # fmt: skip
                        bad.append(f"gRPC {raw[:60]!r}: {e.code().name} {e.details()}")

        await asyncio.gather(*(one(r) for r in cases))
    return stats, bad


def drained(url: str, timeout_s: float = 60.0) -> bool:
    """No rank reports an unfinished request for 2 s in a row (reports lag 0.5 s)."""
    import httpx

    deadline, since = time.time() + timeout_s, None
    while time.time() < deadline:
        lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        busy = sum(
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith("fathom_rank_stat{") and 'stat="num_unfinished"' in line
        )
        if busy:
            since = None
        elif since is None:
            since = time.time()
        elif time.time() - since >= 2:
            return True
        time.sleep(0.25)
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc", default="127.0.0.1:9000", help="'' to skip gRPC")
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--grpc-share", type=float, default=0.2)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=660.0, help="> api.request_timeout_s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key")
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    n_grpc = int(a.requests * a.grpc_share) if a.grpc else 0
    http_cases = [case(rng) for _ in range(a.requests - n_grpc)]
    grpc_cases = [grpc_case(rng) for _ in range(n_grpc)]
    t0 = time.time()
    hs, hbad = asyncio.run(run_http(a.url, http_cases, a.concurrency, a.timeout, a.api_key))
    gs, gbad = Counter(), []
    if grpc_cases:
        gs, gbad = asyncio.run(run_grpc(a.grpc, grpc_cases, a.concurrency, a.timeout, a.api_key))
    took = time.time() - t0
    import httpx

    healthy = httpx.get(f"{a.url}/health", timeout=10).status_code == 200
    is_drained = drained(a.url)
    result = {
        "requests": a.requests, "http": dict(hs), "grpc": dict(gs), "seconds": round(took, 1),
        "failures": len(hbad) + len(gbad), "healthy_after": healthy, "drained_after": is_drained,
        "seed": a.seed, "concurrency": a.concurrency,
    }  # fmt: skip
    for line in (hbad + gbad)[:20]:
        print("FAIL", line)
    print(json.dumps(result, indent=1, default=str))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    raise SystemExit(0 if not (hbad or gbad) and healthy and is_drained else 1)


if __name__ == "__main__":
    main()
