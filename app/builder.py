"""``build_app(args)``: the Ray Serve application (``import_path: app.builder:build_app``).

Ingress (HTTP + gRPC) --choose(block hashes)--> Router   (one replica: loads + prefix index)
        \\-----stream (pinned)--> DPRank x dp_size      (one engine each; or autoscaled)
                                  \\--report(stats, KV events)--> Router
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import (
    GangPlacementStrategy,
    GangRuntimeFailurePolicy,
    GangSchedulingConfig,
    RequestRouterConfig,
)

from app.api.server import ApiConfig
from app.cache.events import HASH_NAMESPACE
from app.config import EngineConfig, ParallelConfig
from app.deployments.ingress import Ingress
from app.deployments.rank import DPRank
from app.deployments.router import EngramPlan, PinnedRequestRouter, Router
from app.deployments.routing import RoutingConfig
from app.engine.capacity import resolve_max_model_len
from app.model.config import ModelConfig
from app.observability import TracingConfig
from app.serve_args import ServeArgs


@dataclass(frozen=True)
class AppConfigs:
    """What the deployments are built from: one ``max_model_len`` for ingress and ranks."""

    engine: EngineConfig
    api: ApiConfig
    bos_token_id: int
    max_pending_per_rank: int
    max_queued_tokens_per_rank: int
    routing: RoutingConfig
    parallel: ParallelConfig
    engram: EngramPlan


def app_configs(sa: ServeArgs) -> AppConfigs:
    """Resolve ``sa`` against the model: the engine config with an explicit max_model_len
    (auto = the model's limit capped by the KV pool), and the API config sharing it."""
    path = sa.model_path()
    mcfg = ModelConfig.from_file(path)
    engine_cfg = resolve_max_model_len(sa.engine_config(path), mcfg)
    if engine_cfg.speculative is not None:  # e.g. mtp on a V4.1 checkpoint: fail here
        engine_cfg.speculative.check_model(mcfg)
    max_pending, max_tokens = sa.rank_limits(engine_cfg)
    max_ranks = sa.autoscaling.max_ranks if sa.autoscaling else sa.dp_size
    api_cfg = ApiConfig(
        served_model_names=sa.names(),
        tokenizer_path=str(path / "tokenizer.json"),
        context_limit=engine_cfg.scheduler.max_model_len,
        model_version=mcfg.arch,
        max_body_bytes=sa.api.max_body_bytes,
        max_prompt_tokens=sa.api.max_prompt_tokens,
        api_keys=list(sa.api.api_keys),
        default_max_tokens=sa.api.default_max_tokens,
        request_timeout_s=sa.api.request_timeout_s,
        vocab_size=mcfg.vocab_size,
        request_id_header=None,  # Serve's proxy sends x-request-id
        body_read_timeout_s=sa.api.body_read_timeout_s,
        max_json_depth=sa.api.max_json_depth,
        max_header_bytes=sa.api.max_header_bytes,
        max_headers=sa.api.max_headers,
        cors_allow_origins=list(sa.api.cors_allow_origins),
        # shed load before any work: what every rank's queue holds, plus what is being prepared
        max_in_flight=-(-max_ranks * max_pending // sa.ingress_replicas) + 32,
    )
    r = sa.routing
    caching = engine_cfg.cache.enable_prefix_caching
    routing = RoutingConfig(
        policy=r.policy,
        block_size=engine_cfg.cache.resolve_block_size(mcfg) if caching else 0,
        namespace=HASH_NAMESPACE,
        balance_abs=r.balance_abs,
        balance_rel=r.balance_rel,
        running_weight=r.running_weight,
        compute_weight=r.compute_weight,
        host_hit_cost=r.host_hit_cost,
        max_index_blocks=r.max_index_blocks,
        pending_ttl_s=r.pending_ttl_s,
    )
    parallel = sa.parallel_config()
    parallel.check(mcfg, sa.dp_size)  # gangs fit the ranks, experts split over a gang
    key = "fathom-engram-" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    engram = EngramPlan(parallel.engram_placement, key)  # one host copy per node and model
    return AppConfigs(engine_cfg, api_cfg, mcfg.bos_token_id, max_pending, max_tokens, routing,
                      parallel, engram)  # fmt: skip


def build_app(args: dict[str, Any]) -> serve.Application:
    """Validate ``args`` (ServeArgs) and bind Router, DPRank and Ingress."""
    sa = ServeArgs.model_validate(args or {})
    cfgs = app_configs(sa)
    obs = sa.observability
    tracing = TracingConfig(obs.tracing, obs.otlp_endpoint, obs.service_name, obs.sample_ratio,
                            obs.export_delay_s)  # fmt: skip
    metrics_s = obs.engine_metrics_interval_s if obs.engine_metrics else None
    router = Router.bind(cfgs.routing, tracing, cfgs.engram)
    if cfgs.routing.policy == "ray_prefix":  # Ray's own prefix router on the rank handle
        from app.deployments.ray_prefix import PinnedOrRayPrefixRouter as rank_router
    else:
        rank_router = PinnedRequestRouter
    scale = sa.autoscaling
    gangs = {}
    if sa.ep_size > 1:  # one placement group per gang, PACK; a lost rank restarts its gang
        gangs["gang_scheduling_config"] = GangSchedulingConfig(
            gang_size=sa.ep_size,
            gang_placement_strategy=GangPlacementStrategy.PACK,
            runtime_failure_policy=GangRuntimeFailurePolicy.RESTART_GANG,
        )
    rank = serve.deployment(
        DPRank,
        name="DPRank",
        num_replicas="auto" if scale else sa.dp_size,
        autoscaling_config=scale.serve_config() if scale else None,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": sa.rank_num_cpus, "num_gpus": sa.rank_num_gpus},
        request_router_config=RequestRouterConfig(request_router_class=rank_router),
        health_check_period_s=10,
        # a rank that scales down finishes its streams first
        graceful_shutdown_timeout_s=sa.api.request_timeout_s or 600.0,
        **gangs,
    ).bind(
        cfgs.engine,
        router,
        cfgs.max_pending_per_rank,
        cfgs.max_queued_tokens_per_rank,
        sa.rank_step_timeout_s,
        stream_interval_s=sa.routing.stream_interval_s,
        tracing=tracing,
        metrics_interval_s=metrics_s,
        parallel=cfgs.parallel,
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        num_replicas=sa.ingress_replicas,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": sa.ingress_num_cpus},
    ).bind(
        cfgs.api,
        rank,
        router,
        cfgs.bos_token_id,
        tracing,
        block_size=cfgs.routing.block_size,
    )
    return ingress
