"""Ingress: the HTTP API (OpenAI / Anthropic, via app.api) and the gRPC ``Generate`` service,
both over the Router + DPRank handles. Tokenization and protocol conversion happen here."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import make_asgi_app
from ray.serve.handle import DeploymentHandle
from tokenizers import Tokenizer

from app.api.server import ApiConfig, build_api
from app.deployments.client import MeteredClient, ServeEngineClient
from app.engine.request import EngineRequest, RequestError, SamplingParams, new_request_id
from app.grpc.fathom_pb2 import GenerateRequest, GenerateResponse
from app.observability import RequestMetrics, setup_tracing

logger = logging.getLogger(__name__)


class Ingress:
    """The front door (one or more replicas)."""

    def __init__(
        self,
        api_cfg: ApiConfig,
        rank: DeploymentHandle,
        router: DeploymentHandle,
        bos_token_id: int,
        tracing: tuple[str, str | None, str],
    ) -> None:
        setup_tracing(*tracing)
        self.api_cfg = api_cfg
        self.metrics = RequestMetrics()
        self.engines = ServeEngineClient(rank, router)
        self.client = MeteredClient(self.engines, self.metrics, api_cfg.served_model_names[0])
        self.tokenizer = Tokenizer.from_file(api_cfg.tokenizer_path)
        self.bos = bos_token_id

    def __serve_build_asgi_app__(self):
        metrics_app = make_asgi_app(self.metrics.registry)

        async def metrics(scope, receive, send):  # refresh rank gauges on each scrape
            try:
                self.metrics.set_ranks(await self.engines.ranks_stats())
            except Exception as e:  # a scrape still answers (with the last rank gauges)
                logger.warning("rank stats for /metrics failed: %r", e)
            await metrics_app(scope, receive, send)

        return build_api(self.api_cfg, self.client, metrics_app=metrics)

    async def Generate(self, request: GenerateRequest) -> AsyncIterator[GenerateResponse]:  # noqa: N802
        """gRPC server-streaming generation (token ids or raw text, no chat template)."""
        # the client's id is echoed back and logged, never used as a key (issue 15, finding 2)
        rid = request.request_id or f"gen-{uuid.uuid4().hex}"
        model = request.model or self.api_cfg.served_model_names[0]
        if model not in self.api_cfg.served_model_names:
            yield GenerateResponse(
                request_id=rid,
                finished=True,
                finish_reason="error",
                error=f"unknown model {model!r}",
            )
            return
        which = request.WhichOneof("prompt")
        ids = (
            list(request.token_ids.ids)
            if which == "token_ids"
            else [self.bos, *self.tokenizer.encode(request.text).ids]
        )
        try:
            params = _sampling(request)
            req = EngineRequest(
                new_request_id(),
                tuple(ids),
                params,
                arrival_time=time.time(),
                client_request_id=request.request_id,
            )
        except RequestError as e:
            yield GenerateResponse(
                request_id=rid, finished=True, finish_reason="error", error=str(e)
            )
            return
        n_gen = 0
        try:
            async for out in self.client.generate(req):
                n_gen += len(out.token_ids)
                if not out.token_ids and not out.finished:
                    continue  # the ack delta
                yield GenerateResponse(
                    request_id=rid,
                    token_ids=out.token_ids,
                    text=self.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                    finished=out.finished,
                    finish_reason=str(out.finish_reason.value) if out.finish_reason else "",
                    error=out.error or "",
                    prompt_tokens=len(ids),
                    completion_tokens=n_gen,
                    cached_tokens=out.num_cached_tokens,
                )
        except RequestError as e:
            yield GenerateResponse(
                request_id=rid, finished=True, finish_reason="error", error=str(e)
            )


def _sampling(r: GenerateRequest) -> SamplingParams:
    s = r.sampling
    kw: dict[str, object] = {
        "stop": list(s.stop),
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "max_tokens",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if s.HasField(name):
            kw[name] = getattr(s, name)
    return SamplingParams(**kw)
