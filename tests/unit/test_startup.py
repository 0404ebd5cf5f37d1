"""Start-up (``app.engine.startup``, ``app.engine.warmup``) on the CPU: the phases'
seconds in the stats; the warm-up's requests run through a real engine and leave nothing
behind (pool, prefix cache, counters); the memory profile's flow on a probe engine with the
device's measurements faked (activation peaks, a long chunk that does not fit and halves,
the probe released); the synthetic steps the profile and the graph capture run (a chunk at
a long context over trash blocks, a step of padding requests); the graph keys cover every
step a runner can build. The GPU side (captures, real measurements) is
tests/gpu/test_startup_cuda.py."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from app.config import EngineConfig
from app.engine import startup, warmup
from app.engine.capacity import pool_bytes, pool_layout, size_pool
from app.engine.core import EngineCore
from app.engine.graphs import (
    batch_buckets,
    graph_keys,
    padding_spec,
    width_bucket,
    width_buckets,
)
from app.engine.metrics import EngineStats
from app.model.loader import load_model

G = 1 << 30


def _engine(path: str, **opts) -> EngineCore:
    opts.setdefault("kv_cache_bytes", 1 << 22)
    return EngineCore(EngineConfig.from_options(path, **opts))


def test_a_cpu_engine_records_its_startup(tiny_ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="app.engine.startup"):
        eng = _engine(tiny_ckpt("v41"))
    st = eng.stats
    assert st.startup_load_s > 0 and st.startup_s >= st.startup_load_s
    assert st.startup_profile_s == st.startup_graphs_s == 0  # CUDA only
    assert eng.stats.report()["startup_s"] == st.startup_s
    text = caplog.text
    assert "start-up: weights done in" in text and "start-up: ready in" in text
    assert "start-up: warm-up done in" in text and "none on the CPU" in text


def test_stats_reset_keeps_the_startup_seconds():
    st = EngineStats(spec_accepted_at=[3, 1])
    st.steps, st.prompt_tokens, st.spec_verifies, st.kv_usage = 9, 40, 2, 0.5
    st.startup_s, st.startup_warmup_s = 12.5, 3.0
    same = st
    st.reset()
    assert same is st and st.steps == st.prompt_tokens == st.spec_verifies == 0
    assert st.kv_usage == 0.0 and st.spec_accepted_at == [0, 0]
    assert (st.startup_s, st.startup_warmup_s) == (12.5, 3.0)


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_draft_tokens": 3}])
def test_warmup_requests_run_and_leave_nothing_behind(tiny_ckpt, spec):
    eng = _engine(tiny_ckpt("v41"), max_num_batched_tokens=64, max_num_seqs=8,
                  kv_cache_bytes=1 << 23, speculative=spec)  # fmt: skip
    batches, grammar = warmup.warmup_requests(eng)
    sizes = [len(b[0].prompt_token_ids) for b in batches if len(b) == 1]
    assert 64 in sizes and 64 + 32 + 3 in sizes  # the token budget; two chunks
    assert any(b[0].params.prompt_logprobs for b in batches)
    k = 3 if spec else 0
    decode = sorted(len(b) for b in batches if b[0].request_id.startswith("warmup-d"))
    assert decode == [b for b in batch_buckets(8) if b * (1 + k) <= 64]
    kinds = {(p.temperature, p.seed is not None, p.top_k, p.logprobs)
             for b in batches for p in (r.params for r in b)}
    assert len(kinds) >= 4  # greedy, seeded top-p, top-k + penalties, logprobs
    steps = sum(warmup.drive(eng, b) for b in batches)
    steps += warmup.drive(eng, [grammar])
    assert steps > 0 and eng.stats.prompt_tokens > 0 and eng.cache.index.stats.query_tokens
    if spec:
        assert eng.stats.spec_verifies > 0
    warmup.reset(eng)
    eng.cache.check_integrity()
    assert not eng.has_unfinished
    assert eng.cache.num_free_blocks == eng.cache.pool.num_blocks
    assert not eng.cache.index.cached_hashes() and not eng.cache.index.drain_events()
    assert eng.cache.index.stats.query_tokens == 0
    assert eng.stats.prompt_tokens == eng.stats.steps == eng.stats.spec_verifies == 0


def test_warmup_prompts_fit_a_small_pool_and_context(tiny_ckpt):
    eng = _engine(tiny_ckpt("v41"), block_size=16, max_num_seqs=4, max_num_batched_tokens=24,
                  kv_cache_bytes=1 << 20, max_model_len=40)  # fmt: skip
    batches, _ = warmup.warmup_requests(eng)
    room = min(eng.max_model_len, eng.cache.pool.num_blocks * 16 // 2)
    assert all(len(r.prompt_token_ids) + r.params.max_tokens <= room for b in batches for r in b)
    for b in batches:
        warmup.drive(eng, b)
    warmup.reset(eng)
    assert eng.cache.num_free_blocks == eng.cache.pool.num_blocks


def test_a_long_chunk_runs_over_trash_blocks(tiny_ckpt):
    """The profile's synthetic chunk at the end of a long context: the real model step over
    a table of trash blocks, nothing of the pool taken."""
    eng = _engine(tiny_ckpt("v41"), max_num_batched_tokens=32)
    free = eng.cache.num_free_blocks
    startup.long_chunk(eng.runner, 32, 5000)
    startup.long_chunk(eng.runner, 32, 32)  # a chunk at the start of a sequence
    assert eng.cache.num_free_blocks == free


@pytest.mark.parametrize("q", [1, 4])
def test_a_step_of_padding_requests_runs(tiny_ckpt, q):
    """What a graph captures at start-up: ``B`` padding requests of ``q`` tokens in the trash
    slot over a table of trash blocks (here eagerly)."""
    spec = {"method": "dspark", "num_draft_tokens": 3} if q > 1 else None
    eng = _engine(tiny_ckpt("v41"), speculative=spec)
    runner, pools = eng.runner, eng.cache.pools
    step = padding_spec(3, q, 8, runner.n_back, pools.trash_slot, pools.trash_block)
    with torch.inference_mode():
        feats: list[torch.Tensor] = []
        logits = eng.model(runner.builder.build(step, runner.sampled), feats)
    assert logits.shape == (3 * q, eng.model.cfg.vocab_size)
    assert bool(torch.isfinite(logits).all())


def test_graph_keys_cover_every_step_a_runner_builds():
    buckets, T = batch_buckets(64), 100
    widths = width_buckets(300, 1000)
    assert widths == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert width_buckets(300, 200) == [1, 2, 4, 8, 16, 32, 64, 128, 200]
    assert width_buckets(1, 50) == [1]
    keys = set(graph_keys(buckets, (1, 4), T, widths))
    for q in (1, 4):
        for n in range(1, min(64, T // q) + 1):  # every step of n requests of q tokens
            b = buckets[int(np.searchsorted(buckets, n))]
            for w in range(1, 301):
                assert (b, q, width_bucket(w, 1000)) in keys, (n, q, w)
    assert (32, 4, 1) in keys and (48, 4, 1) not in keys  # 25 * 4 = 100 tokens at most
    ordered = graph_keys(buckets, (1, 4), T, widths)
    sizes = [(b * q, w) for b, q, w in ordered]
    assert sizes == sorted(sizes, reverse=True)  # largest first


class _FakeDevice:
    """``torch.cuda``'s memory readings, scripted: the profile's flow runs on the CPU."""

    def __init__(self, total: int, used: int, peaks: list[object]) -> None:
        self.total, self.used, self.peaks = total, used, list(peaks)

    def patch(self, mp: pytest.MonkeyPatch) -> None:
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            mp.setattr(torch.cuda, name, lambda *a, **k: None)
        mp.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
        mp.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (self.total - self.used,
                                                                  self.total))
        mp.setattr(torch.cuda, "max_memory_allocated", self._peak)

    def _peak(self, *a, **k) -> int:
        p = self.peaks.pop(0)
        if isinstance(p, BaseException):
            raise p
        return p  # type: ignore[return-value]


@pytest.mark.parametrize("first_long", [65 * G, torch.cuda.OutOfMemoryError("fake")])
def test_profile_flow_with_the_device_faked(tiny_ckpt, monkeypatch, first_long):
    """Probe engine, request peaks, a chunk at the longest context that does not fit (over
    the utilization, or out of memory) and halves: the activation peak is the largest that
    fit, max_model_len is capped at that context, the probe is gone."""
    path = tiny_ckpt("v41")
    cfg = EngineConfig.from_options(path, max_num_batched_tokens=64, max_num_seqs=4,
                                    max_model_len=2048)  # fmt: skip
    model = load_model(path)
    dev = _FakeDevice(80 * G, 10 * G, [2 * G, G, first_long, 3 * G])
    dev.patch(monkeypatch)
    probes: list[EngineCore] = []

    def probe(c: EngineConfig) -> EngineCore:
        probes.append(EngineCore(c, model, probe=True))
        return probes[-1]

    mem, context = startup.profile(cfg, model, True, probe, lambda *a: None)
    assert not dev.peaks  # prefill, decode batch, the long chunk at 2048 then at 1024
    assert context == 1024
    assert mem.activation_peak == 3 * G and mem.graphs == 0  # no graphs on the CPU
    assert mem.in_use == 10 * G and mem.total == 80 * G and mem.utilization == 0.9
    assert mem.weights == startup.model_bytes(model) > 0
    (p,) = probes
    layout = pool_layout(cfg, model)[0]
    assert p.cfg.cache.kv_cache_bytes == pool_bytes(layout, 4, p.cache.pool.num_blocks)
    assert not p.cfg.cuda_graphs and not p.cfg.cache.enable_prefix_caching
    assert p.max_model_len >= 64 + 2 and p.cache.num_free_blocks == p.cache.pool.num_blocks
    # sized from it: the pool takes the rest, max_model_len stops at the profiled context
    size = size_pool(cfg, model, mem.check_budget(), True, context)
    assert size.max_model_len == 1024
    assert mem.total_with(size.pool_bytes(4)) <= mem.limit


def test_profile_keeps_the_configured_context_when_its_chunk_fits(tiny_ckpt, monkeypatch):
    path = tiny_ckpt("v41")
    cfg = EngineConfig.from_options(path, max_num_batched_tokens=64, max_num_seqs=4,
                                    max_model_len=2048, gpu_memory_utilization=0.5)  # fmt: skip
    model = load_model(path)
    _FakeDevice(80 * G, 10 * G, [G, G, 5 * G]).patch(monkeypatch)
    mem, context = startup.profile(cfg, model, True,
                                   lambda c: EngineCore(c, model, probe=True),
                                   lambda *a: None)  # fmt: skip
    assert context is None and mem.activation_peak == 5 * G
    assert mem.kv_budget == 40 * G - 10 * G - 5 * G


def test_the_probe_is_a_plain_engine_of_its_kv_cache_bytes(tiny_ckpt):
    """A probe runs no start-up of its own and is not frozen out of the collector."""
    path = tiny_ckpt("v41")
    cfg = EngineConfig.from_options(path, kv_cache_bytes=1 << 22)
    model = load_model(path)
    p = EngineCore(replace(cfg, cuda_graphs=False), model, probe=True)
    assert p.stats.startup_s == 0.0 and p.max_model_len > 0


def test_the_memory_lines_name_every_part_and_warn_over_the_utilization(
    tiny_ckpt, monkeypatch, caplog
):
    """The CUDA branch of the lines, its readings faked: the parts once the pool is sized,
    what is in use after the warm-up, a warning over the utilization."""
    path = tiny_ckpt("v41")
    eng = _engine(path)
    mem = startup.DeviceMemory(80 * G, 10 * G, 9 * G, 2 * G, G, 0.5)
    monkeypatch.setattr(startup, "profile", lambda *a: (mem, None))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    start = startup.Startup(torch.device("cpu"))
    start.cuda = True
    cfg = EngineConfig.from_options(path, device="cuda", max_num_seqs=4)
    with caplog.at_level(logging.INFO, logger="app.engine.startup"):
        size = start.pool(cfg, eng.model, True, lambda c: eng)
    assert size.pool_bytes(4) <= mem.kv_budget == 40 * G - 10 * G - 2 * G - G
    assert "start-up: memory: weights 9.00 GiB, other in use 1.00 GiB" in caplog.text
    assert f"KV pool {size.pool_bytes(4) / G:.2f} GiB ({size.num_blocks} blocks" in caplog.text
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (70 * G, 80 * G))
    with caplog.at_level(logging.INFO, logger="app.engine.startup"):
        start._memory_line(eng)
    assert "in use on the device after warm-up: 10.00 GiB of 80.00 GiB" in caplog.text
    assert "over gpu_memory_utilization" not in caplog.text
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (30 * G, 80 * G))
    with caplog.at_level(logging.INFO, logger="app.engine.startup"):
        start._memory_line(eng)
    assert "50.00 GiB in use on the device, over gpu_memory_utilization's 40.00 GiB" in (
        caplog.text)
