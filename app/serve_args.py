"""ServeArgs: what ``serve_config.yaml``'s ``args:`` holds, validated once with pydantic and
turned into the frozen engine configs. Kept apart from ``app/config.py`` so the engine (and the
GPU machine, which has no pydantic) never imports pydantic. ``engine:`` holds the flat options
of :meth:`EngineConfig.from_options` (the engine dataclasses are their only declaration: names,
types and bounds are checked there, at validation time).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.config import EngineConfig, ParallelConfig

TINY_MODELS = ("tiny-v41", "tiny-v4")  # app.engine.model_path (imported lazily: torch)


class ApiArgs(BaseModel):
    """HTTP / gRPC front-door options."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 << 20, gt=0)
    max_prompt_tokens: int | None = Field(None, gt=0)
    api_keys: list[str] = Field(default_factory=list)
    default_max_tokens: int | None = Field(None, gt=0)
    request_timeout_s: float | None = Field(600.0, gt=0)
    body_read_timeout_s: float | None = Field(30.0, gt=0)
    max_json_depth: int = Field(64, gt=0)
    max_header_bytes: int = Field(32 << 10, gt=0)
    max_headers: int = Field(100, gt=0)
    cors_allow_origins: list[str] = Field(default_factory=list)
    max_pending_per_rank: int | None = Field(None, gt=0)  # None: 2 x engine.max_num_seqs
    max_queued_tokens_per_rank: int | None = Field(None, gt=0)  # None: 32 x max_num_batched


class ObservabilityArgs(BaseModel):
    """Tracing export (OpenTelemetry) and metrics."""

    model_config = ConfigDict(extra="forbid")

    tracing: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str | None = None  # e.g. http://127.0.0.1:4318/v1/traces
    service_name: str = "fathom"
    sample_ratio: float = Field(1.0, ge=0, le=1)  # of new traces; children follow the parent
    export_delay_s: float = Field(1.0, gt=0)  # batch export period of finished spans
    engine_metrics: bool = True  # the ranks' engine metrics through Ray's metrics export
    engine_metrics_interval_s: float = Field(1.0, gt=0)  # their export period


class RoutingArgs(BaseModel):
    """How the Router picks a DP rank (``app.deployments.routing``)."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["prefix", "least_loaded", "round_robin", "ray_prefix"] = "prefix"
    balance_abs: int = Field(16, ge=0)  # requests over the least loaded rank ...
    balance_rel: float = Field(1.5, ge=1.0)  # ... and this ratio: spread a hot prefix
    running_weight: float = Field(16.0, ge=0)  # prefill tokens a running request counts as
    compute_weight: float = Field(4.0, ge=0)  # a request's own prefill, against the queue
    host_hit_cost: float = Field(0.1, ge=0)  # prefill tokens a host-tier hit token counts as
    max_index_blocks: int = Field(4_000_000, gt=0)  # LRU bound of the prefix index
    pending_ttl_s: float = Field(30.0, gt=0)  # a routed prompt counts as cached there this long
    stream_interval_s: float = Field(0.02, ge=0)  # rank-side delta batching (0 = every step)


class AutoscalingArgs(BaseModel):
    """Serve autoscaling of the DP ranks (``app.deployments.autoscaling``); replaces
    ``dp_size`` when given."""

    model_config = ConfigDict(extra="forbid")

    min_ranks: int = Field(1, ge=1)
    max_ranks: int = Field(4, ge=1)
    initial_ranks: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(16.0, gt=0)  # streams per rank
    target_kv_usage: float = Field(0.8, gt=0, le=1)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0)
    metrics_interval_s: float = Field(2.0, gt=0)
    look_back_period_s: float = Field(10.0, gt=0)

    @field_validator("max_ranks")
    @classmethod
    def _bounds(cls, v: int, info) -> int:
        lo = info.data.get("min_ranks", 1)
        if v < lo:
            raise ValueError(f"max_ranks ({v}) must be >= min_ranks ({lo})")
        return v

    def serve_config(self) -> dict[str, Any]:
        """The DPRank deployment's ``autoscaling_config``."""
        return {
            "min_replicas": self.min_ranks,
            "max_replicas": self.max_ranks,
            "initial_replicas": self.initial_ranks or self.min_ranks,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "metrics_interval_s": self.metrics_interval_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": "app.deployments.autoscaling:RankPolicy",
                "policy_kwargs": {"target_kv_usage": self.target_kv_usage},
            },
        }


class PDRoleArgs(BaseModel):
    """One side of prefill/decode disaggregation: its ranks and engine option overrides."""

    model_config = ConfigDict(extra="forbid")

    ranks: int = Field(1, gt=0)
    num_cpus: float | None = Field(None, gt=0)  # None: rank_num_cpus
    num_gpus: float | None = Field(None, ge=0)  # None: rank_num_gpus
    engine: dict[str, Any] = Field(default_factory=dict)  # over ServeArgs.engine


# engine options that decide the KV layout: a prefill and a decode rank must agree on them
PD_LAYOUT_OPTIONS = ("dtype", "block_size", "kv_quant", "speculative")


