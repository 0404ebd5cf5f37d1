"""What the builder resolves against the model before any deployment exists (no Ray here:
``bench.rank_server`` and the offline benchmarks use it too): the engine config with an
explicit ``max_model_len``, the front door's config sharing it, the ranks' queue bounds, the
block size the Router indexes and the Engram placement."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from app.api.server import FrontDoor
from app.cache.layout import block_size_for
from app.config import EngineConfig
from app.deployments.routing import EngramPlan
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
