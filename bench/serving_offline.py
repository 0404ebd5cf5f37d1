"""The serving benchmark's offline peer: the requests aiperf sent to the server, replayed
through one in-process :class:`AsyncEngine` on the same engine config, at the same
concurrency, with the server's own request conversion (chat template, tokenization,
sampling) and no HTTP, Ingress, Router or Ray in between.

    python -m bench.serving_offline PLAN.json OUT.json

``PLAN.json``: ``{"config": serve config, "runs": [{"key", "endpoint", "concurrency",
"artifacts"}, ...]}`` in the order the server ran them (the prefix cache carries over from
run to run in both). ``OUT.json``: per run key, the measured requests' output tokens/s and
TTFT (ms, from before the request's conversion to its first token). ``bench.serving`` runs
this in its own process once the server has stopped (a GPU holds one engine at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.api import completions as cmpl
from app.api.protocols import CHAT, Prepared, run_events
from app.api.server import FrontDoor, frontends
from app.app_configs import app_configs
from app.engine.engine import AsyncEngine
from app.engine.request import EngineRequest, RequestOutput
from app.serve_args import ServeArgs
from bench.serving_load import Session, sent_sessions

WARMUP_MARK = "[warmup] "  # like aiperf's warmup marker: warmup prompts share no prefix


class Frontends:
    """The Ingress's request conversion for one served model (as ``app.api.server``)."""

    def __init__(self, cfg: FrontDoor) -> None:
        self.recipe, self.completions = frontends(cfg)

    def prepare(
        self, endpoint: str, body: dict[str, Any]
    ) -> tuple[EngineRequest, Prepared | None]:
        """The engine request of ``body``, and on chat its :class:`Prepared` (else None)."""
        if endpoint == "chat":
            prep = self.recipe.prepare(CHAT, json.dumps(body).encode(), body)
            return prep.engine_request, prep
        return self.completions.prepare(cmpl.parse_body(body))[0], None

    async def answer(self, prep: Prepared, outs: list[RequestOutput]) -> str:
        """The chat answer's content as the server streams it (its protocol events over the
        engine's deltas): what the next turn sends back as the assistant's message."""
        usage = self.recipe.usage_fix(prep)
        acc = CHAT.response_cls(prep.response_id, prep.model, prep.created, usage.prompt_tokens, 0)
        async for ev in run_events(prep, _Deltas(outs), self.recipe.stop_ids, usage):
            acc.accumulate(ev)
        return json.loads(acc.to_json())["choices"][0]["message"]["content"] or ""


class _Deltas:
    """A finished request's deltas as the stream :func:`run_events` reads."""

    timed_out = False

    def __init__(self, outs: list[RequestOutput]) -> None:
        self.outs = outs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        for out in self.outs:
            yield out


@dataclass
class Replayed:
    """What the measured requests of one run did offline."""

    ttft_s: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    start: float
    end: float

    def report(self) -> dict[str, float]:
        wall = self.end - self.start
        return {
            "requests": len(self.ttft_s),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens / wall if wall > 0 else 0.0,
            "requests_per_s": len(self.ttft_s) / wall if wall > 0 else 0.0,
            "ttft_p50": statistics.median(self.ttft_s) * 1e3 if self.ttft_s else 0.0,
            "prefix_hit_rate": self.cached_tokens / self.prompt_tokens
            if self.prompt_tokens else 0.0,
        }  # fmt: skip


async def _request(
    engine: AsyncEngine, fronts: Frontends, endpoint: str, body: dict[str, Any], acc: Replayed
) -> tuple[Prepared | None, list[RequestOutput]]:
    """Convert and generate one request (its TTFT and tokens go into ``acc``): its chat
    :class:`Prepared` (or None) and its deltas."""
    t0 = time.perf_counter()
    req, prep = await asyncio.to_thread(fronts.prepare, endpoint, body)
    outs: list[RequestOutput] = []
    first = None
    async for out in engine.generate(req):
        if out.error:
            raise RuntimeError(f"offline request failed: {out.error}")
        if out.token_ids and first is None:
            first = time.perf_counter()
        outs.append(out)
    acc.end = max(acc.end, time.perf_counter())
    acc.ttft_s.append((first or acc.end) - t0)
    acc.output_tokens += sum(len(o.token_ids) for o in outs)
    acc.prompt_tokens += len(req.prompt_token_ids)
    acc.cached_tokens += max((o.num_cached_tokens for o in outs), default=0)
    return prep, outs


async def _session(
    engine: AsyncEngine, fronts: Frontends, endpoint: str, s: Session, acc: Replayed,
    mark: str = "",
) -> None:  # fmt: skip
    """The turns of one conversation in order; on chat each turn carries the conversation
    so far (the assistant's turns as the server would have answered them), as aiperf sends
    it."""
    history: list[dict[str, Any]] = []
    for turn, payload in enumerate(s.payloads):
        body = dict(payload)
        if endpoint == "chat":
            msgs = [dict(m) for m in body["messages"]]
            if mark and turn == 0:
                msgs[0]["content"] = mark + msgs[0]["content"]
            body["messages"] = history + msgs
            prep, outs = await _request(engine, fronts, endpoint, body, acc)
            assert prep is not None
            answer = await fronts.answer(prep, outs)
            history = body["messages"] + [{"role": "assistant", "content": answer}]
        else:
            if mark:
                body["prompt"] = mark + body["prompt"]
            await _request(engine, fronts, endpoint, body, acc)


async def _drive(
    engine: AsyncEngine, fronts: Frontends, endpoint: str, sessions: list[Session],
    concurrency: int, mark: str = "",
) -> Replayed:  # fmt: skip
    """Closed loop: ``concurrency`` workers, each taking the next conversation when its
    last one ends (aiperf's concurrency mode)."""
    acc = Replayed([], 0, 0, 0, time.perf_counter(), 0.0)
    todo = iter(sessions)

    async def worker() -> None:
        for s in todo:
            await _session(engine, fronts, endpoint, s, acc, mark)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return acc


def replay(plan: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Every run of ``plan`` through one engine; the measured requests' figures by key."""
    config = yaml.safe_load(Path(plan["config"]).read_text())
    cfgs = app_configs(ServeArgs.model_validate(config["applications"][0].get("args") or {}))
    engine = AsyncEngine(cfgs.engine)
    fronts = Frontends(cfgs.api)
    out = {}
    try:
        for run in plan["runs"]:
            warmup, measured = sent_sessions(Path(run["artifacts"]))
            ep, c = run["endpoint"], run["concurrency"]
            if warmup:
                # completions warmups are separate prompts already; chat ones are marked
                mark = WARMUP_MARK if ep == "chat" else ""
                asyncio.run(_drive(engine, fronts, ep, warmup, c, mark))
            out[run["key"]] = asyncio.run(_drive(engine, fronts, ep, measured, c)).report()
            print(f"offline {run['key']}: {out[run['key']]}", flush=True)
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serving_offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    result = replay(json.loads(args.plan.read_text()))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
