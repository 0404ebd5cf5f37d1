"""Bisect a device-vs-reference greedy mismatch of the engine to the kernel ops that cause it.

Runs one engine scenario (tiny checkpoint, greedy, the GPU tests' prompts) and compares each
request's tokens with the CPU model's full-sequence greedy:

1. every op on its Triton kernel (what a user runs), then every op on its torch reference;
2. if (1) mismatches and the references match: each op alone on its Triton kernel (the rest on
   references) -- the ops that break the tokens alone are named.

    python -m tools.op_bisect --arch v41 --graphs off --overlap on
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import tempfile
import time

import torch

import kernels
from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.loader import load_model
from app.model.tiny import make_tiny_checkpoint
from kernels.dispatch import OPS, reference_kernels
from tests.support.reference import sequence_logits


def prompts(lens, seed: int = 0) -> list[list[int]]:
    """Random prompts of these lengths (token ids 3..499) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the model's full-sequence forward (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(sequence_logits(model, torch.tensor(seq))[-1].argmax()))
    return seq[len(prompt) :]


def run_requests(eng: EngineCore, prompts: list[list[int]], params: SamplingParams
                 ) -> dict[str, list[int]]:  # fmt: skip
    """Requests ``r0``, ``r1``, ... to the end -> their tokens; the cache checked after."""
    for i, p in enumerate(prompts):
        eng.add_request(EngineRequest(f"r{i}", tuple(p), params))
    got: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    eng.cache.check_integrity()
    return got


def _flag(v: str) -> bool:
    return {"on": True, "off": False}[v]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="v41", choices=("v41", "v4"))
    ap.add_argument("--lens", default="23,5,37,1,12", help="prompt lengths")
    ap.add_argument("--seed", type=int, default=1, help="prompt seed")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--graphs", default="on", choices=("on", "off"))
    ap.add_argument("--overlap", default="on", choices=("on", "off"))
    ap.add_argument("--bounded-replay", default="off")
    ap.add_argument("--packed-experts", default="auto")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    for m in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"kernels.{m.name}")
    ckpt = tempfile.mkdtemp(prefix=f"bisect-{args.arch}-")
    make_tiny_checkpoint(ckpt, arch=args.arch, seed=0)
    ps = prompts([int(x) for x in args.lens.split(",")], args.seed)
    cpu = load_model(ckpt)
    want = [reference_greedy(cpu, p, args.tokens) for p in ps]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    opts = dict(device=args.device, kv_cache_bytes=1 << 24, max_num_batched_tokens=16,
                cuda_graphs=_flag(args.graphs), overlap_schedule=_flag(args.overlap),
                bounded_replay=args.bounded_replay, packed_experts=args.packed_experts)  # fmt: skip

    def check(label: str) -> bool:
        t0 = time.perf_counter()
        out = run_requests(EngineCore(EngineConfig.from_options(ckpt, **opts)), ps, params)
        got = [out[f"r{i}"] for i in range(len(ps))]
        bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        print(f"{label:<40} {'OK' if not bad else 'MISMATCH requests ' + str(bad)}"
              f"  ({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
        for i in bad:
            print(f"    r{i} got  {got[i]}\n    r{i} want {want[i]}", flush=True)
        return not bad

    print(f"scenario: {vars(args)}; ops: {sorted(OPS)}", flush=True)
    triton_ok = check("all ops on Triton")
    with reference_kernels():
        ref_ok = check("all ops on references")
    if triton_ok:
        print("verdict: the kernels give the reference's tokens", flush=True)
        return
    if not ref_ok:
        print("verdict: the references mismatch too -- the cause is outside the kernel ops "
              "(engine, cache, graphs)", flush=True)  # fmt: skip
        return
    names = sorted(OPS)
    bad = []
    for name in names:
        with reference_kernels(*(n for n in names if n != name)):
            if not check(f"only {name} on Triton"):
                bad.append(name)
    alone = "no op breaks the tokens alone: the mismatch needs two or more kernels together"
    print(f"verdict: {bad} break the tokens alone" if bad else f"verdict: {alone}", flush=True)


if __name__ == "__main__":
    main()
