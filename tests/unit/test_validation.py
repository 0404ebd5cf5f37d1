"""One request must never hurt another: the request validator bounds every field (declared
once, in the sampling-field table), the engine re-checks requests that crossed a process
boundary unvalidated, and whatever passes can be stepped beside other requests without failing
their step."""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.engine import AsyncEngine
from app.engine.request import EngineRequest, FinishReason, RequestError, SamplingParams
from app.engine.validation import (
    BODY,
    CHAT,
    COMPLETIONS,
    GRPC,
    MESSAGES,
    RESPONSES,
    TYPED,
    RequestLimits,
    check_request,
    from_wire,
    wire_fields,
)

VICTIM = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def forged(params: SamplingParams | None = None, **bad: object) -> SamplingParams:
    """A SamplingParams holding values its constructor refuses: what an unpickled object from
    another process may hold (unpickling runs no ``__post_init__``)."""
    p = pickle.loads(pickle.dumps(params or SamplingParams()))
    for k, v in bad.items():
        object.__setattr__(p, k, v)
    return p


BAD_FIELDS = [
    ("top_k", 2**63),
    ("top_k", 2**31),
    ("top_k", -2),
    ("top_k", 1.5),
    ("seed", 2**64),
    ("max_tokens", 2**31),
    ("min_tokens", -1),
    ("temperature", float("nan")),
    ("top_p", float("inf")),
    ("repetition_penalty", 0.0),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", tuple(range(300))),
    ("stop", ("x" * 2000,)),
    ("logit_bias", ((5, 100.5),)),
    ("logit_bias", ((5, float("nan")),)),
    ("logit_bias", ((-1, 1.0),)),
    ("logit_bias", ((5, 1.0), (5, 2.0))),
    ("logit_bias", tuple((i, 1.0) for i in range(1025))),
    ("logit_bias", {"5": 1.0}),  # the wire form: the ingress converts it first
    ("n", 0),
    ("n", 129),
    ("stop", tuple(f"s{i}" for i in range(17))),
    ("stop", ("",)),
    ("logprobs", 21),
    ("prompt_logprobs", -1),
    ("ignore_eos", "yes"),
    ("constraint", "json"),
]


@pytest.mark.parametrize(
    ("name", "value"), BAD_FIELDS, ids=[f"{n}={v!r:.20}" for n, v in BAD_FIELDS]
)
def test_every_bound_names_its_field(name, value):
    with pytest.raises(RequestError) as e:
        SamplingParams(**{name: value})
    assert e.value.field == name
    # the engine-side check catches the same value in an object that skipped the constructor
    req = EngineRequest("r", (1, 2, 3), forged(**{name: value}))
    with pytest.raises(RequestError) as e2:
        check_request(req, RequestLimits(vocab_size=1000, max_model_len=4096))
    assert e2.value.field == name


def test_request_fields_and_model_limits():
    limits = RequestLimits(vocab_size=1000, max_model_len=64)
    cases = [
        (EngineRequest("r", (1,), SamplingParams(stop_token_ids=(10**9,))), "stop_token_ids"),
        (EngineRequest("r", (1,), SamplingParams(logprobs=20)), "logprobs"),
        (EngineRequest("r", (1, 1000)), "prompt_token_ids"),  # out of the vocabulary
        (EngineRequest("r", tuple(range(64))), "prompt_token_ids"),  # no room left
        (EngineRequest("r", (1, 2), SamplingParams(max_tokens=63)), "max_tokens"),
        (EngineRequest("r", (1,), SamplingParams(stop_token_ids=(1000,))), "stop_token_ids"),
        (EngineRequest("r", (1,), SamplingParams(logit_bias=((1000, 1.0),))), "logit_bias"),
    ]
    for req, name in cases:
        small = name == "logprobs"  # more alternatives than a 10-token vocabulary has
        with pytest.raises(RequestError) as e:
            check_request(req, RequestLimits(10, 64) if small else limits)
        assert e.value.field == name, req
    check_request(EngineRequest("r", (1, 2), SamplingParams(max_tokens=62)), limits)
    five = EngineRequest("r", (1,), SamplingParams(n=5))
    check_request(five, limits)  # the table's bound only
    with pytest.raises(RequestError, match="^n: must be at most 4 \\(api.max_n\\)"):
        check_request(five, RequestLimits(1000, 64, max_n=4))
    for bad in ({"request_id": ""}, {"request_id": "x" * 300}, {"priority": 2**40}):
        with pytest.raises(RequestError, match=next(iter(bad))):
            EngineRequest(**{"request_id": "r", "prompt_token_ids": (1,), **bad})
    with pytest.raises(RequestError, match="prompt_token_ids"):
        EngineRequest("r", (1, True, 3))


