"""The ingress side of prefill/decode disaggregation (``app.deployments.pd``): one client
stream over a prefill rank and a decode rank. Kept apart from the ranks' module so that the
ingress replicas import neither torch nor the engine (a replica start is ~5 s of CPU
lighter)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing

from app.deployments.client import ServeEngineClient
from app.deployments.pd_metrics import PDMetrics, count_fallback
from app.engine.admission import EngineUnavailableError
from app.engine.request import EngineRequest, FinishReason, RequestOutput

logger = logging.getLogger(__name__)


class PDEngineClient:
    """:class:`app.api.client.EngineClient` of a PD app: prefill on a prefill rank, decode
    on a decode rank, one stream to the caller (``app.deployments.pd``'s module doc)."""

    def __init__(self, prefill: ServeEngineClient, decode: ServeEngineClient) -> None:
        self.prefill, self.decode = prefill, decode
        self.counts: Counter[str] = Counter()
        self._metrics: PDMetrics | None = None

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        output: list[int] = []
        handed, done, parcel, acked = False, False, None, False
        try:
            async with aclosing(self.prefill.generate(req, "prefill")) as outs:
                async for out in outs:
                    output += out.token_ids
                    if out.finish_reason is FinishReason.HANDOFF:
                        handed, parcel = True, out.handoff
                        out = dataclasses.replace(out, finished=False, finish_reason=None,
                                                  handoff=None)  # fmt: skip
                    acked, done = True, out.finished
                    yield out
                    if done or handed:
                        break
        except EngineUnavailableError as e:
            if output:
                raise
            logger.warning("no prefill rank (%s): a decode rank serves the whole request", e)
            count_fallback(self._pd_metrics(), self.counts, "prefill_unavailable")
        if done:
            return  # finished on the prefill rank (its first token ended it)
        if handed:
            stream = self.decode.generate(req, "decode", output_ids=tuple(output), parcel=parcel)
        else:
            stream = self.decode.generate(req)
        async with aclosing(stream) as outs:
            async for out in outs:
                if acked and not out.token_ids and not out.finished:
                    continue  # the decode rank's ack: the caller has had one
                acked = True
                yield out

    def _pd_metrics(self) -> PDMetrics | None:
        if self._metrics is None:
            try:
                self._metrics = PDMetrics()
            except Exception:
                logger.debug("PD metrics unavailable", exc_info=True)
        return self._metrics

    async def abort(self, request_id: str) -> None:
        await self.prefill.abort(request_id)
        await self.decode.abort(request_id)

    async def stats(self) -> dict:
        pre, dec = await asyncio.gather(self.prefill.stats(), self.decode.stats())
        total = {k: pre.get(k, 0) + dec.get(k, 0) for k in set(pre) | set(dec)}
        return {**total, "num_prefill_ranks": pre.get("num_ranks", 0),
                "num_decode_ranks": dec.get("num_ranks", 0)}  # fmt: skip

    async def ranks_stats(self) -> dict[str, dict]:
        pre, dec = await asyncio.gather(self.prefill.ranks_stats(), self.decode.ranks_stats())
        return {**pre, **dec}

    async def ready(self) -> bool:
        return await self.prefill.ready() and await self.decode.ready()

    async def context_limit(self) -> int | None:
        """The smaller side's limit; None until both sides have reported."""
        pre, dec = await asyncio.gather(self.prefill.context_limit(), self.decode.context_limit())
        return None if pre is None or dec is None else min(pre, dec)
