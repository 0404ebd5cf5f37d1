"""An engine's start-up on its device, in this order, each phase logged with its seconds
(kept in ``EngineStats.startup_*``):

    weights        load the checkpoint (the loader's progress bar; a line with seconds, GiB)
    memory profile on a CUDA device without ``kv_cache_bytes`` (:func:`profile`): a probe
                   engine on a minimal pool measures the activation peak and the CUDA
                   graphs; the pool takes what ``gpu_memory_utilization`` of the card leaves
                   (``app.engine.capacity.DeviceMemory``); one line per part, in GiB
    CUDA graphs    every graph key the serving paths reach, captured now (:func:`capture`)
    warm-up        synthetic requests through the real step (``app.engine.warmup``): every
                   Triton specialization is compiled before the first request, then
                   everything is freed, the prefix cache cleared and the counters reset

A rank's constructor returns after the warm-up, so Serve marks it ready (and the ingress
``/health`` says ready) only then. A CPU engine loads and sizes as before (kv_cache_bytes or
``DEFAULT_CPU_KV_BYTES``) and skips profile, graphs and warm-up.

The activation peak is the largest of three measured steps (``max_memory_allocated`` over
what was allocated before):
    a prefill of ``max_num_batched_tokens`` tokens with prompt logprobs (logits of every
    row), a decode (verify) batch of ``max_num_seqs`` requests with top logprobs, filters and
    penalties, both real requests on the probe; and one chunk of ``max_num_batched_tokens``
    at the end of the longest context, a step over trash blocks (the indexer scores every
    visible compressed entry: its transients grow with the context). When that chunk does
    not fit within the utilization, the context halves until it does and ``max_model_len``
    is capped there.
The CUDA graphs' memory is measured on the probe: the largest key of each verify width
(the shared pool's high-water mark and the shared outputs) and a few of the smallest (each
graph's own cost), extrapolated to every key by their static input buffers; a speculating
engine's draft-step graphs (``app.engine.spec.graphs``) the same way: the largest bucket's
and the smallest's, the others (per bucket the greedy and plain random kinds start-up
captures, and the warm-up's mixed one) at the smallest's cost.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from app.cache.layout import CacheLayout
from app.config import EngineConfig, EngineConfigError
from app.engine.batch import StepSpec
from app.engine.capacity import (
    TORCH_DTYPES,
    DeviceMemory,
    PoolSize,
    gib,
    kv_budget,
    pool_bytes,
    pool_layout,
    size_pool,
)
from app.engine.graphs import CudaGraphRunner, width_buckets
from app.engine.parallel import RankParallel
from app.engine.request import MAX_TOP_LOGPROBS, EngineRequest, SamplingParams
from app.engine.runner import ModelRunner, capturable
from app.engine.spec.graphs import DraftGraphs
from app.engine.warmup import Engine, drive, params, prompt, warm_up
from app.model.checkpoint import LoadFormatError
from app.model.loader import load_model
from app.model.model import DeepseekModel

logger = logging.getLogger(__name__)
PROGRESS_S = 5.0  # a graph-capture progress line at most this often


Probe = Callable[[EngineConfig], Engine]  # builds a probe engine (no start-up of its own)


class Startup:
    """One engine's start-up (module doc): its phases' seconds and what it measured.
    ``quiet``: a probe engine's (no lines)."""

    def __init__(self, device: torch.device, quiet: bool = False) -> None:
        self.device, self.quiet = device, quiet
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.memory: DeviceMemory | None = None
        self.size: PoolSize | None = None
        self.graphs_held = 0  # bytes the captured CUDA graphs hold (measured after capture)

    def log(self, msg: str, *args: object) -> None:
        if not self.quiet:
            logger.info("start-up: " + msg, *args)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[list[str]]:
        """Time the phase ``name``; the body appends notes for its closing line."""
        self.log("%s ...", name)
        t, notes = time.perf_counter(), []
        yield notes
        if self.cuda:
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t
        self.seconds[name] = self.seconds.get(name, 0.0) + dt
        self.log("%s done in %.1f s%s", name, dt, "".join(f"; {n}" for n in notes))

    def load(self, cfg: EngineConfig, parallel: RankParallel | None) -> DeepseekModel:
        """The checkpoint of ``cfg`` on this device (this rank's experts in a gang; random
        weights of its shapes with ``load_format: dummy``)."""
        with self.phase("weights") as notes:
            try:
                model = load_model(
                    Path(cfg.model), self.device, TORCH_DTYPES[cfg.dtype],
                    kv_quant=cfg.cache.kv_quant, packed_experts=cfg.packed_experts_flag(),
                    packed_dense=cfg.dense_weights_packed(), dense_act=cfg.dense_act,
                    expert_act=cfg.expert_act,
                    shard=parallel.shard if parallel is not None else None,
                    expert_layout=cfg.expert_layout,
                    prefill_act_fp8=cfg.moe_prefill_act == "fp8",
                    load_format=cfg.load_format, seed=cfg.seed,
                )  # fmt: skip
            except LoadFormatError as e:  # the option does not fit the directory
                raise EngineConfigError(str(e)) from e
            if parallel is not None:
                parallel.attach(model)
            notes.append(gib(model_bytes(model)))
        return model

    def pool(
        self, cfg: EngineConfig, model: DeepseekModel, own_drafter: bool, probe: Probe
    ) -> PoolSize:
        """The KV pool: from ``kv_cache_bytes`` (or the CPU default), else measured
        (:func:`profile`, on a probe engine that ``probe`` builds); on CUDA the memory line
        with every part."""
        budget, slots = kv_budget(cfg), cfg.scheduler.max_num_seqs
        if budget is not None:
            self.size = size_pool(cfg, model, budget, own_drafter)
            if self.cuda:
                self.log("memory: weights %s, KV pool %s (kv_cache_bytes: %s)",
                         gib(model_bytes(model)), gib(self.size.pool_bytes(slots)),
                         self.size.describe(slots))  # fmt: skip
            return self.size
        with self.phase("memory profile") as notes:
            self.memory, context = profile(cfg, model, own_drafter, probe, self.log)
            self.size = size_pool(cfg, model, self.memory.check_budget(), own_drafter, context)
            notes.append(f"KV budget {gib(self.memory.kv_budget)}")
        self.log("memory: %s", self.memory.describe(self.size, slots))
        return self.size

    def finish(self, core: Engine) -> None:
        """CUDA graphs and warm-up (CUDA only), then what is in use on the device and the
        seconds of every phase in ``core.stats``."""
        if self.cuda:
            before = used_bytes(self.device)
            with self.phase("CUDA graphs") as notes:
                n = capture(core, self.log)
                held = self.graphs_held = used_bytes(self.device) - before
                est = f" (estimated {gib(self.memory.graphs)})" if self.memory else ""
                notes.append(f"{n} graphs, {gib(held)}{est}")
        with self.phase("warm-up") as notes:
            n_req, n_steps = warm_up(core)
            notes.append(f"{n_req} requests in {n_steps} steps" if n_req else "none on the CPU")
        self._memory_line(core)
        st, s = core.stats, self.seconds
        st.startup_load_s = s.get("weights", 0.0)
        st.startup_profile_s = s.get("memory profile", 0.0)
        st.startup_graphs_s = s.get("CUDA graphs", 0.0)
        st.startup_warmup_s = s.get("warm-up", 0.0)
        st.startup_s = time.perf_counter() - self.t0
        self.log("ready in %.1f s (%s)", st.startup_s,
                 ", ".join(f"{k} {v:.1f} s" for k, v in s.items()))  # fmt: skip

    def _memory_line(self, core: Engine) -> None:
        """What is in use on the device after the warm-up, checked against the
        utilization."""
        if not self.cuda:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        self.log("in use on the device after warm-up: %s of %s", gib(total - free), gib(total))
        if self.memory is not None and total - free > self.memory.limit:
            logger.warning("start-up: %s in use on the device, over gpu_memory_utilization's "
                           "%s (another process, or a part measured short)",
                           gib(total - free), gib(self.memory.limit))  # fmt: skip


