"""ASGI middleware in front of every route: header limits, JSON content type, cross-origin
requests. Each refusal is the protocol's JSON error:

    431  more than ``max_headers`` headers, or more than ``max_header_bytes`` of them
    415  a POST to /v1/* (or the tokenizer endpoints) whose Content-Type is not
         application/json
    403  a /v1/* (or tokenizer endpoint) request with an ``Origin`` not in
         ``cors_allow_origins`` (default: none), so a web page cannot drive a local server
         through a visitor's browser

Allowed origins also get CORS headers (Starlette's ``CORSMiddleware``, added by ``build_api``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.api.errors import ApiError, error_response, shape_for

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

GUARDED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")  # path prefixes checked


class RequestGuard:
    def __init__(
        self,
        app: ASGIApp,
        max_headers: int,
        max_header_bytes: int,
        allow_origins: list[str],
    ) -> None:
        self.app = app
        self.max_headers, self.max_header_bytes = max_headers, max_header_bytes
        self.any_origin = "*" in allow_origins
        self.origins = {o.rstrip("/").encode() for o in allow_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = self.check(scope) if scope["type"] == "http" else None
        if err is None:
            await self.app(scope, receive, send)
            return
        await error_response(err, shape_for(scope["path"]))(scope, receive, send)

    def check(self, scope: Scope) -> ApiError | None:
        headers = scope["headers"]
        if len(headers) > self.max_headers:
            return ApiError(431, f"{len(headers)} request headers; the limit is {self.max_headers}")
        size = sum(len(k) + len(v) for k, v in headers)
        if size > self.max_header_bytes:
            msg = f"request headers are {size} bytes; the limit is {self.max_header_bytes}"
            return ApiError(431, msg)
        if not scope["path"].startswith(GUARDED):
            return None
        h = dict(headers)
        origin = h.get(b"origin")
        if origin is not None and not self.any_origin and origin.rstrip(b"/") not in self.origins:
            return ApiError(
                403,
                f"cross-origin requests from {origin.decode(errors='replace')!r} are not allowed "
                "(api.cors_allow_origins)",
            )
        if scope["method"] == "POST":
            ctype = h.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                shown = ctype.decode(errors="replace") or "none"
                return ApiError(415, f"Content-Type must be application/json, got {shown}")
        return None
