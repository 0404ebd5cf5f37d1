"""DeepInfer's workload as SGLang ran it, at one GPU's share, through the whole EngineCore.

    python -m bench.deepinfer [--model flash-rank|tiny-v41] [--what prefill,decode]
        [--prefill-tokens 4096,...,65536] [--decode-requests 8,...,256] [--kv-gib G]

SGLang's runs: prefill DP4 / EP4 at 128K-token contexts with 4K new tokens per request,
4K -> 64K new tokens per GPU per batch; decode DP64 / EP64 at 128K-token contexts over a
shared cached prefix, 3 draft tokens per step under static verification; each figure the
mean of every complete batch between the moments 20% and 90% of the requests have finished.
On one GPU this is one rank's share: the flash rank (``configs/models/flash-rank``, 48 of
384 experts, random weights through ``load_format: dummy``; no all-to-all), with the
engine's own pool sizing (``gpu_memory_utilization`` of what is left, or ``--kv-gib``) and
CUDA graphs. ``--model tiny-v41`` runs the same on the CPU at small lengths (a smoke run).

- prefill (``deepinfer.prefill_step``): one engine (no speculation, overlap off: the
  requests end at their first token, so no decode row joins the next batch) sized for the
  largest setting that fits (a setting whose engine does not fit the card is recorded as
  skipped and the next smaller one tried). The cache is warmed with one shared prefix of
  ``context - new`` tokens; every request is that prefix + its own ``new`` tokens, so it
  hits the whole prefix and computes its new tokens plus the engine's bounded replay (the
  window's rows before the hit). The cached part is shared, not per request: the work of
  a step (attention over the whole context, the indexer scoring every visible key) is per
  request the same, while warming a distinct 124K context per request would cost minutes
  of prefill each setting. The token budget is set to exactly N / new requests per step;
  ``--prefill-batches`` batches are queued at once. Floor: the matrix FLOPs of the new
  tokens (decoder layers on the last ``window`` rows of each prompt, as the engine runs
  them; ``floor_all_rows_ms`` with every row in every layer) at the measured bf16 rate.
- decode (``deepinfer.decode_step``): one engine with speculation (DSpark, k drafts, CUDA
  graphs of 1 + k tokens per request). R requests share one cached prefix and each adds
  its own few tokens (prefix hit, bounded replay as the engine default), ``ignore_eos``,
  temperature 1. Output lengths are evenly spaced in [L/2, 3L/2] (with equal lengths all
  would finish together and the 20%-90% window would be empty; the batch shrinks from
  0.8 R to 0.1 R inside it: ``mean_batch``). A request ends when it has its length: the
  bench aborts it then (``max_tokens`` lies past it), so every step verifies exactly k
  drafts per request (a request allowed fewer drafts makes the step uneven, and eager).
  Acceptance: ``--proposer forced`` (default) runs the real DSpark drafter (its device work
  is in every step) and rewrites each draft's proposal distribution so that rejection
  sampling accepts it with probability r, independently, r set for ``--accept-length``
  (1 + r + ... + r^k); ``dspark`` keeps DSpark's own proposals (random weights: an
  acceptance that says nothing of the real model). The oracle proposer of
  ``bench.spec_decode`` needs the target's greedy continuation from a plain run first, and
  bf16 greedy outputs of the random rank part at near ties, so its acceptance collapses.
  Floor per step: max(bytes / copy bandwidth, FLOPs / bf16 rate) at the step's batch:
  dense weights once, the local experts its rows touch, each request's KV once (its 1 + k
  rows read the same keys; ``bench.flash_rank.decode_bytes``), the DSpark draft's bytes;
  FLOPs of every verify row (``prefill_flops``) and the head. TPOT = step / acceptance
  length (measured), tokens/s = tokens emitted / time.

Each window step is one ``EngineCore.step()`` timed on the host (the step ends when its
sampled tokens, and drafts, are on the host). Results: ``bench/results/deepinfer.json``,
written after every setting; ``--merge`` keeps the records of the settings not run now from
an earlier run of the same commit (``params.process`` says which run made a record).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.cache.layout import block_size_for
from app.config import EngineConfig, EngineConfigError
from app.engine.core import EngineCore
from app.engine.fairness import LongPrefillShare
from app.engine.model_path import resolve_model
from app.engine.request import EngineRequest, SamplingParams
from app.engine.startup import Startup
from app.model.dspark import DraftBlock
from app.model.model import DeepseekModel
from bench.common import commit, record, result_path, write
from bench.engine_steps import copy_bandwidth, matmul_rate
from bench.flash_rank import decode_bytes, prefill_flops
from bench.spec_decode import accept_rate_for, draft_bytes

PRESETS: dict[str, dict[str, Any]] = {
    "flash-rank": dict(device="cuda", dtype="bfloat16", load_format="dummy", context=131072,
                       new=4096, prefill_tokens="4096,8192,16384,32768,65536",
                       decode_requests="8,16,32,64,128,256", output_len=128,
                       decode_budget=4096),
    "tiny-v41": dict(device="cpu", dtype="float32", load_format="auto", context=256, new=64,
                     prefill_tokens="64,128,256", decode_requests="2,4,8", output_len=32,
                     decode_budget=256),
}  # fmt: skip
PARTS = {"prefill": "deepinfer.prefill_step", "decode": "deepinfer.decode_step"}


# ---- workloads ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillCase:
    """``new_per_gpu`` new tokens per GPU per step: ``requests_per_step`` requests of
    ``context`` tokens, each the shared cached prefix (``hit`` tokens, whole blocks) and
    ``new`` tokens of its own; the engine computes ``tokens_per_request`` of one (the new
    tokens and the bounded replay before the hit), so a step of ``budget`` tokens holds
    exactly ``requests_per_step`` requests; ``batches`` steps of requests are queued."""

    new_per_gpu: int
    new: int
    context: int
    hit: int
    tokens_per_request: int
    requests_per_step: int
    batches: int

    @property
    def requests(self) -> int:
        return self.requests_per_step * self.batches

    @property
    def budget(self) -> int:
        return self.requests_per_step * self.tokens_per_request


def prefill_case(new_per_gpu: int, context: int, new: int, batches: int, block: int,
                 window: int) -> PrefillCase:  # fmt: skip
    """The setting of ``new_per_gpu``; the cached part must be whole blocks."""
    if new_per_gpu <= 0 or new_per_gpu % new or not 0 < new < context or (context - new) % block:
        raise ValueError(f"{new_per_gpu} new tokens per GPU: needs a multiple of the {new} "
                         f"new tokens per request, and {context} - {new} cached tokens in "
                         f"whole blocks of {block}")  # fmt: skip
    hit = context - new
    return PrefillCase(new_per_gpu, new, context, hit, context - max(0, hit - window),
                       new_per_gpu // new, batches)  # fmt: skip


@dataclass(frozen=True)
class DecodeCase:
    """R requests of ``context`` prompt tokens: a shared cached ``prefix`` (whole blocks)
    and a tail of their own; ``lengths`` their output lengths."""

    requests: int
    context: int
    prefix: int
    lengths: tuple[int, ...]


def staggered(n: int, length: int) -> tuple[int, ...]:
    """``n`` output lengths evenly spaced in [length / 2, 3 length / 2] (rounded, >= 1)."""
    if n == 1:
        return (length,)
    return tuple(max(1, round(length / 2 + length * i / (n - 1))) for i in range(n))


def decode_case(requests: int, context: int, length: int, block: int) -> DecodeCase:
    """R requests whose prompts share the whole blocks before their last token."""
    prefix = (context - 1) // block * block
    if prefix <= 0:
        raise ValueError(f"context {context} holds no cached block of {block} tokens")
    return DecodeCase(requests, context, prefix, staggered(requests, length))


# ---- timing ---------------------------------------------------------------------------------
@dataclass
class Step:
    """One ``EngineCore.step()``: host times, what it computed and emitted."""

    start: float
    end: float
    requests: int  # scheduled requests
    tokens: int  # scheduled tokens (replay rows and verify rows included)
    new_tokens: int  # prompt positions past each request's prefix hit
    emitted: int  # output tokens it returned
    graph: bool = False  # replayed a CUDA graph

    @property
    def seconds(self) -> float:
        return self.end - self.start


def window(steps: list[Step], finish_times: list[float], lo: float = 0.2,
           hi: float = 0.9) -> list[Step]:  # fmt: skip
    """The complete steps between the moments ``lo`` and ``hi`` of the requests had
    finished (SGLang's rule): the steps that start at or after the ceil(lo n)-th finish and
    end at or before the ceil(hi n)-th."""
    t = sorted(finish_times)
    if not t:
        return []
    n = len(t)
    t_lo = t[max(1, math.ceil(lo * n - 1e-9)) - 1]
    t_hi = t[max(1, math.ceil(hi * n - 1e-9)) - 1]
    return [s for s in steps if s.start >= t_lo and s.end <= t_hi]


def drive(core: EngineCore, lengths: dict[str, int] | None = None
          ) -> tuple[list[Step], dict[str, float], dict[str, int]]:  # fmt: skip
    """Step ``core`` until every request is done -> (steps, finish time and cached prompt
    tokens of each request). ``lengths``: a request ends (aborted) once it has that many
    output tokens."""
    steps: list[Step] = []
    finish: dict[str, float] = {}
    cached: dict[str, int] = {}
    got: dict[str, int] = {}
    scheds: list = []
    core.on_step = lambda sched, t0, dt: scheds.append(sched)
    try:
        while core.has_unfinished:
            graphs = core.stats.graph_steps
            t0 = time.perf_counter()
            outs = core.step()
            done = [o.request_id for o in outs if o.finished]
            for o in outs:
                got[o.request_id] = got.get(o.request_id, 0) + len(o.token_ids)
                cached[o.request_id] = max(cached.get(o.request_id, 0), o.num_cached_tokens)
            for rid, n in (lengths or {}).items():
                if rid not in finish and rid not in done and got.get(rid, 0) >= n:
                    core.abort(rid)
                    done.append(rid)
            t1 = time.perf_counter()
            for rid in done:
                finish[rid] = t1
            items = scheds.pop().items if scheds else []
            new = sum(max(0, min(it.start + it.num_tokens, it.seq.num_prompt)
                          - max(it.start, it.seq.num_cached)) for it in items)  # fmt: skip
            steps.append(Step(t0, t1, len(items), sum(it.num_tokens for it in items), new,
                              sum(len(o.token_ids) for o in outs),
                              core.stats.graph_steps > graphs))  # fmt: skip
    finally:
        core.on_step = None
    return steps, finish, cached


# ---- forced acceptance ------------------------------------------------------------------
class ForcedAcceptance:
    """An ``EngineCore.on_draft`` hook: the engine's DSpark drafts (drafted as in serving,
    CUDA graphs included), each accepted with probability ``rate``.

    Each draft's proposal distribution Q is rewritten in place: an accepted draft d gets
    Q(d) = 0 (rejection sampling accepts it whenever P(d) > 0), a rejected one Q = one-hot d
    (accepted with probability P(d), ~1/V). Needs random rows (temperature > 0): a greedy
    row accepts only the argmax."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate, self.seed = rate, seed
        self._gen: torch.Generator | None = None

    def __call__(self, request_ids: list[str], anchors: torch.Tensor, block: DraftBlock) -> None:
        if self._gen is None:
            self._gen = torch.Generator(device=block.ids.device).manual_seed(self.seed)
        force_acceptance(block, self.rate, self._gen)


