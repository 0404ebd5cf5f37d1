"""HTTP protocol layer: OpenAI / Anthropic APIs over an :class:`EngineClient` (no Ray here)."""

from __future__ import annotations

from app.api.client import (
    EngineClient,
    EngineOverloadedError,
    EngineUnavailableError,
    LocalEngineClient,
)
from app.api.errors import ApiError
from app.api.server import ApiConfig, FrontDoor, build_api

__all__ = [
    "ApiConfig",
    "ApiError",
    "EngineClient",
    "EngineOverloadedError",
    "EngineUnavailableError",
    "FrontDoor",
    "LocalEngineClient",
    "build_api",
]
