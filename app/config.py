"""Engine configuration: frozen dataclasses validated once, shared by every layer below
the deployments (the GPU machine has no pydantic; ``ServeArgs`` joins with the serving issue).

Values may be "auto" (0 / None) where the engine resolves them from the model and the
memory budget; resolution makes a new object with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from app.model.config import ModelConfig

ReplayMode = Literal["off", "encoder", "encoder+decoder"]
REPLAY_MODES: tuple[str, ...] = ("off", "encoder", "encoder+decoder")


class EngineConfigError(ValueError):
    """An engine option with an invalid value; the message names the option."""


@dataclass(frozen=True)
class CacheConfig:
    """KV cache options.

    ``block_size``: positions per block; 0 = auto (smallest multiple of every compression
    ratio that is >= 64). ``kv_cache_bytes``: pool budget in bytes (CPU; on GPU the budget
    is ``gpu_memory_utilization`` of free memory when this is None).
    ``bounded_replay``: after a prefix hit ending at H, prefill restarts at H - window
    ("encoder"); V4.1 decoder layers also run only on the last window rows of a prompt
    ("encoder+decoder"); "off" = exact (a hit then saves memory, not compute).
    """

    block_size: int = 0
    enable_prefix_caching: bool = True
    bounded_replay: ReplayMode = "encoder+decoder"
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_quant: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 0:
            raise EngineConfigError(f"block_size must be >= 0 (0 = auto), got {self.block_size}")
        if self.bounded_replay not in REPLAY_MODES:
            raise EngineConfigError(
                f"bounded_replay must be one of {REPLAY_MODES}, got {self.bounded_replay!r}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise EngineConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def resolve_block_size(self, model: ModelConfig) -> int:
        """The block size for ``model``: explicit (validated) or auto."""
        ratios = [s.ratio for s in model.layers if s.owns_compressor]
        lcm = math.lcm(*ratios) if ratios else 1
        if self.block_size:
            if self.block_size % lcm:
                raise EngineConfigError(
                    f"block_size {self.block_size} must be a multiple of {lcm} "
                    "(every compression ratio of this model)"
                )
            return self.block_size
        return lcm * max(1, math.ceil(64 / lcm))
