"""The start-up warm-up (``app.engine.startup``): synthetic requests through an engine's
real step, so that every Triton specialization and CUDA-graph bucket the serving paths hit
is compiled / captured before the first request, then nothing left behind.

    prefill    one prompt each of a few sizes up to the token budget (Triton specializes
               integer arguments equal to 1 and divisible by 16; kernels pick tiles by
               size), one of two chunks (the second after a prefix), one with prompt
               logprobs
    decode     a batch at every CUDA-graph batch bucket (verify steps when speculating),
               the sampling variants mixed: greedy, seeded top-p, top-k + min-p +
               penalties, top logprobs
    grammar    one constrained row (compiles the tokenizer's grammar tables once)
    reset      the pool empty again, the prefix cache cleared (its events dropped), the
               engine's and the caches' counters at zero
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np
import torch

from app.cache.host_tier import HostStats
from app.cache.manager import CacheManager
from app.cache.radix import PrefixStats
from app.config import EngineConfig
from app.engine.graphs import batch_buckets
from app.engine.metrics import EngineStats
from app.engine.parallel import RankParallel
from app.engine.request import (
    EngineRequest,
    OutputConstraint,
    RequestError,
    RequestOutput,
    SamplingParams,
)
from app.engine.runner import ModelRunner
from app.engine.spec.speculator import Speculator
from app.model.model import DeepseekModel

logger = logging.getLogger(__name__)
PREFILL_SIZES = (1, 7, 16, 100, 512)  # besides the token budget and a prompt of two chunks


class Engine(Protocol):
    """What start-up uses of an engine core (``app.engine.core.EngineCore``)."""

    cfg: EngineConfig
    device: torch.device
    model: DeepseekModel
    parallel: RankParallel | None
    runner: ModelRunner
    cache: CacheManager
    stats: EngineStats
    max_model_len: int
    spec: Speculator | None

    @property
    def has_unfinished(self) -> bool: ...

    def add_request(self, req: EngineRequest, export: bool = False) -> None: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def step(self) -> list[RequestOutput]: ...


def warm_up(core: Engine) -> tuple[int, int]:
    """Run the warm-up requests through ``core``'s step (:func:`warmup_requests`; CUDA
    only), then :func:`reset` -> (requests, steps)."""
    if core.device.type != "cuda":
        return 0, 0
    batches, grammar = warmup_requests(core)
    steps = sum(drive(core, batch) for batch in batches)
    n = sum(len(b) for b in batches)
    try:  # compiles the tokenizer's grammar tables once (a model without tokenizer: none)
        steps += drive(core, [grammar])
        n += 1
    except (RequestError, ImportError) as e:
        logger.info("start-up: no grammar warm-up (%s)", e)
    reset(core)
    return n, steps


def warmup_requests(core: Engine) -> tuple[list[list[EngineRequest]], EngineRequest]:
    """The warm-up (module doc) -> (batches run one after the other, a grammar row): one
    prompt each of a few sizes up to the token budget and one of two chunks (the second
    after a prefix), one with prompt logprobs, decode (verify) batches at every graph bucket
    with the sampling variants mixed. Every prompt fits the context and half the pool."""
    s, vocab = core.cfg.scheduler, core.model.cfg.vocab_size
    T, k = s.max_num_batched_tokens, core.cfg.speculative
    k = k.num_draft_tokens if k is not None else 0
    room = min(core.max_model_len, core.cache.pool.num_blocks * core.cache.block_size // 2)
    room -= 4 + k
    rng = np.random.default_rng(0)
    sizes = sorted({n for n in (*PREFILL_SIZES, T, T + T // 2 + 3) if 1 <= n <= room})
    out = [[EngineRequest(f"warmup-p{n}", prompt(rng, vocab, n), params(i, 2 + k, vocab))]
           for i, n in enumerate(sizes)]  # fmt: skip
    if room >= 1:
        lp = SamplingParams(max_tokens=1, prompt_logprobs=min(5, vocab - 1), ignore_eos=True)
        out.append([EngineRequest("warmup-lp", prompt(rng, vocab, min(100, room)), lp)])
    for b in batch_buckets(s.max_num_seqs):
        if b * (1 + k) <= T:
            out.append([EngineRequest(f"warmup-d{b}-{i}", prompt(rng, vocab, 1 + i % 3),
                                      params(i, 3 + k, vocab)) for i in range(b)])  # fmt: skip
    grammar = SamplingParams(temperature=0, max_tokens=4,
                             constraint=OutputConstraint("regex", "[a-z]{1,3}"))  # fmt: skip
    return out, EngineRequest("warmup-g", prompt(rng, vocab, 4), grammar)


def drive(core: Engine, reqs: list[EngineRequest]) -> int:
    """Run ``reqs`` to the end -> steps taken (aborted, with a warning, if they do not
    finish in a generous number of steps)."""
    for r in reqs:
        core.add_request(r)
    budget = core.cfg.scheduler.max_num_batched_tokens
    tokens = sum(len(r.prompt_token_ids) + (r.params.max_tokens or 1) for r in reqs)
    limit, steps = 64 + 4 * (tokens // budget + max(r.params.max_tokens or 1 for r in reqs)), 0
    while core.has_unfinished:
        if steps == limit:
            logger.warning("start-up: %d requests did not finish in %d steps; aborted",
                           len(reqs), steps)  # fmt: skip
            for r in reqs:
                core.abort(r.request_id)
        core.step()
        steps += 1
    return steps


def reset(core: Engine) -> None:
    """After the warm-up: the prefix cache empty, its and the engine's counters at zero."""
    cache = core.cache
    if cache.index is not None:
        cache.index.clear()
        cache.index.drain_events()
        cache.index.stats = PrefixStats()
    if cache.host is not None:
        cache.host.stats = HostStats()
    core.stats.reset()
    if cache.num_free_blocks != cache.pool.num_blocks:
        logger.warning("start-up: %d KV blocks still held after the warm-up",
                       cache.pool.num_blocks - cache.num_free_blocks)  # fmt: skip


def prompt(rng: np.random.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab, n))


def params(i: int, max_tokens: int, vocab: int) -> SamplingParams:
    """The ``i % 4``-th sampling variant: greedy; seeded top-p; top-k, min-p and penalties;
    top logprobs."""
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens,
                              ignore_eos=True)  # fmt: skip
    if kind == 2:
        return SamplingParams(top_k=20, min_p=0.05, repetition_penalty=1.1,
                              presence_penalty=0.5, frequency_penalty=0.5,
                              max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
    return SamplingParams(logprobs=min(5, vocab - 1), max_tokens=max_tokens, ignore_eos=True)
