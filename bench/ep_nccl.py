"""Expert parallelism on two GPUs (issue 21): one process per GPU, NCCL, the real engine and
the real exchanges of ``app.model.ep``.

    (a) greedy   the engine as an EP2 gang (``RankParallel``) on the tiny V4.1 and V4
                 checkpoints, with unequal loads (rank 1 idle or lighter), against the
                 one-process engine (EP1) on the same device: ``ep.greedy_equal`` 1 / 0
    (b) moe      one MoE layer over the gang at the scaled V4.1-Flash rank shapes (5120
                 wide, experts 2304 wide, top-6, packed fp4 "pairs" and fp8; 48 experts as
                 24 + 24 and 96 as 48 + 48) at 1-256 tokens per rank, dense (all-gather +
                 reduce-scatter at the agreed capacity) and sized (all-to-all) exchanges:
                 ``ep.moe.{gate,dispatch,experts,combine,shared}`` (phases of one pass, from
                 ``ep_moe``'s phase hook), ``ep.moe.layer`` (the layer's own forward), the
                 output against the one-process layer, ``ep.moe.one_gpu`` (every expert on
                 one GPU, the gang's tokens), ``ep.agree`` (the step's gang agreement)
    (c) bw       ``EPGroup.gather`` / ``reduce_scatter`` / ``exchange`` (all-to-all) at
                 1-256 MiB sent to the peer per rank, against a plain peer copy
                 cuda:0 -> cuda:1 of the same bytes in the same run: ``ep.bw.*``

    PYTHONPATH=. python -m bench.ep_nccl --out DIR                  # two GPUs, NCCL
    PYTHONPATH=. python -m bench.ep_nccl --cpu-smoke --out DIR      # two CPU processes, gloo

Times are medians over repetitions after warm-up; before each repetition both ranks meet
at a barrier with their devices idle (CUDA events on a GPU). A gang value is the larger of
the two ranks' medians (``per_rank`` in the params). Every record goes to
``DIR/ep_nccl.json`` as it is measured; a failing case is recorded with its error.
No Ray, no pydantic (torch 2.11 + triton 3.6 on the GPU machine).
"""

from __future__ import annotations

import argparse
import functools
import gc
import tempfile
from pathlib import Path
from typing import Any

import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.parallel import RankParallel
from app.engine.request import SamplingParams
from app.model.ep import (
    DENSE_MAX_TOKENS,
    EPGroup,
    ExpertPlacement,
    ExpertShard,
    ep_moe,
    pair_slots,
)
from app.model.moe import MoE, PackedExperts
from bench.common import record
from bench.gang import Gang, chosen_parts, failure, greedy_tokens, median, now, part_worker, run

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LONG = tuple(range(3, 35))  # 32 tokens: two prefill chunks of 16
SHORT = (5, 9, 200, 17, 33)
# (arch, Engram placement, redundant experts, packed experts, dense max tokens, rank 1's
# prompts; rank 0 runs LONG and SHORT). Dense max 8: the 16-token prefill chunks take the
# sized (all-to-all) exchange, decode steps the dense one.
CASES = [
    ("v41", "replicated", 0, "off", 256, ()),
    ("v41", "host", 2, "on", 256, (SHORT,)),
    ("v41", "sharded", 0, "off", 256, ()),
    ("v4", "replicated", 2, "off", 256, (SHORT,)),
    ("v41", "replicated", 0, "on", 8, (SHORT,)),
    ("v4", "replicated", 0, "on", 8, ()),
]
SMOKE_CASES = [("v41", "sharded", 0, "on", 8, ()), ("v4", "replicated", 2, "off", 256, (SHORT,))]

# layers: (expert format, experts in all; each rank holds half)
FLASH_MOE = {"d": 5120, "inter": 2304, "k": 6, "tokens": (1, 8, 64, 256), "reps": 50,
             "layers": (("fp4", 48), ("fp4", 96), ("fp8", 48), ("fp8", 96)), "warmup": 10,
             "dtype": torch.bfloat16}  # fmt: skip
