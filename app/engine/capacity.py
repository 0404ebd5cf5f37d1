"""How big one rank's KV pool is and how long a request may get: one sizing, used by the
engine core (on its device) and by the builder (``resolve_max_model_len``: without weights,
so the ingress and the ranks resolve an auto ``max_model_len`` to the same number).

    budget      kv_cache_bytes; else on a CUDA device what ``gpu_memory_utilization`` of the
                card leaves after what start-up measured (:class:`DeviceMemory`: in use with
                the weights loaded, the activation peak, the CUDA graphs; known on the rank
                only, ``app.engine.startup``); else DEFAULT_CPU_KV_BYTES on the CPU
    layout      the cache layout of the model (with the speculative ring headroom and the
                drafter's context rings: ``app.engine.spec.proposer.cache_extras``)
    num_blocks  after ``max_num_seqs`` request slots (and the trash slot and block) the
                budget buys this many blocks of ``block_size`` positions
    max_model_len = min(configured or max_position_embeddings, max_position_embeddings,
                        num_blocks * block_size, the context start-up profiled): one
                        request can hold the whole pool

The arithmetic is pure (bytes in, blocks out): :meth:`DeviceMemory.kv_budget`,
:func:`pool_blocks`, :func:`fit_pool`; the unit tests run it with measurements passed in.
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
GIB = float(1 << 30)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class DeviceMemory:
    """What start-up measured on the rank's CUDA device, in bytes.

    ``in_use``: in use on the device with the weights loaded and nothing else held (the CUDA
    context, the weights, library workspaces, compiled kernels, and any other process on
    the card: ``torch.cuda.mem_get_info``); ``weights``: the model's own tensors, part of
    ``in_use``; ``activation_peak``: the transient memory of the largest step; ``graphs``:
    what the CUDA graphs of every bucket hold. The KV pool takes what
    ``utilization`` x ``total`` leaves after the other three."""

    total: int
    in_use: int
    weights: int
    activation_peak: int
    graphs: int
    utilization: float

    @property
    def limit(self) -> int:
        """Everything this engine may hold on the card: ``utilization`` x ``total``."""
        return int(self.utilization * self.total)

    @property
    def kv_budget(self) -> int:
        """Bytes left for the KV pool (may be <= 0: :meth:`check_budget` says so)."""
        return self.limit - self.in_use - self.activation_peak - self.graphs

    def check_budget(self) -> int:
        """:attr:`kv_budget`, or :class:`EngineConfigError` naming the parts when none is
        left."""
        if self.kv_budget <= 0:
            raise EngineConfigError(
                f"no memory left for the KV pool: gpu_memory_utilization {self.utilization:g} "
                f"of {gib(self.total)} is {gib(self.limit)}; in use {gib(self.in_use)} "
                f"(weights {gib(self.weights)}), activation peak {gib(self.activation_peak)}, "
                f"CUDA graphs {gib(self.graphs)}: raise gpu_memory_utilization, lower "
                "max_num_batched_tokens / max_num_seqs / max_model_len, or set kv_cache_bytes"
            )
        return self.kv_budget

    def total_with(self, pool_bytes: int) -> int:
        """What the engine holds at most with a pool of ``pool_bytes``."""
        return self.in_use + self.activation_peak + self.graphs + pool_bytes

    def describe(self, size: PoolSize, slots: int) -> str:
        """One line with every part (GiB) and the pool it leaves."""
        pool = size.pool_bytes(slots)
        return (f"weights {gib(self.weights)}, other in use {gib(self.in_use - self.weights)} "
                f"(CUDA context, workspaces, other processes), activation peak "
                f"{gib(self.activation_peak)}, CUDA graphs {gib(self.graphs)}, KV pool "
                f"{gib(pool)} ({size.num_blocks} blocks of {size.layout.block_size}, "
                f"max_model_len {size.max_model_len}), total {self.total_with(pool) / GIB:.2f} "
                f"of {gib(self.total)} (gpu_memory_utilization {self.utilization:g}: "
                f"{gib(self.limit)})")  # fmt: skip


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

    def pool_bytes(self, slots: int) -> int:
        """Bytes the pool allocates with ``slots`` request slots (trash slot and block too)."""
        return pool_bytes(self.layout, slots, self.num_blocks)

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


def kv_budget(cfg: EngineConfig) -> int | None:
    """Bytes for the KV pool (module doc): ``kv_cache_bytes``, the CPU default, or None on
    a CUDA device without ``kv_cache_bytes`` (measured there at start-up)."""
    if cfg.cache.kv_cache_bytes is not None:
        return cfg.cache.kv_cache_bytes
    if torch.device(cfg.device).type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    return None


def pool_bytes(layout: CacheLayout, slots: int, num_blocks: int) -> int:
    """Bytes of a pool of ``num_blocks`` usable blocks and ``slots`` request slots (plus the
    trash slot and block): the inverse of :func:`pool_blocks`."""
    return (slots + 1) * layout.bytes_per_slot + (num_blocks + 1) * layout.bytes_per_block


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


def fit_pool(
    budget: int, slots: int, layout: CacheLayout, max_model_len: int, max_positions: int,
    max_context: int | None = None,
) -> tuple[int, int]:  # fmt: skip
    """-> (usable blocks, max_model_len) of a pool of ``budget`` bytes: the configured
    ``max_model_len`` (0 = the model's ``max_positions``) capped by the model, by what one
    request can hold in the pool and by ``max_context`` (the longest context start-up
    profiled the activations of; None = no such cap)."""
    num_blocks = pool_blocks(budget, slots, layout)
    limit = min(max_model_len or max_positions, max_positions, num_blocks * layout.block_size)
    if max_context is not None:
        limit = min(limit, max_context)
    return num_blocks, limit


def pool_layout(
    cfg: EngineConfig, model: DeepseekModel, own_drafter: bool = True
) -> tuple[CacheLayout, int, int]:
    """-> (layout, ring headroom, draft stages) of ``model``'s cache under ``cfg``."""
    headroom, stages = cache_extras(cfg, model, own_drafter)
    layout = CacheManager.layout_for(model, cfg.cache, TORCH_DTYPES[cfg.dtype], headroom, stages)
    return layout, headroom, stages


def size_pool(
    cfg: EngineConfig, model: DeepseekModel, budget: int, own_drafter: bool = True,
    max_context: int | None = None,
) -> PoolSize:  # fmt: skip
    """The pool ``budget`` bytes buy for ``model`` under ``cfg`` (module doc).
    ``own_drafter``: the checkpoint's drafter runs (False: a test proposer, no rings);
    ``max_context``: :func:`fit_pool`."""
    layout, headroom, stages = pool_layout(cfg, model, own_drafter)
    num_blocks, limit = fit_pool(budget, cfg.scheduler.max_num_seqs, layout,
                                 cfg.scheduler.max_model_len,
                                 model.cfg.max_position_embeddings, max_context)  # fmt: skip
    return PoolSize(layout, num_blocks, limit, headroom, stages)


def kv_positions(cfg: EngineConfig, mcfg: ModelConfig) -> int | None:
    """Positions the KV pool of one rank holds; None when the budget is measured on the
    rank's GPU at start-up (known on the rank only)."""
    budget = kv_budget(cfg)
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
