"""What the Serve integration modules share: a free port, and waiting for an app's /health."""

from __future__ import annotations

import socket
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
