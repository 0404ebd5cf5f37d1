"""Expert parallelism on one GPU: (a) one MoE layer through the EP path with ep_size 1
(gate -> slots -> the fused k-way experts at the rank's slot offset: what every EP rank runs
on its gathered rows, minus the exchanges) against today's fused MoE, at the scaled
V4.1-Flash rank's shapes (5120 wide, 48 local experts 2304 wide, top-6, fp4 pairs and fp8);
(b) the Engram lookup from a ``host`` placement table (a shared-memory file mapped and
registered with CUDA, read over UVA: ``app.model.engram_place``) against a device table and a
plain pinned tensor, at the scaled model's table rows and at a large table (``--host-gib``).

    PYTHONPATH=. python -m bench.ep_step --out DIR          # H200: CUDA-graph replay
    PYTHONPATH=. python -m bench.ep_step --cpu-smoke --out DIR   # tiny shapes, CPU: logic

Times are medians of CUDA-graph replays over rotating inputs (``triton.testing
.do_bench_cudagraph``); every case first checks the two paths agree. Each record goes to
``DIR/ep_step.json`` as it is measured; a failing case is recorded with its error.
No Ray, no pydantic (torch 2.11 + triton 3.6 on the GPU machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app.model.engram_place import host_table
from app.model.ep import EPGroup, ExpertPlacement
from app.model.moe import MoE, PackedExperts
from bench.common import header, record, result_path
from kernels.engram import engram_gather

FLASH = {"d": 5120, "inter": 2304, "experts": 48, "k": 6, "tokens": [1, 8, 64, 512, 4096]}
SMOKE = {"d": 64, "inter": 64, "experts": 8, "k": 2, "tokens": [1, 5, 33]}
ENGRAM_DIM, HEADS = 256, 8 * 3  # row width; rows per token (8 heads x n-grams 2..4)
SCALED_ROWS = 4099 * 3 * 8  # the scaled rank's Engram table (bench.flash_rank, ~rows/layer)


def _timer(dev: torch.device) -> Callable[[Callable[[], Any]], float]:
    """Median µs of ``fn``: CUDA-graph replay on the GPU, a plain loop on the CPU."""
    if dev.type == "cuda":
        import triton.testing

        return lambda fn: float(
            triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")) * 1e3  # fmt: skip

    def cpu(fn: Callable[[], Any]) -> float:
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[2] * 1e6

    return cpu


def _rotating(fn: Callable[[Any], Any], inputs: list[Any]) -> Callable[[], Any]:
    it = itertools.cycle(inputs)
    return lambda: fn(next(it))


def _packed(fmt: str, n: int, d: int, inter: int, dev: torch.device, g: torch.Generator):
    """Random stacked experts (fp8 32x32 blocks, or fp4 e8m0 per 32) like a checkpoint's."""
    if fmt == "fp8":
        w13 = (torch.randn(n, 2 * inter, d, generator=g) * 64).to(torch.float8_e4m3fn)
        w2 = (torch.randn(n, d, inter, generator=g) * 64).to(torch.float8_e4m3fn)
        s13 = torch.randint(117, 121, (n, 2 * inter // 32, d // 32), generator=g).byte()
        s2 = torch.randint(117, 121, (n, d // 32, inter // 32), generator=g).byte()
        block = (32, 32)
    else:
        w13 = torch.randint(-128, 128, (n, 2 * inter, d // 2), generator=g, dtype=torch.int8)
        w2 = torch.randint(-128, 128, (n, d, inter // 2), generator=g, dtype=torch.int8)
        s13 = torch.randint(121, 125, (n, 2 * inter, d // 32), generator=g).byte()
        s2 = torch.randint(121, 125, (n, d, inter // 32), generator=g).byte()
        block = (1, 32)
    e8 = torch.float8_e8m0fnu
    t = [w13.to(dev), s13.to(dev).view(e8), w2.to(dev), s2.to(dev).view(e8)]
    pe = PackedExperts(*t, fmt=fmt, block=block, limit=10.0)  # type: ignore[arg-type]
    if dev.type == "cuda" and pe.can_pair:
        pe.repack("pairs")
    return pe


def _moe(shape: dict, fmt: str, dev: torch.device, dtype: torch.dtype) -> MoE:
    """One MoE layer (gate, packed routed experts, shared expert) with random weights."""
    g = torch.Generator().manual_seed(0)
    d, inter, e, k = shape["d"], shape["inter"], shape["experts"], shape["k"]
    with torch.device("meta"):
        moe = MoE(d, inter, e, k, 2.5, 10.0)
    moe.experts = torch.nn.ModuleList()
    moe.to_empty(device=dev)
    for p in moe.parameters():
        src = torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.1)
        p.data.copy_(src.to(p.dtype))
    moe.to(dtype)  # as the loader holds a bf16 model: the router weight bf16 too
    moe.gate.bias.data = moe.gate.bias.data.float()  # the selection bias stays fp32
    moe.experts = _packed(fmt, e, d, inter, dev, g)
    return moe.eval()


def moe_cases(shape: dict, dev: torch.device, dtype: torch.dtype, out: Callable) -> None:
    """(a): fused MoE vs the EP path (ep_size 1) on the same layer and inputs: as CUDA-graph
    replays (both capture: the EP path reads nothing on the host) and eager (``do_bench``)."""
    time_us = _timer(dev)
    if dev.type == "cuda":
        from triton.testing import do_bench as triton_bench
    fmts = ["fp4", "fp8"] if dev.type == "cuda" else ["fp4"]
    for fmt in fmts:
        fused = _moe(shape, fmt, dev, dtype)
        ep = _moe(shape, fmt, dev, dtype)
        ep.set_ep(ExpertPlacement.default(shape["experts"], 1), EPGroup(0, 1))
        for t in shape["tokens"]:
            params = {"tokens": t, "fmt": fmt, "experts": shape["experts"], "d": shape["d"]}
            try:
                g = torch.Generator(device=dev).manual_seed(t)
                xs = [torch.randn(t, shape["d"], device=dev, generator=g).to(dtype)
                      for _ in range(4)]  # fmt: skip
                ids = [torch.randint(0, 500, (t,), device=dev, generator=g) for _ in xs]
                with torch.inference_mode():
                    a, b = fused(xs[0], ids[0]).float(), ep(xs[0], ids[0]).float()
                    err = float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))
                    pairs = list(zip(xs, ids, strict=True))
                    for name, mod in (("fused", fused), ("ep1", ep)):
                        fn = _rotating(lambda xi, m=mod: m(*xi), pairs)
                        p = {**params, "rel_err_vs_fused": err}
                        if dev.type == "cuda":
                            eager = float(triton_bench(fn, rep=60, return_mode="median")) * 1e3
                            out(record(f"moe.{name}.eager", eager, "us", p))
                        try:
                            out(record(f"moe.{name}", time_us(fn), "us", p))
                        except RuntimeError as e:  # a capture failure is a finding: record it
                            out({"name": f"moe.{name}", "params": p, "error": repr(e)[:200]})
            except Exception as e:  # record and go on: one shape must not lose the rest
                out({"name": "moe", "params": params, "error": repr(e),
                     "trace": traceback.format_exc(limit=3)})  # fmt: skip


def engram_cases(
    rows_list: list[int], dev: torch.device, shm_dir: str, out: Callable, tokens: list[int]
) -> None:
    """(b): Engram lookup of T tokens x 24 rows from a host-placement table (shared file,
    registered) vs a pinned tensor vs a device table; e4m3 rows + e8m0 per 32."""
    time_us = _timer(dev)
    for n_rows in rows_list:
        base = {"rows": n_rows, "dim": ENGRAM_DIM, "bytes": n_rows * (ENGRAM_DIM + 8)}
        try:
            g = torch.Generator().manual_seed(n_rows)
            table = torch.empty(n_rows, ENGRAM_DIM, dtype=torch.uint8)
            for i in range(0, n_rows, 1 << 20):  # fill in chunks (large tables)
                n = min(1 << 20, n_rows - i)
                table[i : i + n] = torch.randint(0, 120, (n, ENGRAM_DIM), generator=g,
                                                 dtype=torch.uint8)  # fmt: skip
            table = table.view(torch.float8_e4m3fn)
            scale = torch.full((n_rows, ENGRAM_DIM // 32), 127, dtype=torch.uint8)
            path = Path(shm_dir) / f"ep-step-engram-{n_rows}.bin"
            t0 = time.perf_counter()
            shared = host_table(table.view(torch.uint8), path).view(torch.float8_e4m3fn)
            tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            if dev.type == "cuda":
                from app.model.engram_place import _pin

                _pin(shared)
                sc_pinned = scale.pin_memory().view(torch.float8_e8m0fnu)
                tables["host_shared"] = (shared, sc_pinned)
                tables["host_pinned"] = (table.pin_memory(), sc_pinned)
                if n_rows * ENGRAM_DIM < (8 << 30):
                    tables["device"] = (table.to(dev), scale.to(dev).view(torch.float8_e8m0fnu))
            else:
                tables["host_shared"] = (shared, scale.view(torch.float8_e8m0fnu))
                tables["replicated"] = (table, scale.view(torch.float8_e8m0fnu))
            setup_s = time.perf_counter() - t0
            for t in tokens:
                rows = [torch.randint(0, n_rows, (t, HEADS), device=dev) for _ in range(8)]
                first = None
                for name, (tab, sc) in tables.items():
                    got = engram_gather(tab, rows[0], sc, torch.bfloat16)
                    first = got if first is None else first
                    ok = bool(torch.equal(got, first))

                    def look(r: torch.Tensor, tab=tab, sc=sc) -> torch.Tensor:
                        return engram_gather(tab, r, sc, torch.bfloat16)

                    us = time_us(_rotating(look, rows))
                    params = {**base, "tokens": t, "table": name, "equal_to_first": ok,
                              "setup_s": round(setup_s, 2)}  # fmt: skip
                    out(record("engram.lookup", us, "us", params))
            path.unlink(missing_ok=True)
        except Exception as e:
            out({"name": "engram.lookup", "params": base, "error": repr(e),
                 "trace": traceback.format_exc(limit=3)})  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for ep_step.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--host-gib", type=float, default=8.0, help="large host table size")
    ap.add_argument("--shm-dir", default="/dev/shm", help="where the host table file goes")
    ap.add_argument("--parts", default="moe,engram", help="which cases: moe, engram")
    args = ap.parse_args(argv)
    doc: dict[str, Any] = {**header("ep_step"), "args": vars(args), "records": []}
    dest = result_path("ep_step", args.out)

    def emit(rec: dict) -> None:
        doc["records"].append(rec)
        dest.write_text(json.dumps(doc, indent=1, default=str))
        print(json.dumps(rec, default=str), flush=True)

    smoke = args.cpu_smoke or not torch.cuda.is_available()
    dev = torch.device("cpu" if smoke else "cuda")
    shm = args.shm_dir
    if not Path(shm).is_dir():
        shm = tempfile.mkdtemp()
    if smoke:
        moe_cases(SMOKE, dev, torch.float32, emit)
        engram_cases([4099], dev, shm, emit, [1, 16])
    else:
        parts = args.parts.split(",")
        if "moe" in parts:
            moe_cases(FLASH, dev, torch.bfloat16, emit)
        if "engram" in parts:
            large = int(args.host_gib * (1 << 30)) // (ENGRAM_DIM + 8)
            engram_cases([SCALED_ROWS, large], dev, shm, emit, [1, 8, 64, 512])
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