# ---- measuring ------------------------------------------------------------------------------
def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once)."""
    seen: dict[int, int] = {}
    for t in (*model.parameters(), *model.buffers()):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def used_bytes(device: torch.device) -> int:
    """Memory in use on the device once this process's unused cached blocks are returned
    (``mem_get_info``: every process on the card, the CUDA context included)."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def peak_bytes(device: torch.device, fn: Callable[[], object]) -> int:
    """The most memory ``fn`` allocated on top of what was allocated before it."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base)


def profile(
    cfg: EngineConfig, model: DeepseekModel, own_drafter: bool, probe: Probe,
    log: Callable[..., None],
) -> tuple[DeviceMemory, int | None]:  # fmt: skip
    """Measure the parts of :class:`DeviceMemory` (module doc) -> (them, the longest
    context the activations were profiled for when below the configured one, else None)."""
    dev, s = torch.device(cfg.device), cfg.scheduler
    mpe = model.cfg.max_position_embeddings
    upper = min(s.max_model_len or mpe, mpe)
    T, B = min(s.max_num_batched_tokens, upper - 1), s.max_num_seqs
    layout, _, _ = pool_layout(cfg, model, own_drafter)
    k = cfg.speculative.num_draft_tokens if cfg.speculative is not None else 0
    blocks = -(-(T + 2 + k) // layout.block_size) + B + 2  # the long prompt; a block each
    probe_bytes = pool_bytes(layout, B, blocks)
    probe_cache = replace(cfg.cache, kv_cache_bytes=probe_bytes, host_bytes=0,
                          enable_prefix_caching=False)  # fmt: skip
    core = probe(replace(cfg, cuda_graphs=False, cache=probe_cache))
    act, graphs, context = _measure(core, cfg.cuda_graphs, layout, T, upper, probe_bytes, log)
    del core
    total = torch.cuda.mem_get_info(dev)[1]
    mem = DeviceMemory(total, used_bytes(dev), model_bytes(model), act, graphs,
                       cfg.cache.gpu_memory_utilization)  # fmt: skip
    return mem, (context if context < upper else None)


def _measure(
    core: Engine, graphs_on: bool, layout: CacheLayout, T: int, upper: int, probe_bytes: int,
    log: Callable[..., None],
) -> tuple[int, int, int]:  # fmt: skip
    """On the probe (its own graphs off): (activation peak, the CUDA graphs of the engine
    (``graphs_on``), the longest context whose chunk fits)."""
    cfg, dev, B = core.cfg, core.device, core.cfg.scheduler.max_num_seqs
    k = cfg.speculative.num_draft_tokens if cfg.speculative is not None else 0
    act = _profile_requests(core, T, k)
    log("activation peak of the largest steps: %s", gib(act))
    widths = width_buckets(-(-upper // layout.block_size), 1 << 62)
    graphs = _graph_bytes(core, T, widths) if graphs_on else 0
    limit = int(cfg.cache.gpu_memory_utilization * torch.cuda.mem_get_info(dev)[1])
    in_use = used_bytes(dev) - probe_bytes
    context = upper
    while context > T:  # a chunk at the end of the longest context that fits
        try:
            long = peak_bytes(dev, lambda c=context: long_chunk(core.runner, T, c, core.parallel))
        except torch.cuda.OutOfMemoryError:
            long = None
        need = pool_bytes(layout, B, -(-context // layout.block_size))
        if long is not None and limit - in_use - max(act, long) - graphs >= need:
            log("activation peak of a %d-token chunk at context %d: %s", T, context, gib(long))
            act = max(act, long)
            break
        if core.parallel is not None:  # a gang steps in lockstep: no retries
            raise EngineConfigError(f"a {T}-token chunk at context {context} does not fit "
                                    "in gpu_memory_utilization: set max_model_len")  # fmt: skip
        log("a %d-token chunk at context %d does not fit: trying %d", T, context, context // 2)
        context = max(T, context // 2)
    return act, graphs, context


def _profile_requests(core: Engine, T: int, k: int) -> int:
    """The activation peak of the probe's real largest steps (module doc)."""
    vocab, B = core.model.cfg.vocab_size, core.cfg.scheduler.max_num_seqs
    n_lp = min(MAX_TOP_LOGPROBS, vocab - 1)
    rng = np.random.default_rng(0)
    big = SamplingParams(max_tokens=1, prompt_logprobs=n_lp, logprobs=n_lp, ignore_eos=True)
    prefill = [EngineRequest("profile-prefill", prompt(rng, vocab, T), big)]
    batch = [EngineRequest(f"profile-{i}", prompt(rng, vocab, 1), params(i, 2 + k, vocab))
             for i in range(B)]  # fmt: skip
    return max(peak_bytes(core.device, lambda: drive(core, prefill)),
               peak_bytes(core.device, lambda: drive(core, batch)))  # fmt: skip


