"""Engine: batched = one-at-a-time = full-forward argmax under chunked prefill, arrivals,
preemption; seeded sampling; aborts free everything; the offline LLM API."""

from __future__ import annotations

import json
import random

import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.llm import LLM
from app.engine.request import (
    EngineRequest,
    FinishReason,
    OutputConstraint,
    RequestError,
    SamplingParams,
)
from tools.op_bisect import prompts, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make_engine(path: str, **opts) -> EngineCore:
    opts.setdefault("kv_cache_bytes", 1 << 22)
    opts.setdefault("bounded_replay", "off")
    return EngineCore(EngineConfig.from_options(path, **opts))


def run_all(eng: EngineCore, reqs: list[EngineRequest], arrive_rng: random.Random | None = None):
    """Add requests (all at once, or at random steps) and step until done."""
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finish: dict[str, FinishReason] = {}
    queue = list(reqs)
    if arrive_rng is None:
        for r in queue:
            eng.add_request(r)
        queue = []
    while queue or eng.has_unfinished:
        if queue and (arrive_rng.random() < 0.5 or not eng.has_unfinished):
            eng.add_request(queue.pop(0))
        for o in eng.step():
            outs[o.request_id] += o.token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
    eng.cache.check_integrity()
    return outs, finish


@pytest.mark.parametrize("arch,overlap", [("v41", True), ("v41", False), ("v4", True)])
def test_batched_equals_single_equals_full_forward(tiny_ckpt, arch, overlap):
    path = tiny_ckpt(arch)
    ps = prompts((23, 5, 37, 11, 1))
    reqs = [EngineRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(ps)]
    eng = make_engine(path, max_num_batched_tokens=16, overlap_schedule=overlap)
    batched, finish = run_all(eng, reqs, random.Random(0))
    assert set(finish.values()) == {FinishReason.LENGTH}
    for i, p in enumerate(ps):
        ref = reference_greedy(eng.model, p, 10)
        assert batched[f"r{i}"] == ref, i
    single = make_engine(path, max_num_batched_tokens=64)
    for r in reqs[:2]:
        out, _ = run_all(single, [r])
        assert out[r.request_id] == batched[r.request_id]


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_keeps_outputs(tiny_ckpt, overlap):
    path = tiny_ckpt("v41")
    ps = prompts((58, 60, 57, 59), seed=1)
    reqs = [EngineRequest(f"r{i}", tuple(p), GREEDY) for i, p in enumerate(ps)]
    roomy, _ = run_all(make_engine(path, max_num_batched_tokens=32, overlap_schedule=False), reqs)
    # 64-token blocks: running requests cross a block boundary while the 3-block pool is full
    tight = make_engine(path, max_num_batched_tokens=32, block_size=64)
    per_block = tight.cache.kv.bytes_per_block()
    per_slot = tight.cache.kv.bytes_per_slot()
    tight = make_engine(
        path,
        max_num_batched_tokens=32,
        block_size=64,
        max_num_seqs=4,
        kv_cache_bytes=(3 + 1) * per_block + (4 + 1) * per_slot,  # + the trash block, slot
        overlap_schedule=overlap,
    )
    assert tight.cache.pool.num_blocks == 3
    got, finish = run_all(tight, reqs)
    assert tight.stats.num_preemptions > 0
    assert got == roomy and set(finish.values()) == {FinishReason.LENGTH}
    assert tight.cache.pool.num_available == 3


def test_seeded_sampling_is_reproducible_across_batches(tiny_ckpt):
    path = tiny_ckpt("v41")
    p = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8, ignore_eos=True
    )
    target = EngineRequest("t", tuple(prompts((9,))[0]), p)
    alone, _ = run_all(make_engine(path), [target])
    others = [
        EngineRequest(f"o{i}", tuple(q), SamplingParams(temperature=1.0, max_tokens=6))
        for i, q in enumerate(prompts((14, 3, 20), seed=5))
    ]
    crowded, _ = run_all(make_engine(path, max_num_batched_tokens=8), [*others, target])
    assert crowded["t"] == alone["t"]
    p2 = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=8, ignore_eos=True
    )
    other_seed, _ = run_all(make_engine(path), [EngineRequest("t", target.prompt_token_ids, p2)])
    assert other_seed["t"] != alone["t"]


