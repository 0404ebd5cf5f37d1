"""Server-sent events: framing, and a streaming response that notices a client disconnect
at once (even between tokens) and always closes its event iterator, so the engine request is
aborted and its KV freed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: str, event: str | None = None) -> bytes:
    """One SSE message: ``event: NAME`` (optional) and a single ``data:`` line."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class SSEResponse(StreamingResponse):
    """``text/event-stream``; every event is sent (and flushed by the server) as it is made.

    The body iterator is raced against ``http.disconnect``: a disconnect cancels the stream,
    and the iterator is closed in every case (its ``finally`` aborts the engine request).
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(content, headers={**SSE_HEADERS, **headers})
        self._events = content
        self.on_close: list[Callable[[], None]] = []  # run once the stream is over

    async def _until_disconnect(self, receive: Receive) -> None:
        """Return when the client goes away: an ``http.disconnect`` message, or (under Ray
        Serve) ``receive`` raising because the proxy cancelled the call. One debug line, no
        traceback: a disconnect is normal."""
        try:
            await self.listen_for_disconnect(receive)
        except Exception as e:
            logger.debug("client went away mid-stream (%s)", type(e).__name__)
            return
        logger.debug("client went away mid-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-write
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self._until_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            for fn in self.on_close:
                fn()
