"""``build_app(args)``: the Ray Serve application (``import_path: app.builder:build_app``).

Ingress (HTTP + gRPC) --choose(block hashes)--> Router   (one replica: loads + prefix index)
        \\-----stream (pinned)--> DPRank x dp_size      (one engine each; or autoscaled)
                                  \\--report(stats, KV events)--> Router

With ``pd``: PrefillRank x n behind the Router, DecodeRank x m behind a DecodeRouter
(app.deployments.pd).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from ray import serve
from ray.serve.config import (
    GangPlacementStrategy,
    GangRuntimeFailurePolicy,
    GangSchedulingConfig,
    RequestRouterConfig,
)

from app.api.server import FrontDoor
from app.cache.events import HASH_NAMESPACE
from app.cache.layout import block_size_for
from app.config import EngineConfig
from app.deployments.ingress import Ingress
from app.deployments.pd import PDRank
from app.deployments.rank import DPRank
from app.deployments.router import EngramPlan, PinnedRequestRouter, Router
from app.engine.capacity import resolve_max_model_len
from app.model.config import ModelConfig
from app.serve_args import ServeArgs

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AppConfigs:
    """What the builder resolves against the model (the options stay in ServeArgs): one
    ``max_model_len`` for ingress and ranks, the ranks' queue bounds, the block size the
    Router indexes (0: prefix caching off)."""

    engine: EngineConfig
    api: FrontDoor
    bos_token_id: int
    max_pending_per_rank: int
    max_queued_tokens_per_rank: int
    block_size: int
    engram: EngramPlan
    prefill: EngineConfig | None = None  # PD: the prefill ranks' config (engine: decode's)


def pd_engine_configs(sa: ServeArgs, path, mcfg: ModelConfig) -> tuple[EngineConfig, ...]:
    """(prefill, decode) engine configs of a PD app, sharing one max_model_len (the
    smaller of the two resolved limits)."""
    cfgs = [resolve_max_model_len(sa.pd_engine_config(path, r), mcfg) for r in ROLES]
    m = min(c.scheduler.max_model_len for c in cfgs)
    return tuple(replace(c, scheduler=replace(c.scheduler, max_model_len=m)) for c in cfgs)


def app_configs(sa: ServeArgs) -> AppConfigs:
    """Resolve ``sa`` against the model: the engine config with an explicit max_model_len
    (auto = the model's limit capped by the KV pool), and the API config sharing it."""
    path = sa.model_path()
    mcfg = ModelConfig.from_file(path)
    prefill_cfg = None
    if sa.pd is not None:
        prefill_cfg, engine_cfg = pd_engine_configs(sa, path, mcfg)
    else:
        engine_cfg = resolve_max_model_len(sa.engine_config(path), mcfg)
    if engine_cfg.speculative is not None:  # e.g. mtp on a V4.1 checkpoint: fail here
        engine_cfg.speculative.check_model(mcfg)
    max_pending, max_tokens = sa.rank_limits(engine_cfg)
    max_ranks = sa.autoscaling.max_ranks if sa.autoscaling else sa.dp_size
    if sa.pd is not None:
        max_ranks = sa.pd.prefill.ranks + sa.pd.decode.ranks
    front = FrontDoor(
        served_model_names=tuple(sa.names()),
        tokenizer_path=str(path / "tokenizer.json"),
        context_limit=engine_cfg.scheduler.max_model_len,
        options=sa.api,
        model_version=mcfg.arch,
        vocab_size=mcfg.vocab_size,
        request_id_header=None,  # Serve's proxy sends x-request-id
        # shed load before any work: what every rank's queue holds, plus what is being prepared
        max_in_flight=-(-max_ranks * max_pending // sa.ingress_replicas) + 32,
        deterministic=engine_cfg.deterministic,
    )
    caching = engine_cfg.cache.enable_prefix_caching
    block_size = block_size_for(mcfg, engine_cfg.cache.block_size) if caching else 0
    sa.parallel.check(mcfg, sa.dp_size)  # gangs fit the ranks, experts split over a gang
    key = "fathom-engram-" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
    engram = EngramPlan(sa.parallel.engram_placement, key)  # one host copy per node and model
    return AppConfigs(engine_cfg, front, mcfg.bos_token_id, max_pending, max_tokens, block_size,
                      engram, prefill_cfg)  # fmt: skip


def build_app(args: dict[str, Any]) -> serve.Application:
    """Validate ``args`` (ServeArgs) and bind Router, DPRank and Ingress (with ``pd``:
    Router + PrefillRank, DecodeRouter + DecodeRank, Ingress)."""
    sa = ServeArgs.model_validate(args or {})
    cfgs = app_configs(sa)
    obs = sa.observability
    metrics_s = obs.engine_metrics_interval_s if obs.engine_metrics else None
    router = Router.bind(sa.routing, obs, cfgs.engram, cfgs.block_size, HASH_NAMESPACE)
    if sa.pd is not None:
        return _pd_app(sa, cfgs, router, obs, metrics_s)
    if sa.routing.policy == "ray_prefix":  # Ray's own prefix router on the rank handle
        from app.deployments.ray_prefix import PinnedOrRayPrefixRouter as rank_router
    else:
        rank_router = PinnedRequestRouter
    scale = sa.autoscaling
    rank = _rank_deployment(
        DPRank, "DPRank", sa, "auto" if scale else sa.dp_size, sa.rank_num_cpus,
        sa.rank_num_gpus, rank_router, scale.serve_config() if scale else None,
        sa.parallel.ep_size,
    ).bind(
        cfgs.engine,
        router,
        cfgs.max_pending_per_rank,
        cfgs.max_queued_tokens_per_rank,
        sa.rank_step_timeout_s,
        stream_interval_s=sa.routing.stream_interval_s,
        tracing=obs,
        metrics_interval_s=metrics_s,
        parallel=sa.parallel,
    )  # fmt: skip
    return _ingress(sa, cfgs, obs, rank, router)


def _rank_deployment(cls, name: str, sa: ServeArgs, replicas, cpus: float, gpus: float,
                     rank_router=PinnedRequestRouter, autoscaling=None, gang: int = 1):  # fmt: skip
    gangs = {}
    if gang > 1:  # one placement group per gang, PACK; a lost rank restarts its gang
        gangs["gang_scheduling_config"] = GangSchedulingConfig(
            gang_size=gang,
            gang_placement_strategy=GangPlacementStrategy.PACK,
            runtime_failure_policy=GangRuntimeFailurePolicy.RESTART_GANG,
        )
    return serve.deployment(
        cls,
        name=name,
        num_replicas=replicas,
        autoscaling_config=autoscaling,
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        request_router_config=RequestRouterConfig(request_router_class=rank_router),
        health_check_period_s=10,
        # a rank that scales down finishes its streams first
        graceful_shutdown_timeout_s=sa.api.request_timeout_s or 600.0,
        **gangs,
    )


def _ingress(sa: ServeArgs, cfgs: AppConfigs, tracing, rank, router, **pd) -> serve.Application:
    return serve.deployment(
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
        block_size=cfgs.block_size,
        **pd,
    )


def _pd_app(sa: ServeArgs, cfgs: AppConfigs, router, tracing, metrics_s) -> serve.Application:
    """Prefill ranks behind the (prefix-aware) Router, decode ranks behind a DecodeRouter
    (least loaded, no prefix index), one Ingress over both (``app.deployments.pd``)."""
    pd = sa.pd
    assert pd is not None and cfgs.prefill is not None
    decode_routing = replace(sa.routing, policy="least_loaded")  # no prefix index (block 0)
    decode_router = Router.options(name="DecodeRouter").bind(decode_routing, tracing)
    ranks = {}
    for role, cfg, rt in (("prefill", cfgs.prefill, router), ("decode", cfgs.engine,
                                                               decode_router)):  # fmt: skip
        side = getattr(pd, role)
        max_pending, max_tokens = sa.rank_limits(cfg)
        cpus = side.num_cpus if side.num_cpus is not None else sa.rank_num_cpus
        gpus = side.num_gpus if side.num_gpus is not None else sa.rank_num_gpus
        name = "PrefillRank" if role == "prefill" else "DecodeRank"
        ranks[role] = _rank_deployment(PDRank, name, sa, side.ranks, cpus, gpus).bind(
            cfg, rt, max_pending, max_tokens, sa.rank_step_timeout_s,
            stream_interval_s=sa.routing.stream_interval_s, tracing=tracing,
            metrics_interval_s=metrics_s, pd=pd,
        )  # fmt: skip
    return _ingress(sa, cfgs, tracing, ranks["prefill"], router, decode=ranks["decode"],
                    decode_router=decode_router)  # fmt: skip