def _graph_bytes(core: Engine, T: int, widths: list[int]) -> int:
    """What the CUDA graphs of every key of ``core`` will hold (module doc)."""
    model = core.model
    if model.gang_exchanges or not capturable(model):
        return 0
    max_q = 1 + core.cache.layout.ring - model.cfg.sliding_window
    qs = verify_widths(core.cfg, max_q)
    drafts = None
    if core.spec is not None and core.spec.steps is not None:  # the probe's, without a pool
        s = core.spec.steps
        drafts = DraftGraphs(s.proposer, s.k, s.buckets[-1], s.trash_slot, s.device, s.dtype)
    return graph_bytes(core.runner, core.cfg.scheduler.max_num_seqs, qs, T, widths, drafts)


def graph_bytes(
    runner: ModelRunner, max_batch: int, qs: tuple[int, ...], max_tokens: int,
    widths: list[int], drafts: DraftGraphs | None = None,
) -> int:  # fmt: skip
    """Bytes the CUDA graphs of every key (:func:`app.engine.graphs.graph_keys`) will hold,
    measured with ``runner``'s model and pools (the graphs are captured, then dropped): the
    largest key of each verify width (the shared pool's high-water mark and the shared
    outputs), a few of the smallest (each graph's own cost beyond its input buffer), the
    other keys extrapolated by their input buffers. With ``drafts`` (a speculating engine's
    draft step, no pool yet) its graphs too, in the same pool: the largest bucket's and the
    smallest's, the others (three per bucket) at the smallest's cost."""
    max_q = 1 + runner.cache.layout.ring - runner.model.cfg.sliding_window
    g = CudaGraphRunner(runner.model, runner.builder, max_batch, runner.features, max_q)
    keys = g.keys(qs, max_tokens, widths)
    if not keys:
        return 0
    largest = [next(k for k in keys if k[1] == q) for q in sorted({k[1] for k in keys})]
    smallest = [k for k in keys[::-1] if k not in largest][:4]
    u0 = used_bytes(runner.device)
    for key in largest:
        g.capture(key, runner.sampled)
    u1 = used_bytes(runner.device)
    for key in smallest:
        g.capture(key, runner.sampled)
    u2 = used_bytes(runner.device)
    own = max(0, u2 - u1 - sum(g.input_bytes(k) for k in smallest)) // max(1, len(smallest))
    rest = sum(g.input_bytes(k) + own for k in keys if k not in g.graphs)
    if drafts is not None:
        drafts.use_pool(g.pool)
        dkeys = drafts.start_keys()
        drafts.capture(dkeys[0])
        u3 = used_bytes(runner.device)
        if len(dkeys) > 1:
            drafts.capture(dkeys[-1])
        u4 = used_bytes(runner.device)
        # the others at the smallest's cost, and per bucket the graph of the warm-up's
        # mixed batches (app.engine.warmup)
        rest += max(0, u4 - u3) * max(0, len(dkeys) - 2 + len(drafts.buckets))
        u2 = u4
        del drafts
    del g
    return u2 - u0 + rest


