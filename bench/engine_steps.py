"""Engine-step benchmarks (PERFORMANCE.md W1, W2, W6).

    python -m bench.engine_steps [--device cpu|cuda] [--batches 1,32,256] [--steps 8]
    python -m bench.engine_steps --model flash-rank [--what decode,prefill,gap,profile,origins]
        [--batches 1,8,32,64,128,256] [--contexts 4096,32768] [--quick]

``--model tiny`` (default): the tiny V4.1 checkpoint through the whole EngineCore: host time
per decode step (schedule, prepare, launch, wait, update) and wall per step with overlap off
and on. ``--model flash-rank`` (CUDA): the scaled V4.1-Flash rank of ``bench.flash_rank``:

- decode (``engine.decode_step``): B requests at context L, one decode step (or a verify step
  of 1 + 3 tokens per request), CUDA graph on and off; the model step plus greedy sampling
  timed with CUDA events (median of repeats), beside its floor (bytes / measured copy BW);
- prefill (``engine.prefill_step``): requests at long context prefilling their last chunk
  (4K-32K new tokens per GPU), with and without V4.1 decoder replay;
- gap (``engine.idle_gap``, ``engine.step_wall``): the EngineCore decoding B requests
  (``--gap-batches``, default 256) with graphs, overlap scheduling on and / or off
  (``--gap-overlap on,off``): wall per step, then the device's idle time between
  consecutive steps from a profiler trace, and host time;
- profile (``engine.decode_ops``): device time per kernel family of one decode step;
- origins (``engine.decode_aten_launches``): the eager step's aten kernel launches by the
  function (under app/ or kernels/) whose op launched them.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import tempfile
import time

import numpy as np
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.tiny import make_tiny_checkpoint
from bench.common import record, write
from bench.flash_rank import DENSE_MODES

PHASES = ("t_schedule", "t_prepare", "t_launch", "t_wait", "t_update")


# ---- tiny: the whole engine -------------------------------------------------------------------
def measure(path: str, device: str, batch: int, steps: int, overlap: bool) -> dict[str, float]:
    eng = EngineCore(
        EngineConfig.from_options(
            path,
            device=device,
            overlap_schedule=overlap,
            max_num_seqs=batch,
            max_num_batched_tokens=max(256, 16 * batch),
            kv_cache_bytes=1 << 28,
        )
    )
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = tuple(torch.randint(3, 500, (16,), generator=g).tolist())
        eng.add_request(EngineRequest(f"b{i}", ids, params))
    for _ in range(3):  # prefill + warm-up decode steps (graph capture)
        eng.step()
    before = {p: getattr(eng.stats, p) for p in PHASES}
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - t0) / steps
    eng.close()  # nothing of this engine may run while the next one starts
    out = {p: (getattr(eng.stats, p) - before[p]) / steps for p in PHASES}
    out["wall"] = wall
    return out


def tiny(args) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp, arch="v41", seed=0)
        print(f"{'B':>4} {'sched':>8} {'prep':>8} {'launch':>8} {'wait':>8} {'update':>8} "
              f"{'wall off':>9} {'wall on':>9}  (ms/step)")  # fmt: skip
        for b in (int(x) for x in args.batches.split(",")):
            off = measure(tmp, args.device, b, args.steps, overlap=False)
            on = measure(tmp, args.device, b, args.steps, overlap=True)
            params = {"batch": b, "device": args.device, "model": "tiny v41 (8 layers)"}
            for name, v in (
                ("engine.schedule_per_step", off["t_schedule"]),
                ("engine.prepare_per_step", off["t_prepare"]),
                ("engine.launch_per_step", off["t_launch"]),
                ("engine.wait_per_step", off["t_wait"]),
                ("engine.update_per_step", off["t_update"]),
                ("engine.step_wall_overlap_off", off["wall"]),
                ("engine.step_wall_overlap_on", on["wall"]),
            ):
                records.append(record(name, v * 1e3, "ms", params))
            print(f"{b:>4} {off['t_schedule'] * 1e3:8.3f} {off['t_prepare'] * 1e3:8.3f} "
                  f"{off['t_launch'] * 1e3:8.3f} {off['t_wait'] * 1e3:8.3f} "
                  f"{off['t_update'] * 1e3:8.3f} {off['wall'] * 1e3:9.2f} "
                  f"{on['wall'] * 1e3:9.2f}", flush=True)  # fmt: skip
    return records


# ---- flash-rank: one model step at a time -------------------------------------------------------
def copy_bandwidth() -> float:
    """Measured device copy bandwidth (bytes read + written per second)."""
    from triton.testing import do_bench

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def matmul_rate() -> float:
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


class Rank:
    """The flash-rank model with a cache, a runner and synthetic requests at a context.
    ``kv_bytes`` None: the pool the engine's sizing gives (``app.engine.startup``): 0.9 of
    the card less what is in use, the activation peak of this bench's largest step (a chunk
    of ``max_tokens`` at ``context``) and its CUDA graphs, measured on a probe pool."""

    def __init__(
        self, max_seqs: int, kv_bytes: int | None, ep: int, max_tokens: int, model=None,
        device="cuda", dense: str = "bf16", ring_headroom: int = 3, draft_stages: int = 0,
        context: int = 36864, expert_act: str = "bf16",
    ) -> None:  # fmt: skip
        from app.cache.manager import CacheManager
        from app.config import CacheConfig
        from app.engine.runner import ModelRunner
        from bench.flash_rank import build_flash_rank

        t0 = time.perf_counter()
        self.device, self.ep = torch.device(device), ep
        self.model = (build_flash_rank(device, ep=ep, dense=dense, expert_act=expert_act)
                      if model is None else model)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            print(f"built flash-rank in {time.perf_counter() - t0:.1f} s, "
                  f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)  # fmt: skip
        cc = CacheConfig(block_size=64, enable_prefix_caching=False, bounded_replay="off")
        # ring headroom 3: verify steps of 1 + 3 tokens per request read the ring directly
        # and run as CUDA graphs; ``draft_stages``: DSpark context rings (bench.spec_decode)
        h = ring_headroom

        def cache(n_blocks: int) -> CacheManager:
            return CacheManager(self.model, cc, n_blocks, max_seqs, torch.bfloat16, device,
                                max_blocks_per_seq=4096, ring_headroom=h,
                                draft_stages=draft_stages)  # fmt: skip

        layout = CacheManager.layout_for(self.model, cc, torch.bfloat16, h, draft_stages)
        if kv_bytes is None:
            kv_bytes = _measured_kv_bytes(self.model, ModelRunner(self.model, cache(8),
                                          max_tokens, self.device), max_seqs, h, context)
        blocks = (kv_bytes - (max_seqs + 1) * layout.bytes_per_slot) // layout.bytes_per_block
        self.mgr = cache(int(blocks) - 1)
        self.runner = ModelRunner(self.model, self.mgr, max_tokens, self.device,
                                  cuda_graphs=True, max_graph_batch=max_seqs)  # fmt: skip
        self._randomize_cache()
        self.n = 0

    def release(self) -> None:
        """Drop the pool and the graphs (the model stays): another engine sizes itself on
        what is left."""
        del self.mgr, self.runner
        gc.collect()
        torch.cuda.empty_cache()

    def _randomize_cache(self) -> None:
        """KV pools hold random codes (what a decode step reads; values do not change cost)."""
        dev = self.device
        g = torch.Generator(device=dev).manual_seed(7)
        p = self.mgr.pools
        for rows in [*p.window, *p.draft, *p.entries.values(), *p.keys.values()]:
            d = rows.data.view(torch.uint8)
            d.copy_(torch.randint(0, 256, d.shape, dtype=torch.uint8, device=dev, generator=g))
            if rows.fmt == "fp8":  # finite e4m3 codes only (0x7f / 0xff are NaN)
                d.bitwise_and_(0x77)
            sc = rows.scale.view(torch.uint8)
            sc.fill_(0x30 if rows.fmt == "nvfp4" else 127 - 4)
        for kv, gate in p.tails.values():
            kv.normal_(generator=g)
            gate.normal_(generator=g)

    def requests(self, batch: int, ctx: int, new: int = 1) -> tuple:
        """``batch`` fresh requests with ``ctx`` positions already in the cache; -> (ids,
        slots, tables width)."""
        rids = []
        for _ in range(batch):
            rid = f"q{self.n}"
            self.n += 1
            self.mgr.admit(rid, [5] * (ctx + new), use_prefix_cache=False)
            self.mgr.ensure(rid, ctx + new)
            rids.append(rid)
        return rids

    def free(self, rids) -> None:
        for r in rids:
            self.mgr.free(r)

    def spec(self, rids, ctx: int, q: int, dec_floor: int = 0):
        from app.engine.batch import StepSpec

        B = len(rids)
        slots = np.array([self.mgr.slot_of(r) for r in rids], dtype=np.int64)
        width = max(self.mgr.num_blocks_of(r) for r in rids)
        T = B * q
        rows = np.arange(q - 1, T, q) if q == 1 or dec_floor else np.arange(T)
        return StepSpec(
            slots=slots, starts=np.full(B, ctx), lens=np.full(B, q),
            floors=np.zeros(B, np.int64), cached=np.full(B, ctx),
            decoder_floors=np.full(B, dec_floor, np.int64),
            history=np.full((B, 3), 7, np.int64), ids=np.full(T, 11, np.int64),
            pending=np.full(T, -1, np.int64), logit_rows=rows.astype(np.int64),
            tables=self.mgr.tables[slots, :width],
        )  # fmt: skip


def _measured_kv_bytes(model, probe, max_seqs: int, headroom: int, context: int) -> int:
    """The engine's pool sizing (``app.engine.capacity.DeviceMemory``) for a Rank, measured
    with ``probe`` (a runner on a small pool, dropped after)."""
    from app.engine.capacity import DeviceMemory
    from app.engine.graphs import width_buckets
    from app.engine.startup import graph_bytes, long_chunk, model_bytes, peak_bytes, used_bytes

    dev, T = probe.device, probe.max_tokens
    act = peak_bytes(dev, functools.partial(long_chunk, probe, T, context))
    widths = width_buckets(-(-context // probe.cache.block_size), probe.cache.tables.shape[1])
    graphs = graph_bytes(probe, max_seqs, (1, 1 + headroom), T, widths)
    del probe
    total = torch.cuda.mem_get_info(dev)[1]
    mem = DeviceMemory(total, used_bytes(dev), model_bytes(model), act, graphs, 0.9)
    print(f"KV pool: {mem.check_budget() / 2**30:.1f} GiB = 0.9 x {total / 2**30:.1f} GiB less "
          f"in use {mem.in_use / 2**30:.1f}, a {T}-token chunk at context {context} "
          f"{act / 2**30:.1f}, CUDA graphs {graphs / 2**30:.1f} GiB", flush=True)  # fmt: skip
    return mem.check_budget()


def _time(fn, reps: int) -> float:
    """Median seconds of ``fn`` (CUDA events around each call)."""
    fn()
    if not torch.cuda.is_available():  # CPU smoke runs of this script
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def decode(rank: Rank, args, bw: float) -> list[dict]:
    from app.engine.runner import StepInputs
    from bench.flash_rank import decode_bytes

    records = []
    print(f"{'ctx':>6} {'B':>4} {'q':>2} {'graph':>8} {'eager':>8} {'floor':>7} {'spec':>7} "
          f"{'x floor':>7} {'x spec':>7}  (ms)", flush=True)  # fmt: skip
    for ctx in (int(c) for c in args.contexts.split(",")):
        for B in (int(b) for b in args.batches.split(",")):
            verify = (4,) if str(B) in args.verify_batches.split(",") else ()
            for q in (1, *verify):
                need = B * (-(-(ctx + q) // 64)) * rank.mgr.layout.bytes_per_block
                if need > 0.9 * rank.mgr.pool.num_blocks * rank.mgr.layout.bytes_per_block:
                    print(f"{ctx:>6} {B:>4} {q:>2}  skipped: KV of {need / 2**30:.1f} GiB")
                    continue
                rids = rank.requests(B, ctx, q)
                spec = rank.spec(rids, ctx, q)
                res = {}
                for graph in (True, False):
                    headroom = rank.mgr.layout.ring - rank.model.cfg.sliding_window
                    if not graph and args.no_eager:
                        res[graph] = float("nan")
                        continue
                    if graph and (q > 1 + headroom or rank.runner.graphs is None):
                        res[graph] = float("nan")  # verify graphs need ring headroom
                        continue
                    inp = StepInputs([], spec, [], graph=graph)

                    def step(inp=inp):
                        with torch.inference_mode():
                            rank.runner.forward(inp).argmax(-1)

                    res[graph] = _time(step, args.reps)
                rank.free(rids)
                own = decode_bytes(rank.model, B, ctx, q)
                fp8 = decode_bytes(rank.model, B, ctx, q, dense_fp8=True)
                floor, spec_floor = own.total / bw, fp8.total / bw
                best = min(v for v in res.values() if v == v)
                params = {"batch": B, "context": ctx, "tokens_per_request": q, "ep": rank.ep,
                          "dense": args.dense, "expert_act": args.expert_act,
                          "bytes": {"dense": own.dense, "experts": own.experts, "kv": own.kv},
                          "floor_fp8_dense_ms": spec_floor * 1e3}  # fmt: skip
                for graph in (True, False):
                    if res[graph] == res[graph]:
                        p = dict(params, cuda_graph=graph)
                        records.append(record("engine.decode_step", res[graph] * 1e3, "ms", p,
                                              floor=floor * 1e3))  # fmt: skip
                print(f"{ctx:>6} {B:>4} {q:>2} {res[True] * 1e3:8.2f} {res[False] * 1e3:8.2f} "  # noqa
                      f"{floor * 1e3:7.2f} {spec_floor * 1e3:7.2f} {best / floor:7.2f} "
                      f"{best / spec_floor:7.2f}", flush=True)  # fmt: skip
    return records


def prefill(rank: Rank, args, rate: float, bw: float) -> list[dict]:

    records = []
    print(f"{'experts':>14} {'ctx':>6} {'reqs':>4} {'new':>6} {'replay':>6} {'ms':>8} "
          f"{'tok/s':>8} {'floor ms':>8} {'x floor':>7}", flush=True)  # fmt: skip
    cases = [tuple(int(v) for v in c.split("x")) for c in args.prefill.split(",")]
    for layout in args.experts.split(","):
        _expert_layout(rank.model, layout)
        records += _prefill_cases(rank, args, rate, cases, layout)
    return records


def _expert_layout(model, layout: str) -> None:
    """``fp4``: as built (pairs); ``fp8_rows``: every layer re-encoded as e4m3 rows (bf16
    activations); ``fp8_rows_act8``: the same with fp8 activations at prefill-sized steps.
    One way: fp4 -> fp8_rows -> fp8_rows_act8."""
    from app.model.loader import _fp8_rows_layout
    from app.model.moe import PackedExperts

    if layout not in ("fp4", "fp8_rows", "fp8_rows_act8"):
        raise SystemExit(f"--experts: unknown layout {layout!r}")
    held = {m.layout for m in model.modules() if isinstance(m, PackedExperts)}
    if layout == "fp4" and "fp8_rows" in held:
        raise SystemExit("--experts: fp4 after fp8_rows (the layout is one way)")
    if layout != "fp4":
        _fp8_rows_layout(model, layout == "fp8_rows_act8", cuda=True)


def _prefill_cases(rank: Rank, args, rate: float, cases: list, layout: str) -> list[dict]:
    from app.engine.runner import StepInputs
    from bench.flash_rank import prefill_flops

    records = []
    for ctx, reqs, new in cases:
        for replay in (False, True) if not args.replay_only else (True,):
            rids = rank.requests(reqs, ctx, new)
            # the chunk ends the prompt: decoder layers see only its last W rows
            floor_pos = ctx + new - rank.model.cfg.sliding_window if replay else 0
            spec = rank.spec(rids, ctx, new, dec_floor=floor_pos)
            spec.logit_rows = np.arange(new - 1, reqs * new, new, dtype=np.int64)
            inp = StepInputs([], spec, [], graph=False)

            def step(inp=inp):
                with torch.inference_mode():
                    rank.runner.forward(inp)

            t = _time(step, max(3, args.reps // 4))
            rank.free(rids)
            tokens = reqs * new
            rows = reqs * rank.model.cfg.sliding_window if replay else None
            fl = prefill_flops(rank.model, tokens, ctx + new // 2, decoder_rows=rows)
            floor = fl / rate
            p = {"context": ctx, "requests": reqs, "new_tokens": new, "decoder_replay": replay,
                 "gflop": fl / 1e9, "rate_bf16_tflops": rate / 1e12, "experts": layout,
                 "dense": args.dense, "expert_act": args.expert_act}  # fmt: skip
            records.append(record("engine.prefill_step", t * 1e3, "ms", p, floor=floor * 1e3))
            print(f"{layout:>14} {ctx:>6} {reqs:>4} {new:>6} {replay!s:>6} {t * 1e3:8.1f} "
                  f"{tokens / t:8.0f} {floor * 1e3:8.1f} {t / floor:7.2f}", flush=True)
    return records


def profile(rank: Rank, args) -> list[dict]:
    """Device time per kernel family (and the largest kernels) of one decode step, replayed
    as a CUDA graph, at each ``--profile-batches`` size and context 4096."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from app.engine.runner import StepInputs

    records, ctx = [], 4096
    for B in (int(b) for b in args.profile_batches.split(",")):
        B = min(B, rank.mgr.kv.max_slots)
        rids = rank.requests(B, ctx, 1)
        inp = StepInputs([], rank.spec(rids, ctx, 1), [], graph=rank.runner.graphs is not None)
        with torch.inference_mode():
            for _ in range(3):
                rank.runner.forward(inp)
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                rank.runner.forward(inp).argmax(-1)
                torch.cuda.synchronize()
            wall = _time(lambda inp=inp: rank.runner.forward(inp), args.reps)
        rank.free(rids)
        fam: dict[str, float] = {}
        kern: list[tuple[float, int, str]] = []
        total = 0.0
        for e in p.key_averages():
            us = e.device_time_total
            if us <= 0:
                continue
            total += us
            fam[_family(e.key)] = fam.get(_family(e.key), 0.0) + us
            kern.append((us, e.count, e.key))
        print(f"decode step B={B} ctx={ctx} (graph): {total / 1e3:.2f} ms of kernels, "
              f"{sum(c for _, c, _ in kern)} launches; step {wall * 1e3:.2f} ms "
              f"(idle {100 * (1 - total / 1e6 / wall):.0f} %)", flush=True)  # fmt: skip
        for name, us in sorted(fam.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<28} {us / 1e3:8.3f} ms  {100 * us / total:5.1f} %")
            records.append(record("engine.decode_ops", us / 1e3, "ms",
                                  {"family": name, "batch": B, "context": ctx,
                                   "share": us / total, "step_ms": wall * 1e3}))  # fmt: skip
        for us, n, key in sorted(kern, reverse=True)[:25]:
            print(f"    {us / 1e3:8.3f} ms {n:5d}x  {key[:110]}")
    return records


