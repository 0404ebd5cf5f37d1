"""The batched engine step on CUDA: the same greedy tokens as the CPU reference with CUDA
graphs on and off, overlap on and off, chunked prefill, prefix hits (replay off) and
preemption; graph replay equals eager; no host sync between a step's input copy and its
sampled tokens; logits of teacher-forced chunks within 1e-4 of the full-sequence reference."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from app.cache.manager import CacheManager
from app.config import CacheConfig, EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.loader import load_model
from bench.teacher import drive
from tests.gpu.conftest import steps_without_host_sync
from tests.support.reference import sequence_logits
from tools.op_bisect import prompts, reference_greedy, run_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("arch", ["v41", "v4"])
@pytest.mark.parametrize("graphs,overlap", [(True, True), (False, True), (True, False)])
def test_engine_greedy_equals_cpu_reference(ckpts, arch, graphs, overlap):
    ps = prompts([23, 5, 37, 1, 12], 1)
    cpu = load_model(ckpts[arch])
    eng = EngineCore(EngineConfig.from_options(
        ckpts[arch], device="cuda", kv_cache_bytes=1 << 24, max_num_batched_tokens=16,
        cuda_graphs=graphs, overlap_schedule=overlap, bounded_replay="off",
    ))  # fmt: skip
    got = run_requests(eng, ps, GREEDY)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference_greedy(cpu, p, 12), i
    assert (eng.stats.graph_steps > 0) == graphs


def test_prefix_hits_and_preemption_equal_cpu_reference(ckpts):
    """Shared prefixes (hits with replay off are exact) and a pool small enough to preempt:
    four requests of up to 4 blocks of 16 (2 shared) need 10 blocks, the pool has 8."""
    cpu = load_model(ckpts["v41"])
    shared = prompts([40], 5)[0]
    ps = [shared + t for t in prompts([3, 9, 6, 11], 6)]
    probe = EngineCore(EngineConfig.from_options(ckpts["v41"], device="cuda", block_size=16,
                                                 kv_cache_bytes=1 << 24))  # fmt: skip
    blk, slot = probe.cache.kv.bytes_per_block(), probe.cache.kv.bytes_per_slot()
    eng = EngineCore(EngineConfig.from_options(
        ckpts["v41"], device="cuda", block_size=16, max_num_seqs=4, max_num_batched_tokens=24,
        kv_cache_bytes=(8 + 1) * blk + (4 + 1) * slot, bounded_replay="off",
    ))  # fmt: skip
    got = run_requests(eng, ps, GREEDY)
    assert eng.cache.index.stats.hit_tokens > 0
    assert eng.stats.num_preemptions > 0
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference_greedy(cpu, p, 12), i


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_teacher_forced_logits_within_1e4(ckpts, arch):
    cpu = load_model(ckpts[arch])
    gpu = load_model(ckpts[arch], device="cuda")
    P = 8 if arch == "v41" else 16
    cfg = CacheConfig(block_size=P, enable_prefix_caching=False, bounded_replay="off")
    mgr = CacheManager(gpu, cfg, num_blocks=64, max_slots=8, device="cuda")
    g = torch.Generator().manual_seed(11)
    seqs = {f"r{i}": torch.randint(3, 500, (n,), generator=g) for i, n in enumerate((45, 7, 30))}
    out = drive(gpu, mgr, seqs, random.Random(0), max_chunk=9)
    for rid, toks in seqs.items():
        ref = sequence_logits(cpu, toks)
        got = torch.stack([out[rid][p] for p in range(toks.numel())])
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4, rid


def _decoding_engine(ckpt: str, graphs: bool, n: int = 6) -> EngineCore:
    eng = EngineCore(EngineConfig.from_options(
        ckpt, device="cuda", kv_cache_bytes=1 << 24, cuda_graphs=graphs, overlap_schedule=True,
    ))  # fmt: skip
    for i, p in enumerate(prompts([9] * n, 9)):
        eng.add_request(EngineRequest(f"d{i}", tuple(p), SamplingParams(
            temperature=0.8, top_p=0.9, seed=i, max_tokens=40, ignore_eos=True)))  # fmt: skip
    for _ in range(4):  # prefill, then decode steps (graphs captured)
        eng.step()
    return eng


def test_graph_replay_equals_eager(ckpts):
    """The same decode inputs through the captured graph and eagerly give the same logits."""
    eng = _decoding_engine(ckpts["v41"], graphs=True)
    runner = eng.runner
    sched = eng.scheduler.schedule()
    inputs = runner.prepare(sched.items, eng.decoder_replay, eng._prev_rows)
    assert inputs.graph
    for _ in range(2):  # the second call replays the captured graph
        graph = runner.forward(inputs).clone()
    inputs.graph = False
    eager = runner.forward(inputs)
    torch.testing.assert_close(graph, eager, rtol=0, atol=1e-5 * eager.abs().max().item())


def test_no_host_sync_inside_a_step(ckpts, monkeypatch):
    """From the step's input copy to its sampled tokens nothing synchronizes with the device:
    decode steps (graph replay, sampling with seeds, top-p) run under sync debug mode
    "error"; only the wait for the copied tokens (outside the step) is allowed to block."""
    eng = _decoding_engine(ckpts["v41"], graphs=True)
    steps_without_host_sync(eng, 8, monkeypatch)
    assert eng.stats.graph_steps >= 8
    assert np.all([s.num_pending <= 1 for s in eng.scheduler.running])


@pytest.mark.parametrize("arch,spec", [("v41", {"method": "dspark", "num_draft_tokens": 3}),
                                       ("v4", {"method": "mtp", "num_draft_tokens": 1})])
def test_speculative_greedy_equals_cpu_reference(ckpts, arch, spec):
    """DSpark (V4.1) and MTP (V4) on the device: the drafter's kernels and the verify steps
    leave greedy outputs equal to the CPU reference; the drafts are finite and checked."""
    ps = prompts([23, 5, 37, 1, 12], 3)
    cpu = load_model(ckpts[arch])
    eng = EngineCore(EngineConfig.from_options(
        ckpts[arch], device="cuda", kv_cache_bytes=1 << 24, max_num_batched_tokens=16,
        bounded_replay="off", speculative=spec,
    ))  # fmt: skip
    blocks = []
    eng.on_draft = lambda rids, anchors, block: blocks.append(block.logits.clone())
    got = run_requests(eng, ps, GREEDY)
    for i, p in enumerate(ps):
        assert got[f"r{i}"] == reference_greedy(cpu, p, 12), i
    assert eng.stats.spec_verifies > 0 and blocks
    assert eng.stats.graph_steps > 0  # verify steps replay graphs that return the features
    assert eng.spec.steps.replays > 0  # and the draft steps replay theirs
    assert all(bool(torch.isfinite(b).all()) for b in blocks)


def test_step_inputs_survive_builds_ahead_of_the_device(ckpts):
    """Step builds that run ahead of the GPU: with the stream stalled, four builds of
    different steps in a row (no sync in between) each land intact in their own device
    buffer. The builder had alternated two pinned staging buffers, so the third build
    overwrote the first's while its copy still waited behind the stall: the first batch read
    the third's rows (the cause of a device-side index_copy_ assert in a graph step under
    a loaded GPU)."""
    from app.engine.batch import StepSpec

    eng = EngineCore(EngineConfig.from_options(ckpts["v41"], device="cuda",
                                               kv_cache_bytes=1 << 24))  # fmt: skip
    builder = eng.runner.builder

    def spec(k: int) -> StepSpec:
        lens = np.array([3, 1], dtype=np.int64)
        return StepSpec(
            slots=np.array([k, k + 1]), starts=np.array([5 * k, 9 + k]), lens=lens,
            floors=np.zeros(2, np.int64), cached=np.zeros(2, np.int64),
            decoder_floors=np.zeros(2, np.int64), history=np.full((2, 0), -1, np.int64),
            ids=np.arange(4, dtype=np.int64) + 100 * k, pending=np.full(4, -1, np.int64),
            logit_rows=np.array([2, 3]), tables=np.full((2, 3), k, np.int64),
        )  # fmt: skip

    for _ in range(2):  # the second round: the host allocator holds four free blocks
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 28)  # ~0.1-0.2 s of GPU time: the copies queue behind it
        stall = torch.cuda.Event()
        stall.record()
        batches = [builder.build(spec(k)) for k in range(4)]
        ahead = not stall.query()  # the builds ran while the GPU was still stalled
        torch.cuda.synchronize()
    assert ahead
    for k, b in enumerate(batches):
        assert b.input_ids.tolist() == [100 * k + i for i in range(4)], k
        assert b.slots.tolist() == [k, k + 1], k
        assert b.positions.tolist() == [5 * k, 5 * k + 1, 5 * k + 2, 9 + k], k
        assert b.block_table.tolist() == [[k] * 3] * 2, k
