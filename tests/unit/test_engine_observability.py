"""The engine's side of observability: phase events of traced requests
(app.engine.lifecycle) and the engine metrics (app.engine.metrics), on the tiny engine."""

from __future__ import annotations

from collections import defaultdict

import pytest

from app.engine.lifecycle import RequestTrace
from app.engine.metrics import TAG_KEYS, EngineMetrics
from app.engine.request import EngineRequest, SamplingParams
from tests.unit.test_engine import make_engine, prompts, run_all

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def traced(eng, rid: str) -> list[tuple[str, dict]]:
    events: list[tuple[str, dict]] = []
    eng.traces[rid] = RequestTrace(lambda name, attrs, t: events.append((name, attrs)))
    return events


def test_traced_request_records_its_phases_untraced_ones_nothing(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"), max_num_batched_tokens=16, overlap_schedule=False)
    p0, p1 = prompts((37, 9))
    ev = traced(eng, "t")
    reqs = [EngineRequest("t", tuple(p0), GREEDY), EngineRequest("u", tuple(p1), GREEDY)]
    run_all(eng, reqs)
    names = [n for n, _ in ev]
    assert names[:2] == ["queued", "scheduled"], names
    assert names[-2:] == ["first_token", "finished"], names
    chunks = [a for n, a in ev if n == "prefill_chunk"]
    assert len(chunks) >= 3  # 37 prompt tokens in steps of at most 16
    assert sum(c["tokens"] for c in chunks) == 37
    assert [c["start"] for c in chunks] == sorted(c["start"] for c in chunks)
    assert ev[0][1] == {"prompt_tokens": 37}
    assert ev[-1][1] == {"reason": "length", "output_tokens": 6, "cached_tokens": 0}
    assert ev[1][1]["queue_wait_s"] >= 0.0 and ev[1][1]["cached_tokens"] == 0
    assert eng.traces == {} and eng._num_traced == 0


def test_prefix_hit_shows_in_the_events(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"), max_num_batched_tokens=64, block_size=16)
    (p,) = prompts((70,))
    run_all(eng, [EngineRequest("a", tuple(p), GREEDY)])
    ev = traced(eng, "b")
    run_all(eng, [EngineRequest("b", tuple(p), GREEDY)])
    sched = next(a for n, a in ev if n == "scheduled")
    assert sched["cached_tokens"] == 64  # 4 whole 16-token blocks of the 70
    assert [a["cached_tokens"] for n, a in ev if n == "finished"] == [64]


def test_aborted_request_finishes_with_abort(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"), max_num_batched_tokens=16)
    (p,) = prompts((40,))
    ev = traced(eng, "t")
    eng.add_request(EngineRequest("t", tuple(p), GREEDY))
    eng.step()
    eng.abort("t")
    assert [n for n, _ in ev][-1] == "finished"
    assert ev[-1][1]["reason"] == "abort"
    assert "first_token" not in [n for n, _ in ev]


def test_preemption_is_an_event(tiny_ckpt):
    path = tiny_ckpt("v41")
    probe = make_engine(path, max_num_batched_tokens=32, block_size=64)
    per_block, per_slot = probe.cache.kv.bytes_per_block(), probe.cache.kv.bytes_per_slot()
    eng = make_engine(
        path,
        max_num_batched_tokens=32,
        block_size=64,
        max_num_seqs=4,
        kv_cache_bytes=(3 + 1) * per_block + (4 + 1) * per_slot,
        overlap_schedule=False,
    )  # fmt: skip  (test_engine.test_preemption_keeps_outputs' pool of 3 blocks)
    ps = prompts((58, 60, 57, 59), seed=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    evs = {f"r{i}": traced(eng, f"r{i}") for i in range(4)}
    run_all(eng, [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(ps)])
    assert eng.stats.num_preemptions > 0
    pre = sum(n == "preempted" for ev in evs.values() for n, _ in ev)
    assert pre == eng.stats.num_preemptions
    for ev in evs.values():  # a preempted request is scheduled again, then finishes
        names = [n for n, _ in ev]
        assert names.count("scheduled") == 1 + names.count("preempted")
        assert names[-1] == "finished" and ev[-1][1]["output_tokens"] == 10


class _Fake:
    """Stand-in for ``ray.util.metrics``: records every call by (metric, tags)."""

    def __init__(self) -> None:
        self.made: dict[str, _Fake.Metric] = {}

    class Metric:
        def __init__(self, name, desc="", boundaries=None, tag_keys=()):
            self.name, self.tag_keys = name, tuple(tag_keys)
            self.values: dict[tuple, list[float]] = defaultdict(list)

        def _rec(self, v, tags):
            assert set(tags) == set(self.tag_keys), tags
            self.values[tuple(sorted(tags.items()))].append(v)

        def observe(self, v, tags):
            self._rec(v, tags)

        def inc(self, v, tags):
            assert v > 0  # Ray's Counter rejects 0 and negative increments
            self._rec(v, tags)

        def set(self, v, tags):
            self._rec(v, tags)

    def _make(self, name, *a, **k):
        m = self.made[name] = _Fake.Metric(name, *a, **k)
        return m

    def Histogram(self, name, *a, **k):  # noqa: N802
        return self._make(name, *a, **k)

    Counter = Gauge = Histogram


def _one(m: _Fake.Metric) -> list[float]:
    (vals,) = m.values.values()  # one series: this rank's tags
    return vals


def test_engine_metrics_count_what_the_engine_did(tiny_ckpt):
    eng = make_engine(
        tiny_ckpt("v41"), max_num_batched_tokens=16, overlap_schedule=False, block_size=16
    )
    fake = _Fake()
    tags = {"deployment": "DPRank", "rank": "1", "replica": "abc"}
    em = EngineMetrics(eng, tags, metrics=fake)
    assert eng.on_step is em.recorder and set(TAG_KEYS) == set(tags)
    lens = (23, 5, 37)
    reqs = [EngineRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(prompts(lens))]
    run_all(eng, reqs)
    em.flush()
    m = fake.made
    assert len(_one(m["fathom_engine_step_seconds"])) == eng.stats.steps
    assert all(0 < s < 60 for s in _one(m["fathom_engine_step_seconds"]))
    batch = _one(m["fathom_engine_batch_size"])
    assert max(batch) == 3 and min(batch) >= 1
    assert len(_one(m["fathom_engine_queue_wait_seconds"])) == 3
    assert sum(_one(m["fathom_engine_prefill_tokens"])) == sum(lens)
    assert sum(_one(m["fathom_engine_decode_tokens"])) == 3 * (6 - 1)
    assert sum(_one(m["fathom_engine_step_tokens"])) == sum(lens) + 3 * 5
    assert "fathom_engine_preemptions" not in m or not m["fathom_engine_preemptions"].values
    pool = eng.cache.pool
    assert _one(m["fathom_engine_kv_blocks_used"]) == [0.0]
    free, cached = (
        _one(m["fathom_engine_kv_blocks_free"]),
        _one(m["fathom_engine_kv_blocks_cached"]),
    )
    assert free[0] + cached[0] == pool.num_blocks
    assert cached[0] > 0  # whole blocks of finished requests stay cached (evictable)
    assert _one(m["fathom_engine_up"]) == [1.0]
    assert _one(m["fathom_engine_requests_running"]) == [0.0]
    # the same prompt again: a prefix hit; the counters export only what is new
    run_all(eng, [EngineRequest("again", tuple(prompts(lens)[2]), GREEDY)])
    em.flush()
    hits = _one(m["fathom_engine_prefix_hit_tokens"])
    assert len(hits) == 1 and hits[0] == eng.cache.index.stats.hit_tokens > 0
    q = sum(_one(m["fathom_engine_prefix_query_tokens"]))
    assert q == eng.cache.index.stats.query_tokens
    assert _one(m["fathom_engine_prefix_hit_rate"])[-1] == pytest.approx(hits[0] / q)
    assert len(_one(m["fathom_engine_step_seconds"])) == eng.stats.steps  # drained, not doubled
