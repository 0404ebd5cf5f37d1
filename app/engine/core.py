"""The synchronous engine core of one DP rank: add / abort / step.

``step()`` = schedule -> prepare inputs -> launch forward -> (apply the previous step's
tokens) -> launch sampling -> outputs. Device work is ordered on one stream; the host never
synchronizes inside a step, it waits only for the copy of a step's sampled tokens. With
overlap scheduling (``EngineConfig.overlap_schedule``) the host prepares and launches step
N+1 before it applies step N's tokens, so the device runs N+1 while the host does N's
bookkeeping; outputs are identical on and off:

    schedule + prepare N+1 (host)       launch forward N+1
    wait for N's sampled tokens (copy event) -> apply N: stops, grammar, outputs
    launch sampling of N+1 (penalties and grammar masks see token N)

Requests that finished at N were already in N+1: they are not sampled and their blocks are
freed once N+1 is done. With overlap off each step is launched, waited for and applied in
the same call.

The parts it loops over: ``Scheduler`` (which tokens), ``ModelRunner`` (inputs, forward),
``sample_chunks`` (``app.engine.sampler``; grammar masks from ``app.engine.grammar``),
``Speculator`` (``app.engine.spec``: drafts, verify; speculating steps are not pipelined, so
overlap is off while speculation is on), ``OutputProcessor`` (stops, logprobs, deltas), the
``HandoffPort`` (``app.engine.handoff``), ``EngineStats`` (``app.engine.metrics``), and at
construction the start-up (``app.engine.startup``: weights, memory profile and pool sizing
by ``app.engine.capacity``, CUDA graphs, warm-up).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.config import EngineConfig
from app.engine.flight import Flight, HostSamples
from app.engine.fork import Forks
from app.engine.grammar import GrammarMatcher, StructuredOutput
from app.engine.handoff import Handoff, HandoffPort
from app.engine.lifecycle import RequestTrace
from app.engine.metrics import EngineStats
from app.engine.outputs import OutputProcessor, checkpoint_text
from app.engine.parallel import RankParallel
from app.engine.request import EngineRequest, FinishReason, RequestError, RequestOutput
from app.engine.runner import ModelRunner
from app.engine.sampler import sample_chunks
from app.engine.scheduler import Scheduler, SchedulerOutput
from app.engine.sequence import Sequence
from app.engine.spec.proposer import Proposer, check_speculation
from app.engine.spec.speculator import OnDraft, Speculator
from app.engine.startup import Startup
from app.engine.validation import RequestLimits, check_request
from app.model.model import DeepseekModel
from kernels.dispatch import batch_invariant

logger = logging.getLogger(__name__)


class EngineCore:
    """One DP rank's engine, usable without Ray."""

    def __init__(
        self, cfg: EngineConfig, model: DeepseekModel | None = None,
        proposer: Proposer | None = None, parallel: RankParallel | None = None,
        probe: bool = False,
    ) -> None:  # fmt: skip
        """``proposer``: drafts in place of the one ``cfg.speculative`` names (tests and
        benchmarks: the target's own continuation, random tokens). ``parallel``: this
        rank's expert-parallel gang (``app.engine.parallel``; the model loads its share).
        Returns after the start-up (``app.engine.startup``: weights, memory profile, KV
        pool, CUDA graphs, warm-up). ``probe``: the start-up's memory probe (sized by
        ``kv_cache_bytes``; no graphs, no warm-up)."""
        self.cfg, self.parallel = cfg, parallel
        self.device = torch.device(cfg.device)
        self.startup = start = Startup(self.device, quiet=probe)  # its phases, what it measured
        if model is None:
            model = start.load(cfg, parallel)
        self.model, mcfg, spec = model, model.cfg, cfg.speculative
        self.tokenizer, self.eos_ids = checkpoint_text(Path(cfg.model), mcfg.eos_token_id)
        if spec is not None and proposer is None:
            check_speculation(spec, model)
        # the KV pool (one layout: allocation = accounting), measured on a probe on CUDA (in
        # deterministic mode with the mode's kernels: their workspaces are part of the peak)
        with batch_invariant(cfg.deterministic):
            size = start.pool(cfg, model, proposer is None,
                              lambda c: EngineCore(c, model, proposer, parallel, probe=True))
        self.max_model_len, slots = size.max_model_len, cfg.scheduler.max_num_seqs
        self.cache = size.make_cache(model, cfg, self.device)
        self.scheduler = Scheduler(cfg.scheduler, self.cache)
        self.stats = EngineStats(spec_accepted_at=[0] * (spec.num_draft_tokens if spec else 0))
        self.spec = Speculator.build(spec, model, proposer, self.cache, self.max_model_len,
                                     self.stats)  # fmt: skip
        self.on_draft: OnDraft | None = None  # called with each step's proposed blocks
        self.overlap = cfg.overlap_schedule and self.spec is None
        # an EP gang steps eagerly: its dense exchanges could be captured, but every rank
        # would have to replay the graph of one agreed bucket in lockstep (not built yet)
        self.runner = ModelRunner(
            model, self.cache, cfg.scheduler.max_num_batched_tokens, self.device,
            cuda_graphs=cfg.cuda_graphs and not model.gang_exchanges, max_graph_batch=slots,
            features=self.spec is not None and self.spec.proposer.needs_features,
        )  # fmt: skip
        if self.spec is not None and self.runner.graphs is not None:
            self.spec.use_graphs(self.runner.graphs.pool)  # the draft step's, in their pool
        self.decoder_replay = cfg.cache.bounded_replay == "encoder+decoder"
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len,
                                       self.cache, self.spec)  # fmt: skip
        self.structured = StructuredOutput(self.tokenizer, mcfg, self.eos_ids[0])
        self.limits = RequestLimits(mcfg.vocab_size, self.max_model_len)
        self.handoff = HandoffPort(cfg, mcfg, self.cache, self.device, self.stats)
        self.forks = Forks(self.cache)  # requests with n > 1
        self._seqs: dict[str, Sequence] = {}
        self._flight: Flight | None = None
        self._prev_rows: dict[str, int] = {}  # request -> row of the last sample output
        # observability (app.engine.lifecycle, app.engine.metrics): phase events of traced
        # requests (registered here by request id before add_request, from any thread), and a
        # hook called after every step with (its schedule, its perf_counter start, seconds)
        self.traces: dict[str, RequestTrace] = {}
        self._num_traced = 0  # live requests with a trace: 0 = no tracing work in a step
        self.on_step: Callable[[SchedulerOutput, float, float], None] | None = None
        if probe:
            return
        logger.info("engine: %s", size.describe(slots))
        with batch_invariant(cfg.deterministic):  # graphs capture the mode's kernels
            start.finish(self)  # CUDA graphs, warm-up, the memory line, the phases' seconds
        # Everything built so far (the model, the pools, the tokenizer) lives as long as the
        # engine: moved out of the collector's generations, so a collection scans only what
        # the steps allocate (a long collection stalls the host: device idle under overlap).
        gc.collect()
        gc.freeze()

    @property
    def proposer(self) -> Proposer | None:
        return self.spec.proposer if self.spec is not None else None

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: EngineRequest, export: bool = False) -> None:
        """Validate and queue a request; raises :class:`RequestError` naming the problem.
        ``export``: after its first token (unless that ends it) the request ends with finish
        reason HANDOFF and its decode state in the output (``app.engine.handoff``)."""
        seq = self.new_sequence(req)
        if req.params.n > 1:  # one prefill, n forked decodes (app.engine.fork)
            if export:
                raise RequestError("n", "n > 1 is not served with prefill/decode disaggregation")
            self.stats.prompt_tokens += seq.num_prompt

            def matcher() -> GrammarMatcher | None:
                return self.structured.matcher(req.params.constraint)

            for s in self.forks.add(seq, matcher):
                self.enter(s, count_prompt=False)
            return
        if export:
            self.handoff.exporting.add(req.request_id)
        self.enter(seq)

    def add_handoff(self, req: EngineRequest, handoff: Handoff) -> str | None:
        """Continue a request another engine prefilled (``app.engine.handoff``): None when
        its decode state was installed, else why it resumes as a local prefill."""
        return self.handoff.install(self, req, handoff)

    def new_sequence(self, req: EngineRequest) -> Sequence:
        """A validated request's engine state, its constraint compiled (not queued yet)."""
        if req.request_id in self._seqs or req.request_id in self.forks.groups:
            raise RequestError("request_id", f"{req.request_id!r} is already running")
        check_request(req, self.limits)
        return Sequence(req=req, tokens=list(req.prompt_token_ids),
                        matcher=self.structured.matcher(req.params.constraint))  # fmt: skip

    def enter(self, seq: Sequence, running: bool = False, count_prompt: bool = True) -> None:
        """Register ``seq``: into the waiting queue, or (``running``: its cache is already
        in place) straight into the running batch (``count_prompt``: its prompt counts in
        the stats; a request's choices count it once)."""
        rid = seq.request_id
        if self.traces and seq.start_trace(self.traces.pop(rid, None)):
            self._num_traced += 1
        self._seqs[rid] = seq
        self.stats.prompt_tokens += seq.num_prompt if count_prompt else 0
        if running:
            self.scheduler.running.append(seq)
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any phase; frees its KV. None if it is unknown or done."""
        if (members := self.forks.abort(request_id)) is not None:
            for seq in members:
                seq.finish_reason = FinishReason.ABORT
                self._finish(seq)
            return RequestOutput(request_id, finished=True, finish_reason=FinishReason.ABORT)
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        self._finish(seq)
        return self.outputs.output(seq, [], None, finished=True)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs) or self._flight is not None

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step (the pipeline of the module doc); returns one output delta
        per request that advanced. In deterministic mode every kernel of it runs
        batch-invariantly (``kernels.invariant``)."""
        with batch_invariant(self.cfg.deterministic):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        st, t0 = self.stats, time.perf_counter()
        sched = self.scheduler.schedule()
        st.num_preemptions += len(sched.preempted)
        if self._num_traced:
            sched.trace(t0)
        t1 = time.perf_counter()
        inputs = None
        if sched.items:
            inputs = self.runner.prepare(sched.items, self.decoder_replay, self._prev_rows)
        if self.parallel is not None:  # every rank of a gang steps (idle: no tokens)
            n_tokens = sum(it.num_tokens for it in inputs.items) if inputs is not None else 0
            self.parallel.step(self.model, n_tokens, self.device)
        t2 = time.perf_counter()
        st.t_schedule, st.t_prepare = st.t_schedule + t1 - t0, st.t_prepare + t2 - t1
        prev = self._flight  # (kept as the step in flight should the launch fail)
        launched = self._flight = None if inputs is None else Flight(
            inputs, *self.runner.forward_with_features(inputs))  # fmt: skip
        st.graph_steps += inputs is not None and inputs.graph
        t3 = time.perf_counter()
        st.t_launch += t3 - t2
        outs = self._complete(prev) if prev is not None else []
        if launched is not None:
            t4 = time.perf_counter()
            self._launch_sampling(launched)
            st.t_launch += time.perf_counter() - t4
            if not self.overlap:
                self._flight = None
                outs += self._complete(launched)
        dt = time.perf_counter() - t0
        st.end_step(dt, self.scheduler, self.cache)
        if self.on_step is not None:
            self.on_step(sched, t0, dt)
        return outs

    def _complete(self, flight: Flight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them (``OutputProcessor.apply``):
        hand off exporting requests after their first token, finish what ended."""
        t0 = time.perf_counter()
        host = flight.host.wait() if flight.host is not None else None
        t1 = time.perf_counter()
        self.stats.t_wait += t1 - t0
        self._release(flight)
        outs: list[RequestOutput] = []
        for seq, out in self.outputs.apply(flight, host):
            self.handoff.after_token(seq, out)
            done = out.finished
            outs.append(self.forks.settle(seq, out))
            if out.token_ids:
                seq.trace_first_token()
            if done:
                self._finish(seq)
        self._fork_ready()
        self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
        self.stats.t_update += time.perf_counter() - t1
        return outs

    @torch.inference_mode()
    def _launch_sampling(self, flight: Flight) -> None:
        """Sample the live rows of a launched step (device), draft the next tokens of
        speculating requests, and start the copy of tokens (and drafts) to the host; the
        tokens stay on the device for the next step's pending inputs."""
        live = flight.live_rows()
        self._prev_rows = live.last_rows() if live is not None else {}
        if live is None:  # e.g. a step of prefill chunks only: their rows still feed the drafter
            if self.spec is not None:
                self.spec.launch(flight, None, None)
            return
        res = sample_chunks(live.items, live.counts, live.logits, self.eos_ids,
                            self.model.cfg.vocab_size)  # fmt: skip
        if self.overlap:  # the next step's pending input tokens (one row per request)
            self.runner.store_samples(res.tokens)
        extra = self.spec.launch(flight, live, res, self.on_draft) if self.spec else None
        flight.host = HostSamples(res, extra)

    def _fork_ready(self) -> None:
        """Fork the choices of requests whose prefill is done (``app.engine.fork``)."""
        for group in self.forks.ready():
            parent = group.parent
            running, waiting = self.forks.fork(group)
            self._seqs.pop(parent.request_id, None)
            self.scheduler.remove(parent)  # its cache entry went to a choice
            for seq in running:
                self.enter(seq, running=True, count_prompt=False)
            for seq in waiting:
                self.enter(seq, count_prompt=False)

    def _release(self, flight: Flight) -> None:
        """Free requests that finished while ``flight`` still used their blocks."""
        for seq in flight.finished_while_in_flight:
            self.scheduler.remove(seq)

    def _finish(self, seq: Sequence) -> None:
        """Forget a finished request; free its KV now, or once the step in flight is done."""
        self._seqs.pop(seq.request_id, None)
        self.handoff.exporting.discard(seq.request_id)
        if seq.end_trace():
            self._num_traced -= 1
        if self._flight is not None and self._flight.holds(seq):  # freed once it is done
            self._flight.finished_while_in_flight.append(seq)
            self.scheduler.retire(seq)
        else:
            self.scheduler.remove(seq)

    def close(self) -> None:
        """Finish the step in flight (no kernels run after)."""
        self.drain()

    def drain_after_error(self) -> None:
        """After a failed step (every request aborted): wait out the step in flight, ignore
        its result and free what it held."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        try:
            if flight.host is not None:
                flight.host.wait()
        except Exception:  # the failure was already reported
            logger.debug("step in flight failed too", exc_info=True)
        self._release(flight)

    def drain(self) -> list[RequestOutput]:
        """Wait for the step in flight and return its outputs (overlap mode)."""
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        return self._complete(flight)
