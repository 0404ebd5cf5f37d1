"""The synchronous engine core of one DP rank: add / abort / step.

``step()`` = schedule -> prepare inputs -> launch forward -> (apply the previous step's
tokens) -> launch sampling -> outputs. Device work is ordered on one stream; the host never
synchronizes inside a step, it waits only for the copy of a step's sampled tokens. With
overlap scheduling (``EngineConfig.overlap_schedule``) the host prepares and launches step
N+1 before it applies step N's tokens, so the device runs N+1 while the host does N's
bookkeeping (see :meth:`EngineCore.step`); outputs are identical on and off.

Speculative decoding (``EngineConfig.speculative``): after each step the proposer drafts up
to k tokens per decoding request on the device (from the step's accept decision, which the
host has not seen yet); the host copies tokens, accept flags and drafts in one transfer, and
the next step verifies the drafts as known tokens of their requests (``app.engine.spec``).
Speculating steps are not pipelined: overlap scheduling is off while speculation is on.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from app.cache.layout import CacheLayout
from app.cache.manager import CacheManager
from app.cache.transfer import LayoutHeader, model_fingerprint
from app.config import EngineConfig, EngineConfigError
from app.engine.handoff import Handoff, export_state, import_state
from app.engine.lifecycle import RequestTrace
from app.engine.outputs import HostSamples, OutputProcessor
from app.engine.parallel import RankParallel
from app.engine.request import EngineRequest, FinishReason, RequestError, RequestOutput
from app.engine.runner import ModelRunner, StepInputs
from app.engine.sampler import RowState, SampleOutput, sample, to_device
from app.engine.scheduler import Scheduled, Scheduler, SchedulerOutput, Sequence
from app.engine.spec.proposer import Proposer, check_speculation, make_proposer
from app.engine.spec.verify import accepted_lengths, accepted_prefix
from app.engine.validation import RequestLimits, check_request
from app.model.dspark import DraftBlock
from app.model.loader import load_model
from app.model.model import DeepseekModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class _Flight:
    """A launched step: inputs, its logits on the device, and (once sampling is launched) the
    sampled rows and their host copy."""

    inputs: StepInputs
    logits: torch.Tensor
    features: torch.Tensor | None = None  # target features of inputs.feat_rows (DSpark)
    live: list[int] = field(default_factory=list)  # sample_items indices that were sampled
    host: HostSamples | None = None
    finished_while_in_flight: list[Sequence] = field(default_factory=list)
    draft_rows: dict[str, int] = field(default_factory=dict)  # request -> row of ``drafts``
    drafts: torch.Tensor | None = None  # [R, k] fp32 logits of the proposed blocks

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
    graph_steps: int = 0
    last_step_s: float = 0.0
    # cumulative host seconds per phase: schedule, prepare, launch (forward + sampling
    # launches; on CPU the compute itself), wait (blocked on a step's sampled tokens), update
    t_schedule: float = 0.0
    t_prepare: float = 0.0
    t_launch: float = 0.0
    t_wait: float = 0.0
    t_update: float = 0.0
    # speculative decoding: verify chunks, drafts they checked, drafts accepted (also per
    # draft position: accepted_at[j] = verifies whose draft j + 1 was accepted)
    spec_verifies: int = 0
    spec_drafts: int = 0
    spec_accepted: int = 0
    spec_accepted_at: list[int] = field(default_factory=list)
    spec_verify_tokens: int = 0  # tokens of verify chunks (1 + drafts each)
    # host KV tier (app.cache.host_tier; zero when off): admissions that loaded blocks back,
    # their tokens, bytes copied each way, summed load latency (issue -> ready), blocks held
    host_hits: int = 0
    host_hit_tokens: int = 0
    host_load_bytes: int = 0
    host_load_s: float = 0.0
    host_offload_bytes: int = 0
    host_blocks: int = 0
    # KV handoffs (app.engine.handoff): states exported and their bytes; handoffs installed,
    # and handoffs resumed as a local prefill (no state, or no room for it)
    kv_exports: int = 0
    kv_export_bytes: int = 0
    kv_imports: int = 0
    kv_import_local: int = 0

    def report(self) -> dict[str, float | int]:
        """Flat numbers for metrics: the counters, the draft acceptance per position
        (``spec_accepted_at_j``: verifies whose draft j was accepted) and the means:
        ``spec_accept_length`` tokens emitted per verify (accepted drafts + the bonus),
        ``spec_acceptance`` accepted / proposed drafts, ``spec_verify_tokens_per_step``."""
        out: dict[str, float | int] = {
            k: v for k, v in self.__dict__.items() if isinstance(v, int | float)
        }
        if self.spec_accepted_at:
            for j, n in enumerate(self.spec_accepted_at, 1):
                out[f"spec_accepted_at_{j}"] = n
            v, d = self.spec_verifies, self.spec_drafts
            out["spec_accept_length"] = (1 + self.spec_accepted / v) if v else 0.0
            out["spec_acceptance"] = self.spec_accepted / d if d else 0.0
            out["spec_verify_tokens_per_step"] = (
                self.spec_verify_tokens / self.steps if self.steps else 0.0
            )
        return out


def cache_extras(
    cfg: EngineConfig, model: DeepseekModel, own_drafter: bool = True
) -> tuple[int, int]:
    """-> (ring headroom, draft rings) of the cache layout: a verify of k drafts writes k
    rows past the window; the checkpoint's drafter keeps a context ring per draft stage
    (DSpark 3, MTP 1; none for a test proposer, ``own_drafter=False``)."""
    spec = cfg.speculative
    if spec is None:
        return 0, 0
    return spec.num_draft_tokens, (len(model.mtp) if own_drafter else 0)


def pool_blocks(budget: int, slots: int, layout: CacheLayout) -> int:
    """Usable KV blocks a budget of ``budget`` bytes buys after ``slots`` request slots (the
    trash slot and block are allocated beside the usable ones); raises when none."""
    num_blocks = (budget - (slots + 1) * layout.bytes_per_slot) // layout.bytes_per_block - 1
    if num_blocks < 1:
        raise EngineConfigError(
            f"KV budget of {budget} bytes holds no block after {slots} request slots "
            f"({layout.bytes_per_slot} B each); raise kv_cache_bytes or lower max_num_seqs"
        )
    return int(num_blocks)


def _stop_token_ids(model_dir: Path, cfg_eos: int) -> tuple[int, ...]:
    ids = {cfg_eos}
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


class EngineCore:
    """One DP rank's engine, usable without Ray."""

    def __init__(
        self, cfg: EngineConfig, model: DeepseekModel | None = None,
        proposer: Proposer | None = None, parallel: RankParallel | None = None,
    ) -> None:  # fmt: skip
        """``proposer``: drafts in place of the one ``cfg.speculative`` names (tests and
        benchmarks: the target's own continuation, random tokens). ``parallel``: this
        rank's expert-parallel gang (``app.engine.parallel``; the model loads its share)."""
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
                packed_dense=cfg.packed_dense_flag(),
                shard=parallel.shard if parallel is not None else None,
                expert_layout=cfg.expert_layout,
                prefill_act_fp8=cfg.moe_prefill_act == "fp8",
            )
            if parallel is not None:
                parallel.attach(model)
        self.parallel = parallel
        self.model = model
        mcfg = model.cfg
        tok_file = path / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
        self.eos_ids = _stop_token_ids(path, mcfg.eos_token_id)
        # ---- speculation: the drafter, verify headroom in the rings, draft context rings
        spec = cfg.speculative
        if spec is not None and proposer is None:
            check_speculation(spec, model)
        self.num_drafts = spec.num_draft_tokens if spec is not None else 0
        headroom, draft_stages = cache_extras(cfg, model, own_drafter=proposer is None)
        # ---- KV pool from the memory budget (one layout: allocation = accounting)
        layout = CacheManager.layout_for(model, cfg.cache, dtype, headroom, draft_stages)
        block_size = layout.block_size
        slots = cfg.scheduler.max_num_seqs
        num_blocks = pool_blocks(self._kv_budget(), slots, layout)
        limit = cfg.scheduler.max_model_len or mcfg.max_position_embeddings
        self.max_model_len = min(limit, mcfg.max_position_embeddings, num_blocks * block_size)
        self.cache = CacheManager(
            model, cfg.cache, num_blocks, slots, dtype, self.device,
            max_blocks_per_seq=-(-self.max_model_len // block_size), ring_headroom=headroom,
            draft_stages=draft_stages,
        )  # fmt: skip
        self.scheduler = Scheduler(cfg.scheduler, self.cache)
        self.proposer: Proposer | None = None
        # called with each step's proposed blocks: (request ids, anchors [R], the block)
        self.on_draft: Callable[[list[str], torch.Tensor, DraftBlock], None] | None = None
        if spec is not None:
            self.proposer = proposer or make_proposer(spec, model, self.cache.pools)
        self.overlap = cfg.overlap_schedule and self.proposer is None
        max_tok = cfg.scheduler.max_num_batched_tokens
        # an EP gang steps eagerly: its dense exchanges could be captured, but every rank
        # would have to replay the graph of one agreed bucket in lockstep (not built yet)
        self.runner = ModelRunner(
            model, self.cache, max_tok, self.device,
            cuda_graphs=cfg.cuda_graphs and not model.gang_exchanges,
            max_graph_batch=slots,
            features=self.proposer is not None and self.proposer.needs_features,
        )  # fmt: skip
        self.decoder_replay = cfg.cache.bounded_replay == "encoder+decoder"
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids, self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._exporting: set[str] = set()  # requests handed off after their first token
        self._kv_header: LayoutHeader | None = None
        self._grammar = None
        self._flight: _Flight | None = None
        self._prev_rows: dict[str, int] = {}  # request -> row of the last sample output
        self.stats = EngineStats(spec_accepted_at=[0] * self.num_drafts)
        # observability (app.engine.lifecycle, app.engine.metrics): phase events of traced
        # requests (registered here by request id before add_request, from any thread), and a
        # hook called after every step with (its schedule, its perf_counter start, seconds)
        self.traces: dict[str, RequestTrace] = {}
        self._num_traced = 0  # live requests with a trace: 0 = no tracing work in a step
        self.on_step: Callable[[SchedulerOutput, float, float], None] | None = None
        # Everything built so far (the model, the pools, the tokenizer) lives as long as the
        # engine: moved out of the collector's generations, so a collection scans only what the
        # steps allocate. (A host stall is device idle time under overlap; a full collection
        # is a suspect for the one 105 ms gap of the H200 W6 trace, not re-measured yet.)
        gc.collect()
        gc.freeze()
        logger.info(
            "engine: %d KV blocks of %d tokens (%.1f MiB), %d slots, max_model_len %d",
            num_blocks,
            block_size,
            num_blocks * layout.bytes_per_block / 2**20,
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
    def add_request(self, req: EngineRequest, export: bool = False) -> None:
        """Validate and queue a request; raises :class:`RequestError` naming the problem.
        ``export``: after its first token (unless that ends it) the request ends with finish
        reason HANDOFF and its decode state in the output (``app.engine.handoff``)."""
        seq = self.new_sequence(req)
        if export:
            self._exporting.add(req.request_id)
        self.queue_sequence(seq)

    def add_handoff(self, req: EngineRequest, handoff: Handoff) -> str | None:
        """Continue a request another engine prefilled (``app.engine.handoff``): None when
        its decode state was installed, else why it resumes as a local prefill."""
        why = import_state(self, req, handoff)
        if why is None:
            self.stats.kv_imports += 1
        else:
            self.stats.kv_import_local += 1
        return why

    def new_sequence(self, req: EngineRequest) -> Sequence:
        """A validated request's engine state (not queued yet)."""
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
        seq = Sequence(req=req, tokens=list(req.prompt_token_ids), matcher=matcher)
        seq.arrived = time.perf_counter()
        return seq

    def queue_sequence(self, seq: Sequence) -> None:
        """Register ``seq`` and put it in the waiting queue."""
        self._register(seq)
        self.scheduler.add(seq)

    def run_sequence(self, seq: Sequence) -> None:
        """Register ``seq``, whose cache is already in place, straight into the running batch."""
        self._register(seq)
        self.scheduler.running.append(seq)

    def _register(self, seq: Sequence) -> None:
        req = seq.req
        if self.traces and (trace := self.traces.pop(req.request_id, None)) is not None:
            seq.trace = trace
            self._num_traced += 1
            trace.event("queued", prompt_tokens=seq.num_prompt)
        self._seqs[req.request_id] = seq
        self.stats.prompt_tokens += len(req.prompt_token_ids)

    @property
    def kv_header(self) -> LayoutHeader:
        """The layout header of this engine's KV states (what an import must match)."""
        if self._kv_header is None:
            path = Path(self.cfg.model)
            fp = model_fingerprint(path) if path.is_dir() else repr(self.model.cfg)
            spec = self.cfg.speculative
            draft = f"{spec.method}:{spec.num_draft_tokens}" if spec is not None else ""
            self._kv_header = LayoutHeader.of(self.cache.layout, fp, draft)
        return self._kv_header

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
        return self.outputs.output(seq, [], None, finished=True)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs) or self._flight is not None

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns one output delta per request that advanced.

        Pipeline (overlap on), all device work on one stream:

            schedule + prepare N+1 (host)       launch forward N+1
            wait for N's sampled tokens (copy event) -> apply N: stops, grammar, outputs
            launch sampling of N+1 (penalties and grammar masks see token N)

        Requests that finished at N were already in N+1: they are not sampled and their
        blocks are freed once N+1 is done. With overlap off each step is launched, waited
        for and applied in the same call.
        """
        t0 = time.perf_counter()
        st = self.stats
        sched = self.scheduler.schedule()
        st.num_preemptions += len(sched.preempted)
        if self._num_traced:
            self._trace_schedule(sched, t0)
        t1 = time.perf_counter()
        inputs = None
        if sched.items:
            inputs = self.runner.prepare(sched.items, self.decoder_replay, self._prev_rows)
        if self.parallel is not None:  # every rank of a gang steps (idle: no tokens)
            n_tokens = sum(it.num_tokens for it in inputs.items) if inputs is not None else 0
            self.parallel.step(self.model, n_tokens, self.device)
        t2 = time.perf_counter()
        st.t_schedule += t1 - t0
        st.t_prepare += t2 - t1
        prev, launched = self._flight, None
        if inputs is not None:
            logits, feats = self.runner.forward_with_features(inputs)
            launched = self._flight = _Flight(inputs, logits, feats)
            st.graph_steps += inputs.graph
        else:
            self._flight = None
        t3 = time.perf_counter()
        st.t_launch += t3 - t2
        outs: list[RequestOutput] = []
        if prev is not None:
            outs = self._complete(prev)
        if launched is not None:
            t4 = time.perf_counter()
            self._launch_sampling(launched)
            st.t_launch += time.perf_counter() - t4
            if not self.overlap:
                self._flight = None
                outs += self._complete(launched)
        dt = time.perf_counter() - t0
        self._stats(dt)
        if self.on_step is not None:
            self.on_step(sched, t0, dt)
        return outs

    @staticmethod
    def _trace_schedule(sched: SchedulerOutput, t0: float) -> None:
        """Phase events of traced requests in this schedule (app.engine.lifecycle)."""
        for seq in sched.admitted:
            if seq.trace is not None:
                seq.trace.event("scheduled", cached_tokens=seq.num_cached,
                                queue_wait_s=round(t0 - seq.arrived, 6))  # fmt: skip
        for it in sched.items:
            seq = it.seq
            if seq.trace is not None and it.start < seq.num_prompt:
                seq.trace.event("prefill_chunk", start=it.start,
                                tokens=min(it.num_tokens, seq.num_prompt - it.start),
                                cached_tokens=seq.num_cached)  # fmt: skip
        for seq in sched.preempted:
            if seq.trace is not None:
                seq.trace.event("preempted", preemptions=seq.num_preemptions)

    def _complete(self, flight: _Flight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them."""
        t0 = time.perf_counter()
        host = flight.host.wait() if flight.host is not None else None
        t1 = time.perf_counter()
        self.stats.t_wait += t1 - t0
        self._release(flight)
        outs = self._update(flight, host)
        self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
        self.stats.t_update += time.perf_counter() - t1
        return outs

    @torch.inference_mode()
    def _launch_sampling(self, flight: _Flight) -> None:
        """Sample the live rows of a launched step (device), draft the next tokens of
        speculating requests, and start the copy of tokens (and drafts) to the host; the
        tokens stay on the device for the next step's pending inputs."""
        items, counts = flight.inputs.sample_items, flight.inputs.sample_counts
        live = [i for i, it in enumerate(items) if it.seq.finish_reason is None]
        flight.live = live
        offs = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        self._prev_rows = {}
        if not live:  # e.g. a step of prefill chunks only: their rows still feed the drafter
            if self.proposer is not None:
                none = np.zeros(0, np.int64)
                self._observe(flight, [], none, none, none, None, None)
            return
        rows = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in live])
        lc = np.asarray([counts[i] for i in live], dtype=np.int64)
        bases = np.concatenate(([0], np.cumsum(lc)[:-1])).astype(np.int64)
        for k, i in enumerate(live):  # pending input rows: the request's last sampled row
            self._prev_rows[items[i].seq.request_id] = int(bases[k] + lc[k] - 1)
        logits = flight.logits[: int(offs[-1])]
        if rows.size < offs[-1]:
            logits = logits[to_device(rows, logits.device)]
        live_items = [items[i] for i in live]
        res = self._sample(live_items, lc, logits)
        if self.overlap:  # the next step's pending input tokens (one row per request)
            self.runner.store_samples(res.tokens)
        extra = None
        if self.proposer is not None:
            extra = self._speculate(flight, live_items, bases, lc, res)
        flight.host = HostSamples(res, extra)

    def _speculates(self, seq: Sequence) -> bool:
        """Whether ``seq`` drafts (constrained requests decode one token at a time)."""
        return self.proposer is not None and seq.matcher is None

    def _speculate(
        self, flight: _Flight, items: list[Scheduled], bases: np.ndarray, counts: np.ndarray,
        res: SampleOutput,
    ) -> list[torch.Tensor]:  # fmt: skip
        """Device side of a step's verify: accepted lengths, the drafter's context of committed
        rows, the next drafts. Returns the tensors the host copies (m, and the drafts)."""
        dev, inp = res.tokens.device, flight.inputs
        m = accepted_lengths(res.accepted, bases, counts, dev)
        ends = np.asarray([it.start + it.num_tokens for it in items], dtype=np.int64)
        anchors = to_device(ends - counts, dev) + m  # last committed position
        bonus = res.tokens[to_device(bases, dev) + m]
        feats, where = self._observe(flight, items, ends, bases, counts, anchors, res.tokens)
        sel = [k for k, it in enumerate(items) if self._speculates(it.seq)]
        if not sel:
            return [m]
        idx = to_device(np.asarray(sel, dtype=np.int64), dev)
        seqs = [items[k].seq for k in sel]
        prompt = to_device(np.asarray([s.num_prompt for s in seqs], dtype=np.int64), dev)
        slots = to_device(np.asarray([self.cache.slot_of(s.request_id) for s in seqs]), dev)
        anchor_feats = None
        if feats is not None:  # the anchor's feature row: its item's rows are contiguous
            it_of = where[sel]
            first_row = np.searchsorted(inp.feat_item, it_of)
            first_pos = inp.feat_pos[first_row]
            host = first_row + (ends[sel] - counts[sel]) - first_pos
            anchor_feats = feats[to_device(host, dev) + m[idx]]
        block = self.proposer.propose(
            [s.request_id for s in seqs], slots, anchors[idx], bonus[idx], self.num_drafts,
            [s.req.params for s in seqs], anchors[idx] + 2 - prompt, anchor_feats,
        )  # fmt: skip
        if self.on_draft is not None:
            self.on_draft([s.request_id for s in seqs], anchors[idx], block)
        flight.draft_rows = {s.request_id: r for r, s in enumerate(seqs)}
        flight.drafts = block.logits
        return [m, block.ids]

    def _observe(
        self, flight: _Flight, items: list[Scheduled], ends: np.ndarray, bases: np.ndarray,
        counts: np.ndarray, anchors: torch.Tensor | None, sampled: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, np.ndarray]:  # fmt: skip
        """Feed the drafter the committed rows of a step: a sampling chunk's rows above its
        anchor are not committed (written to the trash slot). -> (the step's features or
        None, the step item of each sampled item)."""
        inp = flight.inputs
        index = {id(it): k for k, it in enumerate(inp.items)}
        where = np.asarray([index[id(it)] for it in items], np.int64)
        if flight.features is None or not inp.feat_rows.size:
            return None, where
        feats, dev = flight.features, flight.features.device
        big = np.iinfo(np.int64).max
        thr = torch.full((len(inp.items),), big, dtype=torch.int64, device=dev)
        if where.size:
            thr[to_device(where, dev)] = anchors
        item = to_device(inp.feat_item, dev)
        pos = to_device(inp.feat_pos, dev)
        slots = to_device(inp.spec.slots[inp.feat_item], dev)
        slots = torch.where(pos <= thr[item], slots, self.cache.pools.trash_slot)
        nxt = None
        if self.proposer.needs_next_tokens:
            nxt = self._next_tokens(inp, where, ends, bases, counts, sampled, dev)
        self.proposer.observe(slots, pos, feats, nxt)
        return feats, where

    @staticmethod
    def _next_tokens(
        inp: StepInputs, where: np.ndarray, ends: np.ndarray, bases: np.ndarray,
        counts: np.ndarray, sampled: torch.Tensor | None, dev: torch.device,
    ) -> torch.Tensor:  # fmt: skip
        """The token after each feature row (device [N]): a sampled row's own sample (for
        an accepted draft row that is the draft itself), else the next input token of the
        chunk, or of the prompt after a mid-prefill chunk."""
        spec, pos, item = inp.spec, inp.feat_pos, inp.feat_item
        B = spec.num_seqs
        flat0 = np.concatenate(([0], np.cumsum(spec.lens)[:-1]))
        first_sampled = spec.starts + spec.lens  # per step item; sampled items below
        base = np.zeros(B, np.int64)
        first_sampled[where] = ends - counts
        base[where] = bases
        is_s = pos >= first_sampled[item]
        sidx = np.where(is_s, base[item] + pos - first_sampled[item], -1)
        nxt_pos = pos + 1 - spec.starts[item]  # index of the next token within the chunk
        inside = nxt_pos < spec.lens[item]
        host = np.full(pos.size, -1, np.int64)
        ok = ~is_s & inside
        host[ok] = spec.ids[flat0[item[ok]] + nxt_pos[ok]]
        for r in np.flatnonzero(~is_s & ~inside):  # the last row of a mid-prefill chunk
            it = inp.items[item[r]]
            host[r] = it.seq.tokens[it.start + it.num_tokens]
        out = to_device(host, dev)
        if is_s.any():
            rows = np.flatnonzero(is_s)
            out[to_device(rows, dev)] = sampled[to_device(sidx[rows], dev)]
        return out

    def _release(self, flight: _Flight) -> None:
        """Free requests that finished while ``flight`` still used their blocks."""
        for seq in flight.finished_while_in_flight:
            self.scheduler.remove(seq)

    def _sample(
        self, items: list[Scheduled], counts: np.ndarray, logits: torch.Tensor
    ) -> SampleOutput:
        """One row per sampled position: a verify chunk's row j sees its drafts before j as
        output (penalties, min_tokens, seeded counters) and checks draft j + 1."""
        rows, constrained, drafts, lookups = [], [], [], []
        for it, c in zip(items, counts, strict=True):
            s = it.seq
            p = s.req.params
            n_out = len(s.tokens) - s.num_prompt
            eos = (() if p.ignore_eos else self.eos_ids) + tuple(p.stop_token_ids)
            d = s.drafts[: c - 1]
            if c > 1 and not p.greedy:
                lookups.append((len(rows), s.draft_logits[: c - 1]))
            for j in range(c):
                out_ids = s.output_ids + d[:j] if j else s.output_ids
                rows.append(RowState(p, s.req.prompt_token_ids, out_ids,
                                     mask_eos=n_out + j < p.min_tokens, eos_ids=eos))  # fmt: skip
                drafts.append(d[j] if j < c - 1 else -1)
            if s.matcher is not None:
                constrained.append(len(rows) - 1)
        apply = None
        if constrained:
            from app.engine.grammar import allocate_bitmask, apply_bitmask, fill_bitmasks

            mask = allocate_bitmask(len(constrained), self.model.cfg.vocab_size)
            matchers = [rows_seq.seq.matcher for rows_seq in items if rows_seq.seq.matcher]
            fill_bitmasks(matchers, mask, list(range(len(constrained))))

            def apply(lg: torch.Tensor) -> None:
                idx = to_device(np.asarray(constrained, dtype=np.int64), lg.device)
                sub = lg[idx]
                apply_bitmask(sub, mask.to(sub.device), list(range(len(constrained))))
                lg[idx] = sub

        if not any(t >= 0 for t in drafts):
            return sample(logits, rows, apply)
        draft_logits = None
        if lookups:
            draft_logits = torch.zeros_like(logits)
            for r0, lg in lookups:
                draft_logits[r0 : r0 + lg.shape[0]] = lg
        return sample(logits, rows, apply, np.asarray(drafts, dtype=np.int64), draft_logits)

    def _update(self, flight: _Flight, host) -> list[RequestOutput]:
        """Apply a finished step: advance requests, append tokens (a verify chunk's accepted
        drafts and its correction or bonus), roll back rejected positions, take the next
        drafts, emit outputs."""
        inputs = flight.inputs
        outs: list[RequestOutput] = []
        sampled: dict[str, tuple[int, int, int]] = {}  # request -> (live k, first row, rows)
        if host is not None:
            row = 0
            for k, i in enumerate(flight.live):
                c = inputs.sample_counts[i]
                sampled[inputs.sample_items[i].seq.request_id] = (k, row, c)
                row += c
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
            if rid in inputs.prompt_rows:
                first, pos = inputs.prompt_rows[rid]
                lg = flight.logits[first : first + len(pos)]
                plp = self.outputs.prompt_logprobs(seq, pos, lg, it.start)
            if rid not in sampled:
                self.cache.commit(rid, seq.tokens, seq.num_done)
                if plp is not None:
                    outs.append(self.outputs.output(seq, [], None, prompt_logprobs=plp))
                continue
            k, r0, c = sampled[rid]
            m = accepted_prefix(host.accepted[r0 : r0 + c - 1]) if c > 1 else 0
            if c > 1:
                self._count_verify(c - 1, m)
                # rejected drafts: their positions are computed again (app.engine.spec.verify)
                end = it.start + it.num_tokens - c + m + 1
                seq.num_computed = seq.num_done = end
            seq.drafts, seq.draft_logits = [], None
            new, lps = [], []
            want = seq.req.params.logprobs
            for r in range(r0, r0 + m + 1):
                tok = host.tokens[r]
                got = self.outputs.append(seq, tok)
                if got and want is not None:
                    top_ids = host.top_ids[r] if host.top_ids is not None else None
                    top_lp = host.top_logprobs[r] if host.top_logprobs is not None else None
                    lps.append(self.outputs.token_logprob(host.logprobs[r], top_ids, top_lp,
                                                          tok, want))  # fmt: skip
                new += got
                if seq.finish_reason is not None:
                    break
            self.cache.commit(rid, seq.tokens, min(seq.num_done, len(seq.tokens)))
            finished = seq.finish_reason is not None
            if not finished and rid in flight.draft_rows:
                self._take_drafts(seq, host.drafts[flight.draft_rows[rid]], flight, rid)
            out = self.outputs.output(seq, new, lps if new and want is not None else None,
                                      finished, plp)  # fmt: skip
            if new and not finished and rid in self._exporting:
                self._hand_off(seq, out)
                finished = True
            outs.append(out)
            if new and seq.trace is not None and not seq.trace.first_token:
                seq.trace.first_token = True
                seq.trace.event("first_token", output_tokens=len(seq.tokens) - seq.num_prompt)
            if finished:
                self._finish(seq)
        return outs

    def _hand_off(self, seq: Sequence, out: RequestOutput) -> None:
        """End an exporting request after its first token with its decode state (None when
        the export fails: the decode side then prefills it itself)."""
        try:
            out.handoff = state = export_state(self, seq)
            self.stats.kv_exports += 1
            self.stats.kv_export_bytes += state.nbytes
        except Exception:
            logger.exception("request %s: KV export failed", seq.request_id)
        seq.finish_reason = FinishReason.HANDOFF
        out.finished, out.finish_reason = True, FinishReason.HANDOFF

    def _take_drafts(self, seq: Sequence, ids: list[int], flight: _Flight, rid: str) -> None:
        """The next step verifies up to k drafts: as many as max_tokens and the context
        limit leave room for after them (a verify emits up to drafts + 1 tokens)."""
        k = self.num_drafts
        n_out = len(seq.tokens) - seq.num_prompt
        if seq.req.params.max_tokens is not None:
            k = min(k, seq.req.params.max_tokens - n_out - 1)
        k = min(k, self.max_model_len - len(seq.tokens) - 1)
        if k > 0:
            seq.drafts = list(ids[:k])
            seq.draft_logits = flight.drafts[flight.draft_rows[rid]]

    def _count_verify(self, drafts: int, accepted: int) -> None:
        st = self.stats
        st.spec_verifies += 1
        st.spec_drafts += drafts
        st.spec_accepted += accepted
        st.spec_verify_tokens += drafts + 1
        for j in range(accepted):
            st.spec_accepted_at[j] += 1

    def _finish(self, seq: Sequence) -> None:
        """Forget a finished request; free its KV now, or once the step in flight is done."""
        self._seqs.pop(seq.request_id, None)
        self._exporting.discard(seq.request_id)
        if seq.trace is not None:
            self._num_traced -= 1
            reason = seq.finish_reason.value if seq.finish_reason is not None else "unknown"
            seq.trace.finish(reason, len(seq.tokens) - seq.num_prompt, seq.num_cached)
            seq.trace = None
        flight = self._flight
        if flight is not None and any(it.seq is seq for it in flight.items):
            flight.finished_while_in_flight.append(seq)
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
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

    def _stats(self, dt: float) -> None:
        s = self.stats
        s.steps += 1
        s.last_step_s = dt
        s.num_running = len(self.scheduler.running)
        s.num_waiting = self.scheduler.num_waiting
        s.num_free_blocks = self.cache.num_free_blocks
        s.kv_usage = self.cache.pool.usage
        if self.cache.index is not None:
            s.prefix_hit_tokens = self.cache.index.stats.hit_tokens
        if (host := self.cache.host) is not None:
            h = host.stats
            s.host_hits, s.host_hit_tokens = h.hits, h.hit_tokens
            s.host_load_bytes, s.host_load_s = h.load_bytes, h.load_s
            s.host_offload_bytes, s.host_blocks = h.offload_bytes, host.num_used