SMOKE_MOE = {"d": 64, "inter": 64, "k": 2, "tokens": (1, 5), "reps": 2, "warmup": 1,
             "layers": (("fp4", 8), ("fp8", 16)), "dtype": torch.float32}  # fmt: skip
PHASES = ("gate", "dispatch", "experts", "combine", "shared")

BW = {"sizes": tuple(1 << s for s in range(20, 29)), "reps": 20, "warmup": 3}  # 1-256 MiB
SMOKE_BW = {"sizes": (1 << 12, 1 << 16), "reps": 3, "warmup": 1}
NVLINK_GBPS = 450.0  # H200 datasheet, one direction (../shared/docs/PERFORMANCE.md)


# ---- (a) greedy: EP2 engine against EP1 --------------------------------------------------
def greedy_cases(gang: Gang, opts: dict, out) -> None:
    dev, rank = gang.device, gang.rank
    cases = SMOKE_CASES if gang.smoke else CASES
    for i, (arch, engram, redundant, packed, dense_max, other) in enumerate(cases):
        prompts = (LONG, SHORT) if rank == 0 else other
        params = {"arch": arch, "engram": engram, "redundant": redundant, "packed": packed,
                  "dense_max_tokens": dense_max, "prompt_tokens": [[len(LONG), len(SHORT)],
                  [len(p) for p in other]], "max_tokens": GREEDY.max_tokens,
                  "device": str(dev), "backend": gang.backend}  # fmt: skip
        try:
            group = EPGroup(rank, 2, dense_max_tokens=dense_max)
            placement = ExpertPlacement.default(8, 2, redundant)
            par = RankParallel(group, placement, engram, f"ep-nccl-{i}", opts["shm_dir"])
            cfg = EngineConfig.from_options(
                opts["ckpt"][arch], device=str(dev), kv_cache_bytes=1 << 22,
                max_num_batched_tokens=16, packed_experts=packed,
            )  # fmt: skip
            t = now()
            ep2 = greedy_tokens(EngineCore(cfg, parallel=par), prompts, GREEDY, True, dev)
            t_ep2 = now() - t
            ep1_core = EngineCore(cfg)  # the one-process engine (all experts, graphs as set)
            ep1 = greedy_tokens(ep1_core, prompts, GREEDY, False, dev)
            graphs = ep1_core.stats.graph_steps
            del ep1_core
            gc.collect()
            mine = {"ep2": ep2, "ep1": ep1, "wall_s": t_ep2, "ep1_graph_steps": graphs}
        except Exception as e:
            out(failure("ep.greedy_equal", params, e, rank))
            mine = None
        got = gang.gather(mine)
        if rank != 0 or any(g is None for g in got):
            continue
        equal = all(g["ep2"] == g["ep1"] for g in got)
        full = all(len(t) == GREEDY.max_tokens for g in got for t in g["ep1"].values())
        loads = [len(g["ep2"]) for g in got] == [2, len(other)]
        params.update(tokens=[g["ep2"] for g in got], ep1_tokens=[g["ep1"] for g in got],
                      ep2_wall_s=[round(g["wall_s"], 3) for g in got],
                      ep1_graph_steps=[g["ep1_graph_steps"] for g in got],
                      all_tokens=full, loads_as_planned=loads)  # fmt: skip
        out(record("ep.greedy_equal", float(equal and full and loads), "bool", params))


