"""ServeArgs: what ``serve_config.yaml``'s ``args:`` holds, validated once with pydantic.

Each section *is* the frozen dataclass its owner is built from, declared once beside that
owner with stdlib dataclasses (the engine and the GPU machine have no pydantic): ``api``
(:class:`~app.api.server.ApiConfig`), ``routing`` (:class:`~app.deployments.routing.
RoutingConfig`), ``observability`` (:class:`~app.observability.ObservabilityConfig`), ``pd``
(:class:`~app.deployments.pd.PDConfig`), ``experimental``
(:class:`~app.config.ExperimentalConfig`), and the expert-parallel options, written as
top-level keys, which make up ``parallel`` (:class:`~app.config.ParallelConfig`). Pydantic
validates them from their declaration (types, ``Literal`` choices, bounds in field metadata,
unknown keys refused); a plain-Python construction checks the same declaration
(:func:`app.config.check_fields`). ``engine:`` holds the flat options of
:meth:`EngineConfig.from_options` (the engine dataclasses are their only declaration: names,
types and bounds are checked there, at validation time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from app.api.server import ApiConfig
from app.config import EngineConfig, ExperimentalConfig, ParallelConfig, check_fields
from app.deployments.pd_config import PDConfig, Role
from app.deployments.routing import RoutingConfig
from app.engine.model_path import DEFAULT_CACHE_DIR, TINY_MODELS, resolve_model
from app.observability import ObservabilityConfig

# ParallelConfig's fields are top-level keys of ``args`` (``ep_size: 8``)
PARALLEL_OPTIONS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
# engine options that decide the KV layout: a prefill and a decode rank must agree on them
PD_LAYOUT_OPTIONS = ("dtype", "block_size", "kv_quant", "speculative")


@dataclass(frozen=True)
class AutoscalingConfig:
    """Serve autoscaling of the DP ranks (``app.deployments.autoscaling``); replaces
    ``dp_size`` when given."""

    __pydantic_config__ = {"extra": "forbid"}

    min_ranks: int = field(default=1, metadata={"ge": 1})
    max_ranks: int = field(default=4, metadata={"ge": 1})
    initial_ranks: int | None = field(default=None, metadata={"ge": 1})
    target_ongoing_requests: float = field(default=16.0, metadata={"gt": 0})  # streams a rank
    target_kv_usage: float = field(default=0.8, metadata={"gt": 0, "le": 1})
    upscale_delay_s: float = field(default=10.0, metadata={"ge": 0})
    downscale_delay_s: float = field(default=120.0, metadata={"ge": 0})
    metrics_interval_s: float = field(default=2.0, metadata={"gt": 0})
    look_back_period_s: float = field(default=10.0, metadata={"gt": 0})

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_ranks < self.min_ranks:
            raise ValueError(f"max_ranks ({self.max_ranks}) must be >= min_ranks "
                             f"({self.min_ranks})")  # fmt: skip

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


def _no_experimental(options: Mapping[str, Any], where: str) -> None:
    if "experimental" in options:
        raise ValueError(f"{where}: experimental switches go in the top-level "
                         "experimental block")  # fmt: skip


class ServeArgs(BaseModel):
    """The application's arguments (``serve run serve_config.yaml`` passes ``args:``)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "tiny-v41"  # a checkpoint directory, or a built-in tiny model name
    served_model_names: list[str] = Field(default_factory=list)  # default: the model's name
    cache_dir: str = DEFAULT_CACHE_DIR  # where built-in tiny checkpoints are made
    dp_size: int = Field(2, gt=0)
    parallel: ParallelConfig = ParallelConfig()  # written as top-level keys (PARALLEL_OPTIONS)
    rank_num_cpus: float = Field(0.5, gt=0)
    rank_num_gpus: float = Field(0, ge=0)
    rank_step_timeout_s: float = Field(300.0, gt=0)  # a step running longer: restart the rank
    ingress_num_cpus: float = Field(0.25, gt=0)
    ingress_replicas: int = Field(1, gt=0)
    engine: dict[str, Any] = Field(default_factory=dict)  # EngineConfig.from_options keywords
    api: ApiConfig = ApiConfig()
    observability: ObservabilityConfig = ObservabilityConfig()
    routing: RoutingConfig = RoutingConfig()
    autoscaling: AutoscalingConfig | None = None  # None: dp_size fixed ranks
    pd: PDConfig | None = None  # prefill/decode disaggregation (None: DP ranks do both)
    experimental: ExperimentalConfig = ExperimentalConfig()

    @model_validator(mode="before")
    @classmethod
    def _parallel(cls, data: Any) -> Any:
        """The expert-parallel options are top-level keys: gather them into ``parallel``."""
        if not isinstance(data, Mapping):
            return data
        if "parallel" in data:
            raise ValueError(f"unknown key 'parallel': {', '.join(PARALLEL_OPTIONS)} are "
                             "top-level keys")  # fmt: skip
        rest = {k: v for k, v in data.items() if k not in PARALLEL_OPTIONS}
        return {**rest, "parallel": {k: data[k] for k in PARALLEL_OPTIONS if k in data}}

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: dict[str, Any]) -> dict[str, Any]:
        _no_experimental(v, "engine")
        EngineConfig.from_options("<model>", **v)  # EngineConfigError names the option
        return v

    @model_validator(mode="after")
    def _gangs(self) -> ServeArgs:
        ep = self.parallel.ep_size
        if ep > 1 and self.autoscaling is not None:
            raise ValueError("autoscaling of expert-parallel gangs is not supported: set dp_size")
        if ep > 1 and self.pd is not None:
            raise ValueError("pd ranks as expert-parallel gangs are not supported (yet)")
        if ep > 1 and self.engine.get("deterministic"):
            raise ValueError("engine.deterministic: true needs ep_size 1: an expert-parallel "
                             "gang sums a token's experts in an order that depends on the "
                             "other tokens of the step")  # fmt: skip
        self.parallel.check_ranks(self.dp_size)  # EngineConfigError names the option
        return self

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
            _no_experimental(getattr(self.pd, role).engine, f"pd.{role}.engine")
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
        if p.deterministic != d.deterministic:
            raise ValueError("pd: engine option 'deterministic' differs between prefill and "
                             "decode; a request's bits depend on both roles")  # fmt: skip
        return self

    def pd_engine_config(self, path: Path, role: Role) -> EngineConfig:
        """The engine config of a PD role (ServeArgs.engine + the role's overrides)."""
        assert self.pd is not None
        opts = self.pd.role_options(self.engine, role)
        return EngineConfig.from_options(str(path), **opts, experimental=self.experimental)

    @field_validator("served_model_names")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        if any(not n or len(n) > 256 for n in v):
            raise ValueError("served model names must be 1..256 characters")
        return v

    def model_path(self) -> Path:
        """The checkpoint directory; a built-in tiny model is made on first use."""
        return resolve_model(self.model, self.cache_dir)

    def names(self) -> list[str]:
        return self.served_model_names or [
            self.model if self.model in TINY_MODELS else Path(self.model).name
        ]

    def engine_config(self, path: Path) -> EngineConfig:
        """The ranks' engine config: ``engine`` with the ``experimental`` switches."""
        return EngineConfig.from_options(str(path), **self.engine, experimental=self.experimental)

    def rank_limits(self, cfg: EngineConfig) -> tuple[int, int]:
        """Per-rank queue bounds: unfinished requests, prompt tokens queued for prefill."""
        api, s = self.api, cfg.scheduler
        return (
            api.max_pending_per_rank or 2 * s.max_num_seqs,
            api.max_queued_tokens_per_rank or 32 * s.max_num_batched_tokens,
        )
