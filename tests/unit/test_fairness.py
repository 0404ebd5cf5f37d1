"""Fairness for long prefills (issue 15, finding 5): short requests beside a long prompt get
their first token within a few steps, the long prompt still completes with the same output,
and alone it takes each step's whole budget."""

from __future__ import annotations

import pytest

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from tests.unit.test_engine_regressions import prompts

BUDGET = 64
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make(path: str, **opts) -> EngineCore:
    return EngineCore(EngineConfig.from_options(
        path, kv_cache_bytes=1 << 24, max_num_batched_tokens=BUDGET, bounded_replay="off",
        enable_prefix_caching=False, **opts,
    ))  # fmt: skip


def run(core: EngineCore, reqs: list[EngineRequest], late: list[EngineRequest], after: int):
    """Step; add ``late`` after ``after`` steps. Returns (tokens, first-token step, chunks of
    the first request per step)."""
    toks = {r.request_id: [] for r in reqs + late}
    first: dict[str, int] = {}
    for r in reqs:
        core.add_request(r)
    step = 0
    while core.has_unfinished or step < after:
        if step == after:
            for r in late:
                core.add_request(r)
        for o in core.step():
            toks[o.request_id] += o.token_ids
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = step
        step += 1
        assert step < 500
    return toks, first


@pytest.fixture(scope="module")
def path(tiny_ckpt) -> str:
    return tiny_ckpt("v41")


def test_short_requests_are_served_beside_a_long_prefill(path):
    long_prompt = tuple(prompts((20 * BUDGET,), seed=5)[0])
    shorts = [EngineRequest(f"s{i}", tuple(p), GREEDY)
              for i, p in enumerate(prompts((10, 12, 9), seed=6))]  # fmt: skip
    core = make(path)
    try:
        toks, first = run(core, [EngineRequest("L", long_prompt, GREEDY)], shorts, after=2)
    finally:
        core.close()
    # without the share the short prompts waited for all 20 budgets of the long prefill
    assert all(first[s.request_id] <= 2 + 3 for s in shorts), first
    assert all(len(toks[r]) == 4 for r in toks)
    alone = make(path)
    try:
        ref, first_alone = run(alone, [EngineRequest("L", long_prompt, GREEDY)], [], after=0)
    finally:
        alone.close()
    assert ref["L"] == toks["L"]  # chunking differs, the output does not
    assert first_alone["L"] <= 20 + 1  # alone it takes each step's whole budget
    assert first["L"] > first_alone["L"]  # it gave up part of its budget while others ran


def test_share_one_is_the_old_order(path):
    long_prompt = tuple(prompts((10 * BUDGET,), seed=5)[0])
    shorts = [EngineRequest("s0", tuple(prompts((10,), seed=6)[0]), GREEDY)]
    core = make(path, long_prefill_share=1.0)
    try:
        _, first = run(core, [EngineRequest("L", long_prompt, GREEDY)], shorts, after=2)
    finally:
        core.close()
    assert first["s0"] >= 10 - 1  # waited behind the long prefill
