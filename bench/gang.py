"""Two processes, one GPU each (NCCL), or two CPU processes (gloo) for ``--cpu-smoke``: the
spawn, the rendezvous, the clocks and the result file that the two-GPU benchmarks
(``bench.ep_nccl``, ``bench.pd_transfer``) share. No Ray, no pydantic.

    parent: run(worker, opts, doc_path)      spawns ranks 0 and 1 (start method "spawn")
    rank r: gang = join(r, opts)             FileStore rendezvous, cuda:r + NCCL (gloo on CPU)
            out = gang.output(doc_path, ...) rank 0 writes DIR/<bench>.json after every
                                             record; rank 1 writes its errors beside it
            out(record(...)) ... gang.close()

NVLink multicast stays off (``SAFE_ENV``, set in every rank before the process group
starts: the device machines require it). A hung collective ends at ``opts["timeout_s"]``
(the process group's timeout); the parent then records the failure in the result file.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import header, machine

SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
SIZE = 2


def now() -> float:
    """Seconds on CLOCK_MONOTONIC: one clock for every process of the host (Linux), so a
    time taken on rank 0 and one taken on rank 1 can be subtracted."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class Stamps:
    """Points on the device's timeline: CUDA events on a GPU (read after a sync), host
    times on the CPU (its ops are synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def us(self, a: Any, b: Any) -> float:
        """Microseconds from stamp ``a`` to stamp ``b`` (the device synchronized since)."""
        return float(a.elapsed_time(b)) * 1e3 if self.cuda else (b - a) * 1e6


@dataclass
class Gang:
    """This process's place in the two-rank run."""

    rank: int
    device: torch.device
    store: dist.Store
    smoke: bool

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Both ranks here, and this device idle."""
        self.sync()
        dist.barrier()
        self.sync()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        got: list[Any] = [None] * SIZE
        dist.all_gather_object(got, obj)
        return got

    def stamps(self) -> Stamps:
        return Stamps(self.device)

    def output(self, doc_path: Path, args: dict[str, Any]) -> Callable[[dict], None]:
        """Rank 0: the result file's writer (every record, as it comes). Rank 1: a writer of
        its own errors (``<stem>.rank1.json``, merged into the result file by the parent)."""
        if self.rank == 0:
            doc = {**header(doc_path.stem, command(doc_path.stem, args), _machine(self)),
                   "args": args, "records": []}  # fmt: skip
            return _writer(doc, doc_path)
        side = doc_path.with_name(f"{doc_path.stem}.rank1.json")
        return _writer({"records": []}, side, quiet=True)

    def close(self) -> None:
        dist.barrier()
        dist.destroy_process_group()


def _machine(gang: Gang) -> dict[str, Any]:
    info = machine()
    info["backend"] = gang.backend
    if gang.device.type == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return info


def command(bench: str, args: dict[str, Any]) -> str:
    flags = []
    for k, v in args.items():
        if k in ("out",) or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        flags.append(flag if v is True else f"{flag} {v}")
    return f"PYTHONPATH=. python -m bench.{bench} --out {args.get('out', 'DIR')} " + " ".join(flags)


def _writer(doc: dict, path: Path, quiet: bool = False) -> Callable[[dict], None]:
    def emit(rec: dict) -> None:
        doc["records"].append(rec)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        if not quiet:
            print(json.dumps(rec, default=str), flush=True)

    return emit


def failure(name: str, params: dict[str, Any], e: BaseException, rank: int) -> dict[str, Any]:
    """A record of a case that raised (the run goes on with the next case)."""
    return {"name": name, "params": params, "rank": rank, "error": repr(e)[:400],
            "trace": traceback.format_exc(limit=4)}  # fmt: skip


def join(rank: int, opts: dict[str, Any]) -> Gang:
    """Start this rank: multicast off, one thread on the CPU (two gloo processes on two
    cores stall otherwise), ``cuda:rank`` and NCCL on a GPU; the FileStore at
    ``opts["store"]`` is the rendezvous and stays usable for host-side signals."""
    os.environ.update(SAFE_ENV)
    smoke = bool(opts["smoke"])
    if smoke:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    store = dist.FileStore(opts["store"], SIZE)
    store.set_timeout(timedelta(seconds=opts["timeout_s"]))
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group("gloo" if smoke else "nccl", store=store, rank=rank,
                            world_size=SIZE, timeout=timedelta(seconds=opts["timeout_s"]),
                            **kw)  # fmt: skip
    return Gang(rank, device, store, smoke)


def check_devices(smoke: bool) -> None:
    if not smoke and torch.cuda.device_count() < SIZE:
        sys.exit(f"needs {SIZE} CUDA devices (found {torch.cuda.device_count()}); "
                 "--cpu-smoke runs the logic on the CPU")  # fmt: skip


def run(worker: Callable[..., None], opts: dict[str, Any], doc_path: Path) -> None:
    """Spawn ranks 0 and 1 of ``worker(rank, opts)`` (a fresh rendezvous file each run);
    afterwards merge rank 1's errors into the result file and record a crashed run."""
    side = doc_path.with_name(f"{doc_path.stem}.rank1.json")
    side.unlink(missing_ok=True)
    doc_path.unlink(missing_ok=True)  # never merge into an older run's file
    crash = None
    with tempfile.TemporaryDirectory(prefix="fathom-gang-") as tmp:
        opts = {**opts, "store": str(Path(tmp) / "store")}
        try:
            mp.start_processes(worker, args=(opts,), nprocs=SIZE, start_method="spawn")
        except Exception as e:  # a rank died (an error outside a case, a collective timeout)
            crash = e
    doc = json.loads(doc_path.read_text()) if doc_path.is_file() else {"records": []}
    if side.is_file():
        doc["records"] += json.loads(side.read_text())["records"]
        side.unlink()
    if crash is not None:
        doc["records"].append({"name": f"{doc_path.stem}.run", "params": {},
                               "error": repr(crash)[:2000]})  # fmt: skip
    doc_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {doc_path}" + (f" (a rank failed: {crash!r:.200})" if crash else ""))


