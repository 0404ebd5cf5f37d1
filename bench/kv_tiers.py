"""Host KV tier on CPU: a multi-turn workload whose working set is several times the
device KV budget, with and without the host tier, on the tiny V4.1 engine (EngineCore, no Ray).

    python -m bench.kv_tiers [--sessions 8] [--turns 4] [--ratio 4] [--out DIR]

Workload: S sessions, T turns each, visited round-robin (every other session's turn runs
between two turns of one session). Turn 0 is a unique ``context``-token document + a question;
each later turn is the previous prompt + the previous answer + a new ``user``-token question.
Requests run one at a time (TTFT = add_request -> first token, the step loop included), with
a step budget of ``--budget`` tokens (chunked prefill): on CPU the tiny model's step time
hardly depends on its token count, so what a hit saves shows as prefill steps saved.

The device pool holds ``1 / ratio`` of the working set (every session's last prompt, in whole
blocks); the host tier holds all of it. Configurations, one run each:
  device        device pool only (what evicts is dropped)
  device+host   the same device pool + the host tier
  unbounded     a device pool holding everything (the ideal hit rate)
Each configuration runs ``--repeats`` times (the same requests and outputs); a request's TTFT
is its fastest run. Reported: prompt-token hit rate (cached / prompt tokens), TTFT p50 / p90,
host-tier hits, load-back bytes and mean load latency. Greedy outputs of ``device+host`` and
``unbounded`` are compared (same hits, same replay: they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.loader import load_model
from app.model.tiny import make_tiny_checkpoint
from bench.common import record, write

P = 16  # KV block of these runs (short prompts keep the CPU time down)


def workload(sessions: int, turns: int, context: int, user: int, seed: int = 0):
    """Per session: its context and the user tokens of each turn (answers come from the
    engine)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=g).tolist()

    return [(toks(context), [toks(user) for _ in range(turns)]) for _ in range(sessions)]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(
    path: str, model, sessions, answer: int, num_blocks: int, host_blocks: int, step_tokens: int
) -> dict:
    lay = _layout(model)
    kv_bytes = 2 * lay.bytes_per_slot + (num_blocks + 1) * lay.bytes_per_block
    cfg = EngineConfig.from_options(
        path, kv_cache_bytes=kv_bytes, host_bytes=host_blocks * lay.bytes_per_block,
        max_num_seqs=1, block_size=P, max_num_batched_tokens=step_tokens,
    )  # fmt: skip
    eng = EngineCore(cfg, model=model)
    params = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    prompts = [ctx + users[0] for ctx, users in sessions]
    ttft, prompt_toks, cached, outputs = [], 0, 0, []
    turns = len(sessions[0][1])
    for t in range(turns):
        for s, (_, users) in enumerate(sessions):
            if t:
                prompts[s] = prompts[s] + outputs[-len(sessions)][1] + users[t]
            rid = f"s{s}t{t}"
            eng.add_request(EngineRequest(rid, tuple(prompts[s]), params))
            t0, first, out, hit = time.perf_counter(), None, [], 0
            while eng.has_unfinished:
                for o in eng.step():
                    if o.token_ids and first is None:
                        first = time.perf_counter() - t0
                    out += o.token_ids
                    hit = max(hit, o.num_cached_tokens)
            ttft.append(first or 0.0)
            prompt_toks += len(prompts[s])
            cached += hit
            outputs.append((rid, out))
    st = eng.stats
    return {
        "hit_rate": cached / prompt_toks,
        "ttft_p50": statistics.median(ttft),
        "ttft_p90": _pct(ttft, 0.9),
        "ttft": ttft,
        "host_hit_tokens": st.host_hit_tokens,
        "host_load_bytes": st.host_load_bytes,
        "host_load_ms_mean": 1e3 * st.host_load_s / max(1, st.host_hits),
        "device_blocks": num_blocks,
        "host_blocks": host_blocks,
        "outputs": outputs,
    }


def _layout(model):
    from app.cache.manager import CacheManager
    from app.config import CacheConfig

    return CacheManager.layout_for(model, CacheConfig(block_size=P), torch.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--context", type=int, default=96, help="tokens of each session's document")
    ap.add_argument("--user", type=int, default=16, help="tokens of each question")
    ap.add_argument("--answer", type=int, default=4, help="tokens of each answer")
    ap.add_argument("--budget", type=int, default=32, help="max_num_batched_tokens (chunked "
                    "prefill: a step's cost on CPU hardly depends on its tokens below that)")
    ap.add_argument("--ratio", type=float, default=4.0, help="working set / device budget")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; each "
                    "request's TTFT is its fastest run (shared CPUs: others' load is noise)")
    ap.add_argument("--out", default="",
                    help="directory for kv_tiers.json (default bench/results)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    ckpt = tempfile.mkdtemp(prefix="fathom-kv-tiers-")
    make_tiny_checkpoint(ckpt, arch="v41", seed=0)
    model = load_model(ckpt)
    sessions = workload(args.sessions, args.turns, args.context, args.user)
    last = args.context + args.turns * args.user + (args.turns - 1) * args.answer
    per_session = -(-last // P)
    working = args.sessions * per_session
    device = max(per_session + 1, int(working / args.ratio))
    configs = {"device": (device, 0), "device+host": (device, 2 * working),
               "unbounded": (2 * working, 0)}  # fmt: skip
    results = {}
    for name, (nb, nh) in configs.items():
        runs = [run(ckpt, model, sessions, args.answer, nb, nh, args.budget)
                for _ in range(args.repeats)]  # fmt: skip
        r = results[name] = runs[0]
        fastest = [min(x) for x in zip(*(u["ttft"] for u in runs), strict=True)]
        r["ttft_p50"], r["ttft_p90"] = statistics.median(fastest), _pct(fastest, 0.9)
        print(f"{name:<12} hit {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms  "
              f"p90 {r['ttft_p90'] * 1e3:7.1f} ms  host hits {r['host_hit_tokens']} tokens, "
              f"{r['host_load_bytes'] / 2**20:.2f} MiB, "
              f"{r['host_load_ms_mean']:.2f} ms/load")  # fmt: skip
    same = results["device+host"]["outputs"] == results["unbounded"]["outputs"]
    print(f"working set {working} blocks, device {device}: ratio {working / device:.2f}; "
          f"device+host outputs == unbounded: {same}")
    params = {"sessions": args.sessions, "turns": args.turns, "context": args.context,
              "user": args.user, "answer": args.answer, "block_size": P, "budget": args.budget,
              "working_set_blocks": working, "device_blocks": device}  # fmt: skip
    recs = []
    for name, r in results.items():
        p = {**params, "config": name, "host_blocks": r["host_blocks"],
             "device_blocks": r["device_blocks"]}  # fmt: skip
        recs += [record("kv_tiers.hit_rate", r["hit_rate"], "fraction", p),
                 record("kv_tiers.ttft_p50", r["ttft_p50"], "s", p),
                 record("kv_tiers.ttft_p90", r["ttft_p90"], "s", p),
                 record("kv_tiers.host_hit_tokens", r["host_hit_tokens"], "tokens", p),
                 record("kv_tiers.host_load_ms", r["host_load_ms_mean"], "ms", p)]  # fmt: skip
    given = sys.argv[1:] if argv is None else argv
    cmd = "PYTHONPATH=. python -m bench.kv_tiers " + " ".join(given)
    write("kv_tiers", recs, args.out or None, command=cmd.strip(), outputs_equal_unbounded=same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
