"""One Ray cluster and one Serve instance for every integration module (a cluster start and
its shutdown cost ~30 s on two cores). Each module deploys its own app as ``fathom`` and
deletes it at its end (``serve_util.deploy``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.integration.serve_util import Cluster
from tests.ports import free_port


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import gRPCOptions

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Serve kills a proxy that is not ready 5 s after it starts (serve.start then raises
    # ActorDiedError): on a 2-core CI machine beside the unit suite a proxy's start took
    # longer once. The cluster's processes inherit these from this one.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    c = Cluster(free_port(), free_port(), free_port())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=c.metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    options = {
        "http_options": {"host": "127.0.0.1", "port": c.http_port},
        "grpc_options": gRPCOptions(
            port=c.grpc_port,
            grpc_servicer_functions=["app.grpc.raw.add_GenerateServiceServicer_to_server"],
        ),
    }
    try:
        serve.start(**options)
    except TimeoutError:  # its 60 s wait for the proxy (not configurable) ran out: Serve is
        serve.start(**options)  # up, so this connects; each app waits for /health itself
    yield c
    serve.shutdown()
    ray.shutdown()
