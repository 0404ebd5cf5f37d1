"""The synchronous engine core of one DP rank: add / abort / step.

``step()`` = schedule -> prepare inputs -> forward -> sample -> update requests -> outputs.
With overlap scheduling (``EngineConfig.overlap_schedule``) the host prepares step N+1 while
the device runs step N (see :meth:`EngineCore.step`); outputs are identical on and off.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from app.cache.manager import CacheManager
from app.config import EngineConfig, EngineConfigError
from app.engine.request import (
    EngineRequest,
    FinishReason,
    RequestError,
    RequestOutput,
    TokenLogprob,
)
from app.engine.runner import ModelRunner, StepInputs
from app.engine.sampler import RowState, SampleOutput, sample
from app.engine.scheduler import Scheduled, Scheduler, Sequence
from app.engine.validation import RequestLimits, check_request
from app.model.loader import load_model
from app.model.model import DeepseekModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class _StepResult:
    live: list[int]  # indices into the step's sample_items that were sampled
    sample: SampleOutput | None
    prompt_logits: dict[str, torch.Tensor]


@dataclass
class _Flight:
    """A launched step: its inputs, the worker's future, and the event that lets it sample."""

    inputs: StepInputs
    ready: threading.Event
    future: Future | None = None
    finished_while_in_flight: list[Sequence] = field(default_factory=list)
    masks: tuple[torch.Tensor, dict[str, int]] | None = None  # grammar rows, filled by host

    @property
    def items(self) -> list[Scheduled]:
        return self.inputs.items