@pytest.mark.parametrize("phase_steps", [0, 1, 3, 6])
def test_abort_in_every_phase_frees_everything(tiny_ckpt, phase_steps):
    path = tiny_ckpt("v41")
    eng = make_engine(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    ps = prompts((20, 12))
    for i, p in enumerate(ps):
        eng.add_request(EngineRequest(f"r{i}", tuple(p), GREEDY))
    for _ in range(phase_steps):
        eng.step()
    for i in range(2):
        out = eng.abort(f"r{i}")
        assert out is not None and out.finish_reason is FinishReason.ABORT
    assert eng.abort("r0") is None
    while eng.has_unfinished:  # a step in flight (overlap) finishes, then frees their blocks
        assert eng.step() == []
    eng.cache.check_integrity()
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert eng.cache.kv.num_free_slots == eng.cfg.scheduler.max_num_seqs


def test_llm_api(tiny_ckpt):
    llm = LLM(model=tiny_ckpt("v41"), kv_cache_bytes=1 << 22, max_num_batched_tokens=32)
    outs = llm.generate(
        ["Hello, world", "The quick brown fox"],
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
    )
    for o in outs:
        assert len(o.token_ids) == 6 and o.finish_reason is FinishReason.LENGTH
        assert isinstance(o.text, str) and len(o.logprobs) == 6
        assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in o.logprobs)
        assert o.logprobs[0].top[0][1] >= o.logprobs[0].top[1][1]
    # prefix cache: the same long prompt twice serves whole blocks from the cache
    long = "The quick brown fox jumps over the lazy dog. " * 12
    first = llm.generate(long, SamplingParams(temperature=0, max_tokens=3))[0]
    second = llm.generate(long, SamplingParams(temperature=0, max_tokens=3))[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64
    # stop token ids and min_tokens
    stop_tok = outs[0].token_ids[2]
    o = llm.generate(
        "Hello, world",
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_tok]),
    )[0]
    assert o.token_ids == outs[0].token_ids[:2] and o.stop_reason == stop_tok
    o = llm.generate(
        prompt_token_ids=[[0, 5, 9]],
        sampling_params=SamplingParams(
            temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True
        ),
    )[0]
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == 3
    assert [lp.token_id for lp in o.prompt_logprobs[1:]] == [5, 9]


def test_bad_requests_are_rejected(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"))
    with pytest.raises(RequestError, match="prompt_token_ids"):
        eng.add_request(EngineRequest("x", (1, 10_000)))
    with pytest.raises(RequestError, match="max_tokens"):
        eng.add_request(EngineRequest("y", (1, 2), SamplingParams(max_tokens=10**7)))
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


def test_constrained_json_through_the_engine(tiny_ckpt):
    """20 random bounded schemas, sampled by the tiny model through the engine (masks applied
    in the sampler, tokens accepted by the matcher): every output parses and validates."""
    jsonschema = pytest.importorskip("jsonschema")
    from tests.unit.test_grammar import random_object

    llm = LLM(model=tiny_ckpt("v41"), kv_cache_bytes=1 << 23, max_num_batched_tokens=256)
    schemas = [random_object(random.Random(100 + i)) for i in range(20)]
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=300,
            constraint=OutputConstraint("json", json.dumps(s)),
        )
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate(["Answer in JSON: "] * len(schemas), params)
    for o, s in zip(outs, schemas, strict=True):
        assert o.finish_reason is FinishReason.STOP, (o.finish_reason, o.error, o.text)
        jsonschema.validate(json.loads(o.text), s)
    with pytest.raises(RequestError, match="constraint"):
        llm.generate("x", SamplingParams(constraint=OutputConstraint("json", '{"type": 5}')))


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_a_step_computes_rope_once_per_rotary_kind(tiny_ckpt, arch):
    """The cos / sin of a step's positions, and of its compressor groups' entries, are made
    once per rotary kind (every layer of one type has an equal ``Rotary.key``), not once per
    layer: on the GPU each is a launch, four to five a layer (~160 a flash-rank step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCos(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.cos.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    eng = make_engine(tiny_ckpt(arch))
    eng.add_request(EngineRequest("a", tuple(range(3, 40)), GREEDY))
    eng.step()  # the prefill; the counted step decodes
    pools = eng.cache.kv.pools
    attn = [layer.attn for layer in eng.model.layers]
    owners = [a for a in attn if a.spec.owns_compressor]
    kinds = {a.rotary.key for a in attn}
    group_kinds = {(a.rotary.key, a.spec.ratio, a.compressor.span,
                    pools.tail_rows((a.spec.layer_id, "kv"))
                    if (a.spec.layer_id, "kv") in pools.tails else 0) for a in owners}  # fmt: skip
    with CountCos() as mode:
        eng.step()
    assert mode.n == len(kinds) + len(group_kinds)
    assert mode.n < len(attn) + len(owners)  # what one per layer made
