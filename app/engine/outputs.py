"""Host-side output processing of sampled tokens: grammar acceptance, stop conditions,
logprobs, and the RequestOutput deltas a step emits."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from app.engine.request import FinishReason, RequestOutput, TokenLogprob
from app.engine.sampler import SampleOutput
from app.engine.scheduler import Sequence


class OutputProcessor:
    """Applies sampled tokens to requests and builds their output deltas."""

    def __init__(
        self, tokenizer: Tokenizer | None, eos_ids: tuple[int, ...], max_model_len: int
    ) -> None:
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len

    def append(self, seq: Sequence, tok: int) -> list[int]:
        """Add a sampled token; set the finish reason when the request is done. Returns the
        tokens to emit (stop tokens are not emitted)."""
        p = seq.req.params
        if seq.matcher is not None and not seq.matcher.accept(tok):
            seq.finish_reason = FinishReason.ERROR
            seq.error = f"token {tok} violates the output constraint"
            return []
        n_out = len(seq.tokens) - seq.num_prompt
        if n_out >= p.min_tokens and (
            (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, tok
            return []
        seq.tokens.append(tok)
        n_out += 1
        if seq.matcher is not None and seq.matcher.must_stop():  # only EOS could follow
            seq.finish_reason = FinishReason.STOP
        elif p.stop and self.tokenizer is not None and n_out >= p.min_tokens:
            hit = self._stop_string(seq)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, hit
        if seq.finish_reason is None and (
            (p.max_tokens is not None and n_out >= p.max_tokens)
            or len(seq.tokens) >= self.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH
        return [tok]

    def _stop_string(self, seq: Sequence) -> str | None:
        stops = seq.req.params.stop
        span = max(len(s) for s in stops) + 8  # tokens are at least one char, most often
        tail = self.tokenizer.decode(seq.output_ids[-span:], skip_special_tokens=False)
        return next((s for s in stops if s in tail), None)

    @staticmethod
    def token_logprob(
        logprob: float, top_ids: list[int] | None, top_lp: list[float] | None, tok: int, k: int
    ) -> TokenLogprob:
        top = ()
        if k and top_ids is not None:
            top = tuple(zip(top_ids[:k], top_lp[:k], strict=True))
        return TokenLogprob(tok, float(logprob), top)

    @staticmethod
    def prompt_logprobs(
        seq: Sequence, positions: list[int], logits: torch.Tensor, start: int
    ) -> list[TokenLogprob | None] | None:
        """Logprob of each next prompt token given the prefix (position 0 has none). Each
        position is emitted once: a preempted request recomputes rows it already reported."""
        k = seq.req.params.prompt_logprobs or 0
        done = seq.prompt_logprobs_done
        logp = torch.log_softmax(logits.float(), dim=-1).cpu()
        out: list[TokenLogprob | None] = [None] if start == 0 and done == 0 else []
        for j, p in enumerate(positions):
            if p + 1 >= seq.num_prompt:
                break
            if p + 1 < done:  # token p+1 was reported before a preemption
                continue
            nxt = seq.tokens[p + 1]
            top = ()
            if k:
                t = torch.topk(logp[j], k)
                top = tuple(zip(t.indices.tolist(), t.values.tolist(), strict=True))
            out.append(TokenLogprob(nxt, float(logp[j, nxt]), top))
        if positions:
            seq.prompt_logprobs_done = max(done, min(positions[-1] + 2, seq.num_prompt))
        return out or None

    @staticmethod
    def output(
        seq: Sequence, new: list[int], lp, finished: bool = False, prompt_logprobs=None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=list(new),
            logprobs=lp,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason if finished else None,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            error=seq.error,
        )


@dataclass
class HostResult:
    """A step's samples on the host: one entry per sampled row (``accepted``: the row's draft
    was accepted; ``accept_lengths`` / ``drafts``: per sampled request, speculation on)."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    accepted: list[bool] | None = None
    accept_lengths: list[int] | None = None
    drafts: list[list[int]] | None = None


class HostSamples:
    """A step's sampled tokens (logprobs, accept flags, next drafts) copied to the host
    without blocking; ``wait`` blocks on the copy's event."""

    def __init__(self, res: SampleOutput, extra: list[torch.Tensor] | None = None) -> None:
        self._event = None
        extra = list(extra or []) + [None] * (2 - len(extra or []))
        parts = [res.tokens, res.logprobs, res.top_ids, res.top_logprobs, res.accepted, *extra]
        if res.tokens.is_cuda:
            parts = [p.to("cpu", non_blocking=True) if p is not None else None for p in parts]
            self._event = torch.cuda.Event()
            self._event.record()
        self._parts = parts

    def wait(self) -> HostResult:
        if self._event is not None:
            self._event.synchronize()
        return HostResult(*(p.tolist() if p is not None else None for p in self._parts))
