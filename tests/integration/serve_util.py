"""What the Serve integration modules share: the session's cluster (conftest.py), deploying
an app, and waiting for an app's /health (free ports: tests/ports.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

APP = "fathom"


@dataclass(frozen=True)
class Cluster:
    """Ports of the session's Serve instance (HTTP, gRPC) and of Ray's metrics export."""

    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


@contextmanager
def deploy(app: Any) -> Iterator[None]:
    """Run ``app`` as the module's ``fathom`` app at ``/``; delete it afterwards."""
    from ray import serve

    serve.run(app, name=APP, route_prefix="/")
    try:
        yield
    finally:
        serve.delete(APP)


def wait_healthy(base: str, timeout_s: float = 120.0) -> None:
    """Until ``base``/health answers 200 (or ``timeout_s`` passes; the tests then fail on
    their first request, saying what did not answer)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Until ``cond()`` is true (exceptions count as not yet: a router or rank may be
    restarting); fails the test naming ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while True:
        try:
            if cond():
                return
        except Exception:
            pass
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
