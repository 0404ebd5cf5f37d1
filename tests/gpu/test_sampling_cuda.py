"""Sampling features on CUDA: ``n`` > 1 choices forked from one prefill (CUDA graphs on, the
compute dtype and the packed KV formats) equal single requests with the choices' seeds;
``logit_bias`` steers greedy decoding under graphs and speculation as it does eagerly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.fork import choice_seed
from app.engine.request import EngineRequest, SamplingParams
from tools.op_bisect import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=10, ignore_eos=True)


def engine(path: str, **opts) -> EngineCore:
    opts = {"device": "cuda", "kv_cache_bytes": 1 << 26, "bounded_replay": "off", **opts}
    return EngineCore(EngineConfig.from_options(path, **opts))


def collect(eng: EngineCore, reqs: list[EngineRequest]) -> dict[tuple[str, int], list[int]]:
    for r in reqs:
        eng.add_request(r)
    got: dict[tuple[str, int], list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault((o.request_id, o.index), []).extend(o.token_ids)
    eng.cache.check_integrity()
    return got


@pytest.mark.parametrize("kv_quant", [False, True])
def test_forked_choices_equal_single_requests_under_graphs(ckpts, kv_quant):
    path, prompt = ckpts["v41"], tuple(prompts([150], 1)[0])
    eng = engine(path, cuda_graphs=True, kv_quant=kv_quant)
    got = collect(eng, [EngineRequest("r", prompt, dataclasses.replace(SEEDED, n=4))])
    assert eng.stats.graph_steps > 0
    for i in range(4):
        mine = dataclasses.replace(SEEDED, seed=choice_seed(SEEDED.seed, i))
        alone = collect(engine(path, cuda_graphs=True, kv_quant=kv_quant),
                        [EngineRequest("one", prompt, mine)])  # fmt: skip
        assert got["r", i] == alone["one", 0], i
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


@pytest.mark.parametrize("speculative", [None, {"method": "dspark", "num_draft_tokens": 3}])
def test_logit_bias_under_graphs_equals_eager(ckpts, speculative):
    path, ps = ckpts["v41"], prompts([23, 5, 37], 2)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = collect(engine(path), [EngineRequest(f"p{i}", tuple(p), greedy)
                                   for i, p in enumerate(ps)])  # fmt: skip
    reqs = []
    for i, p in enumerate(ps):
        ban = tuple((t, -100.0) for t in sorted(set(plain[f"p{i}", 0][:3])))
        favour = () if 499 in dict(ban) else ((499, 3.0),)
        params = dataclasses.replace(greedy, logit_bias=ban + favour)
        reqs.append(EngineRequest(f"b{i}", tuple(p), params))
    eager = collect(engine(path, cuda_graphs=False, overlap_schedule=False), reqs)
    eng = engine(path, cuda_graphs=True, speculative=speculative)
    got = collect(eng, reqs)
    assert got == eager and eng.stats.graph_steps > 0
    for i, r in enumerate(reqs):
        banned = {t for t, b in r.params.logit_bias if b < 0}
        assert not banned & set(got[f"b{i}", 0]) and got[f"b{i}", 0] != plain[f"p{i}", 0]
