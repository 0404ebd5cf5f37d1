"""How big one rank's KV pool is and how long a request may get: one sizing, used by the
engine core (on its device) and by the builder (``resolve_max_model_len``: without weights,
so the ingress and the ranks resolve an auto ``max_model_len`` to the same number).

    budget      kv_cache_bytes, else gpu_memory_utilization x the GPU's free memory (known
                on the rank only), else DEFAULT_CPU_KV_BYTES on the CPU
    layout      the cache layout of the model (with the speculative ring headroom and the
                drafter's context rings: ``app.engine.spec.proposer.cache_extras``)
    num_blocks  after ``max_num_seqs`` request slots (and the trash slot and block) the
                budget buys this many blocks of ``block_size`` positions
    max_model_len = min(configured or max_position_embeddings, max_position_embeddings,
                        num_blocks * block_size): one request can hold the whole pool
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from app.cache.layout import CacheLayout
from app.cache.manager import CacheManager
from app.config import DTYPES, EngineConfig, EngineConfigError
from app.engine.spec.proposer import cache_extras
from app.model.config import ModelConfig
from app.model.loader import build_empty_model
from app.model.model import DeepseekModel

# EngineConfig.dtype names (app.config.DTYPES) -> torch dtypes; the names are torch's own
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class PoolSize:
    """The KV pool of one rank: its layout, usable blocks and the longest request."""

    layout: CacheLayout
    num_blocks: int
    max_model_len: int
    ring_headroom: int  # rows past the window a verify writes (speculation)
    draft_stages: int  # drafter context rings per slot

    @property
    def positions(self) -> int:
        return self.num_blocks * self.layout.block_size

    def make_cache(
        self, model: DeepseekModel, cfg: EngineConfig, device: torch.device
    ) -> CacheManager:
        """The cache of this size for ``model`` on ``device``: a request's block table holds
        ``max_model_len`` positions."""
        return CacheManager(
            model, cfg.cache, self.num_blocks, cfg.scheduler.max_num_seqs,
            TORCH_DTYPES[cfg.dtype], device,
            max_blocks_per_seq=-(-self.max_model_len // self.layout.block_size),
            ring_headroom=self.ring_headroom, draft_stages=self.draft_stages,
        )  # fmt: skip

    def describe(self, slots: int) -> str:
        P, n = self.layout.block_size, self.num_blocks
        return (f"{n} KV blocks of {P} tokens ({n * self.layout.bytes_per_block / 2**20:.1f} "
                f"MiB), {slots} slots, max_model_len {self.max_model_len}")  # fmt: skip


def kv_budget(cfg: EngineConfig, measure: bool = True) -> int | None:
    """Bytes for the KV pool (module doc). On a GPU without ``kv_cache_bytes`` the budget is
    a share of its free memory: measured here when ``measure``, else None (unknown)."""
    c = cfg.cache
    if c.kv_cache_bytes is not None:
        return c.kv_cache_bytes
    device = torch.device(cfg.device)
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    if not measure:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * c.gpu_memory_utilization)


def pool_blocks(budget: int, slots: int, layout: CacheLayout) -> int:
    """Usable KV blocks a budget of ``budget`` bytes buys after ``slots`` request slots (the
    trash slot and block are allocated beside the usable ones); raises when none."""
    num_blocks = (budget - (slots + 1) * layout.bytes_per_slot) // layout.bytes_per_block - 1
    if num_blocks < 1:
        raise EngineConfigError(
            f"KV budget of {budget} bytes holds no block after {slots} request slots "
            f"({layout.bytes_per_slot} B each); raise kv_cache_bytes or lower max_num_seqs"
        )
    return int(num_blocks)


def size_pool(
    cfg: EngineConfig, model: DeepseekModel, budget: int, own_drafter: bool = True
) -> PoolSize:
    """The pool ``budget`` bytes buy for ``model`` under ``cfg`` (module doc).
    ``own_drafter``: the checkpoint's drafter runs (False: a test proposer, no rings)."""
    headroom, stages = cache_extras(cfg, model, own_drafter)
    layout = CacheManager.layout_for(model, cfg.cache, TORCH_DTYPES[cfg.dtype], headroom, stages)
    num_blocks = pool_blocks(budget, cfg.scheduler.max_num_seqs, layout)
    mpe = model.cfg.max_position_embeddings
    limit = min(cfg.scheduler.max_model_len or mpe, mpe, num_blocks * layout.block_size)
    return PoolSize(layout, num_blocks, limit, headroom, stages)


def kv_positions(cfg: EngineConfig, mcfg: ModelConfig) -> int | None:
    """Positions the KV pool of one rank holds; None when the budget is a fraction of the
    free memory of the rank's GPU (known on the rank only)."""
    budget = kv_budget(cfg, measure=False)
    if budget is None:
        return None
    model = build_empty_model(mcfg, kv_quant=cfg.cache.kv_quant)
    return size_pool(cfg, model, budget).positions


def resolve_max_model_len(cfg: EngineConfig, mcfg: ModelConfig) -> EngineConfig:
    """``cfg`` with ``scheduler.max_model_len`` explicit: the configured value (0 = the
    model's ``max_position_embeddings``) capped by what the KV pool holds, where known."""
    limit = min(cfg.scheduler.max_model_len or mcfg.max_position_embeddings,
                mcfg.max_position_embeddings)  # fmt: skip
    held = kv_positions(cfg, mcfg)
    if held is not None:
        limit = min(limit, held)
    return replace(cfg, scheduler=replace(cfg.scheduler, max_model_len=limit))