def long_chunk(
    runner: ModelRunner, T: int, context: int, parallel: RankParallel | None = None
) -> None:
    """One forward of a ``T``-token chunk ending at ``context``, over trash blocks (their
    values do not matter; the shapes and positions are a real chunk's). ``parallel``: the
    gang's agreement first (every rank runs it)."""
    model, pools, P = runner.model, runner.cache.pools, runner.cache.block_size
    start, W = context - T, model.cfg.sliding_window
    one = np.ones(1, np.int64)
    spec = StepSpec(
        slots=one * pools.trash_slot, starts=one * start, lens=one * T,
        floors=one * max(0, start - W), cached=one * start, decoder_floors=one * 0,
        history=np.full((1, runner.n_back), -1, np.int64), ids=np.zeros(T, np.int64),
        pending=np.full(T, -1, np.int64), logit_rows=np.arange(T, dtype=np.int64),
        tables=np.full((1, -(-context // P)), pools.trash_block, np.int64),
    )  # fmt: skip
    if parallel is not None:
        parallel.step(model, T, runner.device)
    with torch.inference_mode():
        batch = runner.builder.build(spec, runner.sampled)
        model(batch, [] if runner.features else None)


# ---- graphs ---------------------------------------------------------------------------
def verify_widths(cfg: EngineConfig, max_q: int) -> tuple[int, ...]:
    """Tokens per request of a graph step: 1, and 1 + k when speculating (within the
    ring's verify headroom ``max_q``)."""
    k = cfg.speculative.num_draft_tokens if cfg.speculative is not None else 0
    return (1,) + ((1 + k,) if k and 1 + k <= max_q else ())


def capture(core: Engine, log: Callable[..., None]) -> int:
    """Capture every CUDA-graph key of ``core`` (largest first), then the draft step's of a
    speculating engine (``app.engine.spec.graphs``: greedy and plain random draws per batch
    bucket), with progress lines -> how many."""
    runner = core.runner
    if runner.graphs is None:
        return 0
    max_q = 1 + core.cache.layout.ring - core.model.cfg.sliding_window
    keys = runner.graph_keys(verify_widths(core.cfg, max_q))
    drafts = core.spec.steps if core.spec is not None else None
    dkeys = drafts.start_keys() if drafts is not None and drafts.pool is not None else []
    n = len(keys) + len(dkeys)
    t0 = last = time.perf_counter()
    for i, key in enumerate(keys, 1):
        runner.capture_graph(key)
        now = time.perf_counter()
        if now - last >= PROGRESS_S or i == n:
            last = now
            log("CUDA graphs %d / %d (batch %d, %d tokens each, width %d), %.1f s", i, n,
                *key, now - t0)  # fmt: skip
    for i, key in enumerate(dkeys, len(keys) + 1):
        drafts.capture(key)
        now = time.perf_counter()
        if now - last >= PROGRESS_S or i == n:
            last = now
            log("CUDA graphs %d / %d (draft step, batch %d, %s), %.1f s", i, n, key[0],
                "random" if key[1].random else "greedy", now - t0)  # fmt: skip
    return n
