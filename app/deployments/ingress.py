"""Ingress: the HTTP API (OpenAI / Anthropic, via app.api) and the gRPC ``Generate`` service
(``app.api.grpc_service``: the same keys, limits, defaults and validation), both over the
Router + DPRank handles. Tokenization and protocol conversion happen here."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.api.grpc_service import GenerateService
from app.api.metered import MeteredClient, metrics_app
from app.api.server import FrontDoor, build_api
from app.deployments.client import ServeEngineClient
from app.deployments.pd_client import PDEngineClient
from app.engine.admission import Admission
from app.grpc.fathom_pb2 import GenerateResponse
from app.logs import setup_logging
from app.observability import (
    ObservabilityConfig,
    RequestMetrics,
    setup_tracing,
    shutdown_tracing,
    traced_client,
)

logger = logging.getLogger(__name__)


class Ingress:
    """The front door (one or more replicas)."""

    def __init__(
        self,
        api_cfg: FrontDoor,
        rank: DeploymentHandle,
        router: DeploymentHandle,
        bos_token_id: int,
        tracing: ObservabilityConfig | None = None,
        block_size: int = 0,
        decode: DeploymentHandle | None = None,
        decode_router: DeploymentHandle | None = None,
    ) -> None:
        """``rank`` / ``router``: the DP ranks and their Router; with prefill/decode
        disaggregation the prefill ranks, and ``decode`` / ``decode_router`` the decode side
        (app.deployments.pd)."""
        setup_logging()
        setup_tracing(tracing, "Ingress")
        self.api_cfg = api_cfg
        self.metrics = RequestMetrics()
        self.engines = ServeEngineClient(rank, router, block_size)
        if decode is not None and decode_router is not None:
            self.engines = PDEngineClient(self.engines, ServeEngineClient(decode, decode_router))
        self.client = MeteredClient(self.engines, self.metrics, api_cfg.served_model_names[0])
        self.client = traced_client(self.client)  # ingress.request spans (tracing on)
        app_name = serve.get_replica_context().app_name
        self.in_flight = Admission(api_cfg.max_in_flight, None)  # HTTP and gRPC together
        self.grpc = GenerateService(
            api_cfg, self.client, bos_token_id, app_name=app_name, in_flight=self.in_flight
        )

    def __serve_build_asgi_app__(self):
        metrics = metrics_app(self.metrics, self.engines.ranks_stats)
        return build_api(self.api_cfg, self.client, metrics_app=metrics, in_flight=self.in_flight)

    async def Generate(  # noqa: N802 (the gRPC method name)
        self, request: bytes, grpc_context=None
    ) -> AsyncIterator[GenerateResponse]:
        """gRPC server-streaming generation (token ids or raw text, no chat template); the
        request comes as raw bytes (``app.grpc.raw``), Serve passes ``grpc_context``."""
        async for out in self.grpc.generate(request, grpc_context):
            yield out

    def __del__(self) -> None:
        shutdown_tracing()  # export the spans still queued
