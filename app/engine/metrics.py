"""Engine metrics of one DP rank: the core's counters (:class:`EngineStats`, read by the
router and ``AsyncEngine.stats``), exported through Ray's metrics (``ray.util.metrics``), so
Prometheus scraping Ray's metrics endpoint (and the Ray dashboard) sees one series per rank.

:class:`StepRecorder` is the engine's ``on_step`` hook: per step it appends one tuple to a
deque and adds to a few ints (no Ray, no locks on the engine thread). :class:`EngineMetrics`
drains it from its own thread every ``interval_s`` into Ray's histograms, counters and gauges
(names below; Ray's exporter adds the ``ray_`` prefix, and ``_total`` to counters):

    fathom_engine_step_seconds          histogram  host time of one engine step
    fathom_engine_batch_size            histogram  requests in one step
    fathom_engine_step_tokens           histogram  tokens in one step (prefill + decode)
    fathom_engine_queue_wait_seconds    histogram  arrival -> first admission to the batch
    fathom_engine_prefill_tokens        counter    scheduled prompt (and recompute) tokens
    fathom_engine_decode_tokens         counter    scheduled decode tokens (incl. drafts)
    fathom_engine_preemptions           counter    requests preempted (KV pool short)
    fathom_engine_prefix_query_tokens   counter    prompt tokens looked up in the prefix cache
    fathom_engine_prefix_hit_tokens     counter    of those, found in the cache
    fathom_engine_host_hit_tokens       counter    of those, loaded back from the host KV tier
    fathom_engine_host_load_bytes       counter    bytes copied host -> device (load-backs)
    fathom_engine_host_offload_bytes    counter    bytes copied device -> host (demotions)
    fathom_engine_host_load_seconds     histogram  one load-back, issue -> blocks ready
    fathom_engine_requests_running      gauge      requests in the running batch
    fathom_engine_requests_waiting      gauge      requests waiting for admission
    fathom_engine_kv_blocks_used        gauge      KV blocks referenced by requests
    fathom_engine_kv_blocks_free        gauge      KV blocks on the free list
    fathom_engine_kv_blocks_cached      gauge      cached blocks nobody references (evictable)
    fathom_engine_kv_usage              gauge      used / all blocks
    fathom_engine_prefix_hit_rate       gauge      hit / query tokens since the rank started
    fathom_engine_host_blocks_used      gauge      host-tier blocks holding KV
    fathom_engine_startup_seconds       gauge      the rank's start-up: weights, profile,
                                                   CUDA graphs, warm-up (app.engine.startup)
    fathom_engine_up                    gauge      1 while the rank's exporter runs

Tags: ``deployment`` (the Serve deployment), ``rank`` (the replica's rank in the deployment,
0..dp_size-1, reused by a replacement), ``replica`` (the replica id, new on every restart).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from app.cache.manager import CacheManager

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
LOAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TAG_KEYS = ("deployment", "rank", "replica")


@dataclass
class EngineStats:
    """Counters of one engine core, for metrics and the router."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_preemptions: int = 0
    steps: int = 0
    graph_steps: int = 0
    last_step_s: float = 0.0
    # cumulative host seconds per phase: schedule, prepare, launch (forward + sampling
    # launches; on CPU the compute itself), wait (blocked on a step's sampled tokens), update
    t_schedule: float = 0.0
    t_prepare: float = 0.0
    t_launch: float = 0.0
    t_wait: float = 0.0
    t_update: float = 0.0
    # speculative decoding: verify chunks, drafts they checked, drafts accepted (also per
    # draft position: accepted_at[j] = verifies whose draft j + 1 was accepted)
    spec_verifies: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_accepted_at: list[int] = field(default_factory=list)
    spec_verify_tokens: int = 0  # tokens of verify chunks (1 + drafts each)
    # host KV tier (app.cache.host_tier; zero when off): admissions that loaded blocks back,
    # their tokens, bytes copied each way, summed load latency (issue -> ready), blocks held
    host_hits: int = 0
    host_hit_tokens: int = 0
    host_load_bytes: int = 0
    host_load_s: float = 0.0
    host_offload_bytes: int = 0
    host_blocks: int = 0
    # KV handoffs (app.engine.handoff): states exported and their bytes; handoffs installed,
    # and handoffs resumed as a local prefill (no state, or no room for it)
    kv_exports: int = 0
    kv_export_bytes: int = 0
    kv_imports: int = 0
    kv_import_local: int = 0
    # start-up (app.engine.startup): seconds of each phase and in all; kept by reset()
    startup_load_s: float = 0.0
    startup_profile_s: float = 0.0
    startup_graphs_s: float = 0.0
    startup_warmup_s: float = 0.0
    startup_s: float = 0.0

    def report(self) -> dict[str, float | int]:
        """Flat numbers for metrics: the counters, the draft acceptance per position
        (``spec_accepted_at_j``: verifies whose draft j was accepted) and the means:
        ``spec_accept_length`` tokens emitted per verify (accepted drafts + the bonus),
        ``spec_acceptance`` accepted / proposed drafts, ``spec_verify_tokens_per_step``."""
        out: dict[str, float | int] = {
            k: v for k, v in self.__dict__.items() if isinstance(v, int | float)
        }
        if self.spec_accepted_at:
            for j, n in enumerate(self.spec_accepted_at, 1):
                out[f"spec_accepted_at_{j}"] = n
            v, d = self.spec_verifies, self.spec_drafts
            out["spec_accept_length"] = (1 + self.spec_accepted / v) if v else 0.0
            out["spec_acceptance"] = self.spec_accepted / d if d else 0.0
            out["spec_verify_tokens_per_step"] = (
                self.spec_verify_tokens / self.steps if self.steps else 0.0
            )
        return out

    def reset(self) -> None:
        """Every counter back to zero (after the start-up warm-up), in place: the parts that
        count into this object keep it. The start-up seconds stay."""
        keep = {k: v for k, v in self.__dict__.items() if k.startswith("startup_")}
        fresh = EngineStats(spec_accepted_at=[0] * len(self.spec_accepted_at), **keep)
        self.__dict__.update(fresh.__dict__)

    def count_verify(self, drafts: int, accepted: int) -> None:
        """One verify chunk of ``drafts`` drafts, ``accepted`` of them accepted."""
        self.spec_verifies += 1
        self.spec_drafts += drafts
        self.spec_accepted += accepted
        self.spec_verify_tokens += drafts + 1
        for j in range(accepted):
            self.spec_accepted_at[j] += 1

    def end_step(self, dt: float, scheduler: Scheduler, cache: CacheManager) -> None:
        """A step of ``dt`` seconds ended: the levels of the scheduler and the cache now."""
        self.steps += 1
        self.last_step_s = dt
        self.num_running = len(scheduler.running)
        self.num_waiting = scheduler.num_waiting
        self.num_free_blocks = cache.num_free_blocks
        self.kv_usage = cache.pool.usage
        if cache.index is not None:
            self.prefix_hit_tokens = cache.index.stats.hit_tokens
        if (host := cache.host) is not None:
            h = host.stats
            self.host_hits, self.host_hit_tokens = h.hits, h.hit_tokens
            self.host_load_bytes, self.host_load_s = h.load_bytes, h.load_s
            self.host_offload_bytes, self.host_blocks = h.offload_bytes, host.num_used


