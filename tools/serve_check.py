"""Check a running Fathom server the way its clients use it, and print one JSON report.

    python -m tools.serve_check --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000 \\
        --model flash-rank --overload 64 --out report.json

Checks (each a row of the report: ok, seconds, what it saw):
    curl        the README's chat request (plain HTTP, JSON body)
    openai      the OpenAI SDK: chat streamed (time to the first chunk) and a completion
    anthropic   the Anthropic SDK: a message, and the same streamed
    grpc        fathom.GenerateService/Generate, streamed token deltas
    disconnect  a streaming request closed after a few chunks: the rank's running requests
                and KV blocks in use return to where they were (``/metrics``)
    too_long    a prompt one token over the ingress's max_model_len (and over a rank's, where
                ``--rank-max-model-len`` gives it): 400 naming the prompt, then a request
                still answers
    overload    ``--overload`` concurrent requests beyond the ranks' queue bound: some get
                429 with ``Retry-After``, none gets another error, and the server answers after

The SDK rows need ``openai`` / ``anthropic`` installed (not server dependencies); a missing
client is a failed row. Exit status 1 when any row failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

REPORT_S = 2.5  # a little over the ranks' report interval (app.deployments.rank.REPORT_S)
_STAT = re.compile(r"^fathom_rank_stat\{([^}]*)\}\s+(\S+)$", re.M)


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> tuple[int, dict, dict]:
    """POST JSON -> (status, JSON body, headers); HTTP errors are returned, not raised."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}"), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {"raw": raw.decode(errors="replace")[:500]}
        return e.code, data, dict(e.headers)