# ---- (b) one MoE layer over the gang ------------------------------------------------------
def _experts(fmt: str, n: int, d: int, inter: int, dev: torch.device, seed: int) -> PackedExperts:
    """``n`` random stacked experts (fp8 32x32 blocks, or fp4 e8m0 per 32, as a checkpoint
    stores them), drawn on ``dev`` one expert at a time (no fp32 copy of them all)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    e8, u8 = torch.float8_e8m0fnu, torch.uint8
    if fmt == "fp8":
        w13 = torch.empty(n, 2 * inter, d, dtype=torch.float8_e4m3fn, device=dev)
        w2 = torch.empty(n, d, inter, dtype=torch.float8_e4m3fn, device=dev)
        for e in range(n):
            w13[e] = (torch.randn(2 * inter, d, generator=g, device=dev) * 64).to(w13.dtype)
            w2[e] = (torch.randn(d, inter, generator=g, device=dev) * 64).to(w2.dtype)
        s13 = torch.randint(117, 121, (n, 2 * inter // 32, d // 32), generator=g, device=dev,
                            dtype=u8)  # fmt: skip
        s2 = torch.randint(117, 121, (n, d // 32, inter // 32), generator=g, device=dev, dtype=u8)
        block = (32, 32)
    else:
        i8 = torch.int8
        w13 = torch.randint(-128, 128, (n, 2 * inter, d // 2), generator=g, device=dev, dtype=i8)
        w2 = torch.randint(-128, 128, (n, d, inter // 2), generator=g, device=dev, dtype=i8)
        s13 = torch.randint(121, 125, (n, 2 * inter, d // 32), generator=g, device=dev, dtype=u8)
        s2 = torch.randint(121, 125, (n, d, inter // 32), generator=g, device=dev, dtype=u8)
        block = (1, 32)
    return PackedExperts(w13, s13.view(e8), w2, s2.view(e8), fmt, block, 10.0)  # type: ignore[arg-type]


def _slice(full: PackedExperts, start: int, n: int) -> PackedExperts:
    """Experts ``start .. start + n`` of ``full`` (same bytes), held at slot offset start."""
    t = [b[start : start + n].clone() for b in (full.w13, full.s13, full.w2, full.s2)]
    return PackedExperts(*t, full.fmt, full.block, full.limit, start)  # type: ignore[arg-type]


def _shell(shape: dict, n_experts: int, dev, shard: ExpertShard | None) -> MoE:
    """A MoE layer's gate and shared expert (allocated, not filled), no routed experts."""
    with torch.device("meta"):
        moe = MoE(shape["d"], shape["inter"], n_experts, shape["k"], 2.5, 10.0, shard=shard)
    moe.experts = torch.nn.ModuleList()
    for mod in moe.modules():  # (not to_empty: from meta it imports torch._refs, 4 s on a CPU)
        for name, p in list(mod._parameters.items()):
            if p is not None:
                new = torch.empty(p.shape, dtype=p.dtype, device=dev)
                mod._parameters[name] = torch.nn.Parameter(new, requires_grad=False)
    return moe


def _layers(shape: dict, fmt: str, n_experts: int, gang: Gang, group: EPGroup):
    """(the one-process layer: every expert here; this rank's EP2 layer: its half of the
    experts, the same gate and shared expert, joined to ``group``). Both ranks draw the
    same weights (seeded); the EP2 layer's experts are the one-process layer's bytes."""
    dev, dtype = gang.device, shape["dtype"]
    ref = _shell(shape, n_experts, dev, None)
    g = torch.Generator().manual_seed(0)
    for p in ref.parameters():
        src = torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1)
        p.data.copy_(src.to(p.dtype))
    ref.to(dtype)  # as the loader holds a bf16 model: the router weight bf16 too
    ref.gate.bias.data = ref.gate.bias.data.float()  # the selection bias stays fp32
    placement = ExpertPlacement.default(n_experts, 2)
    ep = _shell(shape, n_experts, dev, ExpertShard(placement, gang.rank)).to(dtype)
    ep.gate.bias.data = ep.gate.bias.data.float()
    ep.gate.load_state_dict(ref.gate.state_dict())
    ep.shared_experts.load_state_dict(ref.shared_experts.state_dict())
    full = _experts(fmt, n_experts, shape["d"], shape["inter"], dev, seed=7)
    part = _slice(full, placement.offset(gang.rank), placement.slots_per_rank)
    for pe in (full, part):
        if dev.type == "cuda" and pe.can_pair:
            pe.repack("pairs")  # the CUDA kernels' layout (the loader does this on CUDA)
    ref.experts, ep.experts = full, part
    ep.set_ep(placement, group)
    return ref.eval(), ep.eval()


