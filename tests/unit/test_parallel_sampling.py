"""Parallel sampling (``n`` > 1, ``app.engine.fork``): the prompt is prefilled once, the choices
share its full blocks and copy the partial one, each choice samples from its own seed stream
(choice i = a request of its own with seed + i), and they decode exactly as plain requests
(greedy, seeded, constrained, speculative, preempted, forked short of slots); aborts free all."""

from __future__ import annotations

import dataclasses
import random

import pytest

from app.engine.core import EngineCore
from app.engine.fork import choice_seed
from app.engine.llm import LLM
from app.engine.request import (
    EngineRequest,
    FinishReason,
    OutputConstraint,
    RequestError,
    SamplingParams,
)
from tests.unit.test_engine import make_engine
from tests.unit.test_speculative import DSPARK
from tools.op_bisect import prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=8, ignore_eos=True)


def with_(p: SamplingParams, **kw: object) -> SamplingParams:
    return dataclasses.replace(p, **kw)


def run(eng: EngineCore, reqs: list[EngineRequest], on_step=None):
    """Step until done -> ({(request id, index): tokens}, {(request id, index): finish},
    tokens computed). Exactly one delta per request is ``finished``, its last."""
    outs: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], FinishReason] = {}
    done: list[str] = []
    for r in reqs:
        eng.add_request(r)
    sched_tokens: list[int] = []
    eng.on_step = lambda sched, t0, dt: sched_tokens.append(sched.num_tokens)
    while eng.has_unfinished:
        for o in eng.step():
            assert o.request_id not in done, "a delta after the request finished"
            key = (o.request_id, o.index)
            outs.setdefault(key, []).extend(o.token_ids)
            if o.finish_reason is not None:
                assert key not in finish
                finish[key] = o.finish_reason
            if o.finished:
                done.append(o.request_id)
        if on_step is not None:
            on_step(eng)
    assert sorted(done) == sorted(r.request_id for r in reqs)
    computed = sum(sched_tokens)
    eng.cache.check_integrity()
    return outs, finish, computed


def alone(path: str, prompt, params: SamplingParams, **opts) -> list[int]:
    outs, _, _ = run(make_engine(path, **opts), [EngineRequest("one", tuple(prompt), params)])
    return outs["one", 0]


@pytest.mark.parametrize("overlap", [True, False])
def test_one_prefill_and_choices_equal_plain_requests(tiny_ckpt, overlap):
    """Greedy choices are the plain greedy answer; seeded choice i is the plain answer of
    seed + i; the prompt's L - 1 positions are computed once, then each choice computes
    position L - 1 and its own tokens (max_tokens rows: the last sampled token needs none)."""
    path = tiny_ckpt("v41")
    prompt = prompts((150,), seed=1)[0]
    eng = make_engine(path, overlap_schedule=overlap, enable_prefix_caching=False)
    n = 4
    reqs = [EngineRequest("g", tuple(prompt), with_(GREEDY, n=n)),
            EngineRequest("s", tuple(prompt), with_(SEEDED, n=n))]  # fmt: skip
    outs, finish, computed = run(eng, reqs)
    assert set(finish.values()) == {FinishReason.LENGTH} and len(finish) == 2 * n
    greedy = alone(path, prompt, GREEDY)
    assert all(outs["g", i] == greedy for i in range(n))
    for i in range(n):
        mine = with_(SEEDED, seed=choice_seed(SEEDED.seed, i))
        assert outs["s", i] == alone(path, prompt, mine), i
    assert len({tuple(outs["s", i]) for i in range(n)}) > 1  # own streams: they differ
    once = 2 * ((len(prompt) - 1) + n * GREEDY.max_tokens)
    # (overlap: a choice that finished at step N was in step N + 1 too, one row more)
    assert computed == once if not overlap else once <= computed <= once + 2 * n
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert eng.cache.kv.num_free_slots == eng.cfg.scheduler.max_num_seqs


@pytest.mark.parametrize("kv_quant", [False, True])  # the compute dtype; packed fp8 / fp4 rows
def test_choices_share_the_prompts_full_blocks_and_copy_the_partial_one(tiny_ckpt, kv_quant):
    path = tiny_ckpt("v41")
    opts = {"enable_prefix_caching": False, "kv_quant": kv_quant}
    eng = make_engine(path, overlap_schedule=False, **opts)
    P = eng.cache.block_size
    prompt = prompts((2 * P + 10,), seed=2)[0]  # position L-1 is in the third block
    seen = []

    def look(e: EngineCore) -> None:
        ids = [f"r/{i}" for i in range(3)]
        if all(i in e.cache._seqs for i in ids) and not seen:
            tables = [e.cache.blocks_of(i) for i in ids]
            seen.append(tables)
            pool = e.cache.pool
            assert all(t[:2] == tables[0][:2] for t in tables)  # the full blocks: shared
            assert all(pool.refcount(b) == 3 for b in tables[0][:2])
            assert len({t[2] for t in tables}) == 3  # the partial block: one each
            assert all(pool.refcount(t[2]) == 1 for t in tables)

    n3 = with_(GREEDY, n=3)
    outs, _, _ = run(eng, [EngineRequest("r", tuple(prompt), n3)], on_step=look)
    assert seen, "the choices never ran together"
    assert outs["r", 0] == outs["r", 1] == outs["r", 2] == alone(path, prompt, GREEDY, **opts)
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_choices_short_of_slots_wait_as_plain_requests(tiny_ckpt):
    """Two slots for four choices: one choice forks, one takes the parent's entry, the other
    two wait and run later as plain requests (a prefix hit, or recomputed)."""
    path = tiny_ckpt("v41")
    prompt = prompts((90,), seed=3)[0]
    greedy = alone(path, prompt, GREEDY)
    for caching in (True, False):
        eng = make_engine(path, max_num_seqs=2, enable_prefix_caching=caching)
        outs, _, _ = run(eng, [EngineRequest("r", tuple(prompt), with_(GREEDY, n=4))])
        assert [outs["r", i] for i in range(4)] == [greedy] * 4


