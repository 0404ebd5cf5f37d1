"""Start-up on CUDA (``app.engine.startup``): the pool sized from what was measured, within
``gpu_memory_utilization``; every CUDA-graph key captured before the first request (a
request captures none); the warm-up leaves the pool empty and the counters at zero; with
speculation the verify graphs and the draft step's (greedy requests capture none either);
with ``kv_cache_bytes`` no profile but graphs and warm-up all the same. Each engine takes
``_share`` of the card, not all of it (``-n 16``)."""

from __future__ import annotations

import logging

import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import SamplingParams
from tools.op_bisect import prompts, run_requests

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.gpu_mem(8)]  # fmt: skip
G = 1 << 30
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _share(extra_gib: float) -> float:
    """A utilization leaving this engine about ``extra_gib`` above what the card holds now
    (other xdist workers included): the test takes its share, not the card."""
    free, total = torch.cuda.mem_get_info()
    return min(1.0, (total - free + extra_gib * G) / total)


def _engine(ckpt: str, **opts) -> EngineCore:
    opts.setdefault("gpu_memory_utilization", _share(4.0))
    return EngineCore(EngineConfig.from_options(
        ckpt, device="cuda", max_model_len=8192, max_num_seqs=16, max_num_batched_tokens=256,
        **opts))  # fmt: skip


@pytest.mark.parametrize("spec", [None, {"method": "dspark", "num_draft_tokens": 3}])
def test_measured_start_captures_every_graph_before_a_request(ckpts, caplog, spec):
    with caplog.at_level(logging.INFO, logger="app.engine.startup"):
        eng = _engine(ckpts["v41"], speculative=spec)
    st, mem, size = eng.stats, eng.startup.memory, eng.startup.size
    assert mem is not None and size is not None
    assert st.startup_profile_s > 0 and st.startup_graphs_s > 0 and st.startup_warmup_s > 0
    assert st.startup_s >= st.startup_profile_s + st.startup_graphs_s + st.startup_warmup_s
    assert mem.activation_peak > 0 and mem.graphs > 0 and mem.weights > 0
    assert mem.total_with(size.pool_bytes(16)) <= mem.limit
    # the pool is what the budget buys: no block more fits
    assert size.pool_bytes(16) <= mem.kv_budget < size.pool_bytes(16) + size.layout.bytes_per_block
    assert eng.max_model_len == 8192 and size.max_model_len == 8192
    for part in ("memory: weights", "activation peak", "CUDA graphs", "KV pool", "total",
                 "start-up: ready in"):
        assert part in caplog.text, part
    graphs = eng.runner.graphs
    qs = (1, 4) if spec else (1,)
    keys = eng.runner.graph_keys(qs)
    assert keys and set(keys) <= set(graphs.graphs)
    assert eng.cache.num_free_blocks == eng.cache.pool.num_blocks and st.steps == 0
    drafts = eng.spec.steps if spec else None  # the draft step's: greedy and random kinds
    if drafts is not None:
        assert set(drafts.start_keys()) <= set(drafts.graphs)
    captures = graphs.captures, drafts.captures if drafts else 0
    got = run_requests(eng, prompts([5, 300, 1, 40], 3), GREEDY)
    assert all(len(v) == 24 for v in got.values())
    # no request paid for a capture
    assert (graphs.captures, drafts.captures if drafts else 0) == captures
    assert eng.stats.graph_steps > 0 and (drafts is None or drafts.replays > 0)


def test_kv_cache_bytes_skips_the_profile_not_the_warm_up(ckpts):
    eng = _engine(ckpts["v41"], kv_cache_bytes=1 << 24)
    st = eng.stats
    assert eng.startup.memory is None and st.startup_profile_s == 0
    assert st.startup_graphs_s > 0 and st.startup_warmup_s > 0
    captures = eng.runner.graphs.captures
    assert captures == len(eng.runner.graph_keys((1,)))
    run_requests(eng, prompts([7, 50], 5), GREEDY)
    assert eng.runner.graphs.captures == captures
