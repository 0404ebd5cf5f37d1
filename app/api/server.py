"""The HTTP app: OpenAI Chat Completions / Responses / Completions, Anthropic Messages,
models, health and metrics, over any :class:`~app.api.client.EngineClient`.

    app = build_api(FrontDoor(("tiny-v41",), tokenizer_path=..., context_limit=4096), client)
    uvicorn.run(app)          # or mount it under a Ray Serve ingress
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from app.api import completions as cmpl
from app.api.choices import Choices
from app.api.client import (
    OVERLOAD_RETRY_S,
    ContextSync,
    EngineClient,
    EngineStream,
    open_stream,
)
from app.api.errors import (
    ApiError,
    api_error_handler,
    http_error_handler,
    internal_error_handler,
    shape_for,
    sse_error_event,
)
from app.api.guard import RequestGuard
from app.api.limits import PrepareGate, check_api_key, parse_json, read_body
from app.api.logprobs import prompt_logprobs
from app.api.protocols import (
    CHAT,
    MESSAGES,
    RESPONSES,
    Prepared,
    Protocol,
    RecipeFrontend,
    chat_logprobs_present,
    compact_json,
    patch_usage,
    run_events,
)
from app.api.sse import SSEResponse, sse_event
from app.api.tokenize import TokenizerFrontend
from app.config import check_fields
from app.engine.admission import Admission, EngineOverloadedError
from app.engine.request import EngineRequest
from app.engine.validation import MAX_N, RequestLimits

if TYPE_CHECKING:
    from starlette.types import ASGIApp

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiConfig:
    """HTTP / gRPC front-door options (``api:`` of the serve config, ``ServeArgs.api``).

    ``max_prompt_tokens`` None = the context limit - 1; ``api_keys`` empty = no auth;
    ``default_max_tokens`` caps an unspecified ``max_tokens`` (None = the recipe's default,
    lowered to the context left); ``request_timeout_s``: on expiry the request is aborted
    and the answer ends with finish reason ``length`` (None = no limit).
    ``body_read_timeout_s``: a body not in full by then gets 408. ``max_json_depth``: deeper
    JSON gets 400. ``max_header_bytes`` / ``max_headers``: beyond them 431.
    ``cors_allow_origins``: empty = cross-origin requests (an ``Origin`` header not listed)
    get 403; ``["*"]`` = any. ``max_pending_per_rank`` / ``max_queued_tokens_per_rank``: the
    ranks' queue bounds (None: 2 x ``max_num_seqs`` / 32 x ``max_num_batched_tokens``).
    ``max_n``: choices one chat / completions request may ask for (more: 400 naming ``n``)."""

    __pydantic_config__ = {"extra": "forbid"}

    max_body_bytes: int = field(default=4 << 20, metadata={"gt": 0})
    max_prompt_tokens: int | None = field(default=None, metadata={"gt": 0})
    api_keys: tuple[str, ...] = ()
    default_max_tokens: int | None = field(default=None, metadata={"gt": 0})
    request_timeout_s: float | None = field(default=600.0, metadata={"gt": 0})
    body_read_timeout_s: float | None = field(default=30.0, metadata={"gt": 0})
    max_json_depth: int = field(default=64, metadata={"gt": 0})
    max_header_bytes: int = field(default=32 << 10, metadata={"gt": 0})
    max_headers: int = field(default=100, metadata={"gt": 0})
    cors_allow_origins: tuple[str, ...] = ()
    max_pending_per_rank: int | None = field(default=None, metadata={"gt": 0})
    max_queued_tokens_per_rank: int | None = field(default=None, metadata={"gt": 0})
    max_n: int = field(default=16, metadata={"gt": 0, "le": MAX_N})

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class FrontDoor:
    """What one front door serves: its options and the values the builder derives from the
    model and the deployment (none of them an option). ``context_limit`` is the engine's
    ``max_model_len``. ``vocab_size``: token ids are validated against it (None: by the
    engine only). ``request_id_header``: the response header carrying the response's public
    id (None under Ray Serve, whose proxy already sends ``x-request-id``).
    ``max_in_flight``: generation requests this server holds at once (being prepared,
    queued or streaming); beyond it 429 at once, before any parsing or engine call (load
    shedding in front of the ranks' own bounds). ``deterministic``: the ranks run the
    engine's deterministic mode (said on the model card)."""

    served_model_names: tuple[str, ...]
    tokenizer_path: str
    context_limit: int
    options: ApiConfig = ApiConfig()
    model_version: Literal["v41", "v4"] = "v41"
    vocab_size: int | None = None
    request_id_header: str | None = "x-request-id"
    max_in_flight: int | None = None
    deterministic: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must name at least one model")
        if self.context_limit < 2:
            raise ValueError(f"context_limit must be >= 2, got {self.context_limit}")
        if not 1 <= self.prompt_limit < self.context_limit:
            raise ValueError("max_prompt_tokens must be in [1, context_limit)")

    @property
    def prompt_limit(self) -> int:
        """Prompt tokens a request may have (``max_prompt_tokens``, default the context
        limit - 1)."""
        limit = self.options.max_prompt_tokens
        return self.context_limit - 1 if limit is None else limit

    def narrowed(self, context_limit: int) -> FrontDoor:
        """This front door at a lower context limit (a prompt limit at or above it comes
        down to ``context_limit - 1``)."""
        if context_limit >= self.context_limit:
            return self
        opts = self.options
        if opts.max_prompt_tokens is not None and opts.max_prompt_tokens >= context_limit:
            opts = replace(opts, max_prompt_tokens=context_limit - 1)
        return replace(self, context_limit=context_limit, options=opts)

    @property
    def limits(self) -> RequestLimits:
        """What the engine validates requests against (the same validator runs here)."""
        return RequestLimits(self.vocab_size, self.context_limit, self.options.max_n)


def frontends(cfg: FrontDoor) -> tuple[RecipeFrontend, cmpl.CompletionsFrontend]:
    """The request conversions of one front door: the recipe protocols (chat, responses,
    messages) and raw completions (also what the serving benchmark's offline peer uses)."""
    args = (cfg.limits, cfg.prompt_limit, cfg.options.default_max_tokens)
    recipe = RecipeFrontend(list(cfg.served_model_names), cfg.model_version,
                            cfg.tokenizer_path, *args)  # fmt: skip
    return recipe, cmpl.CompletionsFrontend(cfg.tokenizer_path, list(cfg.served_model_names),
                                            *args)  # fmt: skip


class _Api:
    """Route handlers bound to one config and engine client."""

    def __init__(
        self, cfg: FrontDoor, client: EngineClient, in_flight: Admission | None = None
    ) -> None:
        self.cfg, self.opts = cfg, cfg.options
        self.client = client
        self.recipe, self.completions = frontends(cfg)
        self.tokenizer = TokenizerFrontend(
            self.completions.tokenizer, self.completions.bos, list(cfg.served_model_names),
            cfg.context_limit,
        )  # fmt: skip
        self.created = int(time.time())
        self.sync_context = ContextSync(client, cfg.context_limit, self._narrow)
        self.gate = PrepareGate()
        self.in_flight = in_flight or Admission(cfg.max_in_flight, None)

    def _narrow(self, context_limit: int) -> None:
        """Serve at the engines' lower context limit (:class:`ContextSync`)."""
        self.cfg = self.cfg.narrowed(context_limit)
        for fe in (self.recipe, self.completions):
            fe.set_limits(self.cfg.limits, self.cfg.prompt_limit)
        self.tokenizer.context_limit = self.cfg.context_limit
        logger.info("context limit %d: the engines' max_model_len", self.cfg.context_limit)

    async def shed(self, handler: Callable[[], Awaitable[Response]]) -> Response:
        """Run a generation route within ``max_in_flight`` (429 beyond it); a streamed
        response holds its slot until the stream is over."""
        await self.sync_context()
        try:
            ticket = self.in_flight.admit(0)
        except EngineOverloadedError as e:
            msg = f"the server is overloaded ({e}); retry later"
            raise ApiError(429, msg, headers={"Retry-After": str(OVERLOAD_RETRY_S)}) from None
        try:
            resp = await handler()
        except BaseException:
            ticket.release()
            raise
        if isinstance(resp, SSEResponse):
            resp.on_close.append(ticket.release)
        else:
            ticket.release()
        return resp

    def check_auth(self, request: Request) -> None:
        h = request.headers
        check_api_key(self.opts.api_keys, h.get("authorization"), h.get("x-api-key"))

    async def _body(self, request: Request) -> bytes:
        self.check_auth(request)
        return await read_body(request, self.opts.max_body_bytes, self.opts.body_read_timeout_s)

    def _prepare_recipe(self, proto: Protocol, body: bytes) -> Prepared:
        """Parse, convert, render and encode (a worker thread: the loop keeps serving)."""
        return self.recipe.prepare(proto, body, parse_json(body, self.opts.max_json_depth))

    def _prepare_completion(self, body: bytes) -> tuple[cmpl.CompletionBody, EngineRequest, str]:
        parsed = cmpl.parse_body(parse_json(body, self.opts.max_json_depth))
        req, rid = self.completions.prepare(parsed)
        return parsed, req, rid

    async def _start(self, req: EngineRequest) -> EngineStream:
        return await open_stream(self.client, req, self.opts.request_timeout_s)

    async def recipe_route(self, proto: Protocol, request: Request) -> Response:
        body = await self._body(request)
        prep = await self.gate.run(len(body), self._prepare_recipe, proto, body)
        req = prep.engine_request
        stream = await self._start(req)
        headers = self._id_header(prep.response_id)
        if prep.n > 1:
            return await self._choices(prep, stream, headers)
        usage = self.recipe.usage_fix(prep)
        events = run_events(prep, stream, self.recipe.stop_ids, usage)
        resp_cls = proto.response_cls
        if prep.stream:
            shape = shape_for(request.url.path)

            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for ev in events:
                        yield sse_event(usage.apply(ev.to_json()), resp_cls.sse_event_name(ev))
                    if (done := resp_cls.sse_done_data()) is not None:
                        yield sse_event(done)
                except ApiError as e:
                    yield sse_error_event(e, shape)
                except Exception:
                    logger.exception("stream %s failed", prep.response_id)
                    yield sse_error_event(ApiError(500, "internal error in the stream"), shape)
                finally:
                    await events.aclose()
                    await stream.close()

            return SSEResponse(sse(), headers=headers)
        acc = resp_cls(prep.response_id, prep.model, prep.created, usage.prompt_tokens, 0)
        try:
            async for ev in events:
                acc.accumulate(ev)
        finally:
            await stream.close()
        plp = prep.prompt_logprobs
        if (prep.logprobs and proto is CHAT) or plp is not None:  # the fixes on one parse
            obj = patch_usage(json.loads(acc.to_json()), usage)
            if prep.logprobs and proto is CHAT:
                chat_logprobs_present(obj)
            if plp is not None:
                k = prep.engine_request.params.prompt_logprobs or 0
                obj["prompt_logprobs"] = prompt_logprobs(self.completions.tokenizer, plp, k)
            text = compact_json(obj)
        else:
            text = usage.apply(acc.to_json())
        return Response(text, media_type="application/json", headers=headers)

    async def _choices(
        self, prep: Prepared, stream: EngineStream, headers: dict[str, str]
    ) -> Response:
        """Chat's n > 1 choices (``app.api.choices``), streamed or as one response."""
        usages = [self.recipe.usage_fix(prep) for _ in prep.processors]
        choices = Choices(prep, self.recipe.stop_ids, usages)
        if prep.stream:

            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for data in choices.chunks(stream):
                        yield sse_event(data)
                    if (done := prep.proto.response_cls.sse_done_data()) is not None:
                        yield sse_event(done)
                except ApiError as e:
                    yield sse_error_event(e, "openai")
                except Exception:
                    logger.exception("stream %s failed", prep.response_id)
                    yield sse_error_event(ApiError(500, "internal error in the stream"), "openai")
                finally:
                    await stream.close()

            return SSEResponse(sse(), headers=headers)
        try:
            text = await choices.response(stream)
        finally:
            await stream.close()
        return Response(text, media_type="application/json", headers=headers)

    async def completions_route(self, request: Request) -> Response:
        raw = await self._body(request)
        body, req, rid = await self.gate.run(len(raw), self._prepare_completion, raw)
        stream = await self._start(req)
        events = self.completions.events(body, req, rid, stream)
        headers = self._id_header(rid)
        if body.stream:
            with_usage = body.stream_options is not None and body.stream_options.include_usage

            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for chunk in events:
                        if "usage" in chunk:
                            if not with_usage:
                                continue
                            chunk = {**_head(rid, req, body), "choices": [], **chunk}
                        yield sse_event(json.dumps(chunk, ensure_ascii=False))
                    yield sse_event("[DONE]")
                except ApiError as e:
                    yield sse_error_event(e, "openai")
                finally:
                    await events.aclose()
                    await stream.close()

            return SSEResponse(sse(), headers=headers)
        try:
            chunks = [c async for c in events]
        finally:
            await stream.close()
        return JSONResponse(cmpl.accumulate(chunks), headers=headers)

    async def tokenizer_route(
        self, request: Request, fn: Callable[[Mapping[str, Any]], dict[str, Any]]
    ) -> JSONResponse:
        """``/tokenize`` / ``/detokenize``: ``fn`` of the body (a worker thread)."""
        await self.sync_context()
        body = await self._body(request)
        raw = parse_json(body, self.opts.max_json_depth)
        return JSONResponse(await self.gate.run(len(body), fn, raw))

    def _id_header(self, response_id: str) -> dict[str, str]:
        name = self.cfg.request_id_header
        return {name: response_id} if name else {}

    def model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "fathom",
            "max_model_len": self.cfg.context_limit,
            "deterministic": self.cfg.deterministic,
        }