def force_acceptance(block: DraftBlock, rate: float, gen: torch.Generator) -> torch.Tensor:
    """Rewrite ``block.logits`` in place (module doc) -> the accept decisions [R, k]."""
    lg = block.logits
    acc = torch.rand(block.ids.shape, device=lg.device, generator=gen) < rate
    inf = torch.tensor(float("-inf"), device=lg.device)
    zero = torch.zeros((), device=lg.device)
    lg.copy_(torch.where(acc, zero, inf).unsqueeze(-1).expand_as(lg))
    lg.scatter_(2, block.ids.unsqueeze(-1), torch.where(acc, inf, zero).unsqueeze(-1))
    return acc


# ---- floors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # device copy, bytes read + written per second
    matmul: float  # bf16 FLOP/s


def prefill_floor(model: DeepseekModel, case: PrefillCase, c: Ceilings) -> tuple[float, float]:
    """-> (floor, floor with every row in every layer), seconds of one step's new tokens."""
    R, ctx = case.requests_per_step, case.context - case.new // 2
    rows = R * model.cfg.sliding_window
    replay = prefill_flops(model, R * case.new, ctx, decoder_rows=rows)
    return replay / c.matmul, prefill_flops(model, R * case.new, ctx) / c.matmul


def decode_floor(model: DeepseekModel, requests: int, tokens: int, context: int, drafts: int,
                 c: Ceilings) -> tuple[float, float, float]:  # fmt: skip
    """-> (floor, byte floor, FLOP floor), seconds of one verify step of ``tokens`` rows of
    ``requests`` requests at ``context`` (module doc)."""
    rows = decode_bytes(model, tokens, context, 1)  # dense + the experts the rows touch
    kv = decode_bytes(model, requests, context, 1).kv  # each request's keys once
    b = rows.dense + rows.experts + kv + draft_bytes(model, requests, drafts)
    f = prefill_flops(model, tokens, context) + 2 * tokens * model.head.weight.numel()
    return max(b / c.bandwidth, f / c.matmul), b / c.bandwidth, f / c.matmul


