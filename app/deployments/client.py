"""The engine as the ingress sees it under Ray Serve: ask the Router for a rank (with the
prompt's block hashes, so it can match them against every rank's prefix cache), then stream
from that rank directly (pinned), cancelling that stream when the client goes away. When the
Router cannot be reached the call goes to the DPRank handle without a target (its request
router picks by queue length) and ``fathom_routing_fallbacks_total`` counts it.

One request makes one call to the DPRank deployment at a time (a retry follows only a failed
call to a rank that is gone). Serve's request router matches
a chosen replica to a pending call by the internal request id, which every handle call made
while serving one HTTP request inherits: a second call (an explicit ``abort``) was at times
given the replica picked for the first and left the other pending for good, or sent the
abort to the wrong rank. Cancelling the stream makes the rank's generator abort the engine
request itself (its ``finally``), so no second call is needed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from app.cache.radix import chain_hashes
from app.deployments.routing import RouteQuery
from app.engine.admission import EngineOverloadedError, EngineUnavailableError, Refusal
from app.engine.request import EngineRequest, RequestError, RequestOutput
from app.observability import carrier, tracer

logger = logging.getLogger(__name__)
_PASS_THROUGH = (RequestError, EngineOverloadedError, EngineUnavailableError)
CONTROL_TIMEOUT_S = 5.0  # Router calls of /health and /metrics
CHOOSE_TIMEOUT_S = 2.0  # a routing decision; beyond it the DPRank handle picks by load
HASH_INLINE_TOKENS = 8192  # longer prompts are hashed in a worker thread
MAX_ATTEMPTS = 3  # ranks tried for a request that failed before its first token


class _RankFailed(RuntimeError):
    """A rank's engine stopped (a failed step) before this request's first token."""


_RETRIABLE = (_RankFailed, RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


def _why(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def _unwrap(e: BaseException) -> BaseException:
    """The original exception of a Ray task error (RequestError etc. keep their meaning)."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, _PASS_THROUGH) else e