def part_worker(rank: int, opts: dict[str, Any], *, parts: dict[str, Callable], prefix: str,
                file: str) -> None:  # fmt: skip
    """One rank of a bench: join the gang, run each of ``opts["parts"]`` (``parts[name](gang,
    opts, out)``) recording a part that fails outside its cases as ``{prefix}.{name}``, and
    write ``file`` in ``opts["out"]``. Bind the keywords with ``functools.partial``."""
    gang = join(rank, opts)
    out = gang.output(Path(opts["out"]) / file, opts["args"])
    for part in opts["parts"]:
        t = now()
        try:
            parts[part](gang, opts, out)
        except Exception as e:  # record, go on with the next part
            out(failure(f"{prefix}.{part}", {}, e, rank))
        if rank == 0:
            print(f"{prefix}_{part}: {now() - t:.1f} s", flush=True)
    gang.close()


def chosen_parts(ap: Any, args: Any, parts: dict[str, Callable]) -> tuple[Path, list[str]]:
    """Check the devices, make ``args.out`` and validate ``args.parts`` (comma-separated
    names of ``parts``; ``ap`` reports a bad one) -> (output directory, part names)."""
    check_devices(args.cpu_smoke)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in args.parts.split(",") if p]
    if bad := set(chosen) - set(parts):
        ap.error(f"unknown parts {sorted(bad)}; choose from {sorted(parts)}")
    return out_dir, chosen


def greedy_tokens(core: Any, prompts: tuple, params: Any, gang: bool,
                  device: Any = "cpu") -> dict[str, list[int]]:  # fmt: skip
    """Greedy tokens of ``prompts`` (requests r0, r1, ...) from an ``EngineCore``; in a gang
    (``gang``: the default process group) every rank steps until every rank is done."""
    from app.engine.request import EngineRequest

    outs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", tuple(ids), params))
        outs[f"r{i}"] = []
    while True:
        for o in core.step():
            outs[o.request_id] += o.token_ids
        left = torch.tensor([int(core.has_unfinished)], device=device)
        if gang:
            dist.all_reduce(left, op=dist.ReduceOp.MAX)
        if not left.item():
            return outs
