"""How many positions one rank's KV pool holds, computed without loading weights, so the
ingress and the ranks resolve an auto ``max_model_len`` to the same number.

    cfg = resolve_max_model_len(cfg, model_cfg)   # scheduler.max_model_len: 0 -> explicit

The arithmetic is :class:`~app.engine.core.EngineCore`'s (a test holds them equal): after
``max_num_seqs`` request slots, the budget buys ``num_blocks`` blocks of ``block_size``
positions; one request can hold them all.
"""

from __future__ import annotations

from dataclasses import replace

from app.cache.manager import CacheManager
from app.config import EngineConfig
from app.engine.core import _DTYPES, DEFAULT_CPU_KV_BYTES, cache_extras, pool_blocks
from app.model.config import ModelConfig
from app.model.loader import build_empty_model


def kv_positions(cfg: EngineConfig, mcfg: ModelConfig) -> int | None:
    """Positions the KV pool of one rank holds; None when the budget is a fraction of the
    free memory of the rank's GPU (known on the rank only)."""
    budget = cfg.cache.kv_cache_bytes
    if budget is None:
        if cfg.device != "cpu":
            return None
        budget = DEFAULT_CPU_KV_BYTES
    model = build_empty_model(mcfg, kv_quant=cfg.cache.kv_quant)
    layout = CacheManager.layout_for(model, cfg.cache, _DTYPES[cfg.dtype],
                                     *cache_extras(cfg, model))  # fmt: skip
    return pool_blocks(budget, cfg.scheduler.max_num_seqs, layout) * layout.block_size


def resolve_max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> EngineConfig:
    """``cfg`` with ``scheduler.max_model_len`` explicit: the configured value (0 = the
    model's ``max_position_embeddings``) capped by what the KV pool holds, where known."""
    limit = min(cfg.scheduler.max_model_len or mcfg.max_position_embeddings,
                mcfg.max_position_embeddings)  # fmt: skip
    held = kv_positions(cfg, mcfg)
    if held is not None:
        limit = min(limit, held)
    return replace(cfg, scheduler=replace(cfg.scheduler, max_model_len=limit))