def origins(rank: Rank, args) -> list[dict]:
    """Where the aten launches of one decode step come from: the step run eagerly (no graph;
    the first ``--profile-batches`` size, context 4096) under the profiler with Python
    stacks. Each device kernel belongs to the aten op that launched it; the ops are grouped
    by the innermost frame of ``app/`` or ``kernels/`` in their stack (Triton kernels have no
    aten op and are left out: their launch sites are known). The small aten launches are
    what a graph of a small batch spends its idle time between."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from app.engine.runner import StepInputs

    B, ctx = int(args.profile_batches.split(",")[0]), 4096
    rids = rank.requests(B, ctx, 1)
    inp = StepInputs([], rank.spec(rids, ctx, 1), [], graph=False)
    with torch.inference_mode():
        for _ in range(2):
            rank.runner.forward(inp)
        torch.cuda.synchronize()
        verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # Python frames
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                  experimental_config=verbose) as p:  # fmt: skip
            rank.runner.forward(inp)
            torch.cuda.synchronize()
    rank.free(rids)
    rows = _origins_table(p.events())
    total = sum(n for n, _, _, _ in rows)
    print(f"decode step B={B} ctx={ctx} (eager): {total} aten kernel launches from "
          f"{len(rows)} (op, site) pairs; the largest by launches:", flush=True)  # fmt: skip
    records = []
    for n, us, op, site in rows[:40]:
        print(f"  {n:5d}x {us:9.1f} us  {op:<28} {site}")
        records.append(record("engine.decode_aten_launches", n, "launches",
                              {"op": op, "site": site, "device_us": us, "batch": B,
                               "context": ctx}))  # fmt: skip
    return records


def _origins_table(events) -> list[tuple[int, float, str, str]]:
    """(launches, device us, aten op, site) per (op, site), most launches first: ``events``
    are the profiler's function events; an op's kernels are its ``kernels``, its site the
    innermost stack frame under app/ or kernels/ (``path(line): function``; the profiler
    gives a function's first line), else its innermost Python frame."""
    agg: dict[tuple[str, str], list] = {}
    for e in events:
        ks = getattr(e, "kernels", None) or []
        if not ks or not e.name.startswith("aten::"):
            continue
        stack = list(getattr(e, "stack", None) or [])
        frame = next((f for f in stack if "/app/" in f or "/kernels/" in f),
                     next((f for f in stack if not f.startswith("<built-in")),
                          stack[0] if stack else "?"))  # fmt: skip
        for root in ("/app/", "/kernels/"):
            if root in frame:
                frame = root[1:] + frame.split(root, 1)[1]
                break
        n_us = agg.setdefault((e.name, frame), [0, 0.0])
        n_us[0] += len(ks)
        n_us[1] += sum(k.duration for k in ks)
    return sorted(((n, us, op, site) for (op, site), (n, us) in agg.items()), reverse=True)


def _family(kernel: str) -> str:
    k = kernel.lower()
    for key, fam in (("_moe_gemm", "moe gemm"), ("_moe_dec", "moe gemm"),
                     ("_swiglu_reduce", "moe gemm"), ("_swiglu_halves", "shared expert swiglu"),
                     ("_moe_", "moe other"), ("_quant_act", "moe other"),
                     ("_dense_wg", "dense gemm (fp8)"), ("_split_sum_cast", "dense gemm (fp8)"),
                     ("_f32out", "lm head"), ("_gemv_kernel", "dense gemm (gemv)"),
                     ("_grid_topk", "top-k"),
                     ("_attn_ws", "attention"), ("sparse_attn", "attention"),
                     ("_combine_kernel", "attention"), ("_kv_pack", "kv writes"),
                     ("_norm_rope", "norm / rope"),
                     ("paged_scores", "indexer scores"), ("scores", "indexer scores"),
                     ("select", "top-k"), ("prefix", "top-k"), ("rank_kernel", "top-k"),
                     ("slot_sort", "top-k"), ("_hc_", "mhc"), ("gate", "router"),
                     ("engram", "engram"), ("_pool_kernel", "compressor"),
                     ("gemm", "dense gemm (aten)"), ("gemv", "dense gemm (aten)"),
                     ("cutlass", "dense gemm (aten)"), ("nvjet", "dense gemm (aten)"),
                     ("sm90", "dense gemm (aten)"), ("splitk", "dense gemm (aten)"),
                     ("elementwise", "elementwise (aten)"), ("reduce", "reductions (aten)"),
                     ("index", "gather/scatter (aten)"), ("scatter", "gather/scatter (aten)"),
                     ("copy", "copies (aten)")):  # fmt: skip
        if key in k:
            return fam
    return "other"


def gap(args, model, B: int = 256, overlap: bool = True) -> list[dict]:
    """Idle device time between decode steps of the whole EngineCore (graphs; overlap
    scheduling on or off), B requests of 16 prompt tokens: the wall per step first without
    the profiler, then the gaps and host phases of 10 steps under it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with tempfile.TemporaryDirectory() as tmp:
        eng = EngineCore(EngineConfig.from_options(
            tmp, device="cuda", dtype="bfloat16", max_num_seqs=B, max_num_batched_tokens=8192,
            max_model_len=4096, enable_prefix_caching=False, overlap_schedule=overlap,
        ), model=model)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        for i in range(B):
            eng.add_request(EngineRequest(f"g{i}", tuple([5 + i % 100] * 16), params))
        for _ in range(6):  # prefill, decode
            eng.step()
        steps = 10
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        plain = (time.perf_counter() - t0) / steps
        before = {p: getattr(eng.stats, p) for p in PHASES}
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps
        host = {k: (getattr(eng.stats, k) - before[k]) / steps for k in PHASES}
        eng.close()
    ev = sorted((e.time_range.start, e.time_range.end) for e in p.events()
                if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    gaps = [b[0] - a[1] for a, b in zip(ev, ev[1:], strict=False) if b[0] > a[1]]
    busy = sum(e - s for s, e in _merge(ev))
    span = (ev[-1][1] - ev[0][0]) if ev else 0
    big = sorted(gaps)[-steps:] if gaps else [0]
    cpu = sum(host[k] for k in ("t_schedule", "t_prepare", "t_launch", "t_update"))
    print(f"B={B} overlap={overlap:d}: wall {plain * 1e3:.2f} ms/step ({wall * 1e3:.2f} under "
          f"the profiler), device busy {100 * busy / max(span, 1):.1f} %"
          f", largest gaps {[round(g, 1) for g in big]} us, host {cpu * 1e3:.2f} ms/step "
          f"({', '.join(f'{k[2:]} {v * 1e3:.2f}' for k, v in host.items())})")  # fmt: skip
    p0 = {"batch": B, "context": 16, "steps": steps, "overlap": overlap}
    return [
        record("engine.idle_gap", statistics.median(big), "us", dict(p0, stat="median of the "
               "largest gap per step"), floor=150.0),  # fmt: skip
        record("engine.idle_gap", max(big), "us", dict(p0, stat="max"), floor=150.0),
        record("engine.device_busy", busy / max(span, 1), "fraction", p0),
        record("engine.cpu_per_step", cpu * 1e3, "ms", dict(p0, **{k: v * 1e3 for k, v in
                                                                   host.items()})),
        record("engine.step_wall", plain * 1e3, "ms", p0),
        record("engine.step_wall_profiled", wall * 1e3, "ms", p0),
        record("engine.device_kernel_time", busy / steps / 1e3, "ms", p0),
    ]


def _merge(ev):
    out = []
    for s, e in ev:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="tiny", choices=("tiny", "flash-rank"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default=None)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--what", default="decode,prefill,profile,gap")
    ap.add_argument("--prefill", default="32768x1x4096,32768x2x4096,32768x4x4096,32768x8x4096",
                    help="prefill cases: context x requests x new tokens, comma-separated")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gap-batches", default="256", help="gap: the EngineCore's batch sizes")
    ap.add_argument("--gap-overlap", default="on", help="gap: overlap scheduling, on and / or off")
    ap.add_argument("--dense", default="bf16", choices=DENSE_MODES,
                    help="flash-rank dense projections: bf16, fp8 blocks (packed_dense), or "
                         "fp8 blocks with fp8 activations (dense_act: fp8)")
    ap.add_argument("--expert-act", default="bf16", choices=("bf16", "fp8"),
                    help="flash-rank routed experts: the release's fp8 activation rounding "
                         "(expert_act: fp8) or none")
    ap.add_argument("--no-eager", action="store_true", help="decode: CUDA graph only")
    ap.add_argument("--verify-batches", default="1,32,256",
                    help="decode batches also timed as verify steps of 1 + 3 tokens")
    ap.add_argument("--profile-batches", default="1,64,256")
    ap.add_argument("--out", default=None,
                    help="directory for engine_steps.json (default bench/results)")
    ap.add_argument("--experts", default="fp4",
                    help="prefill: expert layouts in turn, one way: fp4 (pairs), fp8_rows, "
                         "fp8_rows_act8 (fp8 activations at prefill-sized steps)")
    ap.add_argument("--replay-only", action="store_true",
                    help="prefill: decoder replay on only (the engine's default)")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="flash-rank KV pool size (default: what 0.9 of the card leaves)")
    args = ap.parse_args()
    _run(args)


def _run(args) -> None:
    if args.model == "tiny":
        args.batches = args.batches or "1,32,256"
        print("wrote", write("engine_steps", tiny(args), args.out))
        return
    args.batches = args.batches or "1,8,32,64,128,256"
    what = args.what.split(",")
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    records = [record("ceiling.copy_bandwidth", bw / 1e12, "TB/s"),
               record("ceiling.bf16_matmul", rate / 1e12, "TFLOP/s")]  # fmt: skip
    kv = None if args.kv_gib is None else int(args.kv_gib * 2**30)
    ctx = max([int(c) + 4 for c in args.contexts.split(",")]
              + [int(c.split("x")[0]) + int(c.split("x")[2]) for c in args.prefill.split(",")])
    rank = Rank(max_seqs=256, kv_bytes=kv, ep=8, max_tokens=32768, dense=args.dense,
                context=ctx, expert_act=args.expert_act)  # fmt: skip
    parts = {"decode": lambda: decode(rank, args, bw), "profile": lambda: profile(rank, args),
             "origins": lambda: origins(rank, args),
             "prefill": lambda: prefill(rank, args, rate, bw),
             "gap": lambda: [r for b in args.gap_batches.split(",")
                             for o in args.gap_overlap.split(",")
                             for r in gap(args, rank.model, int(b), o == "on")]}  # fmt: skip
    for part, fn in parts.items():
        if part in what:
            if part == "gap":  # its EngineCore sizes its own pool: the rank's goes first
                rank.release()
            records += fn()
            write("engine_steps", records, args.out)  # kept if a later part runs out of time
            gc.collect()
            torch.cuda.empty_cache()
    print("wrote", write("engine_steps", records, args.out))


if __name__ == "__main__":
    main()
