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
  speculation     the pending drafts and their proposal logits (the decode engine's first
                  step verifies them, as the prefill engine's next step would have)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from app.cache.block_pool import NoFreeBlocks
from app.cache.transfer import KVState, KVTransferError, gather, scatter
from app.engine.request import EngineRequest, RequestError
from app.engine.scheduler import SeqStatus, Sequence

if TYPE_CHECKING:
    from app.engine.core import EngineCore


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


def export_state(core: EngineCore, seq: Sequence) -> DecodeState:
    """The decode state of ``seq`` right after its first output token (copies; the caller
    frees the request's cache afterwards)."""
    cache, rid = core.cache, seq.request_id
    kv = gather(cache.pools, cache.layout, core.kv_header, cache.slot_of(rid),
                cache.blocks_of(rid), seq.num_prompt, cache.window_floor(rid),
                seq.num_cached)  # fmt: skip
    logits = seq.draft_logits.detach().clone() if seq.draft_logits is not None else None
    state = DecodeState(rid, tuple(seq.output_ids), kv, tuple(seq.drafts), logits)
    if core.device.type == "cuda":
        state.ready = torch.cuda.Event()
        state.ready.record()
    return state


def import_state(core: EngineCore, req: EngineRequest, handoff: Handoff) -> str | None:
    """Queue ``req`` on ``core`` continuing from ``handoff``. Returns None when the state was
    installed (the request decodes in the next step), else why it resumes as a local
    prefill ("no_state", "no_room"). Raises :class:`KVTransferError` on a header mismatch
    and :class:`RequestError` when the output does not fit the request."""
    state, out = handoff.state, list(handoff.output_ids)
    if state is not None:
        state.kv.header.check(core.kv_header)
        if state.request_id != req.request_id or list(state.output_ids) != out:
            raise KVTransferError(f"the KV state is {state.request_id!r}'s, not this request's")
    if not out:
        raise RequestError("handoff", "a handoff needs the output tokens so far")
    seq = core.new_sequence(req)
    seq.tokens += out
    if seq.matcher is not None:
        for tok in out:
            if not seq.matcher.accept(tok):
                raise RequestError("constraint", f"output token {tok} violates the constraint")
    if state is None:
        core.queue_sequence(seq)
        return "no_state"
    cache, rid = core.cache, req.request_id
    kv = state.kv
    try:
        slot, blocks = cache.adopt(rid, kv.num_blocks, req.extra_key, kv.window_floor,
                                   kv.num_cached)  # fmt: skip
    except (NoFreeBlocks, RuntimeError):
        core.queue_sequence(seq)
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
        seq.draft_logits = lg.to(core.device) if lg is not None else None
    cache.commit(rid, seq.tokens, kv.num_computed)  # the prompt's blocks join the prefix index
    seq.status = SeqStatus.RUNNING
    core.run_sequence(seq)
    return None