def rank_stats(url: str) -> dict[str, float]:
    """``fathom_rank_stat`` gauges of ``/metrics`` summed over ranks, by stat."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for labels, value in _STAT.findall(text):
        m = re.search(r'stat="([^"]+)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


class Checks:
    """The checks against one server (module doc)."""

    def __init__(self, url: str, grpc_target: str | None, model: str, overload: int,
                 rank_limit: int = 0) -> None:  # fmt: skip
        self.url, self.grpc, self.model = url.rstrip("/"), grpc_target, model
        self.burst, self.rank_limit = overload, rank_limit

    def curl(self) -> dict[str, Any]:
        status, body, _ = post(f"{self.url}/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 16})  # fmt: skip
        assert status == 200, (status, body)
        return {"finish_reason": body["choices"][0]["finish_reason"], "usage": body["usage"]}

    def openai(self) -> dict[str, Any]:
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key="unused")
        t0, first, chunks = time.perf_counter(), None, 0
        stream = client.chat.completions.create(
            model=self.model, stream=True, max_tokens=32,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"thinking": {"type": "disabled"}, "ignore_eos": True})  # fmt: skip
        for chunk in stream:
            if chunk.choices and (chunk.choices[0].delta.content or "") and first is None:
                first = time.perf_counter() - t0
            chunks += 1
        done = client.completions.create(model=self.model, prompt="def add(a, b):",
                                         max_tokens=16, temperature=0)  # fmt: skip
        assert chunks > 1 and done.usage.completion_tokens == 16, (chunks, done.usage)
        return {"stream_chunks": chunks, "first_chunk_s": first,
                "completion_tokens": done.usage.completion_tokens}  # fmt: skip

    def anthropic(self) -> dict[str, Any]:
        import anthropic

        client = anthropic.Anthropic(base_url=self.url, api_key="unused")
        msg = client.messages.create(model=self.model, max_tokens=16,
                                     messages=[{"role": "user", "content": "Hello"}])  # fmt: skip
        events = 0
        with client.messages.stream(model=self.model, max_tokens=16,
                                    messages=[{"role": "user", "content": "Hi"}]) as s:  # fmt: skip
            for _ in s:
                events += 1
            final = s.get_final_message()
        assert msg.usage.output_tokens > 0 and events > 2, (msg.usage, events)
        return {
            "stop_reason": msg.stop_reason,
            "output_tokens": msg.usage.output_tokens,
            "stream_events": events,
            "stream_output_tokens": final.usage.output_tokens,
        }

    def grpc_(self) -> dict[str, Any]:
        import grpc

        from app.grpc import fathom_pb2, fathom_pb2_grpc

        assert self.grpc, "no --grpc target"
        with grpc.insecure_channel(self.grpc) as channel:
            stub = fathom_pb2_grpc.GenerateServiceStub(channel)
            req = fathom_pb2.GenerateRequest(
                model=self.model,
                text="The capital of France is",
                sampling=fathom_pb2.SamplingOptions(temperature=0, max_tokens=16, ignore_eos=True),
            )
            deltas = list(stub.Generate(req, metadata=(("application", "fathom"),), timeout=300))
        last = deltas[-1]
        assert last.finished and not last.error and last.completion_tokens == 16, last
        return {
            "deltas": len(deltas),
            "finish_reason": last.finish_reason,
            "completion_tokens": last.completion_tokens,
        }

    def _settled(self, base: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits and the free KV blocks are back
        at ``base``'s; -> the last stats (AssertionError when they never settle)."""
        deadline = time.monotonic() + timeout
        while True:
            now = rank_stats(self.url)
            idle = now.get("num_running", 0) == 0 and now.get("num_waiting", 0) == 0
            if idle and now.get("num_free_blocks", 0) >= base.get("num_free_blocks", 0):
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"not released after {timeout:.0f} s: {now}")
            time.sleep(0.5)

    def disconnect(self) -> dict[str, Any]:
        base = self._settled({})
        # long enough to be running when the client leaves, within the served context
        max_tokens = min(4000, self._context_limit() // 2)
        body = {"model": self.model, "prompt": "Once upon a time " * 50, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True}  # fmt: skip
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})  # fmt: skip
        r = urllib.request.urlopen(req, timeout=600)
        lines = 0
        while lines < 8:
            if r.readline().startswith(b"data:"):
                lines += 1
        time.sleep(REPORT_S)  # the ranks' stats reach /metrics through the router's reports
        busy = rank_stats(self.url)
        r.close()  # the client goes away mid-stream
        t0 = time.monotonic()
        after = self._settled(base)
        assert busy.get("num_running", 0) >= 1, busy  # the request was running
        return {"free_blocks_before": base.get("num_free_blocks"), "free_blocks_streaming":
                busy.get("num_free_blocks"), "free_blocks_after": after.get("num_free_blocks"),
                "released_s": round(time.monotonic() - t0, 2)}  # fmt: skip

    def _context_limit(self) -> int:
        """The served model's ``max_model_len`` (its ``/v1/models`` card)."""
        models = json.loads(urllib.request.urlopen(f"{self.url}/v1/models", timeout=10).read())
        return int(next(m for m in models["data"] if m["id"] == self.model)["max_model_len"])

    def too_long(self) -> dict[str, Any]:
        limits = {"ingress": self._context_limit()}
        if self.rank_limit:
            limits["rank"] = self.rank_limit
        seen = {}
        for where, limit in limits.items():
            status, body, _ = post(f"{self.url}/v1/completions", {
                "model": self.model, "prompt": [7] * (limit + 1), "max_tokens": 1})  # fmt: skip
            assert status == 400 and "prompt" in json.dumps(body), (where, status, body)
            seen[where] = {"prompt_tokens": limit + 1, "status": status,
                           "error": body.get("error", body)}  # fmt: skip
        ok, _, _ = post(f"{self.url}/v1/completions", {"model": self.model, "prompt": "Hi",
                                                      "max_tokens": 4})  # fmt: skip
        assert ok == 200, ok
        return seen

    def overload(self) -> dict[str, Any]:
        codes: list[int] = []
        retry_after: list[str | None] = []
        lock = threading.Lock()

        def one() -> None:
            status, _, headers = post(f"{self.url}/v1/completions", {
                "model": self.model, "prompt": "Count to ten:", "max_tokens": 64,
                "ignore_eos": True})  # fmt: skip
            with lock:
                codes.append(status)
                if status == 429:
                    retry_after.append(headers.get("Retry-After") or headers.get("retry-after"))

        threads = [threading.Thread(target=one) for _ in range(self.burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seen = {c: codes.count(c) for c in sorted(set(codes))}
        assert set(seen) <= {200, 429} and seen.get(429) and all(retry_after), seen
        ok, _, _ = post(f"{self.url}/v1/completions", {"model": self.model, "prompt": "Hi",
                                                      "max_tokens": 4})  # fmt: skip
        assert ok == 200, ok
        return {"requests": self.burst, "statuses": seen, "retry_after": retry_after[:3]}

    def all(self) -> dict[str, Callable[[], dict[str, Any]]]:
        rows = {
            "curl": self.curl,
            "openai": self.openai,
            "anthropic": self.anthropic,
            "grpc": self.grpc_,
            "disconnect": self.disconnect,
            "too_long": self.too_long,
        }
        return rows | ({"overload": self.overload} if self.burst else {})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.serve_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--grpc", default=None, help="host:port of Serve's gRPC proxy")
    ap.add_argument("--model", required=True)
    ap.add_argument("--overload", type=int, default=0,
                    help="concurrent requests of the overload row (0: skip it); set it above "
                         "the ranks' max_pending_per_rank")  # fmt: skip
    ap.add_argument("--rank-max-model-len", type=int, default=0,
                    help="a rank's max_model_len (its start-up log) when below the ingress's: "
                         "too_long also sends a prompt one token over it")  # fmt: skip
    ap.add_argument("--only", default=None, help="comma list of rows to run")
    ap.add_argument("--out", default=None, help="write the report here too")
    args = ap.parse_args(argv)
    rows = Checks(args.url, args.grpc, args.model, args.overload, args.rank_max_model_len).all()
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only.split(",")}
    report: dict[str, Any] = {}
    for name, check in rows.items():
        t0 = time.perf_counter()
        try:
            report[name] = {"ok": True, **check()}
        except Exception as e:  # a row fails, the others still run
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"[serve_check] {name}: {json.dumps(report[name], default=str)}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0 if all(r["ok"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
