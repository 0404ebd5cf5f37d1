"""Protocol error shapes and the exception -> HTTP status mapping.

OpenAI routes answer ``{"error": {"message", "type", "param", "code"}}``; the Anthropic route
(``/v1/messages``) answers ``{"type": "error", "error": {"type", "message"}}``:

    status  OpenAI type              Anthropic type          when
    400     invalid_request_error    invalid_request_error   malformed / invalid request, prompt
                                                             too long (context_length_exceeded)
    401     authentication_error     authentication_error    missing or wrong API key
    403     permission_error         permission_error        cross-origin request not allowed
    404     not_found_error          not_found_error         unknown model or route
    408     timeout_error            timeout_error           body not sent in time
    413     invalid_request_error    request_too_large       body over max_body_bytes
    415     invalid_request_error    invalid_request_error   Content-Type not JSON
    429     rate_limit_error         rate_limit_error        engine queue full
    431     invalid_request_error    request_too_large       too many / too large headers
    500     server_error             api_error               engine failure (never user input)
    503     service_unavailable      overloaded_error        engine not ready / draining
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

Shape = Literal["openai", "anthropic"]

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


@dataclass
class ApiError(Exception):
    """An error answered to the client: status, a message saying what was wrong, and
    (OpenAI shape) the offending parameter and a machine-readable code."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"


def shape_for(path: str) -> Shape:
    """Anthropic's shape for the Messages route, OpenAI's for everything else."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(err: ApiError, shape: Shape) -> dict:
    if shape == "anthropic":
        kind = _ANTHROPIC_TYPES.get(err.status, "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}
    kind = _OPENAI_TYPES.get(err.status, "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(err: ApiError, shape: Shape) -> JSONResponse:
    return JSONResponse(error_body(err, shape), status_code=err.status, headers=err.headers)


def sse_error_event(err: ApiError, shape: Shape) -> bytes:
    """An error inside an already-started event stream (headers are gone: the status is 200)."""
    data = json.dumps(error_body(err, shape), ensure_ascii=False)
    prefix = "event: error\n" if shape == "anthropic" else ""
    return f"{prefix}data: {data}\n\n".encode()


def from_recipe_error(exc: Exception) -> ApiError:
    """deepseek-recipe's ``ConversionError`` (status + OpenAI-shaped body) or a parse
    ``ValueError`` ("invalid JSON request: ...", "invalid request body: ...") -> ApiError."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    if isinstance(status, int) and isinstance(body, str):
        try:
            inner = json.loads(body).get("error", {})
            message = str(inner.get("message") or body)
            param = inner.get("param")
        except (json.JSONDecodeError, AttributeError):
            message, param = body, None
        status = status if 400 <= status < 500 else 400
        return ApiError(status, message, param=param, code="invalid_request")
    return ApiError(400, str(exc) or type(exc).__name__, code="invalid_request")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc, shape_for(request.url.path))


async def http_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route, wrong method) in the protocol's shape."""
    status = int(getattr(exc, "status_code", 400))
    detail = getattr(exc, "detail", None) or "request failed"
    if status == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif status == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    return error_response(ApiError(status, str(detail)), shape_for(request.url.path))


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    err = ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error")
    return error_response(err, shape_for(request.url.path))
