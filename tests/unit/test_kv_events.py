"""The engine's KV event feed for the router (numbered events drained after each step,
snapshots between steps, a clear), and delta batching of streams."""

from __future__ import annotations

import asyncio

import pytest

from app.cache.events import CLEARED, STORED
from app.cache.radix import chain_hashes
from app.config import EngineConfig
from app.engine.engine import AsyncEngine
from app.engine.request import EngineRequest, FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    eng = AsyncEngine(EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22))
    yield eng
    eng.shutdown()


def _run(engine: AsyncEngine, rid: str, prompt: tuple[int, ...], n: int, interval: float = 0):
    async def main():
        req = EngineRequest(
            rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        return [o async for o in engine.generate(req, stream_interval_s=interval)]

    return asyncio.run(main())


def test_stored_events_carry_the_prompt_chain_hashes(engine):
    P = engine.block_size
    prompt = tuple((7 * i) % 50 + 3 for i in range(3 * P + 5))
    seq0 = engine.kv_events.seq
    _run(engine, "a", prompt, 4)
    batch = engine.kv_events.since(seq0)
    stored = [h for kind, hs in batch.events if kind == STORED for h in hs]
    # the prompt's three full blocks are announced under the hashes the ingress computes
    # (generated tokens do not fill a fourth block here: 5 + 4 - 1 < P)
    assert stored == chain_hashes(prompt, P)
    assert batch.first_seq == seq0 + 1 and engine.kv_events.seq == batch.last_seq
    snap = engine.kv_snapshot()
    assert snap.seq == engine.kv_events.seq and set(stored) <= set(snap.hashes)
    assert set(snap.hashes) == engine.core.cache.index.cached_hashes()


def test_clear_is_an_event_and_empties_the_snapshot(engine):
    _run(engine, "b", tuple(range(3, 3 + 2 * engine.block_size + 1)), 2)
    seq = engine.kv_events.seq
    engine.clear_prefix_cache()
    assert engine.kv_events.since(seq).events == ((CLEARED, ()),)
    assert engine.kv_snapshot().hashes == ()


def test_stream_interval_merges_deltas_without_losing_tokens(engine):
    prompt = (0, 5, 9, 11)
    before = engine.stats()
    each = _run(engine, "c", prompt, 12)
    after = engine.stats()  # the router's per-rank token counters
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4
    assert after["generated_tokens"] - before["generated_tokens"] == 12
    merged = _run(engine, "d", prompt, 12, interval=0.5)
    tokens = [t for o in each for t in o.token_ids]
    assert tokens == [t for o in merged for t in o.token_ids] and len(tokens) == 12
    # one delta per step without batching; with it the first token goes alone (TTFT) and
    # the rest arrive in far fewer deltas, the last one finished
    assert len([o for o in each if o.token_ids]) == 12
    with_tokens = [o for o in merged if o.token_ids]
    assert len(with_tokens[0].token_ids) == 1 and len(with_tokens) < 6
    assert merged[-1].finished and merged[-1].finish_reason is FinishReason.LENGTH
    assert sum(o.finished for o in merged) == 1
