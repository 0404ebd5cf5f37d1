"""PD disaggregation against the same ranks without it (CPU, tiny V4.1, the real Serve app):
TTFT and TPOT of a mixed load — long prompts with a few output tokens arriving among
decode-heavy requests (short prompts, many output tokens).

    python -m bench.pd [--long 8] [--decode 8] [--long-tokens 1536] [--decode-tokens 64]

Runs the app twice on one local Ray: ``dp`` (2 DP ranks, every rank prefills and decodes)
and ``pd`` (1 prefill rank + 1 decode rank, KV through the object store), the same engine
options and arrival schedule; streams over gRPC (exact token counts). TPOT of a request =
(last token - first token) / (tokens - 1). Writes bench/results/pd.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from bench.common import record, write

ENGINE = {"kv_cache_bytes": 1 << 26, "max_model_len": 4096, "max_num_seqs": 32,
          "max_num_batched_tokens": 512}  # fmt: skip


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def schedule(args) -> list[tuple[float, str, list[int], int]]:
    """(arrival s, class, prompt, max_tokens): long prompts and decode-heavy requests
    interleaved, Poisson arrivals at ``args.rate`` per second."""
    rng = random.Random(0)
    kinds = ["long"] * args.long + ["decode"] * args.decode
    rng.shuffle(kinds)
    t, out = 0.0, []
    for k in kinds:
        n, m = (args.long_tokens, 4) if k == "long" else (32, args.decode_tokens)
        out.append((t, k, [0] + [rng.randrange(3, 500) for _ in range(n)], m))
        t += rng.expovariate(args.rate)
    return out


async def drive(target: str, reqs) -> list[dict]:
    import grpc

    from app.grpc import fathom_pb2 as pb
    from app.grpc import fathom_pb2_grpc as pbg

    async with grpc.aio.insecure_channel(target) as ch:
        stub = pbg.GenerateServiceStub(ch)
        t0 = time.perf_counter()

        async def one(at: float, kind: str, prompt: list[int], n: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            req = pb.GenerateRequest(
                model="tiny-v41", token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingOptions(max_tokens=n, temperature=0, ignore_eos=True),
            )  # fmt: skip
            start, times = time.perf_counter(), []
            async for out in stub.Generate(req, metadata=(("application", "fathom"),)):
                times += [time.perf_counter()] * len(out.token_ids)
            ttft = times[0] - start
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            return {"kind": kind, "ttft": ttft, "tpot": tpot, "tokens": len(times)}

        return list(await asyncio.gather(*(one(*r) for r in reqs)))


def run(mode: str, reqs, cache_dir: str) -> dict:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from app.builder import build_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()},
                grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[
                    "app.grpc.raw.add_GenerateServiceServicer_to_server"]))  # fmt: skip
    args = {"model": "tiny-v41", "cache_dir": cache_dir, "rank_num_cpus": 0.5, "engine": ENGINE,
            "api": {"request_timeout_s": 600}}  # fmt: skip
    if mode == "pd":
        args["pd"] = {"prefill": {"ranks": 1}, "decode": {"ranks": 1}}
    else:
        args["dp_size"] = 2
    serve.run(build_app(args), name="fathom", route_prefix="/")
    target = f"127.0.0.1:{port}"
    asyncio.run(drive(target, [(0.0, "warm", [0, 5, 9], 4)]))  # ranks up, code paths warm
    t0 = time.perf_counter()
    res = asyncio.run(drive(target, reqs))
    wall = time.perf_counter() - t0
    serve.shutdown()
    out: dict = {"wall_s": wall}
    for kind in ("long", "decode"):
        rs = [r for r in res if r["kind"] == kind]
        tp = [r["tpot"] for r in rs if r["tpot"] is not None]
        out[kind] = {
            "n": len(rs), "ttft_p50": _pct([r["ttft"] for r in rs], 0.5),
            "ttft_p90": _pct([r["ttft"] for r in rs], 0.9), "tpot_p50": _pct(tp, 0.5),
            "tpot_p90": _pct(tp, 0.9), "tpot_mean": statistics.fmean(tp) if tp else None,
        }  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import tempfile

    import ray

    reqs = schedule(args)
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    cache_dir = tempfile.mkdtemp(prefix="fathom-bench-pd-")
    table = {mode: run(mode, reqs, cache_dir) for mode in ("dp", "pd")}
    ray.shutdown()
    records = []
    params = {k: getattr(args, k) for k in ("long", "decode", "long_tokens", "decode_tokens",
                                            "rate")}  # fmt: skip
    print(f"{'mode':4} {'class':6} {'TTFT p50':>9} {'p90':>7} {'TPOT p50':>9} {'p90':>7}  wall")
    for mode, res in table.items():
        for kind in ("long", "decode"):
            r = res[kind]
            tp50, tp90 = r["tpot_p50"] or 0, r["tpot_p90"] or 0
            print(f"{mode:4} {kind:6} {r['ttft_p50']:9.3f} {r['ttft_p90']:7.3f} "
                  f"{tp50:9.4f} {tp90:7.4f}  {res['wall_s']:.1f}")  # fmt: skip
            for key in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
                if r[key] is not None:
                    records.append(record(f"{mode}.{kind}.{key}", r[key], "s", params))
        records.append(record(f"{mode}.wall", res["wall_s"], "s", params))
    print(write("pd", records))


if __name__ == "__main__":
    main()
