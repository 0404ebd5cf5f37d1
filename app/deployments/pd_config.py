"""The prefill/decode disaggregation section of the serve config (``ServeArgs.pd``): plain
frozen dataclasses, importable without torch or Ray (the config is validated in the driver
before any rank starts; ``app.deployments.pd`` holds the ranks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from app.config import check_fields

Role = Literal["prefill", "decode"]
TransportName = Literal["auto", "object_store", "nixl", "cuda_ipc"]


@dataclass(frozen=True)
class PDRoleConfig:
    """One side of prefill/decode disaggregation: its ranks and engine option overrides."""

    __pydantic_config__ = {"extra": "forbid"}

    ranks: int = field(default=1, metadata={"gt": 0})
    num_cpus: float | None = field(default=None, metadata={"gt": 0})  # None: rank_num_cpus
    num_gpus: float | None = field(default=None, metadata={"ge": 0})  # None: rank_num_gpus
    engine: dict[str, Any] = field(default_factory=dict)  # over ServeArgs.engine

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class PDConfig:
    """Prefill/decode disaggregation (``ServeArgs.pd``; replaces ``dp_size``). A PD rank
    gets it with its role; the test-only fault injection is ``experimental.pd_fault``."""

    __pydantic_config__ = {"extra": "forbid"}

    prefill: PDRoleConfig = PDRoleConfig()
    decode: PDRoleConfig = PDRoleConfig()
    transport: TransportName = "auto"
    transfer_timeout_s: float = field(default=10.0, metadata={"gt": 0})  # then: local prefill

    def __post_init__(self) -> None:
        check_fields(self, "pd.")

    def role_options(self, engine: dict[str, Any], role: Role) -> dict[str, Any]:
        """The engine options of ``role``: ServeArgs.engine with the role's overrides."""
        side: PDRoleConfig = getattr(self, role)
        return {**engine, **side.engine}
