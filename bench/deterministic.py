"""The deterministic mode's cost (``EngineConfig.deterministic``): the flash rank's decode step
at B = 1, 64, 256 and its prefill throughput, with the mode off and on, in one process.

    python -m bench.deterministic [--batches 1,64,256] [--context 4096]
        [--prefill 4096x1,8192x1] [--reps 20] [--out DIR]
    python -m bench.deterministic --model tiny --device cpu    (a CPU smoke run: the plumbing)

One model (``bench.flash_rank``: the V4.1-Flash EP8 rank, random weights, packed fp4 experts,
the V4.1 cache formats), one KV pool of random codes (``bench.engine_steps.Rank``), two model
runners over them: the default one, and one whose every step runs inside
``kernels.dispatch.batch_invariant`` (the mode's kernels; its CUDA graphs are captured in
the mode). Each case times the model step and greedy sampling (``argmax``), CUDA events,
median of ``--reps``, the two modes one after the other:

- decode (``deterministic.decode_step``, ms): B requests at context L decode one token each,
  CUDA graphs on (the serving path);
- prefill (``deterministic.prefill_step``, tokens/s): R requests prefill N new tokens each
  after a context of L (``--prefill`` LxRxN; L = 0: a cold prompt), eager.

One record per case and mode (``params.mode``: "default" / "deterministic"); the
deterministic one has ``peer`` = {"default": the default path's value, "ratio": its step
time over the default path's} (> 1: slower, for decode and prefill alike). The issue's
goals: <= 1.10 in decode, <= 1.15 in prefill.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch

from app.engine.runner import ModelRunner, StepInputs
from bench.common import record, write
from bench.engine_steps import Rank, _time
from kernels.dispatch import batch_invariant

MODES = ("default", "deterministic")


def runners(rank: Rank, max_seqs: int, max_tokens: int) -> dict[str, ModelRunner]:
    """The default runner (the rank's own) and a second one over the same model and pool,
    for the mode (its own CUDA graphs)."""
    graphs = rank.device.type == "cuda"
    mode = ModelRunner(rank.model, rank.mgr, max_tokens, rank.device, cuda_graphs=graphs,
                       max_graph_batch=max_seqs)  # fmt: skip
    return {"default": rank.runner, "deterministic": mode}


def step_seconds(runner: ModelRunner, inputs: StepInputs, mode: str, reps: int) -> float:
    """Median seconds of one step of ``inputs`` (forward + argmax) in ``mode``."""

    def step() -> None:
        with torch.inference_mode(), batch_invariant(mode == "deterministic"):
            runner.forward(inputs).argmax(-1)

    return _time(step, reps)


def pair(name: str, unit: str, params: dict, seconds: dict[str, float], value) -> list[dict]:
    """The two records of one case: ``value(seconds)`` per mode, the deterministic one with
    its ratio to the default path."""
    off, on = seconds["default"], seconds["deterministic"]
    base = value(off)
    return [record(name, base, unit, dict(params, mode="default")),
            record(name, value(on), unit, dict(params, mode="deterministic"),
                   peer={"default": base, "ratio": on / off})]  # fmt: skip


def decode(rank: Rank, run: dict[str, ModelRunner], args) -> list[dict]:
    """``deterministic.decode_step`` at each batch (graphs on where the runner has them)."""
    records, ctx = [], args.context
    print(f"{'B':>4} {'default ms':>10} {'determ. ms':>10} {'ratio':>6}", flush=True)
    for B in (int(b) for b in args.batches.split(",")):
        rids = rank.requests(B, ctx)
        spec = rank.spec(rids, ctx, 1)
        sec = {}
        for mode in MODES:
            graph = run[mode].graphs is not None
            sec[mode] = step_seconds(run[mode], StepInputs([], spec, [], graph=graph), mode,
                                     args.reps)  # fmt: skip
        rank.free(rids)
        params = {"batch": B, "context": ctx, "cuda_graph": run["default"].graphs is not None}
        records += pair("deterministic.decode_step", "ms", params, sec, lambda s: s * 1e3)
        print(f"{B:>4} {sec['default'] * 1e3:10.3f} {sec['deterministic'] * 1e3:10.3f} "
              f"{sec['deterministic'] / sec['default']:6.3f}", flush=True)  # fmt: skip
    return records


def prefill(rank: Rank, run: dict[str, ModelRunner], args) -> list[dict]:
    """``deterministic.prefill_step`` (tokens/s) for each ``--prefill`` case, eager."""
    records = []
    print(f"{'ctx':>6} {'reqs':>4} {'new':>6} {'default tok/s':>13} {'determ. tok/s':>13} "
          f"{'ratio':>6}", flush=True)  # fmt: skip
    for case in args.prefill.split(","):
        ctx, reqs, new = (int(v) for v in case.split("x"))
        rids = rank.requests(reqs, ctx, new)
        spec = rank.spec(rids, ctx, new)
        spec.logit_rows = np.arange(new - 1, reqs * new, new, dtype=np.int64)  # prompts' ends
        sec = {mode: step_seconds(run[mode], StepInputs([], spec, [], graph=False), mode,
                                  args.reps) for mode in MODES}  # fmt: skip
        rank.free(rids)
        tokens = reqs * new
        params = {"context": ctx, "requests": reqs, "new_tokens": new}
        records += pair("deterministic.prefill_step", "tokens/s", params, sec,
                        lambda s, n=tokens: n / s)  # fmt: skip
        print(f"{ctx:>6} {reqs:>4} {new:>6} {tokens / sec['default']:13.0f} "
              f"{tokens / sec['deterministic']:13.0f} "
              f"{sec['deterministic'] / sec['default']:6.3f}", flush=True)  # fmt: skip
    return records


def build(args) -> tuple[Rank, int]:
    """The flash rank on CUDA (pool: what 0.9 of the card leaves, or ``--kv-gib``), or the
    tiny V4.1 config with random weights (``--model tiny``); and its request slots."""
    batches = [int(b) for b in args.batches.split(",")]
    cases = [tuple(int(v) for v in c.split("x")) for c in args.prefill.split(",")]
    max_seqs = max(batches + [r for _, r, _ in cases])
    max_tokens = max(max(batches), *(r * n for _, r, n in cases))
    context = max([args.context + 1] + [c + n for c, _, n in cases])
    kv = None if args.kv_gib is None else int(args.kv_gib * 2**30)
    if args.model == "flash-rank":
        return Rank(max_seqs, kv, 8, max_tokens, device=args.device, context=context), max_seqs
    from bench.flash_rank import load_rank, tiny_rank_dir

    model = load_rank(tiny_rank_dir(tempfile.mkdtemp(prefix="fathom-det-")), args.device)
    rank = Rank(max_seqs, kv or 1 << 26, 8, max_tokens, model=model, device=args.device,
                context=context)  # fmt: skip
    return rank, max_seqs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="flash-rank", choices=("flash-rank", "tiny"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,64,256", help="decode batch sizes")
    ap.add_argument("--context", type=int, default=4096, help="decode: positions per request")
    ap.add_argument("--prefill", default="0x1x4096,0x1x8192",
                    help="prefill cases: context x requests x new tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kv-gib", type=float, default=None)
    ap.add_argument("--out", default=None, help="directory for deterministic.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rank, max_seqs = build(args)
    run = runners(rank, max_seqs, rank.runner.max_tokens)
    records = decode(rank, run, args)
    write("deterministic", records, args.out)  # kept if the prefill runs out of time
    records += prefill(rank, run, args)
    print("wrote", write("deterministic", records, args.out),
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