class StepRecorder:
    """``EngineCore.on_step``: what each step scheduled, kept until :meth:`drain`."""

    def __init__(self) -> None:
        self.steps: deque[tuple[float, int, int]] = deque()  # (seconds, requests, tokens)
        self.waits: deque[float] = deque()
        self.prefill_tokens = 0
        self.decode_tokens = 0

    def __call__(self, sched: SchedulerOutput, t0: float, dt: float) -> None:
        n_tok = prefill = 0
        for it in sched.items:
            n_tok += it.num_tokens
            decode = it.samples and it.start >= it.seq.num_prompt
            if not (decode and it.num_tokens == 1 + it.num_drafts):  # prompt or recompute
                prefill += it.num_tokens
        self.prefill_tokens += prefill
        self.decode_tokens += n_tok - prefill
        for seq in sched.admitted:
            if seq.num_preemptions == 0:
                self.waits.append(t0 - seq.arrived)
        if sched.items:
            self.steps.append((dt, len(sched.items), n_tok))

    def drain(self) -> tuple[list[tuple[float, int, int]], list[float]]:
        steps, waits = [], []
        while self.steps:
            steps.append(self.steps.popleft())
        while self.waits:
            waits.append(self.waits.popleft())
        return steps, waits


class EngineMetrics:
    """Exports one engine's metrics via Ray (``metrics`` = ``ray.util.metrics`` unless a test
    passes a stand-in module). ``start()`` runs :meth:`flush` every ``interval_s``."""

    def __init__(
        self, core: Any, tags: dict[str, str], interval_s: float = 1.0, metrics: Any = None
    ) -> None:
        if metrics is None:  # Ray, imported where used: the engine itself runs without it
            from ray.util import metrics
        self.core, self.tags, self.interval_s = core, dict(tags), interval_s
        self.recorder = StepRecorder()
        core.on_step = self.recorder
        m, k = metrics, TAG_KEYS

        def hist(name: str, desc: str, b: tuple) -> Any:
            return m.Histogram(name, desc, boundaries=list(b), tag_keys=k)

        self.h_step = hist("fathom_engine_step_seconds", "host time of one engine step",
                           STEP_BUCKETS)  # fmt: skip
        self.h_batch = hist("fathom_engine_batch_size", "requests in one step", BATCH_BUCKETS)
        self.h_tokens = hist("fathom_engine_step_tokens", "tokens in one step", TOKEN_BUCKETS)
        self.h_wait = hist("fathom_engine_queue_wait_seconds",
                           "arrival to first admission", WAIT_BUCKETS)  # fmt: skip
        self.h_load = hist("fathom_engine_host_load_seconds",
                           "host-tier load-back, issue to blocks ready", LOAD_BUCKETS)  # fmt: skip
        self.counters = {
            name: m.Counter(f"fathom_engine_{name}", desc, tag_keys=k)
            for name, desc in (
                ("prefill_tokens", "scheduled prompt tokens (and recomputed ones)"),
                ("decode_tokens", "scheduled decode tokens (with draft tokens)"),
                ("preemptions", "requests preempted when the KV pool ran short"),
                ("prefix_query_tokens", "prompt tokens looked up in the prefix cache"),
                ("prefix_hit_tokens", "prompt tokens found in the prefix cache"),
                ("host_hit_tokens", "prompt tokens loaded back from the host KV tier"),
                ("host_load_bytes", "bytes copied from the host KV tier to the device"),
                ("host_offload_bytes", "bytes copied from the device to the host KV tier"),
            )
        }
        self.gauges = {
            name: m.Gauge(f"fathom_engine_{name}", desc, tag_keys=k)
            for name, desc in (
                ("requests_running", "requests in the running batch"),
                ("requests_waiting", "requests waiting for admission"),
                ("kv_blocks_used", "KV blocks referenced by requests"),
                ("kv_blocks_free", "KV blocks on the free list"),
                ("kv_blocks_cached", "cached KV blocks nobody references (evictable)"),
                ("kv_usage", "fraction of KV blocks in use"),
                ("prefix_hit_rate", "prefix-cache token hit rate since the rank started"),
                ("host_blocks_used", "host KV tier blocks holding KV"),
                ("startup_seconds", "the rank's start-up, weights to warm-up"),
                ("up", "1 while the rank exports metrics"),
            )
        }
        self._last: dict[str, float] = dict.fromkeys(self.counters, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> EngineMetrics:
        self._thread = threading.Thread(target=self._loop, name="fathom-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # metrics never stop the rank
                logger.warning("engine metrics export failed", exc_info=True)

    def totals(self) -> dict[str, float]:
        """The cumulative counters now."""
        core, r = self.core, self.recorder
        index = getattr(core.cache, "index", None)
        q = index.stats.query_tokens if index is not None else 0
        h = index.stats.hit_tokens if index is not None else 0
        return {
            "prefill_tokens": r.prefill_tokens,
            "decode_tokens": r.decode_tokens,
            "preemptions": core.stats.num_preemptions,
            "prefix_query_tokens": q,
            "prefix_hit_tokens": h,
            "host_hit_tokens": core.stats.host_hit_tokens,
            "host_load_bytes": core.stats.host_load_bytes,
            "host_offload_bytes": core.stats.host_offload_bytes,
        }

    def levels(self) -> dict[str, float]:
        """The gauges now (read from the engine thread's state without a lock: each value
        is one int read; a scrape may mix two steps)."""
        core = self.core
        pool = core.cache.pool
        free, cached = pool.num_free, pool.num_cached_unreferenced
        index = getattr(core.cache, "index", None)
        return {
            "requests_running": len(core.scheduler.running),
            "requests_waiting": len(core.scheduler.waiting),
            "kv_blocks_used": pool.num_blocks - free - cached,
            "kv_blocks_free": free,
            "kv_blocks_cached": cached,
            "kv_usage": pool.usage,
            "prefix_hit_rate": index.stats.token_hit_rate if index is not None else 0.0,
            "host_blocks_used": core.stats.host_blocks,
            "startup_seconds": core.stats.startup_s,
            "up": 1,
        }

    def flush(self) -> None:
        tags = self.tags
        steps, waits = self.recorder.drain()
        for dt, n_req, n_tok in steps:
            self.h_step.observe(dt, tags=tags)
            self.h_batch.observe(n_req, tags=tags)
            self.h_tokens.observe(n_tok, tags=tags)
        for w in waits:
            self.h_wait.observe(w, tags=tags)
        host = getattr(self.core.cache, "host", None)
        while host is not None and host.stats.latencies:  # appended by the engine thread
            self.h_load.observe(host.stats.latencies.popleft(), tags=tags)
        for name, v in self.totals().items():
            d = v - self._last[name]
            if d > 0:  # Ray counters reject 0
                self.counters[name].inc(d, tags=tags)
                self._last[name] = v
        for name, v in self.levels().items():
            self.gauges[name].set(float(v), tags=tags)


def rank_tags(deployment: str, rank: int | str | None, replica: str) -> dict[str, str]:
    return {"deployment": deployment, "rank": str(replica if rank is None else rank),
            "replica": replica}  # fmt: skip


def install_engine_metrics(core: Any, interval_s: float = 1.0) -> EngineMetrics | None:
    """On a Serve replica: export ``core``'s metrics tagged with the replica's deployment,
    rank and id (None, logged, when Ray's metrics are unavailable)."""
    try:
        from ray import serve  # only on a Serve replica (the engine runs without Ray)

        ctx = serve.get_replica_context()
        rank = getattr(getattr(ctx, "rank", None), "rank", None)
        tags = rank_tags(ctx.deployment, rank, ctx.replica_id.unique_id)
        return EngineMetrics(core, tags, interval_s).start()
    except Exception:
        logger.warning("engine metrics are not exported", exc_info=True)
        return None
