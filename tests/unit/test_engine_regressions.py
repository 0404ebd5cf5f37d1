"""Engine regressions found in review: cancelled adds, errors mid-pipeline, prompt logprobs
after preemption, and shared cached blocks never rewritten after a re-admission."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.engine import AsyncEngine
from app.engine.request import EngineRequest, FinishReason, SamplingParams
from tools.op_bisect import prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make_engine(path: str, **opts) -> EngineCore:
    opts.setdefault("kv_cache_bytes", 1 << 22)
    opts.setdefault("bounded_replay", "off")
    return EngineCore(EngineConfig.from_options(path, **opts))


def run_all(eng: EngineCore, reqs):
    outs = {r.request_id: [] for r in reqs}
    plp = {r.request_id: [] for r in reqs}
    finish = {}
    for r in reqs:
        eng.add_request(r)
    while eng.has_unfinished:
        for o in eng.step():
            outs[o.request_id] += o.token_ids
            if o.prompt_logprobs is not None:
                plp[o.request_id] += o.prompt_logprobs
            if o.finished:
                finish[o.request_id] = o.finish_reason
    return outs, plp, finish


# ---- 1. AsyncEngine: a generate() cancelled while its add command is queued kills the loop
def test_cancelled_generate_before_add_does_not_kill_engine_loop(tiny_ckpt):
    eng = AsyncEngine(
        EngineConfig.from_options(tiny_ckpt("v41"), kv_cache_bytes=1 << 22, bounded_replay="off")
    )
    try:
        gate = threading.Event()
        eng._submit(gate.wait)  # keep the loop thread busy so the add stays queued

        async def main():
            req = EngineRequest("c1", (5, 6, 7), GREEDY)

            async def consume():
                async for _ in eng.generate(req):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)  # generate() is now awaiting the queued add
            task.cancel()  # client disconnects
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            await asyncio.sleep(0.5)
            assert eng._thread.is_alive(), "engine loop thread died"
            # the engine still serves, and the cancelled request did not linger
            outs = [o async for o in eng.generate(EngineRequest("c2", (5, 6, 7), GREEDY))]
            assert outs[-1].finished
            assert "c1" not in eng.core._seqs

        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        eng._stopped = True
        eng._wake.set()


# ---- 2. EngineCore (overlap): an error in _update leaves the launched step waiting forever
def test_error_in_update_does_not_hang_drain_after_error(tiny_ckpt):
    eng = make_engine(tiny_ckpt("v41"), overlap_schedule=True, enable_prefix_caching=True)
    eng.add_request(EngineRequest("a", tuple(prompts((12,))[0]), GREEDY))
    eng.step()  # launches step 0 (prefill)
    real_commit = eng.cache.commit

    def boom(*a, **k):
        raise RuntimeError("injected failure while applying a step")

    eng.cache.commit = boom
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()  # launches step 1, then _update(step 0) raises before ready.set()
    eng.cache.commit = real_commit
    stuck = eng._flight
    # what AsyncEngine._fail_all does: abort everything, then drain the step in flight
    eng.abort("a")
    t = threading.Thread(target=eng.drain_after_error, daemon=True)
    t.start()
    t.join(timeout=5)
    hung = t.is_alive()
    assert stuck is not None  # a step was in flight when the update failed
    assert not hung, "drain_after_error hangs on the step in flight"
    assert eng._flight is None and not eng.has_unfinished


# ---- 3. prompt logprobs are emitted twice for a request that is preempted and recomputed
def _tight(path, overlap):
    probe = make_engine(path, max_num_batched_tokens=32, block_size=64)
    per_block = probe.cache.kv.bytes_per_block()
    per_slot = probe.cache.kv.bytes_per_slot()
    return make_engine(
        path,
        max_num_batched_tokens=32,
        block_size=64,
        max_num_seqs=4,
        kv_cache_bytes=(3 + 1) * per_block + (4 + 1) * per_slot,  # + the trash block, slot
        overlap_schedule=overlap,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_not_repeated_after_preemption(tiny_ckpt, overlap):
    path = tiny_ckpt("v41")
    ps = prompts((58, 60, 57, 59), seed=1)
    lp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=0)
    reqs = [EngineRequest(f"r{i}", tuple(p), lp) for i, p in enumerate(ps)]
    eng = _tight(path, overlap)
    outs, plp, finish = run_all(eng, reqs)
    assert eng.stats.num_preemptions > 0
    assert set(finish.values()) == {FinishReason.LENGTH}
    for r in reqs:
        assert len(plp[r.request_id]) == len(r.prompt_token_ids), r.request_id


# ---- 4. a preempted request re-admitted with a prefix hit beyond its prompt rewrites the
#         compressed entries of shared, cached blocks (cached_lens is clamped to the prompt
#         length through seq.num_cached), with bounded-replay approximations
def test_readmitted_request_does_not_rewrite_cached_blocks(tiny_ckpt):
    path = tiny_ckpt("v41")
    eng = make_engine(
        path,
        overlap_schedule=False,
        enable_prefix_caching=True,
        bounded_replay="encoder",
        block_size=16,
        max_num_batched_tokens=64,
    )
    P = eng.cache.block_size
    p = prompts((20,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request(EngineRequest("a", tuple(p), params))
    seq = eng._seqs["a"]
    while len(seq.tokens) < 20 + 2 * P:  # outputs fill and commit blocks past the prompt
        eng.step()
    blocks = eng.cache.blocks_of("a")
    eng.scheduler._preempt(seq)  # what _reserve does when the pool runs short
    def by_block(rows):  # flat pool rows -> [blocks + trash, P / r, D]
        return rows.data.view(eng.cache.kv.num_blocks + 1, -1, rows.data.shape[-1])

    before = {k: by_block(v).clone() for k, v in eng.cache.pools.entries.items()}
    eng.step()  # re-admission: prefix hit (prompt + committed output blocks), replay
    hit = eng.cache.num_cached("a")
    assert hit > seq.num_prompt  # the hit covers committed output blocks
    shared = blocks[: hit // P]
    assert all(eng.cache.pool.is_cached(b) for b in shared)
    for layer, rows in eng.cache.pools.entries.items():
        # cached blocks are shared through the prefix index: never rewritten
        t = by_block(rows)
        torch.testing.assert_close(t[shared], before[layer][shared], rtol=0, atol=0)