@pytest.fixture(scope="module")
def core(tiny_ckpt):
    eng = EngineCore(EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22))
    yield eng
    eng.close()


def _run(core: EngineCore, reqs: list[EngineRequest]) -> dict[str, FinishReason]:
    done: dict[str, FinishReason] = {}
    for r in reqs:
        core.add_request(r)
    for _ in range(500):
        if not core.has_unfinished:
            break
        for o in core.step():
            if o.finished:
                done[o.request_id] = o.finish_reason
    assert not core.has_unfinished
    return done


def test_engine_rejects_forged_params_and_the_rest_runs(core):
    """A ``top_k`` >= 2**63 once reached the sampler and failed the step of every request
    of the rank: ``add_request`` refuses it; the running request is untouched."""
    core.add_request(EngineRequest("victim", (0, 5, 9), VICTIM))
    core.step()
    for i, (name, value) in enumerate(BAD_FIELDS):
        with pytest.raises(RequestError):
            core.add_request(EngineRequest(f"bad{i}", (0, 5), forged(**{name: value})))
    with pytest.raises(RequestError, match="vocab"):  # masked as EOS inside the step
        core.add_request(EngineRequest("oov", (0, 5), SamplingParams(stop_token_ids=(10**9,))))
    done = _run(core, [])
    assert done == {"victim": FinishReason.LENGTH}
    pool = core.cache.pool
    assert pool.num_available == pool.num_blocks


_settings = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@st.composite
def accepted_params(draw) -> SamplingParams:
    """Anything the validator accepts, edge values included."""
    kw = {
        "temperature": draw(st.sampled_from([0.0, 1e-6, 0.7, 100.0])),
        "top_p": draw(st.sampled_from([1e-9, 0.5, 1.0])),
        "top_k": draw(st.sampled_from([-1, 0, 1, 7, 2**31 - 1])),
        "min_p": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "repetition_penalty": draw(st.sampled_from([1e-6, 1.0, 100.0])),
        "presence_penalty": draw(st.floats(-2, 2)),
        "frequency_penalty": draw(st.floats(-2, 2)),
        "seed": draw(st.one_of(st.none(), st.sampled_from([-(2**63), 0, 2**63 - 1]))),
        "max_tokens": draw(st.integers(1, 5)),
        "stop_token_ids": tuple(draw(st.lists(st.integers(0, 499), max_size=4))),
        "stop": tuple(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))),
        "logprobs": draw(st.one_of(st.none(), st.integers(0, 20))),
        "prompt_logprobs": draw(st.one_of(st.none(), st.integers(0, 20))),
        "ignore_eos": draw(st.booleans()),
        "logit_bias": tuple(
            (t, draw(st.sampled_from([-100.0, -1e-3, 0.0, 7.5, 100])))
            for t in sorted(draw(st.sets(st.integers(0, 499), max_size=4)))
        ),
    }
    kw["min_tokens"] = draw(st.integers(0, kw["max_tokens"]))
    return SamplingParams(**kw)


@_settings
@given(params=accepted_params(), prompt=st.lists(st.integers(0, 499), min_size=1, max_size=40))
def test_accepted_params_never_fail_a_step(core, params, prompt):
    done = _run(
        core,
        [EngineRequest("victim", (0, 5, 9), VICTIM), EngineRequest("fuzz", tuple(prompt), params)],
    )
    assert done["victim"] is FinishReason.LENGTH
    assert done["fuzz"] in (FinishReason.LENGTH, FinishReason.STOP)
    pool = core.cache.pool
    assert pool.num_available == pool.num_blocks


def test_logit_bias_wire_form():
    """A JSON object of token id (a decimal string key; a gRPC map's int key) -> bias becomes
    the engine's pairs, sorted by id; a key that is no token id is refused by name."""
    bias = SamplingParams.__dataclass_fields__["logit_bias"]
    conv = from_wire(SamplingParams, {"logit_bias": {"17": 5, "3": -100.0}, "top_k": 4})
    assert conv == {"logit_bias": ((3, -100.0), (17, 5)), "top_k": 4}
    assert SamplingParams(**conv).logit_bias == ((3, -100.0), (17, 5))
    assert from_wire(SamplingParams, {"logit_bias": {9: 1.5}})["logit_bias"] == ((9, 1.5),)
    assert from_wire(SamplingParams, {"logit_bias": None})["logit_bias"] == bias.default == ()
    for key in ("x", "1.5", "", "１", "1e3"):
        with pytest.raises(RequestError, match="logit_bias: keys must be token ids"):
            from_wire(SamplingParams, {"logit_bias": {key: 1.0}})
    with pytest.raises(RequestError, match="logit_bias: biases 1025 tokens"):
        from_wire(SamplingParams, {"logit_bias": {str(i): 1.0 for i in range(1025)}})


