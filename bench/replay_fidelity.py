"""How far SWA bounded replay moves outputs after a prefix-cache hit (CPU, tiny models).

For pairs of prompts sharing a prefix: run A, then B with the prefix cache in each replay
mode, and compare B's last-prompt-token logits and greedy continuation with a cold run of B.

    python -m bench.replay_fidelity [--pairs 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch

from app.cache.manager import CacheManager
from app.config import CacheConfig
from app.model.loader import load_model
from app.model.tiny import make_tiny_checkpoint
from bench.common import record, write
from bench.teacher import drive
from tests.support.reference import sequence_logits

BLOCK = {"v41": 8, "v4": 16}


def run(arch: str, mode: str, pairs: int, seed: int, model) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    P, W = BLOCK[arch], model.cfg.sliding_window
    rels, top1 = [], 0
    for k in range(pairs):
        cfg = CacheConfig(block_size=P, enable_prefix_caching=True, bounded_replay=mode)
        mgr = CacheManager(model, cfg, num_blocks=128, max_slots=2)
        shared = torch.randint(3, 500, (4 * P + 1,), generator=g)
        a = torch.cat((shared, torch.randint(3, 500, (5,), generator=g)))
        b = torch.cat((shared, torch.randint(3, 500, (7,), generator=g)))
        rng = random.Random(seed * 1000 + k)
        drive(model, mgr, {"a": a}, rng, max_chunk=W)
        mgr.free("a")
        out = drive(model, mgr, {"b": b}, rng, max_chunk=W, prompt_lens={"b": b.numel()})
        last = b.numel() - 1
        cold = sequence_logits(model, b)[last]
        rels.append(((out["b"][last] - cold).abs().max() / cold.abs().max()).item())
        top1 += int(out["b"][last].argmax() == cold.argmax())
    return {"max_rel": max(rels), "mean_rel": sum(rels) / len(rels), "top1_agree": top1 / pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, modes in (
            ("v41", ("off", "encoder", "encoder+decoder")),
            ("v4", ("off", "encoder")),
        ):
            make_tiny_checkpoint(f"{tmp}/{arch}", arch=arch, seed=0)
            model = load_model(f"{tmp}/{arch}")
            for mode in modes:
                r = run(arch, mode, args.pairs, args.seed, model)
                params = {
                    "arch": arch,
                    "bounded_replay": mode,
                    "pairs": args.pairs,
                    "model": f"tiny {arch} seed 0",
                    "window": model.cfg.sliding_window,
                }
                records.append(record("replay.logits_max_rel", r["max_rel"], "rel", params))
                records.append(record("replay.logits_mean_rel", r["mean_rel"], "rel", params))
                records.append(record("replay.top1_agree", r["top1_agree"], "fraction", params))
                print(
                    f"{arch:4} {mode:16} max rel {r['max_rel']:.3e}  mean rel "
                    f"{r['mean_rel']:.3e}  top-1 agree {r['top1_agree']:.2f}"
                )
    print("wrote", write("replay_fidelity", records))


if __name__ == "__main__":
    main()