def _times(gang: Gang, fn, reps: int, warmup: int) -> list[float]:
    """µs of ``fn()`` per repetition (both ranks at a barrier first, devices idle)."""
    st, ts = gang.stamps(), []
    for i in range(warmup + reps):
        gang.barrier()
        a = st.mark()
        fn()
        b = st.mark()
        gang.sync()
        if i >= warmup:
            ts.append(st.us(a, b))
    return ts


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)) if a.numel() else 0.0


def _moe_point(gang: Gang, group: EPGroup, ref: MoE, ep: MoE, shape: dict, T: int) -> dict:
    """This rank's figures at ``T`` tokens: both exchanges, the one-GPU layer, agree()."""
    dev, dtype, reps, warm = gang.device, shape["dtype"], shape["reps"], shape["warmup"]
    g = torch.Generator(device=dev).manual_seed(1000 * gang.rank + T)
    x = torch.randn(T, shape["d"], generator=g, device=dev).to(dtype)
    tok = torch.randint(0, 500, (T,), generator=g, device=dev)
    st = gang.stamps()
    per = ep._placement.slots_per_rank
    res: dict[str, Any] = {}

    def phased() -> tuple[torch.Tensor, list]:
        m = [st.mark()]
        ids, w = ep.gate(x, tok)
        slots = pair_slots(ids, ep._routes)
        m.append(st.mark())
        routed = ep_moe(x, slots, w, per, group, ep._local, phase=lambda _: m.append(st.mark()))
        m.append(st.mark())
        y = routed + ep.shared_experts(x)
        m.append(st.mark())
        return y, m

    with torch.inference_mode():
        want = ref(x, tok)
        res["ref_abs_max"] = float(want.float().abs().max()) if T else 0.0
        agree = []
        for i in range(warm + reps):
            gang.barrier()
            t = now()
            group.agree(T, dev)
            if i >= warm:
                agree.append((now() - t) * 1e6)
        res["agree_us"] = median(agree)
        for mode in ("dense", "sized"):
            # the gang's agreement picks the exchange: no dense steps at all for "sized"
            group.dense_max_tokens = DENSE_MAX_TOKENS if mode == "dense" else 0
            group.agree(T, dev)
            got = ep(x, tok)
            y, _ = phased()
            gang.sync()
            r: dict[str, Any] = {"capacity": group.capacity, "rel_err": _rel(want, got),
                                 "phased_equal": bool(torch.equal(y, got))}  # fmt: skip
            phases: dict[str, list[float]] = {p: [] for p in PHASES}
            for i in range(warm + reps):
                gang.barrier()
                _, m = phased()
                gang.sync()
                if i >= warm:
                    for j, p in enumerate(PHASES):
                        phases[p].append(st.us(m[j], m[j + 1]))
            r["phases_us"] = {p: median(v) for p, v in phases.items()}
            r["layer_us"] = median(_times(gang, lambda: ep(x, tok), reps, warm))
            res[mode] = r
        group.dense_max_tokens = DENSE_MAX_TOKENS
        x2 = torch.randn(2 * T, shape["d"], generator=g, device=dev).to(dtype)
        tok2 = torch.randint(0, 500, (2 * T,), generator=g, device=dev)
        res["one_gpu_us"] = median(_times(gang, lambda: ref(x2, tok2), reps, warm))
    return res


