"""Tracing overhead per decode step (docs/performance.md, "Observability overhead").

    python -m bench.tracing_overhead [--batch 8] [--prompt 32] [--tokens 64] [--rounds 7]

The tiny V4.1 checkpoint through the whole EngineCore (CPU, overlap on), B requests decoding
together; each round runs the same workload in three modes, interleaved:

- ``off``: tracing off (``rank_span`` yields a non-recording span, no engine work): the
  production path with ``observability.tracing: none``;
- ``trace``: tracing on at ``sample_ratio`` 1.0: a real TracerProvider with the OTLP/HTTP
  exporter (batch processor) posting to a local receiver thread; every request opens its
  ``rank.generate`` span through :func:`app.observability.rank_span` and the engine emits its
  phase events onto it;
- ``metrics``: tracing off, the engine-metrics step hook on (``StepRecorder``; Ray's export
  thread is not part of it).

Decode steps are those after every request has its first token. Figures: the median wall
time of those steps (each mode's per-round median, then the median of rounds; on a shared
2-core machine this is dominated by the CPU forward and its noise), the median host
bookkeeping time of the same steps (``t_schedule + t_update`` of ``EngineStats``: where the
tracing code runs), and ``SchedulerOutput.trace`` alone on a decode schedule (micro-timed).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app import observability as obs
from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.metrics import StepRecorder
from app.engine.request import EngineRequest, SamplingParams
from app.model.tiny import make_tiny_checkpoint
from bench.common import record, write


def _receiver() -> tuple[ThreadingHTTPServer, str, list[int]]:
    got: list[int] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            got.append(len(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}/v1/traces", got


def run(core: EngineCore, mode: str, batch: int, prompt: int, tokens: int, tag: str):
    """-> (wall seconds, host bookkeeping seconds: schedule + update) of each decode step."""
    obs._enabled = mode == "trace"
    core.on_step = StepRecorder() if mode == "metrics" else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    reqs = [
        EngineRequest(f"{tag}-{i}", tuple((7 * i + j) % 400 + 3 for j in range(prompt)), params)
        for i in range(batch)
    ]
    started: set[str] = set()
    decode: list[float] = []
    host: list[float] = []
    st = core.stats
    with ExitStack() as spans:
        for r in reqs:
            spans.enter_context(obs.rank_span(r, core))
            core.add_request(r)
        while core.has_unfinished:
            all_started = len(started) == batch
            h0 = st.t_schedule + st.t_update
            t0 = time.perf_counter()
            outs = core.step()
            dt = time.perf_counter() - t0
            if all_started and outs:
                decode.append(dt)
                host.append(st.t_schedule + st.t_update - h0)
            started.update(o.request_id for o in outs if o.token_ids)
    obs._enabled = False
    return decode, host


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    srv, url, posts = _receiver()
    obs.setup_tracing(obs.ObservabilityConfig("otlp", url, "bench", 1.0, 0.2), "bench")
    with tempfile.TemporaryDirectory() as d:
        make_tiny_checkpoint(d, arch="v41", seed=0)
        cfg = EngineConfig.from_options(d, kv_cache_bytes=1 << 26, enable_prefix_caching=False)
        core = EngineCore(cfg)
        modes = ("off", "trace", "metrics")
        per: dict[str, list[float]] = {m: [] for m in modes}
        per_host: dict[str, list[float]] = {m: [] for m in modes}
        run(core, "off", a.batch, a.prompt, 4, "warm")
        for k in range(a.rounds):
            for m in modes:
                steps, host = run(core, m, a.batch, a.prompt, a.tokens, f"{m}{k}")
                per[m].append(statistics.median(steps))
                per_host[m].append(statistics.median(host))
        # SchedulerOutput.trace alone on a decode schedule of traced requests
        obs._enabled = True
        reqs = [EngineRequest(f"micro-{i}", (5, 6, 7, 8), SamplingParams(max_tokens=1000,
                ignore_eos=True)) for i in range(a.batch)]  # fmt: skip
        with ExitStack() as spans:
            for r in reqs:
                spans.enter_context(obs.rank_span(r, core))
                core.add_request(r)
            for _ in range(3):
                core.step()
            sched = core.scheduler.schedule()
            t0 = time.perf_counter()
            n_micro = 20000
            for _ in range(n_micro):
                sched.trace(t0)
            micro = (time.perf_counter() - t0) / n_micro
            for it in sched.items:  # undo the schedule's bookkeeping before aborting
                it.seq.num_in_flight -= 1
            for r in reqs:
                core.abort(r.request_id)
        obs._enabled = False
    obs.shutdown_tracing()
    srv.shutdown()
    med = {m: statistics.median(v) for m, v in per.items()}
    hmed = {m: statistics.median(v) for m, v in per_host.items()}
    params = {"batch": a.batch, "prompt": a.prompt, "tokens": a.tokens, "rounds": a.rounds,
              "model": "tiny-v41", "device": "cpu", "overlap": True}  # fmt: skip
    recs = [record(f"tracing.decode_step.{m}", med[m] * 1e3, "ms", params) for m in modes]
    recs += [record(f"tracing.decode_host.{m}", hmed[m] * 1e6, "us", params) for m in modes]
    recs.append(record("tracing.decode_step.trace_minus_off", (med["trace"] - med["off"]) * 1e6,
                       "us", params))  # fmt: skip
    recs.append(record("tracing.decode_host.trace_minus_off",
                       (hmed["trace"] - hmed["off"]) * 1e6, "us", params))  # fmt: skip
    recs.append(record("tracing.trace_schedule_decode", micro * 1e6, "us", params))
    out = write("tracing_overhead", recs)
    for m in modes:
        print(f"{m:8s} decode step median {med[m] * 1e3:.3f} ms  rounds "
              f"{[round(x * 1e3, 3) for x in per[m]]}; schedule+update {hmed[m] * 1e6:.1f} us "
              f"rounds {[round(x * 1e6, 1) for x in per_host[m]]}")  # fmt: skip
    print(f"trace - off: {(med['trace'] - med['off']) * 1e6:+.1f} us per decode step (wall), "
          f"{(hmed['trace'] - hmed['off']) * 1e6:+.1f} us (schedule+update); "
          f"SchedulerOutput.trace on a decode step of {a.batch}: {micro * 1e6:.2f} us; "
          f"OTLP posts received: {len(posts)}")  # fmt: skip
    print(out)


if __name__ == "__main__":
    main()
