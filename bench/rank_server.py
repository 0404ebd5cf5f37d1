"""One Fathom engine as a standalone HTTP server (no Ray): the same front door and engine as
a DP rank behind the Ingress, in one process. It is the per-rank endpoint a gateway of its own
(sglang-router in bench/routing.py) fronts, and the way to serve a config on a host where Ray
cannot run (no Router, no Serve proxy, no gRPC).

    python -m bench.rank_server --port 31001 --kv-bytes 4333568          # tiny-v41, CPU
    python -m bench.rank_server --config configs/flash-rank-1gpu.yaml    # a serve config
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from app.api.metered import MeteredClient, metrics_app
from app.api.server import build_api
from app.app_configs import app_configs
from app.deployments.engine_host import LocalEngineClient
from app.engine.engine import AsyncEngine
from app.logs import setup_logging
from app.observability import RequestMetrics
from app.serve_args import ServeArgs


def serve_args(args: argparse.Namespace) -> tuple[ServeArgs, str, int]:
    """(the app's args, host, port): a serve config's first application and http_options
    (``--port`` overrides), or the tiny test engine of ``--kv-bytes``."""
    if args.config:
        config: dict[str, Any] = yaml.safe_load(Path(args.config).read_text())
        http = config.get("http_options") or {}
        sa = ServeArgs.model_validate(config["applications"][0].get("args") or {})
        return sa, http.get("host", "127.0.0.1"), args.port or http.get("port", 8000)
    if args.kv_bytes is None or args.port is None:
        raise SystemExit("--config, or --port and --kv-bytes")
    sa = ServeArgs.model_validate({
        "model": args.model,
        "dp_size": 1,
        "engine": {"kv_cache_bytes": args.kv_bytes, "max_model_len": 4096, "max_num_seqs": 16,
                   "max_num_batched_tokens": 1024},
        "api": {"request_timeout_s": 300},
    })  # fmt: skip
    return sa, "127.0.0.1", args.port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="serve config YAML: its first application's args")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--kv-bytes", type=int, default=None, help="without --config")
    ap.add_argument("--model", default="tiny-v41", help="without --config")
    args = ap.parse_args()
    setup_logging()
    sa, host, port = serve_args(args)
    if sa.dp_size != 1 or sa.pd is not None:
        raise SystemExit("one engine: dp_size 1, no pd")
    cfgs = app_configs(sa)
    engine = AsyncEngine(cfgs.engine)  # on CUDA: weights, profile, graphs, warm-up
    local = LocalEngineClient(engine, cfgs.max_pending_per_rank, cfgs.max_queued_tokens_per_rank,
                              sa.routing.stream_interval_s)  # fmt: skip
    metrics = RequestMetrics()  # /metrics as the Ingress serves it: requests and the rank's gauges
    client = MeteredClient(local, metrics, sa.names()[0])

    async def ranks_stats() -> dict[str, dict]:
        return {"0": await local.stats()}

    app = build_api(cfgs.api, client, metrics_app=metrics_app(metrics, ranks_stats))
    uvicorn.run(app, host=host, port=port, log_level="warning")


if __name__ == "__main__":
    main()