def moe_cases(gang: Gang, opts: dict, out) -> None:
    shape = SMOKE_MOE if gang.smoke else FLASH_MOE
    rank = gang.rank
    group = EPGroup(rank, 2)
    for fmt, n_experts in shape["layers"]:
        base = {"fmt": fmt, "experts": n_experts, "local_experts": n_experts // 2,
                "d": shape["d"], "inter": shape["inter"], "k": shape["k"],
                "dtype": str(shape["dtype"]).removeprefix("torch."), "reps": shape["reps"],
                "backend": gang.backend}  # fmt: skip
        try:
            ref, ep = _layers(shape, fmt, n_experts, gang, group)
            ok = True
        except Exception as e:
            out(failure("ep.moe", base, e, rank))
            ok = False
        if not all(gang.gather(ok)):
            continue
        for T in shape["tokens"]:
            params = {**base, "tokens_per_rank": T}
            try:
                mine = _moe_point(gang, group, ref, ep, shape, T)
            except Exception as e:
                out(failure("ep.moe", params, e, rank))
                mine = None
            got = gang.gather(mine)
            if rank == 0 and all(g is not None for g in got):
                _moe_records(got, params, out)
        del ref, ep
        gc.collect()
        if gang.device.type == "cuda":
            torch.cuda.empty_cache()


def _moe_records(got: list[dict], params: dict, out) -> None:
    gang_max = max  # a gang step waits for its slower rank
    agree = [g["agree_us"] for g in got]
    out(record("ep.agree", gang_max(agree), "us", {**params, "per_rank": agree}))
    one = [g["one_gpu_us"] for g in got]
    out(record("ep.moe.one_gpu", gang_max(one), "us",
               {**params, "tokens": 2 * params["tokens_per_rank"], "per_rank": one,
                "local_experts": params["experts"]}))  # fmt: skip
    for mode in ("dense", "sized"):
        rs = [g[mode] for g in got]
        p = {**params, "mode": mode, "capacity": rs[0]["capacity"]}
        for ph in PHASES:
            vals = [r["phases_us"][ph] for r in rs]
            out(record(f"ep.moe.{ph}", gang_max(vals), "us", {**p, "per_rank": vals}))
        layer = [r["layer_us"] for r in rs]
        sums = [sum(r["phases_us"].values()) for r in rs]
        out(record("ep.moe.layer", gang_max(layer), "us",
                   {**p, "per_rank": layer, "phases_sum_us": gang_max(sums),
                    "rel_err_vs_one_process": max(r["rel_err"] for r in rs),
                    "one_process_abs_max": min(g["ref_abs_max"] for g in got),
                    "phased_equal": all(r["phased_equal"] for r in rs),
                    "one_gpu_us": gang_max(one)}))  # fmt: skip


