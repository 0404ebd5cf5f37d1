"""Free TCP ports for the test servers, outside the ranges other processes draw from.

A port found by ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range
(32768-60999 here), the same range every Ray worker, raylet and gRPC client socket binds
into; with the Ray modules running beside the unit tests, such a port can be taken between
the probe and the server's own bind ("Failed to bind to address" at ``serve.start``). The
ports below come from 20000-32767: under the ephemeral range and above Ray's worker-port
range (10002-19999), so only an explicit bind can hold one.
"""

from __future__ import annotations

import os
import random
import socket
import time

_LO, _HI = 20000, 32768


def free_port() -> int:
    """A port in [20000, 32768) that nothing listens on now (probed with a bind)."""
    rng = random.Random(os.getpid() * 1_000_003 + time.monotonic_ns())
    for _ in range(500):
        port = rng.randrange(_LO, _HI)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{_LO}, {_HI}) after 500 probes")
