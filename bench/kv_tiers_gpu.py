"""Host-tier load-back bandwidth on one GPU (docs/performance.md, "Host KV tier").

    PYTHONPATH=. python -m bench.kv_tiers_gpu --out DIR [--tokens 32768] [--repeats 10]

The paged cache of the scaled V4.1-Flash model (the released formats: 890 B per token, blocks
of 64 positions: 56,960 B a block in 16 tensors) is allocated by the engine's own code
(``CacheLayout`` + ``PagedKVCache``), beside a pinned ``HostTier``. A 32K-token request's
blocks (512) are written back to the host and loaded back into scattered device blocks by
``HostTier.load`` (the engine's path: one H2D copy per contiguous run of host rows into a
staging buffer, one ``index_copy_`` per tensor, on the copy stream). Reported, each against
the PCIe ceiling measured in the same run (one large pinned H2D copy):

- ``kv_tiers.load_back`` (contiguous host rows: how the tier allocates) and
  ``kv_tiers.load_back_scattered`` (every block its own run: the worst case): device time
  of the copy stream (CUDA events), floor = bytes / ceiling;
- ``kv_tiers.load_ready``: host-observed issue -> ``ready`` (what a waiting request sees);
- ``kv_tiers.offload``: the write-back (device -> host) of the same blocks;
- ``kv_tiers.load_overlap``: a load issued while the compute stream runs a ~step-long
  matmul loop: wall time of both against the longer of the two alone.

Correctness is checked on the way (the loaded bytes equal the original ones). Needs torch
only (no Ray, no pydantic, no network); ``--device cpu`` runs the same logic on a CPU
(smoke test; times are host copies).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from app.cache.host_tier import HostTier
from app.cache.kv_cache import PagedKVCache
from app.cache.layout import CacheLayout
from bench.common import machine, record, write


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Timer:
    """Device time of work on ``stream`` (CUDA events), or host time on CPU."""

    def __init__(self, dev: torch.device, stream=None) -> None:
        self.dev, self.stream = dev, stream

    def __enter__(self) -> _Timer:
        if self.dev.type == "cuda":
            self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            self.a.record(self.stream)
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.dev.type == "cuda":
            self.b.record(self.stream)
            self.b.synchronize()
            self.s = self.a.elapsed_time(self.b) / 1e3
        else:
            self.s = time.perf_counter() - self.t0


def ceiling(dev: torch.device, nbytes: int, repeats: int) -> float:
    """Seconds of one pinned H2D copy of ``nbytes`` (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(repeats + 1):
        with _Timer(dev, torch.cuda.current_stream(dev) if dev.type == "cuda" else None) as t:
            dst.copy_(src, non_blocking=True)
        times.append(t.s)
    return statistics.median(times[1:])


def build(dev: torch.device, tokens: int) -> tuple[PagedKVCache, HostTier, int]:
    """The scaled V4.1-Flash paged pools (twice the request's blocks) and a host tier."""
    from bench.flash_rank import flash_config

    cfg = flash_config()
    layout = CacheLayout.build(cfg, 64, torch.bfloat16, kv_quant=True)
    n = -(-tokens // layout.block_size)
    kv = PagedKVCache(layout, 2 * n, 1, dev)
    host = HostTier(kv.pools, 2 * n, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    for v in host.views:  # random bytes in every block
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g).to(dev))
    return kv, host, n


def _wait_ready(host: HostTier, blocks: list[int]) -> float:
    t0 = time.perf_counter()
    host.poll()
    while not host.ready(blocks):
        host.poll()
    return time.perf_counter() - t0


def run(dev: torch.device, tokens: int, repeats: int) -> tuple[list[dict], dict]:
    kv, host, n = build(dev, tokens)
    nbytes = n * host.bytes_per_block
    cs = host.copy_stream
    main = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    src = list(range(n))  # the request's blocks
    original = [v[:n].clone() for v in host.views]
    g = torch.Generator().manual_seed(1)
    dst_all = (n + torch.randperm(n, generator=g)).tolist()  # scattered free device blocks
    c_small = ceiling(dev, nbytes, repeats)
    c_big = ceiling(dev, max(nbytes, 256 << 20), repeats)
    ceil_bw = max(c_small and nbytes / c_small, c_big and max(nbytes, 256 << 20) / c_big)
    params = {"tokens": tokens, "blocks": n, "bytes": nbytes,
              "bytes_per_block": host.bytes_per_block, "tensors": len(host.views)}  # fmt: skip
    res: dict[str, list[float]] = {k: [] for k in ("offload", "load", "scattered", "ready")}
    for _ in range(repeats + 1):
        rows = [host.alloc() for _ in range(n)]  # contiguous: lowest first
        with _Timer(dev, main) as t:
            host.offload(src, rows)
        res["offload"].append(t.s)
        _sync(dev)
        t = _Timer(dev, cs).__enter__()
        t0 = time.perf_counter()
        host.load(rows, dst_all)
        end = None
        if dev.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record(cs)
        _wait_ready(host, dst_all)
        res["ready"].append(time.perf_counter() - t0)  # issue -> ready, as a request sees it
        if end is not None:
            end.synchronize()
            t.s = t.a.elapsed_time(end) / 1e3
        else:
            t.s = res["ready"][-1]
        res["load"].append(t.s)
        for v, o in zip(host.views, original, strict=True):
            if not torch.equal(v[dst_all], o):
                raise AssertionError("load-back changed the bytes")
        every = [host.alloc() for _ in range(2 * n)]  # every other row: runs of one
        host.free(every[1::2])
        host.offload(src, every[::2])
        _sync(dev)
        with _Timer(dev, cs) as t:
            host.load(every[::2], dst_all)
        res["scattered"].append(t.s)
        _wait_ready(host, dst_all)
        _sync(dev)
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    floor = nbytes / ceil_bw
    recs = [
        record("kv_tiers.pcie_ceiling", nbytes / c_small / 1e9, "GB/s", params,
               peer={"name": "256 MiB pinned H2D", "value": max(nbytes, 256 << 20) / c_big / 1e9}),
        record("kv_tiers.load_back", med["load"] * 1e3, "ms", params, floor * 1e3,
               peer={"name": "load GB/s", "value": nbytes / med["load"] / 1e9}),
        record("kv_tiers.load_back_scattered", med["scattered"] * 1e3, "ms", params, floor * 1e3,
               peer={"name": "load GB/s", "value": nbytes / med["scattered"] / 1e9}),
        record("kv_tiers.load_ready", med["ready"] * 1e3, "ms", params, floor * 1e3),
        record("kv_tiers.offload", med["offload"] * 1e3, "ms", params, floor * 1e3,
               peer={"name": "offload GB/s", "value": nbytes / med["offload"] / 1e9}),
    ]  # fmt: skip
    if dev.type == "cuda":
        recs.append(overlap(dev, host, dst_all, nbytes, repeats, params))
    return recs, {"ceiling_GBps": ceil_bw / 1e9}


def overlap(dev, host: HostTier, dst: list[int], nbytes: int, repeats: int, params) -> dict:
    """A load on the copy stream while the compute stream runs a matmul loop."""
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

    def step() -> None:
        for _ in range(32):  # ~6 ms on an H200: a decode step's length
            a @ a

    n = len(dst)
    times = {"step": [], "load": [], "both": []}
    for _ in range(repeats + 1):
        rows = [host.alloc() for _ in range(n)]
        host.offload(list(range(n)), rows)
        _sync(dev)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times["step"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        host.load(rows, dst)
        _sync(dev)
        times["load"].append(time.perf_counter() - t0)
        _wait_ready(host, dst)
        rows = [host.alloc() for _ in range(n)]
        host.offload(list(range(n)), rows)
        _sync(dev)
        t0 = time.perf_counter()
        step()
        host.load(rows, dst)
        _sync(dev)
        times["both"].append(time.perf_counter() - t0)
        _wait_ready(host, dst)
    m = {k: statistics.median(v[1:]) for k, v in times.items()}
    serial = {"name": "step + load serially (ms)", "value": (m["step"] + m["load"]) * 1e3}
    return record("kv_tiers.load_overlap", m["both"] * 1e3, "ms", params,
                  max(m["step"], m["load"]) * 1e3, peer=serial)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for kv_tiers_gpu.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    recs, info = run(dev, args.tokens, args.repeats)
    cmd = f"PYTHONPATH=. python -m bench.kv_tiers_gpu --out {args.out} --tokens {args.tokens}"
    write("kv_tiers_gpu", recs, args.out, command=cmd, info={**machine(), **info})
    for r in recs:
        ratio = f"{r['ratio_to_floor']:.2f}x floor" if r["ratio_to_floor"] else ""
        peer = f"  [{r['peer']['name']}: {r['peer']['value']:.2f}]" if r["peer"] else ""
        print(f"{r['name']:<32} {r['value']:10.3f} {r['unit']:<5} {ratio}{peer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
