"""Admission control: bounded queues by requests and by queued prefill tokens, exact under a
burst, released by every way a request ends; and the one resolved max_model_len that the
ingress and the ranks share."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import EngineConfig
from app.deployments.engine_host import LocalEngineClient
from app.engine.admission import Admission, EngineOverloadedError
from app.engine.capacity import kv_positions, resolve_max_model_len
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.config import ModelConfig
from app.serve_args import ServeArgs
from tests.unit.test_api import engine  # noqa: F401 (fixture)

SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_admission_counts_and_releases():
    adm = Admission(max_requests=2, max_queued_tokens=100, short_prompt_tokens=10)
    a = adm.admit(80)
    with pytest.raises(EngineOverloadedError, match="prompt tokens queued"):
        adm.admit(30)  # long: 80 + 30 > 100
    b = adm.admit(5)  # short prompts pass the token bound
    with pytest.raises(EngineOverloadedError, match="requests pending"):
        adm.admit(1)
    a.prefilled()
    assert adm.queued_tokens == 5
    a.release()
    a.release()  # idempotent
    assert (adm.requests, adm.queued_tokens) == (1, 5)
    with pytest.raises(EngineOverloadedError):
        adm.admit(1000)  # long, and 5 tokens are queued
    b.release()
    assert (adm.requests, adm.queued_tokens) == (0, 0)
    adm.admit(10**6)  # an empty queue takes any legal prompt


def test_burst_is_bounded_exactly(engine):  # noqa: F811
    """40 requests in one event-loop tick against a queue of 8: exactly 8 run (the check
    counts admitted requests, not the engine's lagging counters); all 8 complete; afterwards
    the queue is empty again."""
    client = LocalEngineClient(engine, max_pending=8)

    async def one(i: int) -> str:
        try:
            toks = [t async for o in client.generate(EngineRequest(f"b{i}", (0, 5 + i), SHORT))
                    for t in o.token_ids]  # fmt: skip
        except EngineOverloadedError:
            return "429"
        return f"ok{len(toks)}"

    async def main() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(40)))

    results = asyncio.run(main())
    assert results.count("ok4") == 8 and results.count("429") == 32
    assert (client.admission.requests, client.admission.queued_tokens) == (0, 0)
    assert engine.num_unfinished == 0


def test_queued_tokens_bound_long_prompts_only(engine):  # noqa: F811
    short = engine.core.cfg.scheduler.max_num_batched_tokens
    client = LocalEngineClient(engine, max_queued_tokens=short + 10)

    async def main() -> tuple[int, list[str]]:
        long_req = EngineRequest("L", tuple([0] + [7] * short), SamplingParams(max_tokens=1))
        it = client.generate(long_req)
        await anext(it)  # admitted (the ack): its prompt is queued
        outcomes = []
        for i, n in enumerate((20, short + 5)):  # a short and a long prompt behind it
            try:
                gen = client.generate(EngineRequest(f"q{i}", tuple([0] * n), SHORT))
                await anext(gen)
                await gen.aclose()
                outcomes.append("ok")
            except EngineOverloadedError:
                outcomes.append("429")
        queued = client.admission.queued_tokens
        await it.aclose()
        return queued, outcomes

    queued, outcomes = asyncio.run(main())
    assert queued == short + 1 and outcomes == ["ok", "429"]
    assert client.admission.requests == 0


@pytest.mark.parametrize("opts", [{"kv_cache_bytes": 1 << 22}, {"kv_cache_bytes": 1 << 24,
                                  "max_num_seqs": 3}, {"max_model_len": 300},
                                  {"kv_cache_bytes": 1 << 22, "speculative": {"method": "dspark",
                                   "num_draft_tokens": 3}}])  # fmt: skip
def test_resolved_max_model_len_matches_the_engine(tiny_ckpt, opts):
    path = tiny_ckpt("v41")
    cfg = EngineConfig.from_options(path, **opts)
    resolved = resolve_max_model_len(cfg, ModelConfig.from_file(path))
    core = EngineCore(cfg)
    try:
        assert resolved.scheduler.max_model_len == core.max_model_len
        held = kv_positions(cfg, ModelConfig.from_file(path))
        assert held == core.cache.pool.num_blocks * core.cache.block_size
    finally:
        core.close()
    # resolving twice is stable, and the engine built from it agrees
    again = EngineCore(resolved)
    try:
        assert again.max_model_len == resolved.scheduler.max_model_len
    finally:
        again.close()


def test_ingress_and_ranks_share_max_model_len(tmp_path):
    pytest.importorskip("ray")
    from app.builder import app_configs

    sa = ServeArgs.model_validate(
        {"cache_dir": str(tmp_path), "engine": {"kv_cache_bytes": 1 << 23}}
    )
    cfgs = app_configs(sa)
    limit = cfgs.engine.scheduler.max_model_len
    mcfg = ModelConfig.from_file(sa.model_path())
    assert 0 < limit < mcfg.max_position_embeddings  # capped by the 8 MiB pool
    assert cfgs.api.context_limit == limit
    assert (cfgs.max_pending_per_rank, cfgs.max_queued_tokens_per_rank) == (128, 65536)


@pytest.mark.parametrize(
    ("engine_args", "words"),
    [({"max_num_seq": 4}, "unknown engine option 'max_num_seq'"),
     ({"overlap_schedule": "no"}, "'overlap_schedule' must be bool"),
     ({"dtype": "fp64"}, "dtype must be one of"),
     ({"kv_cache_bytes": -1}, "kv_cache_bytes must be positive")],
)  # fmt: skip
def test_serve_args_engine_options_are_validated_by_the_engine_config(engine_args, words):
    with pytest.raises(ValidationError, match=words):
        ServeArgs.model_validate({"engine": engine_args})
    ok = ServeArgs.model_validate({"engine": {"max_num_seqs": 4, "bounded_replay": "off"}})
    cfg = ok.engine_config(Path("/m"))
    assert cfg.scheduler.max_num_seqs == 4 and cfg.cache.bounded_replay == "off"


def test_ingress_sheds_load_before_any_work(tiny_ckpt, engine):  # noqa: F811
    """``max_in_flight``: a stream holds its slot until it is over; beyond the bound the
    answer is 429 at once (nothing parsed, nothing sent to an engine)."""
    import httpx

    from app.api import build_api
    from tests.unit.test_api import HI, MODEL, Server, api_config

    client = LocalEngineClient(engine)
    with Server(build_api(api_config(tiny_ckpt, engine, max_in_flight=1), client)) as srv:
        body = {"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True,
                "ignore_eos": True, "thinking": {"type": "disabled"}}  # fmt: skip
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                # keep the iterator: a discarded one closes the response when the garbage
                # collector gets to it (a reference cycle), which ends the stream early
                lines = r.iter_lines()
                next(lines)
                shed = http.post("/v1/completions", content=b"not even json",
                                 headers={"content-type": "application/json"})  # fmt: skip
            assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
            assert "overloaded" in shed.json()["error"]["message"]
            for _ in range(100):  # the closed stream gives its slot back
                ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                        "max_tokens": 1})  # fmt: skip
                if ok.status_code == 200:
                    break
                time.sleep(0.05)
            assert ok.status_code == 200
