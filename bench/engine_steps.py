"""Engine-step CPU overhead: scheduler + input preparation + output handling per decode step,
against the model (forward) and sampling time of the same step (PERFORMANCE.md W6).

    python -m bench.engine_steps [--device cpu|cuda] [--batches 1,32,256] [--steps 8]

Runs the tiny V4.1 checkpoint (made on the fly). Each batch: B requests with 16-token prompts
are prefilled, then ``--steps`` decode steps are timed with overlap off (clean per-phase
attribution) and on (wall time per step).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, SamplingParams
from app.model.tiny import make_tiny_checkpoint
from bench.common import record, write

PHASES = ("t_schedule", "t_prepare", "t_update", "t_forward", "t_sample")


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
    for _ in range(3):  # prefill + warm-up decode steps
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(tmp, arch="v41", seed=0)
        print(
            f"{'B':>4} {'sched':>8} {'prep':>8} {'update':>8} {'host':>8} {'forward':>9} "
            f"{'sample':>8} {'wall off':>9} {'wall on':>9}  (ms/step)"
        )
        for b in (int(x) for x in args.batches.split(",")):
            off = measure(tmp, args.device, b, args.steps, overlap=False)
            on = measure(tmp, args.device, b, args.steps, overlap=True)
            host = off["t_schedule"] + off["t_prepare"] + off["t_update"]
            params = {
                "batch": b,
                "device": args.device,
                "model": "tiny v41 (8 layers)",
                "phase": "decode",
            }
            for name, v in (
                ("engine.host_per_step", host),
                ("engine.schedule_per_step", off["t_schedule"]),
                ("engine.prepare_per_step", off["t_prepare"]),
                ("engine.update_per_step", off["t_update"]),
                ("engine.forward_per_step", off["t_forward"]),
                ("engine.sample_per_step", off["t_sample"]),
                ("engine.step_wall_overlap_off", off["wall"]),
                ("engine.step_wall_overlap_on", on["wall"]),
            ):
                records.append(record(name, v * 1e3, "ms", params))
            print(
                f"{b:>4} {off['t_schedule'] * 1e3:8.3f} {off['t_prepare'] * 1e3:8.3f} "
                f"{off['t_update'] * 1e3:8.3f} {host * 1e3:8.3f} {off['t_forward'] * 1e3:9.2f} "
                f"{off['t_sample'] * 1e3:8.2f} {off['wall'] * 1e3:9.2f} {on['wall'] * 1e3:9.2f}"
            )
    print("wrote", write(f"engine_steps_{args.device}", records))


if __name__ == "__main__":
    main()
