"""Start-up of one engine (``app.engine.startup``): the seconds of each phase (weights,
memory profile, CUDA graphs, warm-up), the memory parts in GiB, and the first requests
after it (a request after the warm-up pays for no compilation or capture: the first and
the second take the same time).

    python -m bench.startup --model flash-rank            # the scaled V4.1-Flash rank (CUDA)
    python -m bench.startup --model flash-rank --drafts 3 # speculating (DSpark, 3 drafts)
    python -m bench.startup --model tiny-v41-chat --dtype float32   # a checkpoint (models/)

Params: the decode / verify graphs (``graphs``) and the draft step's (``draft_graphs``,
``app.engine.spec.graphs``) after the warm-up; ``memory.cuda_graphs`` is the profile's
estimate, ``memory.cuda_graphs_held`` what the captures held.

``flash-rank`` is loaded before the engine (``bench.flash_rank``: the shipped config, random
weights drawn by ``load_format: dummy``): its weights phase is that load, not a checkpoint
read. The pool is sized the engine's way
(``gpu_memory_utilization``, default 0.9) unless ``--kv-gib`` is given.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from app.config import EngineConfig
from app.engine.capacity import GIB
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from bench.common import record, write

MODELS = Path(__file__).resolve().parent.parent / "models"


def _request(eng: EngineCore, rid: str, n_prompt: int, n_out: int, batch: int = 1) -> float:
    """Seconds for ``batch`` greedy requests of ``n_prompt`` tokens to produce ``n_out``."""
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    vocab = eng.model.cfg.vocab_size
    t0 = time.perf_counter()
    for i in range(batch):
        ids = tuple((7 * i + 11 * j + 3) % vocab for j in range(n_prompt))
        eng.add_request(EngineRequest(f"{rid}-{i}", ids, params))
    while eng.has_unfinished:
        eng.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="flash-rank", help="flash-rank, or a models/ directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-gib", type=float, default=None, help="a fixed pool (no profile)")
    ap.add_argument("--drafts", type=int, default=0, help="DSpark drafts (0: no speculation)")
    ap.add_argument("--out", default=None, help="directory for startup.json")
    args = ap.parse_args()
    opts = dict(device="cuda", dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_bytes=None if args.kv_gib is None else int(args.kv_gib * GIB))  # fmt: skip
    if args.drafts:
        opts["speculative"] = {"method": "dspark", "num_draft_tokens": args.drafts}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model, path, build_s = None, str(MODELS / args.model), 0.0
        if args.model == "flash-rank":
            from bench.flash_rank import build_flash_rank

            model, path = build_flash_rank("cuda"), tmp
            torch.cuda.synchronize()
            build_s = time.perf_counter() - t0
            print(f"flash-rank built in {build_s:.1f} s", flush=True)
        eng = EngineCore(EngineConfig.from_options(path, **opts), model=model)
        total_s = time.perf_counter() - t0
        st, start = eng.stats, eng.startup
        drafts = eng.spec.steps if eng.spec is not None else None
        p = {"model": args.model, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": eng.max_model_len, "kv_blocks": eng.cache.pool.num_blocks,
             "graphs": len(eng.runner.graphs.graphs) if eng.runner.graphs else 0,
             "drafts": args.drafts,
             "draft_graphs": len(drafts.graphs) if drafts is not None else 0}  # fmt: skip
        records = [
            record("startup.weights", build_s or st.startup_load_s, "s", p),
            record("startup.memory_profile", st.startup_profile_s, "s", p),
            record("startup.cuda_graphs", st.startup_graphs_s, "s", p),
            record("startup.warmup", st.startup_warmup_s, "s", p),
            record("startup.total", total_s, "s", p),
        ]
        free, card = torch.cuda.mem_get_info()
        mem = start.memory
        parts = {"weights": mem.weights, "in_use": mem.in_use,
                 "activation_peak": mem.activation_peak,
                 "cuda_graphs": mem.graphs} if mem is not None else {}  # fmt: skip
        parts["cuda_graphs_held"] = start.graphs_held
        parts["kv_pool"] = start.size.pool_bytes(args.max_num_seqs)
        parts["in_use_after_warmup"] = card - free
        records += [record(f"memory.{k}", v / GIB, "GiB", dict(p, card_gib=card / GIB))
                    for k, v in parts.items()]  # fmt: skip
        first = _request(eng, "first", 64, 64)
        second = _request(eng, "second", 64, 64)
        batch = _request(eng, "batch", 512, 32, batch=8)
        print(f"start-up {total_s:.1f} s; first request {first:.3f} s, second {second:.3f} s, "
              f"8 x 512 prompt tokens {batch:.3f} s", flush=True)  # fmt: skip
        records += [record("request.first", first, "s", dict(p, prompt=64, tokens=64),
                           peer={"second_s": second}),
                    record("request.batch", batch, "s", dict(p, prompt=512, tokens=32,
                                                             batch=8))]  # fmt: skip
        eng.close()
    print("wrote", write("startup", records, args.out))


if __name__ == "__main__":
    main()