@dataclass
class EngineStats:
    """Counters for metrics and the router."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_preemptions: int = 0
    steps: int = 0
    last_step_s: float = 0.0
    # cumulative seconds per phase (host: schedule, prepare, update; worker: forward, sample)
    t_schedule: float = 0.0
    t_prepare: float = 0.0
    t_forward: float = 0.0
    t_sample: float = 0.0
    t_update: float = 0.0


def _stop_token_ids(model_dir: Path, cfg_eos: int) -> tuple[int, ...]:
    ids = {cfg_eos}
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


class EngineCore:
    """One DP rank's engine, usable without Ray."""

    def __init__(self, cfg: EngineConfig, model: DeepseekModel | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        dtype = _DTYPES[cfg.dtype]
        path = Path(cfg.model)
        if model is None:
            model = load_model(
                path,
                self.device,
                dtype,
                kv_quant=cfg.cache.kv_quant,
                packed_experts=cfg.packed_experts_flag(),
            )
        self.model = model
        mcfg = model.cfg
        tok_file = path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.eos_ids = _stop_token_ids(path, mcfg.eos_token_id)
        # ---- KV pool from the memory budget
        block_size = cfg.cache.resolve_block_size(mcfg)
        probe = CacheManager(
            model, cfg.cache, num_blocks=1, max_slots=1, dtype=dtype, device="meta"
        )
        per_block = probe.kv.bytes_per_block()
        per_slot = probe.kv.bytes_per_slot()
        budget = self._kv_budget()
        slots = cfg.scheduler.max_num_seqs
        num_blocks = (budget - slots * per_slot) // per_block
        if num_blocks < 1:
            raise EngineConfigError(
                f"KV budget of {budget} bytes holds no block after {slots} request slots "
                f"({per_slot} B each); raise kv_cache_bytes or lower max_num_seqs"
            )
        self.cache = CacheManager(model, cfg.cache, num_blocks, slots, dtype, self.device)
        limit = cfg.scheduler.max_model_len or mcfg.max_position_embeddings
        self.max_model_len = min(limit, mcfg.max_position_embeddings, num_blocks * block_size)
        self.scheduler = Scheduler(cfg.scheduler, self.cache)
        max_tok = cfg.scheduler.max_num_batched_tokens
        self.runner = ModelRunner(model, self.cache, max_tok, self.device)
        self.decoder_replay = cfg.cache.bounded_replay == "encoder+decoder"
        self._seqs: dict[str, Sequence] = {}
        self._grammar = None
        self._flight: _Flight | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fathom-step")
        self.stats = EngineStats()
        logger.info(
            "engine: %d KV blocks of %d tokens (%.1f MiB), %d slots, max_model_len %d",
            num_blocks,
            block_size,
            num_blocks * per_block / 2**20,
            slots,
            self.max_model_len,
        )

    def _kv_budget(self) -> int:
        c = self.cfg.cache
        if c.kv_cache_bytes is not None:
            return c.kv_cache_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * c.gpu_memory_utilization)
        return DEFAULT_CPU_KV_BYTES

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue a request; raises :class:`RequestError` naming the problem."""
        if req.request_id in self._seqs:
            raise RequestError("request_id", f"{req.request_id!r} is already running")
        check_request(req, RequestLimits(self.model.cfg.vocab_size, self.max_model_len))
        p = req.params
        matcher = None
        if p.constraint is not None:
            from app.engine.grammar import GrammarError

            try:
                matcher = self.grammar.matcher(self.grammar.compile(p.constraint))
            except GrammarError as e:
                raise RequestError("constraint", str(e)) from e
        gen = None
        if p.seed is not None and not p.greedy:
            gen = torch.Generator(device=self.device).manual_seed(p.seed % 2**63)
        seq = Sequence(req=req, tokens=list(req.prompt_token_ids), generator=gen, matcher=matcher)
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    @property
    def grammar(self):
        """The grammar compiler (built on first use; needs the checkpoint's tokenizer)."""
        if self._grammar is None:
            from app.engine.grammar import GrammarCompiler

            if self.tokenizer is None:
                raise RequestError("constraint", "this model has no tokenizer.json")
            think = self.tokenizer.token_to_id("</think>")
            self._grammar = GrammarCompiler(
                self.tokenizer,
                self.model.cfg.vocab_size,
                self.eos_ids[0],
                think,
                arch=self.model.cfg.arch,
            )
        return self._grammar

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any phase; frees its KV. None if it is unknown or done."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return self._output(seq, [], None, finished=True)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs) or self._flight is not None

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one output delta per request that advanced.

        Pipeline (overlap on): schedule and prepare step N+1 on the host, wait for step N's
        sampled tokens, fill the pending input tokens of N+1 on the device and launch it,
        then turn step N's tokens into outputs (stop checks, grammar, streaming) while N+1
        runs; sampling of N+1 waits for that update (penalties and grammar masks need token
        N). Requests that finished at N were already in N+1: their extra token is dropped and
        their blocks are freed once N+1 is done. With overlap off, each step launches and
        waits in the same call.
        """
        t0 = time.perf_counter()
        st = self.stats
        sched = self.scheduler.schedule()
        st.num_preemptions += len(sched.preempted)
        t1 = time.perf_counter()
        inputs = self.runner.prepare(sched.items, self.decoder_replay) if sched.items else None
        st.t_schedule += t1 - t0
        st.t_prepare += time.perf_counter() - t1
        prev, prev_res = self._flight, None
        if prev is not None:
            prev_res = prev.future.result()
            self._release(prev)
        self._flight = None
        if inputs is not None:
            if inputs.pending:
                self._fill_pending(inputs, prev, prev_res)
            flight = _Flight(inputs, threading.Event())
            flight.future = self._executor.submit(self._run_and_sample, flight)
            self._flight = flight
        t2 = time.perf_counter()
        try:
            outs = self._update(prev, prev_res) if prev is not None else []
            if self._flight is not None:
                # grammar masks need token N (just accepted): fill them while N+1's forward runs
                self._flight.masks = self._fill_masks(self._flight.inputs)
        finally:  # the worker must never be left waiting (an error here fails every request)
            if self._flight is not None:
                self._flight.ready.set()
        st.t_update += time.perf_counter() - t2
        if self._flight is not None and not self.cfg.overlap_schedule:
            flight, self._flight = self._flight, None
            res = flight.future.result()
            self._release(flight)
            t3 = time.perf_counter()
            outs += self._update(flight, res)
            st.t_update += time.perf_counter() - t3
        self._stats(time.perf_counter() - t0)
        return outs

    def _run_and_sample(self, flight: _Flight) -> _StepResult:
        """Worker: forward, then (once the previous step's tokens are applied and the grammar
        masks filled) sample."""
        inputs = flight.inputs
        t0 = time.perf_counter()
        logits, prompt_logits = self.runner.run(inputs)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.stats.t_forward += time.perf_counter() - t0
        flight.ready.wait()
        t1 = time.perf_counter()
        live = [i for i, it in enumerate(inputs.sample_items) if it.seq.finish_reason is None]
        res = None
        if live:
            items = [inputs.sample_items[i] for i in live]
            res = self._sample(items, logits[live], flight.masks)
            if res.tokens.is_cuda:
                torch.cuda.synchronize(res.tokens.device)
        self.stats.t_sample += time.perf_counter() - t1
        return _StepResult(live, res, prompt_logits)

    def _fill_pending(
        self, inputs: StepInputs, prev: _Flight | None, prev_res: _StepResult | None
    ) -> None:
        """Write last step's sampled tokens into this step's input ids (on the device)."""
        if prev is None or prev_res is None or prev_res.sample is None:
            raise RuntimeError("pending input tokens without a step in flight")
        where = {}
        for k, i in enumerate(prev_res.live):
            seq = prev.inputs.sample_items[i].seq
            where[seq.request_id] = k
        rows = list(inputs.pending)
        src = [where[inputs.pending[r][0]] for r in rows]
        dev = inputs.batch.input_ids.device
        tokens = prev_res.sample.tokens
        inputs.batch.input_ids[torch.tensor(rows, device=dev)] = tokens[
            torch.tensor(src, device=tokens.device)
        ].to(dev)

    def _release(self, flight: _Flight) -> None:
        """Free requests that finished while ``flight`` still used their blocks."""
        for seq in flight.finished_while_in_flight:
            self.scheduler.remove(seq)

    def _fill_masks(self, inputs: StepInputs) -> tuple[torch.Tensor, dict[str, int]] | None:
        """Grammar bitmask rows of the constrained requests that sample in ``inputs``."""
        rows = {it.seq.request_id: it.seq.matcher for it in inputs.sample_items if it.seq.matcher}
        if not rows:
            return None
        from app.engine.grammar import allocate_bitmask, fill_bitmasks

        mask = allocate_bitmask(len(rows), self.model.cfg.vocab_size)
        fill_bitmasks(list(rows.values()), mask, list(range(len(rows))))
        return mask, {rid: i for i, rid in enumerate(rows)}

    def _sample(
        self,
        items: list[Scheduled],
        logits: torch.Tensor,
        masks: tuple[torch.Tensor, dict[str, int]] | None,
    ) -> SampleOutput:
        rows = []
        for it in items:
            s = it.seq
            p = s.req.params
            n_out = len(s.tokens) - s.num_prompt
            rows.append(
                RowState(
                    params=p,
                    generator=s.generator,
                    prompt_ids=s.req.prompt_token_ids,
                    output_ids=s.output_ids,
                    mask_eos=n_out < p.min_tokens,
                    eos_ids=(() if p.ignore_eos else self.eos_ids) + tuple(p.stop_token_ids),
                )
            )
        apply = None
        if masks is not None:
            from app.engine.grammar import apply_bitmask

            mask, where = masks
            pairs = [
                (i, where[it.seq.request_id])
                for i, it in enumerate(items)
                if it.seq.request_id in where
            ]
            idx = [i for i, _ in pairs]
            sel = mask[[r for _, r in pairs]]

            def apply(lg: torch.Tensor) -> None:
                sub = lg[idx]
                apply_bitmask(sub, sel.to(sub.device), list(range(len(idx))))
                lg[idx] = sub

        return sample(logits, rows, apply)

    def _update(self, flight: _Flight, res: _StepResult) -> list[RequestOutput]:
        """Apply a finished step: advance requests, append tokens, emit outputs."""
        inputs = flight.inputs
        outs: list[RequestOutput] = []
        sampled: dict[str, tuple[int, int]] = {}
        if res.sample is not None:
            toks = res.sample.tokens.tolist()
            for k, i in enumerate(res.live):
                sampled[inputs.sample_items[i].seq.request_id] = (k, toks[k])
        for it in flight.items:
            seq = it.seq
            rid = seq.request_id
            seq.num_in_flight -= 1
            seq.num_done = max(seq.num_done, it.start + it.num_tokens)
            if it.samples:
                seq.num_pending -= 1
            if seq.finish_reason is not None:  # finished or aborted meanwhile: drop
                continue
            plp = None
            if rid in res.prompt_logits:
                pairs = inputs.prompt_rows[rid]
                plp = self._prompt_logprobs(seq, pairs, res.prompt_logits[rid], it.start)
            if rid not in sampled:
                self.cache.commit(rid, seq.tokens, seq.num_done)
                if plp is not None:
                    outs.append(self._output(seq, [], None, prompt_logprobs=plp))
                continue
            k, tok = sampled[rid]
            lp = None
            if seq.req.params.logprobs is not None:
                lp = [self._token_logprob(res.sample, k, tok, seq.req.params.logprobs)]
            new = self._append(seq, tok)
            self.cache.commit(rid, seq.tokens, min(seq.num_done, len(seq.tokens)))
            finished = seq.finish_reason is not None
            outs.append(self._output(seq, new, lp if new else None, finished, plp))
            if finished:
                self._finish(seq)
        return outs

    def _finish(self, seq: Sequence) -> None:
        """Forget a finished request; free its KV now, or once the step in flight is done."""
        self._seqs.pop(seq.request_id, None)
        flight = self._flight
        if flight is not None and any(it.seq is seq for it in flight.items):
            flight.finished_while_in_flight.append(seq)
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
        else:
            self.scheduler.remove(seq)

    def close(self) -> None:
        """Finish the step in flight and stop the worker thread (no kernels run after)."""
        self.drain()
        self._executor.shutdown(wait=True)

    def drain_after_error(self) -> None:
        """After a failed step (every request aborted): wait out the step in flight, ignore
        its result and free what it held."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.ready.set()
        try:
            flight.future.result()
        except Exception:  # the failure was already reported
            logger.debug("step in flight failed too", exc_info=True)
        self._release(flight)

    def drain(self) -> list[RequestOutput]:
        """Wait for the step in flight and return its outputs (overlap mode)."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        res = flight.future.result()
        self._release(flight)
        return self._update(flight, res)

    def _append(self, seq: Sequence, tok: int) -> list[int]:
        """Add a sampled token; set the finish reason when the request is done. Returns the
        tokens to emit (stop tokens are not emitted)."""
        p = seq.req.params
        if seq.matcher is not None and not seq.matcher.accept(tok):
            seq.finish_reason = FinishReason.ERROR
            seq.error = f"token {tok} violates the output constraint"
            return []
        n_out = len(seq.tokens) - seq.num_prompt
        if n_out >= p.min_tokens and (
            (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, tok
            return []
        seq.tokens.append(tok)
        n_out += 1
        if seq.matcher is not None and seq.matcher.must_stop():  # only EOS could follow
            seq.finish_reason = FinishReason.STOP
        elif p.stop and self.tokenizer is not None and n_out >= p.min_tokens:
            hit = self._stop_string(seq)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, hit
        if seq.finish_reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens)
            or len(seq.tokens) >= self.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH
        return [tok]

    def _stop_string(self, seq: Sequence) -> str | None:
        stops = seq.req.params.stop
        span = max(len(s) for s in stops) + 8  # tokens are at least one char, most often
        tail = self.tokenizer.decode(seq.output_ids[-span:], skip_special_tokens=False)
        return next((s for s in stops if s in tail), None)

    @staticmethod
    def _token_logprob(res: SampleOutput, i: int, tok: int, k: int) -> TokenLogprob:
        top = ()
        if k and res.top_ids is not None:
            top = tuple(
                zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist(), strict=True)
            )
        return TokenLogprob(tok, float(res.logprobs[i]), top)

    def _prompt_logprobs(
        self, seq: Sequence, pairs: list[tuple[int, int]], logits: torch.Tensor, start: int
    ) -> list[TokenLogprob | None] | None:
        """Logprob of each next prompt token given the prefix (position 0 has none). Each
        position is emitted once: a preempted request recomputes rows it already reported."""
        k = seq.req.params.prompt_logprobs or 0
        done = seq.prompt_logprobs_done
        logp = torch.log_softmax(logits.float(), dim=-1)
        out: list[TokenLogprob | None] = [None] if start == 0 and done == 0 else []
        for j, (_, p) in enumerate(pairs):
            if p + 1 >= seq.num_prompt:
                break
            if p + 1 < done:  # token p+1 was reported before a preemption
                continue
            nxt = seq.tokens[p + 1]
            top = ()
            if k:
                t = torch.topk(logp[j], k)
                top = tuple(zip(t.indices.tolist(), t.values.tolist(), strict=True))
            out.append(TokenLogprob(nxt, float(logp[j, nxt]), top))
        if pairs:
            seq.prompt_logprobs_done = max(done, min(pairs[-1][1] + 2, seq.num_prompt))
        return out or None

    def _output(
        self, seq: Sequence, new: list[int], lp, finished: bool = False, prompt_logprobs=None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=list(new),
            logprobs=lp,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            error=seq.error,
        )

    def _stats(self, dt: float) -> None:
        s = self.stats
        s.steps += 1
        s.last_step_s = dt
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_free_blocks = self.cache.num_free_blocks
        s.kv_usage = self.cache.pool.usage
        if self.cache.index is not None:
            s.prefix_hit_tokens = self.cache.index.stats.hit_tokens
