"""Request checks of the ingress that come before the engine: the shared request validator
(the same one ``EngineCore.add_request`` runs) turned into 400s naming the field."""

from __future__ import annotations

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
