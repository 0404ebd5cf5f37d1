"""One Fathom engine as a standalone HTTP server (no Ray): the per-rank endpoint a gateway of
its own (sglang-router in bench/routing.py) fronts. The same API and engine as a DPRank.

    python -m bench.rank_server --port 31001 --kv-bytes 4333568
"""

from __future__ import annotations

import argparse

import uvicorn

from app.api.server import build_api
from app.builder import app_configs
from app.deployments.engine_host import LocalEngineClient
from app.engine.engine import AsyncEngine
from app.serve_args import ServeArgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--model", default="tiny-v41")
    args = ap.parse_args()
    sa = ServeArgs.model_validate({
        "model": args.model,
        "engine": {"kv_cache_bytes": args.kv_bytes, "max_model_len": 4096, "max_num_seqs": 16,
                   "max_num_batched_tokens": 1024},
        "api": {"request_timeout_s": 300},
    })  # fmt: skip
    cfgs = app_configs(sa)
    engine = AsyncEngine(cfgs.engine)
    client = LocalEngineClient(engine, 256, 1 << 20, sa.routing.stream_interval_s)
    uvicorn.run(build_api(cfgs.api, client), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
