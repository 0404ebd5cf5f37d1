"""A request's decode state across engines (prefill/decode disaggregation).

    prefill engine: add_request(req, export=True)
        prompt -> first token -> DecodeState (KV rows + what the host knows) -> the request
        ends there with finish reason HANDOFF (its blocks freed; the prefix cache keeps them)
    decode engine:  add_handoff(req, Handoff(output_ids, state))
        state given: allocate blocks + slot, write the rows, continue decoding at once
        state None (the transfer failed) or no room: resume as a local prefill of
        prompt + output ids (what a preempted request does; same output under greedy)

What :class:`DecodeState` carries and where the rest comes from:
  KV              paged blocks of every group, window ring, compressor tails, DSpark/MTP
                  context rings (``app.cache.transfer.KVState``, with the layout header)
  tokens          the output ids (the first sampled token); Engram history is read from
                  the request's committed tokens, so the ids are its whole state
  sampler         stateless given the ids: penalties count prompt + output ids, a seeded
                  request's draws are counters of (seed, output index); unseeded requests
                  draw from each engine's own generator
  grammar         the constraint (in the request) replayed over the output ids on import
                  (``app.engine.grammar.replay``)
  speculation     the pending drafts and their proposal logits (the decode engine's first
                  step verifies them, as the prefill engine's next step would have)

An engine core's side of this is its :class:`HandoffPort`, which reaches back into the core
only through the :class:`Engine` protocol (make a request's sequence, enter it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from app.cache.block_pool import NoFreeBlocks
from app.cache.manager import CacheManager
from app.cache.transfer import (
    KVState,
    KVTransferError,
    LayoutHeader,
    gather,
    model_fingerprint,
    scatter,
)
from app.config import EngineConfig
from app.engine import grammar
from app.engine.metrics import EngineStats
from app.engine.request import EngineRequest, FinishReason, RequestError, RequestOutput
from app.engine.sequence import SeqStatus, Sequence
from app.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    """Everything a decode engine needs to continue a request (module doc)."""

    request_id: str
    output_ids: tuple[int, ...]
    kv: KVState
    drafts: tuple[int, ...] = ()
    draft_logits: torch.Tensor | None = None  # [k, V] fp32 (random rows read them)
    ready: object | None = field(default=None, repr=False)  # CUDA event of the copies

    @property
    def nbytes(self) -> int:
        lg = self.draft_logits
        return self.kv.nbytes + (lg.numel() * lg.element_size() if lg is not None else 0)

    def wait_ready(self) -> None:
        """Block until the copies out of the pools are done (CUDA; no-op on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    def map_tensors(self, fn) -> DecodeState:
        """A copy whose tensors are ``fn(tensor)`` (no CUDA event: not picklable)."""
        lg = None if self.draft_logits is None else fn(self.draft_logits)
        return DecodeState(self.request_id, self.output_ids, self.kv.map_tensors(fn),
                           self.drafts, lg)  # fmt: skip

    def __getstate__(self) -> dict:
        return {**self.__dict__, "ready": None}


@dataclass(frozen=True)
class Handoff:
    """What a decode engine is given: the output so far and, unless the transfer failed,
    the decode state."""

    output_ids: tuple[int, ...]
    state: DecodeState | None = None


class Engine(Protocol):
    """What an import needs of the engine core that continues a request."""

    def new_sequence(self, req: EngineRequest) -> Sequence:
        """A validated request's engine state (not queued yet)."""

    def enter(self, seq: Sequence, running: bool = False) -> None:
        """Register ``seq``: into the waiting queue, or (``running``: its cache is in
        place) straight into the running batch."""


class HandoffPort:
    """One engine core's side of handoffs: requests marked to export after their first
    token, their export, and the import of requests another engine prefilled (counted in
    ``stats``)."""

    def __init__(
        self, cfg: EngineConfig, model_cfg: ModelConfig, cache: CacheManager,
        device: torch.device, stats: EngineStats,
    ) -> None:  # fmt: skip
        self.cfg, self.model_cfg, self.cache = cfg, model_cfg, cache
        self.device, self.stats = device, stats
        self.exporting: set[str] = set()  # requests handed off after their first token
        self._header: LayoutHeader | None = None

    @property
    def header(self) -> LayoutHeader:
        """The layout header of this engine's KV states (what an import must match): its
        cache layout, the checkpoint's fingerprint and the drafter."""
        if self._header is None:
            path, spec = Path(self.cfg.model), self.cfg.speculative
            fp = model_fingerprint(path) if path.is_dir() else repr(self.model_cfg)
            draft = f"{spec.method}:{spec.num_draft_tokens}" if spec is not None else ""
            self._header = LayoutHeader.of(self.cache.layout, fp, draft)
        return self._header

    def after_token(self, seq: Sequence, out: RequestOutput) -> None:
        """A step's delta ``out`` of ``seq``: an exporting request's first tokens end it with
        its decode state (unless they end it anyway)."""
        if out.token_ids and not out.finished and seq.request_id in self.exporting:
            self.export(seq, out)

    def export(self, seq: Sequence, out: RequestOutput) -> None:
        """End an exporting request after its first token with its decode state in ``out``
        (None when the export fails: the decode side then prefills it itself)."""
        try:
            out.handoff = state = self.state_of(seq)
            self.stats.kv_exports += 1
            self.stats.kv_export_bytes += state.nbytes
        except Exception:
            logger.exception("request %s: KV export failed", seq.request_id)
        seq.finish_reason = FinishReason.HANDOFF
        out.finished, out.finish_reason = True, FinishReason.HANDOFF

    def state_of(self, seq: Sequence) -> DecodeState:
        """The decode state of ``seq`` right after its first output token (copies; the
        caller frees the request's cache afterwards)."""
        cache, rid = self.cache, seq.request_id
        kv = gather(cache.pools, cache.layout, self.header, cache.slot_of(rid),
                    cache.blocks_of(rid), seq.num_prompt, cache.window_floor(rid),
                    seq.num_cached)  # fmt: skip
        logits = seq.draft_logits.detach().clone() if seq.draft_logits is not None else None
        state = DecodeState(rid, tuple(seq.output_ids), kv, tuple(seq.drafts), logits)
        if self.device.type == "cuda":
            state.ready = torch.cuda.Event()
            state.ready.record()
        return state

    def install(self, engine: Engine, req: EngineRequest, handoff: Handoff) -> str | None:
        """Queue ``req`` on ``engine`` continuing from ``handoff``. Returns None when the
        state was installed (the request decodes in the next step), else why it resumes as
        a local prefill ("no_state", "no_room"). Raises :class:`KVTransferError` on a header
        mismatch and :class:`RequestError` when the output does not fit the request."""
        why = self._install(engine, req, handoff)
        if why is None:
            self.stats.kv_imports += 1
        else:
            self.stats.kv_import_local += 1
        return why

    def _install(self, engine: Engine, req: EngineRequest, handoff: Handoff) -> str | None:
        state, out = handoff.state, list(handoff.output_ids)
        if state is not None:
            state.kv.header.check(self.header)
            if state.request_id != req.request_id or list(state.output_ids) != out:
                raise KVTransferError(
                    f"the KV state is {state.request_id!r}'s, not this request's"
                )
        if not out:
            raise RequestError("handoff", "a handoff needs the output tokens so far")
        seq = engine.new_sequence(req)
        seq.prompt_logprobs_done = seq.num_prompt  # the prefill engine sent them (if asked)
        seq.tokens += out
        grammar.replay(seq.matcher, out)
        if state is None:
            engine.enter(seq)
            return "no_state"
        cache, rid, kv = self.cache, req.request_id, state.kv
        try:
            slot, blocks = cache.adopt(rid, kv.num_blocks, req.extra_key, kv.window_floor,
                                       kv.num_cached)  # fmt: skip
        except (NoFreeBlocks, RuntimeError):
            engine.enter(seq)
            return "no_room"
        try:
            scatter(cache.pools, cache.layout, kv, slot, blocks)
        except BaseException:
            cache.free(rid)
            raise
        seq.num_computed = seq.num_done = kv.num_computed
        seq.num_cached = kv.num_cached
        if state.drafts:
            seq.drafts = list(state.drafts)
            lg = state.draft_logits
            seq.draft_logits = lg.to(self.device) if lg is not None else None
        cache.commit(rid, seq.tokens, kv.num_computed)  # the prompt's blocks join the index
        seq.status = SeqStatus.RUNNING
        engine.enter(seq, running=True)
        return None
