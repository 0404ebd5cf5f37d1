"""Prefill/decode disaggregation: prefill ranks and decode ranks as separate deployments.

    Ingress (PDEngineClient, app.deployments.pd_client)
      1 --choose(block hashes)--> Router --> a prefill rank (prefix-aware, as for DP ranks)
      2 --prefill(req)--> PrefillRank: prompt -> first token -> DecodeState --send--> Parcel
           <-- ack, first token (streamed to the client at once), Parcel (an ObjectRef)
      3 --choose--> DecodeRouter (least loaded) --> a decode rank
      4 --decode(req, output ids, Parcel)--> DecodeRank: receive -> import -> decode
           <-- the rest of the stream (the client sees one stream)

The state travels as a Ray object: through the object store between CPU actors
(:class:`ObjectStoreTransport`), or through Ray's tensor transport between GPU actors
(:class:`TensorTransport`: ``ray.put(..., _tensor_transport=...)``, one-sided NIXL, or CUDA
IPC on one node); no socket protocol of our own. The prefill rank owns the object; the
ingress holds the ref until the decode call ends.

Degrading: an export that fails, a state that cannot be received within
``transfer_timeout_s`` (lost, its owner dead), a header that does not match the decode
rank's, or no room for it there: the decode rank prefills prompt + first token itself
(``app.engine.handoff``; the same output under greedy). A prefill side that is unavailable
sends the whole request to a decode rank. No accepted request is dropped.

Metrics (``ray.util.metrics``; exported with the ``ray_`` prefix, counters with ``_total``):
``fathom_pd_transfer_bytes{role}``, ``fathom_pd_transfer_seconds{stage}`` (send: the prefill
rank's copy into the transport; receive: the decode rank's wait for the state),
``fathom_pd_handoffs{role}``, ``fathom_pd_fallbacks{reason}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import typing
import warnings
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import ray
import torch

from app.cache.transfer import KVTransferError
from app.config import EngineConfig, PDFault
from app.deployments.pd_config import PDConfig, TransportName
from app.deployments.pd_metrics import PDMetrics, count_fallback
from app.deployments.rank import DPRank
from app.engine.admission import Refusal
from app.engine.handoff import DecodeState, Handoff
from app.engine.request import EngineRequest, FinishReason, RequestOutput

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Parcel:
    """A decode state in transit: the Ray object holding it."""

    ref: ray.ObjectRef
    nbytes: int
    transport: str


class KVTransport(Protocol):
    """How a decode state crosses from a prefill rank to a decode rank."""

    name: str

    async def send(self, state: DecodeState) -> Parcel: ...

    async def receive(self, parcel: Parcel, device: torch.device, timeout_s: float
                      ) -> DecodeState: ...  # fmt: skip


@dataclass(frozen=True)
class _HostTensor:
    """A tensor as a uint8 numpy array (Ray's object store passes numpy out of band:
    no pickle copy, zero-copy reads on the receiver)."""

    array: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> _HostTensor:
        b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return cls(b.numpy(), t.dtype, tuple(t.shape))

    def tensor(self, device: torch.device) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only object store memory: only read here
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(self.array)
        return t.view(self.dtype).reshape(self.shape).to(device)


class ObjectStoreTransport:
    """CPU actors: the state's tensors as numpy buffers in Ray's object store."""

    name = "object_store"

    async def send(self, state: DecodeState) -> Parcel:
        await asyncio.to_thread(state.wait_ready)
        host = state.map_tensors(_HostTensor.of)
        ref = await asyncio.to_thread(ray.put, host)
        return Parcel(ref, state.nbytes, self.name)

    async def receive(self, parcel: Parcel, device: torch.device, timeout_s: float
                      ) -> DecodeState:  # fmt: skip
        host = await asyncio.wait_for(parcel.ref, timeout_s)
        return host.map_tensors(lambda h: h.tensor(device))


class TensorTransport:
    """GPU actors: Ray's tensor transport (RDT, Ray 2.60 alpha) for ``ray.put`` — one-sided
    ``nixl`` (needs NIXL installed) or ``cuda_ipc`` (actors on one node). The tensors stay
    on the prefill GPU until the decode rank reads them. Not run in CI (no GPUs)."""

    def __init__(self, backend: Literal["nixl", "cuda_ipc"]) -> None:
        self.name = backend

    async def send(self, state: DecodeState) -> Parcel:
        await asyncio.to_thread(state.wait_ready)
        plain = state.map_tensors(lambda t: t)  # without the CUDA event
        ref = await asyncio.to_thread(ray.put, plain, _tensor_transport=self.name)
        return Parcel(ref, state.nbytes, self.name)

    async def receive(self, parcel: Parcel, device: torch.device, timeout_s: float
                      ) -> DecodeState:  # fmt: skip
        state = await asyncio.to_thread(ray.get, parcel.ref, timeout=timeout_s)
        return state.map_tensors(lambda t: t.to(device, non_blocking=True))


def make_transport(name: TransportName, device: str) -> KVTransport:
    """``auto``: the object store on the CPU; NIXL on CUDA where it is installed, else the
    object store (through host memory)."""
    if name == "auto":
        name = "object_store"
        if device.startswith("cuda"):
            try:
                import nixl  # noqa: F401

                name = "nixl"
            except ImportError:
                logger.warning("NIXL is not installed: KV states go through the object store")
    if name == "object_store":
        return ObjectStoreTransport()
    return TensorTransport(name)


class PDRank(DPRank):
    """A DP rank in a PD role: ``prefill`` streams up to the first token and hands the
    decode state off; ``decode`` continues a handed-off request (``generate`` still serves
    whole requests: the fallback when no prefill rank is available). ``pd``: the transport
    options; the injected fault starts as the engine config's ``experimental.pd_fault``."""

    def __init__(self, engine_cfg: EngineConfig, *args: Any, pd: PDConfig, **kwargs: Any) -> None:
        super().__init__(engine_cfg, *args, **kwargs)
        self.pd = pd
        self.fault: PDFault = engine_cfg.experimental.pd_fault
        self.transport = make_transport(pd.transport, str(self.engine.core.device))
        self.header = self.engine.core.handoff.header  # computed once here: reads the checkpoint
        self.counts: Counter[str] = Counter()
        self.pd_metrics = PDMetrics()

    async def prefill(
        self, req: EngineRequest, target: str | None = None, cost: float | None = None
    ) -> AsyncIterator[RequestOutput | Refusal]:
        """The deltas up to the first token; the last one (finish reason HANDOFF, unless
        the first token ended the request) carries a :class:`Parcel` (None: export failed)."""
        del target
        async for out in self._respond(req, cost, self._handing_off(req)):
            yield out

    async def _handing_off(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(req, export=True):
            if out.finish_reason is FinishReason.HANDOFF:
                out.handoff = await self._send(out.handoff)
            yield out

    async def _send(self, state: DecodeState | None) -> Parcel | None:
        t0 = time.perf_counter()
        try:
            if state is None:
                raise RuntimeError("the engine's export failed")
            if self.fault == "export":
                raise RuntimeError("injected fault: export")
            if self.fault == "header":
                bad = dataclasses.replace(state.kv.header, model="injected-fault")
                state = dataclasses.replace(state, kv=dataclasses.replace(state.kv, header=bad))
            parcel = await self.transport.send(state)
        except Exception as e:
            logger.warning("KV export failed (%r): the decode rank prefills it", e)
            self.counts["export_failed"] += 1
            return None
        dt = time.perf_counter() - t0
        self.counts["sent"] += 1
        self.counts["sent_bytes"] += parcel.nbytes
        self._observe("prefill", "send", parcel.nbytes, dt)
        return parcel

    async def decode(
        self, req: EngineRequest, output_ids: tuple[int, ...], parcel: Parcel | None,
        target: str | None = None, cost: float | None = None,
    ) -> AsyncIterator[RequestOutput | Refusal]:  # fmt: skip
        """Continue ``req`` from ``output_ids`` with the state in ``parcel``; without a
        usable state, prefill prompt + output ids here."""
        del target
        state, why = await self._receive(parcel)
        if why is not None:
            count_fallback(self.pd_metrics, self.counts, why)
        stream = self.engine.generate(req, handoff=Handoff(tuple(output_ids), state))
        async for out in self._respond(req, 0.0 if state else cost, stream):
            yield out

    async def _receive(self, parcel: Parcel | None) -> tuple[DecodeState | None, str | None]:
        """The state and None, or None and why not (export_failed, timeout, lost,
        mismatch)."""
        if parcel is None:
            return None, "export_failed"
        t0 = time.perf_counter()
        try:
            state = await self.transport.receive(
                parcel, self.engine.core.device, self.pd.transfer_timeout_s
            )
        except (TimeoutError, ray.exceptions.GetTimeoutError):
            logger.warning("KV state not received within %.1f s", self.pd.transfer_timeout_s)
            return None, "timeout"
        except Exception as e:  # lost object, dead owner, deserialization
            logger.warning("KV state lost (%r)", e)
            return None, "lost"
        try:
            state.kv.header.check(self.header)
        except KVTransferError as e:
            logger.error("%s: the decode rank prefills the request", e)
            return None, "mismatch"
        self.counts["received"] += 1
        self.counts["received_bytes"] += parcel.nbytes
        self._observe("decode", "receive", parcel.nbytes, time.perf_counter() - t0)
        return state, None

    def _observe(self, role: str, stage: str, nbytes: int, seconds: float) -> None:
        try:
            m = self.pd_metrics
            m.bytes.inc(nbytes, tags={"role": role})
            m.handoffs.inc(tags={"role": role})
            m.seconds.observe(seconds, tags={"stage": stage})
        except Exception:
            logger.debug("PD metrics failed", exc_info=True)

    async def set_fault(self, fault: PDFault, target: str | None = None) -> None:
        """Switch the injected fault (tests and drills; ``experimental.pd_fault`` at start)."""
        del target
        if fault not in typing.get_args(PDFault):
            raise ValueError(f"unknown fault {fault!r}")
        self.fault = fault

    async def pd_stats(self, target: str | None = None) -> dict[str, int]:
        """Handoff counters of this rank (sent / received states and bytes, fallbacks by
        reason), the engine's own (kv_exports, kv_imports, kv_import_local, host_hit_tokens)
        and, read now,
        its unfinished requests and the KV blocks requests reference."""
        del target
        core = self.engine.core
        st, pool = core.stats, core.cache.pool
        return {**self.counts, "kv_exports": st.kv_exports, "kv_imports": st.kv_imports,
                "kv_import_local": st.kv_import_local, "host_hit_tokens": st.host_hit_tokens,
                "num_unfinished": int(self.engine.load().get("num_unfinished", 0)),
                "kv_blocks_used": pool.num_blocks - pool.num_available}  # fmt: skip