# ---- (c) collective bandwidth against a peer copy -----------------------------------------
def _collectives(group: EPGroup, size: int, dev: torch.device) -> dict:
    """The three exchanges, each sending ``size`` bytes to the peer from this rank."""
    w = 1024 if size >= 1024 else 1
    rows = size // w
    gat = torch.randint(0, 256, (rows, w), dtype=torch.uint8, device=dev)
    red = torch.randn(2 * size // 4, device=dev)  # fp32 partial sums, 2 blocks of size bytes
    a2a = torch.randint(0, 256, (2 * rows, w), dtype=torch.uint8, device=dev)
    split = [rows, rows]  # rows to / from each rank, known here (no split_sizes exchange)
    return {
        "all_gather": lambda: group.gather(gat),
        "reduce_scatter": lambda: group.reduce_scatter(red),
        "all_to_all": lambda: group.exchange(a2a, split, split),
    }


def _peer_copies(gang: Gang, sizes, reps: int, warm: int) -> dict[int, float]:
    """Rank 0 alone: µs of ``dst.copy_(src)`` of ``size`` bytes, cuda:0 -> cuda:1 (the CPU
    copies within its memory in the smoke)."""
    dev = gang.device
    peer = torch.device("cuda", 1) if dev.type == "cuda" else dev
    st, res = gang.stamps(), {}
    for size in sizes:
        src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
        dst = torch.empty(size, dtype=torch.uint8, device=peer)
        ts = []
        for i in range(warm + reps):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.synchronize(peer)
            a = st.mark()
            dst.copy_(src)
            b = st.mark()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.synchronize(peer)
            if i >= warm:
                ts.append(st.us(a, b))
        assert torch.equal(dst.to(dev), src)
        res[size] = median(ts)
        del src, dst
    return res


def bandwidth_cases(gang: Gang, opts: dict, out) -> None:
    bw = SMOKE_BW if gang.smoke else BW
    rank, dev = gang.rank, gang.device
    group = EPGroup(rank, 2)
    mine: dict[tuple[str, int], float] = {}
    for size in bw["sizes"]:
        try:
            ops = _collectives(group, size, dev)
            for op, fn in ops.items():
                mine[op, size] = median(_times(gang, fn, bw["reps"], bw["warmup"]))
            del ops
        except Exception as e:
            out(failure("ep.bw", {"bytes_per_rank": size}, e, rank))
            break
    got = gang.gather(mine)
    gang.barrier()
    if rank == 0:
        try:
            copies = _peer_copies(gang, bw["sizes"], bw["reps"], bw["warmup"])
        except Exception as e:
            out(failure("ep.bw.peer_copy", {}, e, rank))
            copies = {}
        gang.store.set("peer_done", "1")
    else:
        gang.store.wait(["peer_done"])  # GPU 1 idle while rank 0 copies into it
        return
    base = {"backend": gang.backend, "reps": bw["reps"], "nvlink_gbps_datasheet": NVLINK_GBPS}
    for size, us in copies.items():
        out(record("ep.bw.peer_copy", us, "us",
                   {**base, "bytes": size, "gbps": size / us / 1e3,
                    "path": "cuda:0 -> cuda:1" if dev.type == "cuda" else "cpu"}))  # fmt: skip
    ops = sorted({op for op, _ in got[0]})
    for op in ops:
        for size in bw["sizes"]:
            vals = [g.get((op, size)) for g in got]
            if any(v is None for v in vals):
                continue
            us = max(vals)
            floor = copies.get(size)
            out(record(f"ep.bw.{op}", us, "us",
                       {**base, "bytes_per_rank": size, "gbps": size / us / 1e3,
                        "per_rank": vals, "peer_copy_gbps": size / floor / 1e3 if floor
                        else None}, floor=floor))  # fmt: skip


# ---- driver -------------------------------------------------------------------------------
PARTS = {"greedy": greedy_cases, "moe": moe_cases, "bw": bandwidth_cases}
worker = functools.partial(part_worker, parts=PARTS, prefix="ep", file="ep_nccl.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for ep_nccl.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="gloo on the CPU, tiny shapes")
    ap.add_argument("--parts", default="greedy,moe,bw", help="which: greedy, moe, bw")
    ap.add_argument("--timeout-s", type=int, default=300, help="a hung collective ends here")
    ap.add_argument("--shm-dir", default="/dev/shm", help="Engram 'host' placement files")
    args = ap.parse_args(argv)
    out_dir, parts = chosen_parts(ap, args, PARTS)
    with tempfile.TemporaryDirectory(prefix="fathom-ep-nccl-") as tmp:
        shm = args.shm_dir if Path(args.shm_dir).is_dir() else str(Path(tmp) / "shm")
        Path(shm).mkdir(parents=True, exist_ok=True)
        ckpt = {}
        if "greedy" in parts:
            from app.model.tiny import make_tiny_checkpoint

            for arch in ("v41", "v4"):
                ckpt[arch] = str(make_tiny_checkpoint(Path(tmp) / arch, arch=arch, seed=0))
        opts = {"smoke": args.cpu_smoke, "out": str(out_dir), "parts": parts, "ckpt": ckpt,
                "shm_dir": shm, "timeout_s": args.timeout_s, "args": vars(args)}  # fmt: skip
        run(worker, opts, out_dir / "ep_nccl.json")


if __name__ == "__main__":
    main()