def test_validator_covers_every_sampling_field():
    """A new SamplingParams field must get a bound here (or be listed as bounded elsewhere)."""
    bounded = {n for n, _ in BAD_FIELDS} | {
        "min_p", "presence_penalty", "frequency_penalty", "skip_special_tokens",
    }  # fmt: skip
    assert {f.name for f in fields(SamplingParams)} == bounded


# ---- AsyncEngine: failures stay with their request; a broken step stops the engine
@pytest.fixture
def engine(tiny_ckpt):
    eng = AsyncEngine(EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22))
    yield eng
    eng.shutdown()


async def _collect(engine: AsyncEngine, req: EngineRequest) -> list:
    return [o async for o in engine.generate(req)]


def test_bad_and_duplicate_requests_do_not_touch_running_streams(engine):
    async def main():
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        victims = [
            asyncio.create_task(_collect(engine, EngineRequest(f"v{i}", (0, 5 + i, 9), long)))
            for i in range(4)
        ]
        await asyncio.sleep(0.3)  # the victims are running
        with pytest.raises(RequestError, match="top_k"):
            await _collect(engine, EngineRequest("bad", (0, 5), forged(top_k=2**63)))
        with pytest.raises(RequestError, match="already running"):
            await _collect(engine, EngineRequest("v0", (0, 5), VICTIM))
        return await asyncio.gather(*victims)

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finish_reason is FinishReason.LENGTH
        assert sum(len(o.token_ids) for o in outs) == 40
    assert engine.healthy and engine.num_unfinished == 0


def test_broken_step_fails_every_request_and_stops_the_engine(engine):
    def broken_step():
        raise RuntimeError("device lost")

    async def main():
        task = asyncio.create_task(
            _collect(
                engine,
                EngineRequest("a", (0, 5, 9), SamplingParams(max_tokens=500, ignore_eos=True)),
            )
        )
        await asyncio.sleep(0.2)
        engine.core.step = broken_step
        outs = await asyncio.wait_for(task, 30)
        with pytest.raises(RuntimeError, match="stopped after an error"):
            await _collect(engine, EngineRequest("b", (0, 5), VICTIM))
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finish_reason is FinishReason.ERROR and "device lost" in outs[-1].error
    assert not engine.healthy and engine.num_unfinished == 0
    del engine.core.step  # the real step again, so shutdown can drain


def test_which_endpoints_take_each_sampling_field():
    """The sampling-field table's endpoints, as the README documents them: ``temperature``,
    ``top_p`` (as sent, over the recipe's resolution), ``ignore_eos`` and ``min_tokens`` on
    every recipe protocol, ``top_k`` on chat and messages, ``min_p``, the
    penalties, ``logit_bias`` and ``n`` on chat, vLLM's ``prompt_logprobs`` on chat and
    completions; the completions body and gRPC's SamplingOptions
    take theirs by name."""
    penalties = {"repetition_penalty", "presence_penalty", "frequency_penalty"}
    by_name = {  # endpoint -> fields read from a body field of the same name
        CHAT: {"temperature", "top_p", "top_k", "min_p", *penalties, "logit_bias", "ignore_eos",
               "min_tokens", "n", "prompt_logprobs"},
        RESPONSES: {"temperature", "top_p", "ignore_eos", "min_tokens"},
        MESSAGES: {"temperature", "top_p", "top_k", "ignore_eos", "min_tokens"},
        COMPLETIONS: {"temperature", "top_p", "top_k", "min_p", *penalties, "logit_bias",
                      "seed", "max_tokens", "stop", "logprobs", "prompt_logprobs", "ignore_eos",
                      "n"},
        GRPC: {"temperature", "top_p", "top_k", "min_p", *penalties, "logit_bias", "seed",
               "max_tokens", "stop", "stop_token_ids", "ignore_eos"},
    }  # fmt: skip
    for endpoint, names in by_name.items():
        assert {f.name for f in wire_fields(SamplingParams, endpoint, BODY)} == names, endpoint
    typed = {CHAT: {"seed", "max_tokens"}, RESPONSES: set(), MESSAGES: {"max_tokens"}}
    for endpoint, names in typed.items():
        assert {f.name for f in wire_fields(SamplingParams, endpoint, TYPED)} == names, endpoint
