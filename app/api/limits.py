"""Request checks of the ingress that come before the engine (HTTP and gRPC alike): API keys,
body size and read time, depth-safe JSON, request preparation off the event loop, and the
request validator (the one ``EngineCore.new_sequence`` runs again) turned into 400s naming the
field."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hmac
import json
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request

from app.api.errors import ApiError
from app.engine.request import EngineRequest, SamplingParams
from app.engine.validation import RequestError, RequestLimits, check_request, from_wire

T = TypeVar("T")


def make_request(
    rid: str, ids: list[int] | tuple[int, ...], sampling: Mapping[str, Any],
    limits: RequestLimits, **fields: object,
) -> EngineRequest:  # fmt: skip
    """The :class:`EngineRequest` of a prepared body (``sampling``: its
    :class:`SamplingParams` fields), checked by the request validator, or a 400 naming the
    field: every endpoint's one validation at the ingress. A field with a wire form of its
    own (``logit_bias``: a JSON object / gRPC map) is converted first."""
    try:
        params = SamplingParams(**from_wire(SamplingParams, sampling))
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


async def read_body(request: Request, limit: int, timeout_s: float | None) -> bytes:
    """The body, refused with 413 as soon as it exceeds ``limit`` (before any parsing), and
    with 408 when it has not arrived in full within ``timeout_s``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)

    try:
        async with asyncio.timeout(timeout_s):
            await receive()
    except TimeoutError:
        msg = f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)"
        raise ApiError(408, msg) from None
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def parse_json(body: bytes, max_depth: int) -> dict[str, Any]:
    """A JSON object with valid unicode (no lone surrogates), nested at most ``max_depth``
    levels, or a 400 saying why not (deep nesting once raised a RecursionError: 500)."""
    if not body.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        obj = json.loads(body)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e.reason} at {e.start}") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise ApiError(400, f"malformed JSON: {e.msg} at {where}") from None
    except RecursionError:
        raise ApiError(400, f"JSON nested deeper than {max_depth} levels") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(obj).__name__}")
    if json_depth(obj, max_depth) > max_depth:
        raise ApiError(400, f"JSON nested deeper than {max_depth} levels")
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ApiError(400, "request body holds invalid unicode (a lone surrogate)") from None
    return obj


def json_depth(obj: Any, stop: int) -> int:
    """Nesting depth of containers in ``obj`` (iterative; stops counting past ``stop``)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if deepest > stop:
                return deepest
            todo.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


class PrepareGate:
    """Runs request preparation (JSON parse, rendering, tokenization) in worker threads, so
    the event loop keeps serving while a large prompt is tokenized; at most ``large_slots``
    bodies over ``large_bytes`` at once (others wait, without blocking the loop), which
    bounds the memory a burst of large bodies can take. After a large one the allocator
    returns its free pages to the system (a 4 MB prompt's tokenization takes ~0.5 GB that
    glibc otherwise keeps: the ingress stayed at 2.5 GB after a burst)."""

    def __init__(self, large_bytes: int = 256 << 10, large_slots: int = 2) -> None:
        self.large_bytes = large_bytes
        self._large = asyncio.Semaphore(large_slots)

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size <= self.large_bytes:
            return await anyio.to_thread.run_sync(fn, *args)
        async with self._large:
            return await anyio.to_thread.run_sync(_then_trim, fn, *args)


def _then_trim(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    finally:
        _malloc_trim()


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def _malloc_trim() -> None:
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
