"""HTTP protocol layer: OpenAI / Anthropic APIs over an :class:`EngineClient` (no Ray here)."""

from __future__ import annotations

from app.api.client import EngineClient
from app.api.errors import ApiError
from app.api.server import ApiConfig, FrontDoor, build_api
from app.engine.admission import EngineOverloadedError, EngineUnavailableError

__all__ = [
    "ApiConfig",
    "ApiError",
    "EngineClient",
    "EngineOverloadedError",
    "EngineUnavailableError",
    "FrontDoor",
    "build_api",
]