def _head(rid: str, req: EngineRequest, body: cmpl.CompletionBody) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(req.arrival_time),
        "model": body.model,
    }


def _metrics_text(stats: Mapping[str, Any]) -> str:
    lines = [
        f"fathom_{k} {float(v)}"
        for k, v in stats.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    ]
    return "\n".join(lines) + "\n"


class _Asgi:
    """Wraps an ASGI callable so Starlette routes to it as an app (a plain function would be
    taken for a request handler)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def build_api(
    cfg: FrontDoor,
    client: EngineClient,
    metrics_app: ASGIApp | None = None,
    in_flight: Admission | None = None,
) -> FastAPI:
    """The FastAPI app. ``metrics_app`` (e.g. a Prometheus ASGI app) is mounted at
    ``/metrics``; without one, ``/metrics`` lists the client's numeric stats as gauges.
    ``in_flight``: the ``max_in_flight`` count, shared with the gRPC service."""
    api = _Api(cfg, client, in_flight)
    app = FastAPI(title="Fathom", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(
        RequestGuard,
        max_headers=cfg.options.max_headers,
        max_header_bytes=cfg.options.max_header_bytes,
        allow_origins=cfg.options.cors_allow_origins,
    )
    if cfg.options.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cfg.options.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await api.shed(lambda: api.recipe_route(CHAT, request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await api.shed(lambda: api.recipe_route(RESPONSES, request))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await api.shed(lambda: api.recipe_route(MESSAGES, request))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.shed(lambda: api.completions_route(request))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await api.tokenizer_route(request, api.tokenizer.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await api.tokenizer_route(request, api.tokenizer.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> dict[str, Any]:
        api.check_auth(request)
        await api.sync_context()
        return api.tokenizer.info()

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        api.check_auth(request)
        await api.sync_context()
        return {"object": "list", "data": [api.model_card(n) for n in cfg.served_model_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        api.check_auth(request)
        if name not in cfg.served_model_names:
            raise ApiError(404, f"model {name!r} does not exist", param="model")
        await api.sync_context()
        return api.model_card(name)

    @app.get("/health")
    async def health() -> Response:
        try:
            ok = await client.ready()
            if ok:
                await api.sync_context()
        except Exception as e:  # an unreachable engine is just not ready
            logger.warning("readiness check failed: %r", e)
            ok = False
        status = 200 if ok else 503
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=status)

    if metrics_app is not None:
        # a route, not a mount: "/metrics" answers directly (a mount redirects to "/metrics/")
        app.add_route("/metrics", _Asgi(metrics_app), include_in_schema=False)
    else:

        @app.get("/metrics")
        async def metrics() -> Response:
            return PlainTextResponse(_metrics_text(await client.stats()))

    return app