class ServeEngineClient:
    """:class:`app.api.client.EngineClient` over the Router and DPRank deployment handles."""

    def __init__(
        self, rank: DeploymentHandle, router: DeploymentHandle, block_size: int = 0
    ) -> None:
        self.rank = rank
        self.router = router
        self.block_size = block_size  # the engine's KV block (0: no prefix index)
        self._streams: dict[str, Any] = {}  # request id -> the rank's response stream
        self._fallbacks = None  # ray.util.metrics counter, made on first use

    async def generate(
        self, req: EngineRequest, method: str = "generate", **call: Any
    ) -> AsyncIterator[RequestOutput]:
        """Stream ``req`` from the rank the Router picks (``method`` of the rank deployment,
        with keywords ``call``: the PD ranks' ``prefill`` / ``decode``). A rank that fails
        before the request's first token (its process died, or its engine stopped) is dropped
        from the Router and the request is retried on another (up to ``MAX_ATTEMPTS`` ranks);
        after the first token a failure ends the stream with :class:`EngineUnavailableError`
        (retriable: the API answers 503 / an error event saying so)."""
        tried: list[str] = []
        acked = False
        for attempt in range(MAX_ATTEMPTS):
            attrs = {
                "request_id": req.request_id,
                "client_request_id": req.client_request_id,
                "prompt_tokens": len(req.prompt_token_ids),
                "attempt": attempt,
            }
            with tracer.start_as_current_span("ingress.dispatch", attributes=attrs):
                target, cost = await self._choose(req, tried)
                traced = _with_trace(req)
            sent = False  # a token or the final delta reached the caller
            try:
                async with aclosing(self._stream(traced, target, cost, method, call)) as outs:
                    async for out in outs:
                        if out.engine_failed:  # the rank's step failed: not this request
                            raise _RankFailed(out.error or "")
                        if not out.token_ids and out.finish_reason is None and not out.finished:
                            if acked:
                                continue  # a retry's ack: the caller has had one
                            acked = True
                        sent = sent or bool(out.token_ids) or out.finished
                        yield out
                return
            except _RETRIABLE as e:
                await self._drop(target)
                if sent:
                    raise EngineUnavailableError(
                        f"the engine rank serving this request failed mid-stream ({_why(e)}); "
                        "retry the request"
                    ) from None
                logger.warning("rank %s failed before the first token (%s); retrying", target,
                               _why(e))  # fmt: skip
                if target is not None:
                    tried.append(target)
        raise EngineUnavailableError(f"{len(tried)} engine ranks failed this request; retry later")

    async def _hashes(self, req: EngineRequest) -> tuple[bytes, ...]:
        """Chain hashes of the prompt's full blocks but the last token (what the engine can
        match: at least one prompt token is always computed)."""
        ids, bs = req.prompt_token_ids[:-1], self.block_size
        if not bs or len(ids) < bs:
            return ()
        if len(ids) <= HASH_INLINE_TOKENS:
            return tuple(chain_hashes(ids, bs, req.extra_key))
        return tuple(await asyncio.to_thread(chain_hashes, ids, bs, req.extra_key))

    async def _choose(
        self, req: EngineRequest, exclude: list[str]
    ) -> tuple[str | None, float | None]:
        """The rank's replica id (None: the DPRank handle chooses, e.g. the Router is
        unreachable or its policy delegates) and the prefill tokens predicted there."""
        q = RouteQuery(
            len(req.prompt_token_ids), await self._hashes(req), self.block_size, req.session,
            tuple(exclude),
        )  # fmt: skip
        with tracer.start_as_current_span("router.choose") as span:
            try:
                d = await asyncio.wait_for(self.router.choose.remote(q), CHOOSE_TIMEOUT_S)
            except Exception as e:  # the index is unreachable: route by load alone
                logger.warning("router unreachable (%s): the DPRank handle routes by load",
                               _why(e))  # fmt: skip
                span.set_attribute("routing.reason", "router_unreachable")
                self._count_fallback("router_unreachable")
                return None, None
            if d is not None:
                span.set_attributes(d.attributes())
        if d is None:
            why = "no other engine rank is ready" if exclude else "no engine rank is ready yet"
            raise EngineUnavailableError(why)
        return d.target, (d.compute_tokens if d.target is not None else None)

    def _count_fallback(self, why: str) -> None:
        try:
            if self._fallbacks is None:
                from ray.util.metrics import Counter

                self._fallbacks = Counter(
                    "fathom_routing_fallbacks_total",
                    "Requests routed by load alone because the Router was unreachable",
                    tag_keys=("why",),
                )
            self._fallbacks.inc(tags={"why": why})
        except Exception:  # metrics never fail a request
            logger.debug("fallback counter failed", exc_info=True)

    async def _drop(self, target: str | None) -> None:
        if target is None:
            return
        try:
            await asyncio.wait_for(self.router.drop.remote(target), CONTROL_TIMEOUT_S)
        except Exception as e:  # the Router also drops ranks that stop reporting
            logger.debug("dropping rank %s failed: %r", target, e)

    async def _stream(
        self, req: EngineRequest, target: str | None, cost: float | None = None,
        method: str = "generate", call: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """One call to one rank (pinned), cancelled if it does not finish."""
        if req.request_id in self._streams:  # internal ids are unique: never another's stream
            raise RequestError("request_id", f"{req.request_id!r} is already in flight")
        fn = getattr(self.rank.options(stream=True), method)
        stream = fn.remote(req, target=target, cost=cost, **(call or {}))
        self._streams[req.request_id] = stream
        finished = False
        try:
            async for out in stream:
                if isinstance(out, Refusal):
                    finished = True
                    if out.kind == "unavailable":
                        raise _RankFailed(out.message)
                    raise out.error()
                finished = out.finished
                yield out
            if not finished:  # a rank killed mid-stream can end the stream with no error
                raise _RankFailed("the rank's stream ended before the request finished")
        except Exception as e:
            err = _unwrap(e)
            if err is e:
                raise
            raise err from None
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:  # the rank's generator aborts the engine request (frees its KV)
                stream.cancel()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()

    async def stats(self) -> dict:
        ranks = await self.ranks_stats()
        total: dict[str, float] = {"num_ranks": len(ranks)}
        for s in ranks.values():
            for k, v in s.items():
                if isinstance(v, int | float) and k in (
                    "num_running",
                    "num_waiting",
                    "num_unfinished",
                    "prefix_hit_tokens",
                ):
                    total[k] = total.get(k, 0) + v
        return total

    async def ranks_stats(self) -> dict[str, dict]:
        """Each live rank's last report, from the Router (``TimeoutError`` after
        ``CONTROL_TIMEOUT_S``)."""
        return await asyncio.wait_for(self.router.ranks_stats.remote(), CONTROL_TIMEOUT_S)

    async def ready(self) -> bool:
        try:
            return bool(await self.ranks_stats())
        except Exception:
            return False

    async def context_limit(self) -> int | None:
        """The live ranks' smallest ``max_model_len``, from the Router."""
        return await asyncio.wait_for(self.router.context_limit.remote(), CONTROL_TIMEOUT_S)


def _with_trace(req: EngineRequest) -> EngineRequest:
    from dataclasses import replace

    return replace(req, trace_context=carrier())