# ---- engines --------------------------------------------------------------------------------
def engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
    """The engine config of ``args``' model (V4.1 cache formats, ``--kv-gib``) and
    ``options``."""
    kv = {} if args.kv_gib is None else {"kv_cache_bytes": int(args.kv_gib * 2**30)}
    return EngineConfig.from_options(
        str(resolve_model(args.model)), device=args.device, dtype=args.dtype,
        load_format=args.load_format, kv_quant=True, seed=args.seed, **kv, **options,
    )  # fmt: skip


def free_memory() -> None:
    """Collect a closed engine (its start-up froze its objects) and return its memory."""
    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start(cfg: EngineConfig, model: DeepseekModel, need_len: int, check: bool = False
          ) -> tuple[EngineCore | None, str]:  # fmt: skip
    """An engine of ``cfg`` on ``model``, or None and why it does not fit: its sizing left
    no KV pool, the card ran out of memory, or ``max_model_len`` < ``need_len``. ``check``:
    size it first without graphs or warm-up (the engine's probe mode), so that a setting
    that does not fit costs only its memory profile."""
    why = ""
    try:
        if check:
            probe = EngineCore(cfg, model=model, probe=True)
            limit = probe.max_model_len
            probe.close()
            del probe
            free_memory()
            if limit < need_len:
                return None, f"max_model_len {limit} < {need_len}"
        core = EngineCore(cfg, model=model)
        if core.max_model_len >= need_len:
            return core, ""
        why = f"max_model_len {core.max_model_len} < {need_len}"
        core.close()
        del core
    except (EngineConfigError, RuntimeError) as e:  # torch.cuda.OutOfMemoryError is one
        if not isinstance(e, EngineConfigError) and not out_of_memory(e):
            raise
        why = f"{type(e).__name__}: {str(e)[:300]}"
    free_memory()
    return None, why


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the device ran out of memory (torch's, or a library's)."""
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def set_budget(core: EngineCore, tokens: int) -> None:
    """The scheduler's token budget per step (at most the engine's, which sized it)."""
    s = core.scheduler
    s.cfg = dataclasses.replace(s.cfg, max_num_batched_tokens=tokens)
    s.fair = LongPrefillShare(tokens, s.cfg.long_prefill_share, s.cfg.long_prefill_threshold)


def random_ids(gen: torch.Generator, n: int, vocab: int) -> tuple[int, ...]:
    """``n`` random token ids below ``vocab`` (none of the special ids 0-2)."""
    return tuple(torch.randint(3, vocab - 1, (n,), generator=gen).tolist())


def warm(core: EngineCore, prefix: tuple[int, ...]) -> float:
    """Prefill ``prefix`` once (its blocks stay in the prefix cache) -> seconds."""
    t0 = time.perf_counter()
    req = EngineRequest(f"warm-{t0}", prefix, SamplingParams(temperature=0, max_tokens=1))
    core.add_request(req)
    drive(core)
    return time.perf_counter() - t0


def timed(core: EngineCore, rids: list[str], lengths: dict[str, int] | None = None
          ) -> tuple[list[Step], dict[str, int], str]:  # fmt: skip
    """:func:`drive` -> (the window's steps, cached prompt tokens per request, why not
    measured: "" when measured). Out of memory ends the part (``rids`` aborted)."""
    try:
        steps, finish, cached = drive(core, lengths)
    except RuntimeError as e:
        if not out_of_memory(e):
            raise
        for rid in rids:
            core.abort(rid)
        core.drain_after_error()
        return [], {}, f"OutOfMemoryError: {str(e)[:300]}"
    win = window(steps, list(finish.values()))
    return win, cached, "" if win else "empty window"


def _params(args: argparse.Namespace, core: EngineCore | None, win: list[Step],
            cached: dict[str, int], hit: int) -> dict[str, Any]:  # fmt: skip
    return {"card": args.card, "model": args.model, "device": args.device,
            "kv_pool_blocks": core.cache.pool.num_blocks if core is not None else None,
            "hits": sum(v == hit for v in cached.values()) / len(cached) if cached else None,
            "steps_in_window": len(win), "step_ms": [round(s.seconds * 1e3, 3) for s in win],
            "graph_steps": sum(s.graph for s in win) / max(1, len(win))}  # fmt: skip


Save = Callable[[list[dict]], None]


def run_prefill(args: argparse.Namespace, model: DeepseekModel, c: Ceilings | None,
                save: Save) -> list[dict]:  # fmt: skip
    """The prefill settings on one engine sized for the largest that fits (module doc)."""
    mcfg, name = model.cfg, PARTS["prefill"]
    block = block_size_for(mcfg, 0)
    cases = sorted((prefill_case(int(n), args.context, args.new, args.prefill_batches, block,
                                 mcfg.sliding_window) for n in args.prefill_tokens.split(",")),
                   key=lambda k: k.new_per_gpu)  # fmt: skip
    records: list[dict] = []
    core, check = None, args.device.startswith("cuda") and args.kv_gib is None
    while cases and core is None:
        top = cases[-1]
        cfg = engine_config(args, max_num_seqs=top.requests_per_step,
                            max_num_batched_tokens=top.budget, overlap_schedule=False,
                            max_model_len=args.context + block)  # fmt: skip
        core, why = start(cfg, model, args.context + 1, check and len(cases) > 1)
        if core is None:
            print(f"prefill N={top.new_per_gpu}: the engine does not fit ({why})", flush=True)
            records.append(record(name, None, "ms", {**_prefill_params(top), "skipped": why,
                                                     **_params(args, None, [], {}, 0)}))
            cases.pop()
    if core is None:
        return records
    gen = torch.Generator().manual_seed(args.seed)
    prefix = random_ids(gen, args.context - args.new, mcfg.vocab_size)
    print(f"prefill: the {len(prefix)}-token prefix warmed in {warm(core, prefix):.1f} s\n"
          f"{'N':>6} {'reqs':>4} {'steps':>5} {'ms':>9} {'floor':>9} {'x':>5} {'tok/s':>9} "
          f"{'hits':>5}", flush=True)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for case in cases:
        set_budget(core, case.budget)
        rids = [f"p{case.new_per_gpu}-{i}" for i in range(case.requests)]
        for rid in rids:
            tail = random_ids(gen, case.new, mcfg.vocab_size)
            core.add_request(EngineRequest(rid, prefix + tail, greedy))
        win, cached, why = timed(core, rids)
        p = {**_prefill_params(case), **_params(args, core, win, cached, case.hit)}
        if why:
            records.append(record(name, None, "ms", dict(p, skipped=why)))
            if why.startswith("OutOfMemory"):
                break
            continue
        secs = sum(s.seconds for s in win)
        ms, floor = secs / len(win) * 1e3, None
        p.update(new_tokens_per_step=statistics.fmean(s.new_tokens for s in win),
                 tokens_per_s=sum(s.new_tokens for s in win) / secs)  # fmt: skip
        if c is not None:
            f, f_all = prefill_floor(model, case, c)
            floor = f * 1e3
            p.update(floor_all_rows_ms=f_all * 1e3, tokens_per_s_at_floor=case.new_per_gpu / f)
        records.append(record(name, ms, "ms", p, floor=floor))
        print(f"{case.new_per_gpu:>6} {case.requests_per_step:>4} {len(win):>5} {ms:9.1f} "
              f"{floor or math.nan:9.1f} {ms / (floor or math.nan):5.2f} "
              f"{p['tokens_per_s']:9.0f} {p['hits']:5.2f}", flush=True)  # fmt: skip
        save(records)
    core.close()
    del core
    free_memory()
    return records


def _prefill_params(case: PrefillCase) -> dict[str, Any]:
    return {"new_tokens_per_gpu": case.new_per_gpu, "new_tokens_per_request": case.new,
            "context": case.context, "requests_per_step": case.requests_per_step,
            "requests": case.requests, "cached_tokens": case.hit, "prefix": "shared",
            "tokens_per_request": case.tokens_per_request, "token_budget": case.budget,
            "overlap": False}  # fmt: skip


def run_decode(args: argparse.Namespace, model: DeepseekModel, c: Ceilings | None,
               save: Save) -> list[dict]:  # fmt: skip
    """The decode settings on one speculating engine sized for the largest (module doc)."""
    mcfg, name, k = model.cfg, PARTS["decode"], args.drafts
    block = block_size_for(mcfg, 0)
    cases = [decode_case(r, args.context, args.output_len, block)
             for r in sorted(int(r) for r in args.decode_requests.split(","))]  # fmt: skip
    extra = 2 * (k + 1)  # max_tokens past the length: no step verifies fewer than k drafts
    need = args.context + max(cases[-1].lengths) + extra
    cfg = engine_config(args, max_num_seqs=cases[-1].requests,
                        max_num_batched_tokens=args.decode_budget, max_model_len=need + block,
                        speculative={"method": "dspark", "num_draft_tokens": k})  # fmt: skip
    core, why = start(cfg, model, need)
    rate = accept_rate_for(args.accept_length, k) if args.proposer == "forced" else None
    if core is None:
        print(f"decode: the engine does not fit ({why})", flush=True)
        return [record(name, None, "ms", {**_decode_params(case, args, rate), "skipped": why,
                                          **_params(args, None, [], {}, 0)}) for case in cases]
    if rate is not None:
        core.on_draft = ForcedAcceptance(rate, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    prefix = random_ids(gen, cases[0].prefix, mcfg.vocab_size)
    print(f"decode: the {len(prefix)}-token prefix warmed in {warm(core, prefix):.1f} s\n"
          f"{'R':>4} {'batch':>6} {'steps':>5} {'ms':>8} {'floor':>8} {'x':>5} {'AL':>5} "
          f"{'TPOT':>7} {'tok/s':>8}", flush=True)  # fmt: skip
    records: list[dict] = []
    floors: dict[tuple[int, int], tuple[float, float, float]] = {}
    for case in cases:
        lengths = {f"d{case.requests}-{i}": n for i, n in enumerate(case.lengths)}
        for rid, n in lengths.items():
            sp = SamplingParams(temperature=1.0, max_tokens=n + extra, ignore_eos=True)
            tail = random_ids(gen, case.context - case.prefix, mcfg.vocab_size)
            core.add_request(EngineRequest(rid, prefix + tail, sp))
        win, cached, why = timed(core, list(lengths), lengths)
        p = {**_decode_params(case, args, rate), **_params(args, core, win, cached, case.prefix)}
        if why:
            records.append(record(name, None, "ms", dict(p, skipped=why)))
            if why.startswith("OutOfMemory"):
                break
            continue
        secs, emitted = sum(s.seconds for s in win), sum(s.emitted for s in win)
        ms, al, floor = secs / len(win) * 1e3, emitted / sum(s.requests for s in win), None
        p.update(mean_batch=statistics.fmean(s.requests for s in win), accept_length=al,
                 static_steps=sum(s.tokens == s.requests * (k + 1) for s in win) / len(win),
                 tokens_per_s=emitted / secs, tpot_ms=ms / al)  # fmt: skip
        if c is not None:
            parts = [floors.setdefault((s.requests, s.tokens), decode_floor(
                model, s.requests, s.tokens, case.context, k, c)) for s in win]  # fmt: skip
            f = statistics.fmean(x[0] for x in parts)
            floor = f * 1e3
            p.update(floor_bytes_ms=statistics.fmean(x[1] for x in parts) * 1e3,
                     floor_flops_ms=statistics.fmean(x[2] for x in parts) * 1e3,
                     tpot_floor_ms=floor / al, tokens_per_s_at_floor=emitted / (f * len(win)))
        records.append(record(name, ms, "ms", p, floor=floor))
        print(f"{case.requests:>4} {p['mean_batch']:6.1f} {len(win):>5} {ms:8.2f} "
              f"{floor or math.nan:8.2f} {ms / (floor or math.nan):5.2f} {al:5.2f} "
              f"{p['tpot_ms']:7.2f} {p['tokens_per_s']:8.0f}", flush=True)  # fmt: skip
        save(records)
    core.close()
    del core
    free_memory()
    return records


def _decode_params(case: DecodeCase, args: argparse.Namespace, rate: float | None
                   ) -> dict[str, Any]:  # fmt: skip
    return {"requests_per_gpu": case.requests, "context": case.context,
            "cached_prefix": case.prefix, "prefix": "shared", "drafts": args.drafts,
            "verification": "static", "proposer": args.proposer,
            "accept_length_target": args.accept_length if rate is not None else None,
            "accept_rate": rate, "output_len": args.output_len,
            "output_lengths": [min(case.lengths), max(case.lengths)], "temperature": 1.0,
            "token_budget": args.decode_budget}  # fmt: skip


# ---- the result file ------------------------------------------------------------------------
def setting(r: dict) -> tuple[str, int | None]:
    """A record's name and setting (new tokens or requests per GPU; None for ceilings)."""
    p = r["params"]
    return r["name"], p.get("new_tokens_per_gpu", p.get("requests_per_gpu"))


