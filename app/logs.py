"""Logging of the app's own modules in Ray processes. Ray Serve configures only its
``ray.serve`` logger; without a handler, ``app.*`` INFO lines (engine sizes, "ready") were
dropped and warnings went out unformatted. One stderr handler (Ray forwards a replica's stderr
to the driver console and its worker log) in Serve's line format."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(asctime)s %(name)s -- %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    """Idempotent: a handler on the ``app`` logger (not propagated to the root)."""
    log = logging.getLogger("app")
    if any(getattr(h, "_fathom", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler._fathom = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False
