"""Request checks of the ingress that come before the engine (HTTP and gRPC alike): API keys,
and the shared request validator (the same one ``EngineCore.add_request`` runs) turned into
400s naming the field."""

from __future__ import annotations

import hmac

from app.api.errors import ApiError
from app.engine.request import EngineRequest, RequestError, SamplingParams
from app.engine.validation import RequestLimits, check_request


def make_request(
    rid: str, ids: list[int] | tuple[int, ...], params: SamplingParams, limits: RequestLimits,
    **fields: object,
) -> EngineRequest:  # fmt: skip
    """An :class:`EngineRequest` that passes the engine's checks, or a 400 naming the field."""
    try:
        req = EngineRequest(rid, tuple(ids), params, **fields)  # type: ignore[arg-type]
        check_request(req, limits)
    except RequestError as e:
        raise ApiError(400, str(e), param=e.field) from None
    return req


def check_api_key(keys: list[str], authorization: str | None, x_api_key: str | None) -> None:
    """401 unless ``keys`` is empty or the request carries one of them, as
    ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (HTTP headers or gRPC metadata)."""
    if not keys:
        return
    auth = authorization or ""
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    key = key or x_api_key
    if not key:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    if not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        raise ApiError(401, "invalid API key", code="invalid_api_key")
