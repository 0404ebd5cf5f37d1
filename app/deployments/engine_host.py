"""What a DPRank needs of its engine: the :class:`RankEngine` protocol, and
:class:`LocalRankEngine`, the in-process engine behind it (an :class:`AsyncEngine` with its
admission queue). A DPRank is built with ``engine_cls`` (the Ray Serve LLM ``LLMServer``
pattern), so the deployment never reaches into engine internals.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from app.api.client import LocalEngineClient
from app.cache.events import HASH_NAMESPACE, KVEventBatch, KVSnapshot
from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.engine import AsyncEngine
from app.engine.handoff import Handoff
from app.engine.parallel import RankParallel
from app.engine.request import EngineRequest, RequestOutput


@dataclass(frozen=True)
class RankInfo:
    """What a rank announces to the router once (its ``meta``)."""

    max_model_len: int
    block_size: int
    namespace: str
    prefix_caching: bool
    window: int  # sliding window: the replay a prefix hit still costs
    replay: str  # bounded replay mode ("off": a hit saves memory only)

    def meta(self) -> dict[str, object]:
        return {
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "namespace": self.namespace,
            "prefix_caching": self.prefix_caching,
            "window": self.window,
            "replay": self.replay,
        }


class RankEngine(Protocol):
    """The engine of one DP rank as the deployment uses it. ``core`` is the engine core, for
    the observability hooks only (``EngineCore.traces`` and ``on_step``: app.engine.lifecycle,
    app.engine.metrics)."""

    info: RankInfo
    core: EngineCore

    def generate(
        self, req: EngineRequest, export: bool = False, handoff: Handoff | None = None
    ) -> AsyncIterator[RequestOutput]:
        """An empty ack, then the deltas (raises the admission / validation errors).
        ``export`` / ``handoff``: prefill / decode side of a PD handoff (app.engine.handoff)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> dict[str, float]:
        """Flat numbers for the router: running, waiting, queued prefill tokens, KV usage,
        health, and the engine's counters."""
        ...

    def kv_events_since(self, seq: int) -> KVEventBatch | None: ...

    def kv_snapshot(self) -> KVSnapshot: ...

    def clear_prefix_cache(self) -> None: ...

    def problem(self, step_timeout_s: float | None) -> str | None: ...

    def shutdown(self) -> None: ...


class LocalRankEngine:
    """:class:`RankEngine` over an in-process :class:`AsyncEngine` on this replica's devices."""

    def __init__(
        self,
        cfg: EngineConfig,
        max_pending: int | None = None,
        max_queued_tokens: int | None = None,
        stream_interval_s: float = 0.0,
        step_timeout_s: float | None = None,
        parallel: RankParallel | None = None,
    ) -> None:
        self.engine = AsyncEngine(cfg, parallel=parallel)
        self.parallel = parallel
        self.client = LocalEngineClient(
            self.engine, max_pending, max_queued_tokens, stream_interval_s
        )
        self.step_timeout_s = step_timeout_s
        self.core = core = self.engine.core
        self.info = RankInfo(
            max_model_len=core.max_model_len,
            block_size=self.engine.block_size,
            namespace=HASH_NAMESPACE,
            prefix_caching=self.engine.prefix_caching,
            window=core.model.cfg.sliding_window,
            replay=cfg.cache.bounded_replay,
        )

    def generate(
        self, req: EngineRequest, export: bool = False, handoff: Handoff | None = None
    ) -> AsyncIterator[RequestOutput]:
        return self.client.generate(req, export, handoff)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    def load(self) -> dict[str, float]:
        gang: dict[str, float] = {}
        if self.parallel is not None:  # its gang rank and what its Engram tables cost
            gang["ep_rank"] = self.parallel.group.rank
            if self.parallel.engram_bytes is not None:
                gang.update(self.parallel.engram_bytes.report())
        return {
            **gang,
            **self.engine.stats(),
            "num_unfinished": self.engine.num_unfinished,
            "queued_prefill_tokens": self.client.admission.queued_tokens,
            "healthy": int(self.problem(self.step_timeout_s) is None),
        }

    def kv_events_since(self, seq: int) -> KVEventBatch | None:
        return self.engine.kv_events.since(seq)

    def kv_snapshot(self) -> KVSnapshot:
        return self.engine.kv_snapshot()

    def clear_prefix_cache(self) -> None:
        self.engine.clear_prefix_cache()

    def problem(self, step_timeout_s: float | None) -> str | None:
        return self.engine.problem(step_timeout_s)

    def shutdown(self) -> None:
        self.engine.shutdown()
