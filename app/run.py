"""``python -m app.run [serve_config.yaml]`` (``make serve``): what ``serve run`` does for this
app, plus one "ready" line with the URLs once every rank serves, and a clean shutdown on
SIGTERM or Ctrl-C (under ``serve run``, Ray's driver prints a crash-style trace on SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from app.logs import setup_logging

logger = logging.getLogger("app.run")
READY_TIMEOUT_S = 600.0


def _builder(import_path: str) -> Any:
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _wait_ready(url: str, stop: threading.Event) -> bool:
    """True once ``url`` answers 200 (every rank reported), False when asked to stop."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        stop.wait(0.5)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.run", description=__doc__)
    parser.add_argument("config", nargs="?", default="serve_config.yaml")
    config = yaml.safe_load(Path(parser.parse_args(argv).config).read_text())
    setup_logging()
    from ray import serve

    http = config.get("http_options") or {}
    serve.start(
        proxy_location=config.get("proxy_location"),
        http_options=http,
        grpc_options=config.get("grpc_options"),
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after Ray's init: replaces its handler
        signal.signal(sig, lambda *_: stop.set())
    try:
        for app in config["applications"]:
            target = _builder(app["import_path"])(app.get("args") or {})
            serve.run(target, name=app["name"], route_prefix=app.get("route_prefix", "/"))
        host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
        grpc = config.get("grpc_options") or {}
        if _wait_ready(f"http://{host}:{port}/health", stop):
            where = f"http://{host}:{port}" + (f", gRPC {host}:{grpc['port']}" if grpc else "")
            names = ", ".join(a["name"] for a in config["applications"])
            logger.info("Fathom ready at %s (applications: %s)", where, names)
        elif not stop.is_set():
            logger.error("not ready after %.0f s: see the replica logs", READY_TIMEOUT_S)
        stop.wait()
        logger.info("shutting down")
    finally:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