def test_preempted_choices_and_one_token_prompts(tiny_ckpt):
    path = tiny_ckpt("v41")
    ps = prompts((70, 1, 33), seed=4)
    params = with_(SEEDED, n=3, max_tokens=24)
    plain = {
        (f"r{k}", i): alone(path, p, with_(SEEDED, max_tokens=24, seed=choice_seed(7, i)))
        for k, p in enumerate(ps)
        for i in range(3)
    }
    eng = make_engine(
        path, kv_cache_bytes=8 * 17408 + 5 * 36864, max_num_seqs=8, max_num_batched_tokens=16
    )  # five blocks of 64 positions
    reqs = [EngineRequest(f"r{k}", tuple(p), params) for k, p in enumerate(ps)]
    outs, _, _ = run(eng, reqs)
    assert eng.stats.num_preemptions > 0  # the small pool preempts choices
    assert outs == plain


def test_constrained_choices_each_match(tiny_ckpt):
    llm = LLM(model=tiny_ckpt("v41"), kv_cache_bytes=1 << 23)
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=5,
                       constraint=OutputConstraint("regex", "[0-9]{3}[a-z]"))  # fmt: skip
    outs = llm.generate(["Code: "], p)
    assert [o.index for o in outs] == list(range(5))
    for o in outs:
        assert o.finish_reason is FinishReason.STOP and len(o.text) == 4, o.text
        assert o.text[:3].isdigit() and o.text[3].isalpha()
    assert len({o.text for o in outs}) > 1


@pytest.mark.parametrize("proposer", ["dspark", "random"])
def test_choices_under_speculation_equal_plain(tiny_ckpt, proposer):
    from bench.proposers import RandomProposer
    from tests.unit.test_speculative import engine as spec_engine

    path = tiny_ckpt("v41")
    prompt = prompts((75,), seed=5)[0]
    vocab = make_engine(path).model.cfg.vocab_size
    prop = RandomProposer(vocab) if proposer == "random" else None
    eng = spec_engine(path, prop, speculative=DSPARK)
    n3 = with_(GREEDY, n=3, max_tokens=12)
    outs, _, _ = run(eng, [EngineRequest("r", tuple(prompt), n3)])
    plain = alone(path, prompt, with_(GREEDY, max_tokens=12))
    assert [outs["r", i] for i in range(3)] == [plain] * 3
    assert eng.stats.spec_verifies > 0


@pytest.mark.parametrize("steps", [0, 1, 3, 5])
def test_abort_in_every_phase_frees_everything(tiny_ckpt, steps):
    path = tiny_ckpt("v41")
    eng = make_engine(path, max_num_batched_tokens=16, enable_prefix_caching=False)
    eng.add_request(EngineRequest("r", tuple(prompts((40,))[0]),
                                  with_(GREEDY, n=3)))  # fmt: skip
    for _ in range(steps):
        eng.step()
    with pytest.raises(RequestError, match="already running"):  # forked or not
        eng.add_request(EngineRequest("r", (5, 6), GREEDY))
    out = eng.abort("r")
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert eng.abort("r") is None
    while eng.has_unfinished:
        assert eng.step() == []
    eng.cache.check_integrity()
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert eng.cache.kv.num_free_slots == eng.cfg.scheduler.max_num_seqs


def test_n_bounds_and_disaggregation(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"))
    with pytest.raises(RequestError, match="^n: "):
        SamplingParams(n=129)
    with pytest.raises(RequestError, match="^n: "):
        SamplingParams(n=0)
    with pytest.raises(RequestError, match="^n: .*disaggregation"):
        eng.add_request(EngineRequest("x", (1, 2, 3), SamplingParams(n=2)), export=True)
    assert choice_seed(2**63 - 1, 1) == -(2**63) and choice_seed(None, 3) is None
    rng = random.Random(0)
    for _ in range(20):
        s, i = rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 127)
        assert -(2**63) <= choice_seed(s, i) < 2**63 and (choice_seed(s, i) - s - i) % 2**64 == 0