class PDArgs(BaseModel):
    """Prefill/decode disaggregation (``app.deployments.pd``); replaces ``dp_size``."""

    model_config = ConfigDict(extra="forbid")

    prefill: PDRoleArgs = Field(default_factory=PDRoleArgs)
    decode: PDRoleArgs = Field(default_factory=PDRoleArgs)
    transport: Literal["auto", "object_store", "nixl", "cuda_ipc"] = "auto"
    transfer_timeout_s: float = Field(10.0, gt=0)  # beyond: the decode rank prefills it
    fault: Literal["none", "export", "header"] = "none"  # test-only fault injection

    def role_options(self, engine: dict[str, Any], role: str) -> dict[str, Any]:
        """The engine options of ``role``: ServeArgs.engine with the role's overrides."""
        return {**engine, **getattr(self, role).engine}


class ServeArgs(BaseModel):
    """The application's arguments (``serve run serve_config.yaml`` passes ``args:``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-v41"  # a checkpoint directory, or a built-in tiny model name
    served_model_names: list[str] = Field(default_factory=list)  # default: the model's name
    cache_dir: str = "~/.cache/fathom"  # where built-in tiny checkpoints are made
    dp_size: int = Field(2, gt=0)
    # expert parallelism (app.config.ParallelConfig): gangs of ep_size DP ranks
    ep_size: int = Field(1, gt=0)
    redundant_experts: int = Field(0, ge=0)
    engram_placement: Literal["replicated", "host", "sharded"] = "replicated"
    rank_num_cpus: float = Field(0.5, gt=0)
    rank_num_gpus: float = Field(0, ge=0)
    rank_step_timeout_s: float = Field(300.0, gt=0)  # a step running longer: restart the rank
    ingress_num_cpus: float = Field(0.25, gt=0)
    ingress_replicas: int = Field(1, gt=0)
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig.from_options keywords
    api: ApiArgs = Field(default_factory=ApiArgs)
    observability: ObservabilityArgs = Field(default_factory=ObservabilityArgs)
    routing: RoutingArgs = Field(default_factory=RoutingArgs)
    autoscaling: AutoscalingArgs | None = None  # None: dp_size fixed ranks
    pd: PDArgs | None = None  # prefill/decode disaggregation (None: DP ranks do both)

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: dict[str, Any]) -> dict[str, Any]:
        EngineConfig.from_options("<model>", **v)  # EngineConfigError names the option
        return v

    @model_validator(mode="after")
    def _gangs(self) -> ServeArgs:
        self.parallel_config()  # EngineConfigError names the option
        if self.ep_size > 1 and self.autoscaling is not None:
            raise ValueError("autoscaling of expert-parallel gangs is not supported: set dp_size")
        if self.ep_size > 1 and self.pd is not None:
            raise ValueError("pd ranks as expert-parallel gangs are not supported (yet)")
        if self.dp_size % self.ep_size:
            raise ValueError(f"dp_size ({self.dp_size}) must be a multiple of ep_size "
                             f"({self.ep_size})")  # fmt: skip
        return self

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.ep_size, self.redundant_experts, self.engram_placement)

    @model_validator(mode="after")
    def _pd(self) -> ServeArgs:
        if self.pd is None:
            return self
        if self.autoscaling is not None:
            raise ValueError("pd and autoscaling cannot be combined (yet): set pd.*.ranks")
        if self.routing.policy == "ray_prefix":
            raise ValueError("pd needs the Router's policies (not ray_prefix)")
        cfgs = {}
        for role in ("prefill", "decode"):
            opts = self.pd.role_options(self.engine, role)
            try:
                cfgs[role] = EngineConfig.from_options("<model>", **opts)
            except ValueError as e:
                raise ValueError(f"pd.{role}.engine: {e}") from None
        p, d = cfgs["prefill"], cfgs["decode"]
        mine = {"dtype": (p.dtype, d.dtype), "block_size": (p.cache.block_size,
                d.cache.block_size), "kv_quant": (p.cache.kv_quant, d.cache.kv_quant),
                "speculative": (p.speculative, d.speculative)}  # fmt: skip
        for name in PD_LAYOUT_OPTIONS:
            a, b = mine[name]
            if a != b:
                raise ValueError(f"pd: engine option {name!r} differs between prefill ({a!r}) "
                                 f"and decode ({b!r}); the KV layout must be the same")  # fmt: skip
        return self

    def pd_engine_config(self, path: Path, role: str) -> EngineConfig:
        """The engine config of a PD role (ServeArgs.engine + the role's overrides)."""
        assert self.pd is not None
        return EngineConfig.from_options(str(path), **self.pd.role_options(self.engine, role))

    @field_validator("served_model_names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        if any(not n or len(n) > 256 for n in v):
            raise ValueError("served model names must be 1..256 characters")
        return v

    def model_path(self) -> Path:
        """The checkpoint directory; a built-in tiny model is made on first use."""
        from app.engine.model_path import resolve_model

        return resolve_model(self.model, self.cache_dir)

    def names(self) -> list[str]:
        return self.served_model_names or [
            self.model if self.model in TINY_MODELS else Path(self.model).name
        ]

    def engine_config(self, path: Path) -> EngineConfig:
        return EngineConfig.from_options(str(path), **self.engine)

    def rank_limits(self, cfg: EngineConfig) -> tuple[int, int]:
        """Per-rank queue bounds: unfinished requests, prompt tokens queued for prefill."""
        api, s = self.api, cfg.scheduler
        return (
            api.max_pending_per_rank or 2 * s.max_num_seqs,
            api.max_queued_tokens_per_rank or 32 * s.max_num_batched_tokens,
        )