def earlier(args: argparse.Namespace, planned: set[tuple[str, int]]
            ) -> tuple[list[dict], str | None]:  # fmt: skip
    """With ``--merge``: the records of an earlier run of this commit in the result file
    but those of the ``planned`` settings (tagged ``params.process``), and its command."""
    path = result_path("deepinfer", args.out)
    if not args.merge or not path.is_file():
        return [], None
    doc = json.loads(path.read_text())
    if doc.get("commit") != commit():
        raise SystemExit(f"--merge: {path} is of commit {doc.get('commit')}, not {commit()}")
    kept = [r for r in doc["records"] if setting(r) not in planned]
    for r in kept:
        r["params"].setdefault("process", 0)
    return kept, doc["command"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, the model's preset filling those not given."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add = ap.add_argument
    add("--model", default="flash-rank", choices=tuple(PRESETS))
    add("--what", default="prefill,decode", help="prefill and / or decode")
    add("--device", default=None, help="default: cuda (flash-rank), cpu (tiny-v41)")
    add("--context", type=int, default=None, help="tokens per request (default 128K)")
    add("--new", type=int, default=None, help="prefill: new tokens per request")
    add("--prefill-tokens", default=None, help="prefill: new tokens per GPU per step (list)")
    add("--prefill-batches", type=int, default=10, help="prefill: steps of requests queued")
    add("--decode-requests", default=None, help="decode: requests per GPU (list)")
    add("--output-len", type=int, default=None, help="decode: L, lengths in [L/2, 3L/2]")
    add("--drafts", type=int, default=3, help="decode: draft tokens per step")
    add("--proposer", default="forced", choices=("forced", "dspark"))
    add("--accept-length", type=float, default=2.5, help="decode: tokens per step (forced)")
    add("--decode-budget", type=int, default=None, help="decode: max_num_batched_tokens")
    add("--kv-gib", type=float, default=None, help="KV pool (default: the engine's sizing)")
    add("--seed", type=int, default=0)
    add("--out", default=None, help="directory for deepinfer.json (default bench/results)")
    add("--merge", action="store_true", help="keep the other settings' records of an "
        "earlier run of this commit in the file")  # fmt: skip
    args = ap.parse_args(argv)
    for key, value in PRESETS[args.model].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.what = [w for w in args.what.split(",") if w]
    if not args.what or set(args.what) - set(PARTS):
        ap.error(f"--what: prefill and / or decode, got {args.what!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Measure the parts of ``--what`` and write ``deepinfer.json`` (module doc)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cuda = args.device.startswith("cuda")
    args.card = torch.cuda.get_device_name(0) if cuda else "cpu"
    planned = {(PARTS["prefill"], int(n)) for n in args.prefill_tokens.split(",")
               if "prefill" in args.what} | {(PARTS["decode"], int(r)) for r in
               args.decode_requests.split(",") if "decode" in args.what}  # fmt: skip
    kept, before = earlier(args, planned)
    command = "python -m bench.deepinfer " + " ".join(sys.argv[1:] if argv is None else argv)
    process = before.count(";") + 1 if before else None
    records, ceil = [], None
    if cuda:
        ceil = Ceilings(copy_bandwidth(), matmul_rate())
        print(f"copy bandwidth {ceil.bandwidth / 1e12:.2f} TB/s, bf16 matmul "
              f"{ceil.matmul / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
        records = [record("ceiling.copy_bandwidth", ceil.bandwidth / 1e12, "TB/s"),
                   record("ceiling.bf16_matmul", ceil.matmul / 1e12, "TFLOP/s")]  # fmt: skip

    def save(part: list[dict]) -> None:
        for r in records + part:
            if process is not None:
                r["params"]["process"] = process
        write("deepinfer", kept + records + part, args.out,
              command=f"{before}; {command}" if before else command)  # fmt: skip

    model = Startup(torch.device(args.device)).load(engine_config(args), None)
    for part in args.what:
        run = run_prefill if part == "prefill" else run_decode
        records += run(args, model, ceil, save)
        save([])
    print("wrote", result_path("deepinfer", args.out), flush=True)


if __name__ == "__main__":
    main()
