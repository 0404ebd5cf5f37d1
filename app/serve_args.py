"""ServeArgs: what ``serve_config.yaml``'s ``args:`` holds, validated once with pydantic and
turned into the frozen engine configs. Kept apart from ``app/config.py`` so the engine (and the
GPU machine, which has no pydantic) never imports pydantic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.config import CacheConfig, EngineConfig, SchedulerConfig

TINY_MODELS = {"tiny-v41": "v41", "tiny-v4": "v4"}


class EngineArgs(BaseModel):
    """Engine options of every DP rank (fields of EngineConfig / CacheConfig /
    SchedulerConfig; see docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid")

    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    packed_experts: Literal["auto", "on", "off"] = "auto"
    overlap_schedule: bool = True
    seed: int = 0
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    max_model_len: int = Field(0, ge=0)
    block_size: int = Field(0, ge=0)
    enable_prefix_caching: bool = True
    bounded_replay: Literal["off", "encoder", "encoder+decoder"] = "encoder+decoder"
    kv_cache_bytes: int | None = Field(None, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_quant: bool = False


class ApiArgs(BaseModel):
    """HTTP / gRPC front-door options."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 << 20, gt=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    api_keys: list[str] = Field(default_factory=list)
    default_max_tokens: int | None = Field(None, gt=0)
    request_timeout_s: float | None = Field(600.0, gt=0)
    max_pending_per_rank: int | None = Field(None, gt=0)


class ObservabilityArgs(BaseModel):
    """Tracing export (OpenTelemetry) and metrics."""

    model_config = ConfigDict(extra="forbid")

    tracing: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = "fathom"


class ServeArgs(BaseModel):
    """The application's arguments (``serve run serve_config.yaml`` passes ``args:``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-v41"  # a checkpoint directory, or a built-in tiny model name
    served_model_names: list[str] = Field(default_factory=list)  # default: the model's name
    cache_dir: str = "~/.cache/fathom"  # where built-in tiny checkpoints are made
    dp_size: int = Field(2, gt=0)
    rank_num_cpus: float = Field(0.5, gt=0)
    rank_num_gpus: float = Field(0, ge=0)
    ingress_num_cpus: float = Field(0.25, gt=0)
    ingress_replicas: int = Field(1, gt=0)
    engine: EngineArgs = Field(default_factory=EngineArgs)
    api: ApiArgs = Field(default_factory=ApiArgs)
    observability: ObservabilityArgs = Field(default_factory=ObservabilityArgs)

    @field_validator("served_model_names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        if any(not n or len(n) > 256 for n in v):
            raise ValueError("served model names must be 1..256 characters")
        return v

    def model_path(self) -> Path:
        """The checkpoint directory; a built-in tiny model is made on first use."""
        if self.model in TINY_MODELS:
            from app.model.tiny import make_tiny_checkpoint

            path = Path(self.cache_dir).expanduser() / self.model
            if not (path / "config.json").is_file():
                make_tiny_checkpoint(path, arch=TINY_MODELS[self.model], seed=0)
            return path
        path = Path(self.model).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {self.model!r} is neither a built-in tiny model "
                f"({', '.join(TINY_MODELS)}) nor a directory with config.json"
            )
        return path

    def names(self) -> list[str]:
        return self.served_model_names or [
            self.model if self.model in TINY_MODELS else Path(self.model).name
        ]

    def engine_config(self, path: Path) -> EngineConfig:
        e = self.engine
        return EngineConfig(
            model=str(path),
            device=e.device,
            dtype=e.dtype,
            packed_experts=e.packed_experts,
            overlap_schedule=e.overlap_schedule,
            seed=e.seed,
            cache=CacheConfig(
                block_size=e.block_size,
                enable_prefix_caching=e.enable_prefix_caching,
                bounded_replay=e.bounded_replay,
                kv_cache_bytes=e.kv_cache_bytes,
                gpu_memory_utilization=e.gpu_memory_utilization,
                kv_quant=e.kv_quant,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=e.max_num_seqs,
                max_num_batched_tokens=e.max_num_batched_tokens,
                max_model_len=e.max_model_len,
            ),
        )
