"""``fathom.GenerateService/Generate`` over any :class:`~app.api.client.EngineClient`, with
the HTTP API's API keys, limits, defaults and request validation, and gRPC status codes.

The request arrives as raw bytes (``app.grpc.raw`` registers the method without a
deserializer), so a malformed message is answered here with ``INVALID_ARGUMENT``. Errors are
``ApiError``s mapped to codes (:data:`GRPC_CODES`); the last message of a failed call also
carries the error in-band (``finish_reason="error"``): behind Ray Serve's proxy a status set on
the context reaches the client only with a message.

``context`` is a ``grpc.aio.ServicerContext`` or Ray Serve's ``RayServegRPCContext`` (both
have ``invocation_metadata``, ``set_code``, ``set_details``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from tokenizers import Tokenizer

from app.api.client import ContextSync, EngineClient, open_stream
from app.api.errors import ApiError
from app.api.limits import check_api_key, make_request
from app.engine.admission import Admission, EngineOverloadedError
from app.engine.request import FinishReason, SamplingParams, new_request_id
from app.engine.validation import BODY, GRPC, wire_fields
from app.grpc.fathom_pb2 import GenerateRequest, GenerateResponse, SamplingOptions

if TYPE_CHECKING:
    from app.api.server import FrontDoor
    from app.engine.request import EngineRequest, RequestOutput

logger = logging.getLogger(__name__)

GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}
# SamplingOptions' fields: those of the sampling-field table that gRPC takes (a unit test holds
# the proto to the table)
_SAMPLING = tuple(f.name for f in wire_fields(SamplingParams, GRPC, BODY))


class GrpcContext(Protocol):
    def invocation_metadata(self) -> Any: ...

    def set_code(self, code: grpc.StatusCode) -> None: ...

    def set_details(self, details: str) -> None: ...


class GenerateService:
    """Generation from token ids or raw text (no chat template). ``cfg`` is the HTTP API's
    :class:`~app.api.server.FrontDoor`; ``app_name`` (Serve's application) must match an
    ``application`` metadata entry when the client sends one."""

    def __init__(
        self,
        cfg: FrontDoor,
        client: EngineClient,
        bos_token_id: int,
        app_name: str | None = None,
        in_flight: Admission | None = None,
    ) -> None:
        self.cfg, self.opts = cfg, cfg.options
        self.in_flight = in_flight or Admission(cfg.max_in_flight, None)
        self.client = client
        self.sync_context = ContextSync(client, cfg.context_limit, self._narrow)
        self.tokenizer = Tokenizer.from_file(cfg.tokenizer_path)
        self.bos = bos_token_id
        self.app_name = app_name

    def _narrow(self, context_limit: int) -> None:
        """Serve at the engines' lower context limit (:class:`ContextSync`)."""
        self.cfg = self.cfg.narrowed(context_limit)

    async def generate(
        self, raw: bytes | GenerateRequest, context: GrpcContext
    ) -> AsyncIterator[GenerateResponse]:
        """Stream responses; on an error set the status code and end with an error message."""
        rid = ""
        n_prompt = n_gen = 0
        ticket = None
        try:
            meta = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
            self._check_call(meta)
            try:
                ticket = self.in_flight.admit(0)  # the same bound as the HTTP routes
            except EngineOverloadedError as e:
                raise ApiError(429, f"the server is overloaded ({e}); retry later") from None
            await self.sync_context()
            request = self._parse(raw)
            rid = request.request_id or f"gen-{uuid.uuid4().hex}"
            req = await self._engine_request(request)
            n_prompt = len(req.prompt_token_ids)
            stream = await open_stream(self.client, req, self.opts.request_timeout_s)
            try:
                async for out in stream:
                    if not out.token_ids and not out.finished:
                        continue  # the ack delta
                    if out.finish_reason is FinishReason.ERROR:
                        raise ApiError(500, f"the engine failed: {out.error}")
                    if out.finish_reason is FinishReason.ABORT:
                        raise ApiError(503, "the engine aborted the request; retry")
                    n_gen += len(out.token_ids)
                    yield self._response(rid, out.token_ids, n_prompt, n_gen, out)
                if not stream.finished:  # request_timeout_s ran out
                    yield GenerateResponse(
                        request_id=rid, finished=True, finish_reason="length",
                        prompt_tokens=n_prompt, completion_tokens=n_gen,
                    )  # fmt: skip
            finally:
                await stream.close()
        except Exception as e:
            if not isinstance(e, ApiError):
                logger.exception("gRPC request %s failed", rid)
                e = ApiError(500, f"internal error: {type(e).__name__}")
            code = GRPC_CODES.get(e.status, grpc.StatusCode.INTERNAL)
            if e.status >= 500:
                logger.warning("gRPC request %s failed: %s", rid, e.message)
            context.set_code(code)
            context.set_details(e.message)
            yield GenerateResponse(
                request_id=rid, finished=True, finish_reason="error", error=e.message,
                prompt_tokens=n_prompt, completion_tokens=n_gen,
            )  # fmt: skip
        finally:
            if ticket is not None:
                ticket.release()

    def _check_call(self, meta: dict[str, str]) -> None:
        check_api_key(self.opts.api_keys, meta.get("authorization"), meta.get("x-api-key"))
        app = meta.get("application")
        if app is not None and self.app_name is not None and app != self.app_name:
            raise ApiError(
                404, f"application {app!r} is not served here (this is {self.app_name!r})"
            )

    def _parse(self, raw: bytes | GenerateRequest) -> GenerateRequest:
        if isinstance(raw, GenerateRequest):
            return raw
        if len(raw) > self.opts.max_body_bytes:
            raise ApiError(
                413, f"request is {len(raw)} bytes; the limit is {self.opts.max_body_bytes}"
            )
        try:
            return GenerateRequest.FromString(raw)
        except DecodeError as e:
            raise ApiError(400, f"malformed GenerateRequest protobuf: {e}") from None

    async def _engine_request(self, r: GenerateRequest) -> EngineRequest:
        names = self.cfg.served_model_names
        model = r.model or names[0]
        if model not in names:
            raise ApiError(
                404, f"model {model!r} does not exist; served models: {', '.join(names)}"
            )
        which = r.WhichOneof("prompt")
        if which is None:
            raise ApiError(400, "prompt: set text or token_ids", param="prompt")
        if which == "text":
            if not r.text:
                raise ApiError(400, "text: must not be empty", param="text")
            # encode_batch releases the GIL (encode does not): the event loop keeps serving
            enc = await asyncio.to_thread(self.tokenizer.encode_batch, [r.text])
            ids = [self.bos, *enc[0].ids]
        else:
            ids = list(r.token_ids.ids)
        limit, n = self.cfg.context_limit, len(ids)
        if n > self.cfg.prompt_limit:
            raise ApiError(400, f"prompt is {n} tokens; the limit is {self.cfg.prompt_limit}")
        sampling = self._sampling(r, room=limit - n)
        return make_request(
            new_request_id(), ids, sampling, self.cfg.limits,
            arrival_time=time.time(), client_request_id=r.request_id,
        )  # fmt: skip

    def _sampling(self, r: GenerateRequest, room: int) -> dict[str, object]:
        """The SamplingParams fields the request sets: maps and repeated fields always, a
        field with presence when set (unset: the table's default), any other one as is."""
        s = r.sampling
        kw: dict[str, object] = {}
        for name in _SAMPLING:
            desc = SamplingOptions.DESCRIPTOR.fields_by_name[name]
            if desc.message_type is not None and desc.message_type.GetOptions().map_entry:
                kw[name] = dict(getattr(s, name))
            elif desc.is_repeated:
                kw[name] = tuple(getattr(s, name))
            elif not desc.has_presence or s.HasField(name):
                kw[name] = getattr(s, name)
        if "max_tokens" not in kw:  # the HTTP default: the context left, capped by the config
            default = self.opts.default_max_tokens
            kw["max_tokens"] = max(1, room if default is None else min(room, default))
        return kw

    def _response(
        self, rid: str, ids: list[int], n_prompt: int, n_gen: int, out: RequestOutput
    ) -> GenerateResponse:
        return GenerateResponse(
            request_id=rid,
            token_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            finished=out.finished,
            finish_reason=out.finish_reason.value if out.finish_reason else "",
            prompt_tokens=n_prompt,
            completion_tokens=n_gen,
            cached_tokens=out.num_cached_tokens,
        )
