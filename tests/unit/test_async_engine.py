"""Async engine: concurrent streams, early close aborts and frees KV, invalid requests."""

from __future__ import annotations

import asyncio

import pytest

from app.config import EngineConfig
from app.engine.engine import AsyncEngine
from app.engine.request import EngineRequest, FinishReason, RequestError, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    eng = AsyncEngine(EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22))
    yield eng
    eng.shutdown()


def test_concurrent_streams_complete(engine):
    async def one(i: int) -> list[int]:
        toks = []
        req = EngineRequest(
            f"s{i}", (0, 5 + i, 9, 11), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        )
        async for out in engine.generate(req):
            toks += out.token_ids
            last = out
        assert last.finished and last.finish_reason is FinishReason.LENGTH
        return toks

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(main())
    assert all(len(r) == 5 for r in results)


def test_closing_a_stream_aborts_and_frees(engine):
    async def main():
        req = EngineRequest(
            "long", (0, 5, 9), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        )
        gen = engine.generate(req)
        first = await gen.__anext__()
        assert not first.finished
        await gen.aclose()  # client went away
        pool = engine.core.cache.pool
        for _ in range(200):  # the abort is applied between steps, the KV freed after
            if pool.num_available == pool.num_blocks:
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    core = engine.core
    assert core.cache.pool.num_available == core.cache.pool.num_blocks
    core.cache.check_integrity()


def test_invalid_request_raises_before_streaming(engine):
    def ok(rid: str) -> EngineRequest:
        return EngineRequest(
            rid, (0, 5), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        )

    async def main() -> tuple[list[int], list[int]]:
        before = [t async for o in engine.generate(ok("ok0")) for t in o.token_ids]
        req = EngineRequest("bad", (0, 10**6), SamplingParams())
        with pytest.raises(RequestError, match="prompt_token_ids"):
            async for _ in engine.generate(req):
                pass
        assert engine.num_unfinished == 0 and "bad" not in engine.core._seqs
        return before, [t async for o in engine.generate(ok("ok1")) for t in o.token_ids]

    before, after = asyncio.run(main())
    # the engine still serves, and the same greedy tokens as before the bad request
    assert len(after) == 3 and after == before
    assert engine.healthy
