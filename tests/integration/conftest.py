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
    c = Cluster(free_port(), free_port(), free_port())
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=c.metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})  # fmt: skip
    serve.start(
        http_options={"host": "127.0.0.1", "port": c.http_port},
        grpc_options=gRPCOptions(
            port=c.grpc_port,
            grpc_servicer_functions=["app.grpc.raw.add_GenerateServiceServicer_to_server"],
        ),
    )
    yield c
    serve.shutdown()
    ray.shutdown()
