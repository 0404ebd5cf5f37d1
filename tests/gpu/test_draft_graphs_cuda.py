"""The draft step's CUDA graphs (app/engine/spec/graphs.py) on the device: a replay gives
the same bits as the same function run eagerly on the same padded buffers (DSpark and MTP;
greedy, seeded, top-k / top-p / min-p draws; several buckets), rings included; start-up
captures the greedy and plain random kinds of every bucket; speculating decode steps
(verify graph, sampling, draft graph) run without a host sync; in the deterministic mode
the engine with draft graphs (steps padded to buckets) gives the bits of the eager protocol
path (observe + propose at the step's own sizes). The CPU twin is
tests/unit/test_draft_step.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.engine.sampler import PickKind
from app.engine.spec.graphs import DraftGraphs
from tests.gpu.conftest import steps_without_host_sync
from tests.unit.test_draft_step import (
    DSPARK,
    MTP,
    draft_inputs,
    requests,
    run,
    same_blocks,
)
from tools.op_bisect import prompts

pytestmark = pytest.mark.cuda
GPU = {"device": "cuda", "dtype": "bfloat16", "kv_cache_bytes": 1 << 26, "max_num_seqs": 16,
       "bounded_replay": "off"}  # fmt: skip
KINDS = {
    "greedy": lambda R: [SamplingParams(temperature=0)] * R,
    "seeded": lambda R: [SamplingParams(temperature=0.9, seed=i) for i in range(R)],
    "mixed": lambda R: [SamplingParams(temperature=0) if i % 3 == 0 else
                        SamplingParams(temperature=1.3, top_k=20, top_p=0.8, min_p=0.01,
                                       seed=7 * i) for i in range(R)],
}  # fmt: skip


def spec_engine(path: str, spec: dict, **opts) -> EngineCore:
    return EngineCore(EngineConfig.from_options(path, speculative=spec, **{**GPU, **opts}))


@pytest.mark.gpu_mem(4)
@pytest.mark.parametrize("arch,spec", [("v41", DSPARK), ("v4", MTP)])
def test_draft_graph_replay_equals_eager(tiny_ckpt, arch, spec):
    eng = spec_engine(tiny_ckpt(arch), spec)
    graphs: DraftGraphs = eng.spec.steps
    assert graphs.pool is not None  # start-up captured the greedy and random kinds
    keys = graphs.start_keys()
    assert set(keys) <= set(graphs.graphs)
    assert (16, PickKind()) in keys and (1, PickKind(random=True)) in keys
    eager = DraftGraphs(graphs.proposer, graphs.k, 16, graphs.trash_slot, graphs.device,
                        graphs.dtype)
    eager.pad = True  # the same padded buffers, no graph
    k, rng, W = graphs.k, np.random.default_rng(0), eng.model.cfg.sliding_window
    rings = eng.cache.pools.draft
    width, dt = graphs.proposer.feature_width, graphs.dtype
    for R in (1, 3, 6, 13):
        for name, ps in KINDS.items():
            inp = draft_inputs(R, k, rng, ps(R))
            g = torch.Generator(device="cuda").manual_seed(R)
            S, N = inp.num_sampled, inp.num_context
            tokens = torch.randint(0, 500, (S,), generator=g, device="cuda")
            accepted = torch.rand(S, generator=g, device="cuda") < 0.6
            feats = torch.randn(N, width, generator=g, device="cuda").to(dt)
            base = [r.data.clone() for r in rings]
            got = []
            for runner in (eager, graphs, graphs):  # the second graph call replays
                for r, d in zip(rings, base, strict=True):
                    r.data.copy_(d)
                out = runner.run(inp, tokens, accepted, feats)
                got.append(([t.clone() for t in out.tensors() if t is not None],
                            [r.data[: (R + 3) * W].view(torch.uint8).clone()
                             for r in rings]))  # fmt: skip
            for outs, rs in got[1:]:
                for a, b in zip(got[0][0] + got[0][1], outs + rs, strict=True):
                    assert torch.equal(a, b), (R, name)
    assert graphs.replays >= 12 and eager.captures == 0


@pytest.mark.gpu_mem(4)
def test_no_host_sync_inside_a_speculating_step(tiny_ckpt, monkeypatch):
    """From a step's input copy to its tokens and next drafts nothing synchronizes with the
    device: verify steps (graphs), sampling (greedy and seeded top-p) and the draft step's
    graph run under sync debug mode "error"; only the wait for the copied tokens (outside
    the step) may block. Every graph the steps reach was captured in the first steps."""
    eng = spec_engine(tiny_ckpt("v41"), DSPARK)
    for i, p in enumerate(prompts([9] * 6, 9)):
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=200,
                                ignore_eos=True) if i % 2 else \
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # fmt: skip
        eng.add_request(EngineRequest(f"d{i}", tuple(p), params))
    for _ in range(4):  # prefill, then verify steps (the draft graphs of their kind captured)
        eng.step()
    steps, replays = eng.stats.graph_steps, eng.spec.steps.replays
    steps_without_host_sync(eng, 8, monkeypatch)
    assert eng.stats.graph_steps - steps >= 6 and eng.spec.steps.replays - replays >= 6
    assert eng.stats.spec_verifies > 0


@pytest.mark.gpu_mem(4)
@pytest.mark.parametrize("arch,spec", [("v41", DSPARK), ("v4", MTP)])
def test_draft_graphs_equal_the_eager_protocol_path_in_deterministic_mode(tiny_ckpt, arch,
                                                                          spec):  # fmt: skip
    """Greedy, seeded and constrained requests arriving at random steps: the engine whose
    draft steps replay graphs of padded buckets and one drafting eagerly through the
    protocol at each step's own sizes give the same tokens, logprobs and draft blocks, bit
    for bit (the mode's kernels make a row's bits independent of the rows beside it)."""
    path = tiny_ckpt(arch)
    reqs = requests(9, seed=3)
    graphs = spec_engine(path, spec, deterministic=True, max_num_batched_tokens=24)
    eager = spec_engine(path, spec, deterministic=True, max_num_batched_tokens=24)
    eager.spec.steps = None
    got, blocks = run(graphs, reqs, seed=1)
    want, want_blocks = run(eager, reqs, seed=1)
    assert got == want
    same_blocks(blocks, want_blocks)
    assert graphs.spec.steps.replays > 0 and graphs.stats.spec_verifies > 0
