"""Host-side output processing of sampled tokens: grammar acceptance, stop conditions,
logprobs, and the RequestOutput deltas a step emits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from app.engine import grammar
from app.engine.flight import Flight, HostResult
from app.engine.request import FinishReason, RequestOutput, TokenLogprob
from app.engine.sequence import Sequence

if TYPE_CHECKING:
    from app.cache.manager import CacheManager
    from app.engine.spec.speculator import Speculator


def checkpoint_text(model_dir: Path, eos_token_id: int) -> tuple[Tokenizer | None, tuple[int, ...]]:
    """A checkpoint's tokenizer (None without ``tokenizer.json``) and its stop ids: the
    model's EOS and the EOS ids of ``generation_config.json``."""
    tok_file = model_dir / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    ids = {eos_token_id}
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tokenizer, tuple(sorted(ids))


class OutputProcessor:
    """Applies sampled tokens to requests and builds their output deltas; commits what a
    step computed to the prefix cache (``cache``) and settles its drafts (``spec``)."""

    def __init__(
        self, tokenizer: Tokenizer | None, eos_ids: tuple[int, ...], max_model_len: int,
        cache: CacheManager, spec: Speculator | None = None,
    ) -> None:  # fmt: skip
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, eos_ids, max_model_len
        self.cache, self.spec = cache, spec

    def apply(
        self, flight: Flight, host: HostResult | None
    ) -> Iterator[tuple[Sequence, RequestOutput]]:
        """Apply a finished step, request by request: advance it, append its tokens (a verify
        chunk's accepted drafts and its correction or bonus; rejected positions roll back),
        take its next drafts, and yield its delta (if it has one) before the next request."""
        sampled = flight.sampled_rows() if host is not None else {}
        for it in flight.items:
            seq = it.seq
            rid = seq.request_id
            seq.num_in_flight -= 1
            seq.num_done = max(seq.num_done, it.start + it.num_tokens)
            if it.samples:
                seq.num_pending -= 1
            if seq.finish_reason is not None:  # finished or aborted meanwhile: drop
                continue
            plp = None
            if rid in flight.inputs.prompt_rows:
                first, pos = flight.inputs.prompt_rows[rid]
                plp = self.prompt_logprobs(seq, pos, flight.logits[first : first + len(pos)],
                                           it.start)  # fmt: skip
            if rid not in sampled:
                self.cache.commit(rid, seq.tokens, seq.num_done)
                if plp is not None:
                    yield seq, self.output(seq, [], None, prompt_logprobs=plp)
                continue
            r0, c = sampled[rid]
            m = self.spec.verify(seq, it, host.accepted[r0 : r0 + c - 1]) if c > 1 else 0
            seq.drafts, seq.draft_logits = [], None
            new, lps = self.emit(seq, host, r0, m + 1)
            self.cache.commit(rid, seq.tokens, min(seq.num_done, len(seq.tokens)))
            finished = seq.finish_reason is not None
            if not finished and rid in flight.draft_rows:
                self.spec.take(seq, host.drafts[flight.draft_rows[rid]], flight)
            yield seq, self.output(seq, new, lps, finished, plp)

    def append(self, seq: Sequence, tok: int) -> list[int]:
        """Add a sampled token; set the finish reason when the request is done. Returns the
        tokens to emit (stop tokens are not emitted)."""
        p = seq.req.params
        if (error := grammar.accept(seq.matcher, tok)) is not None:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
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

    def emit(
        self, seq: Sequence, host: HostResult, first: int, rows: int
    ) -> tuple[list[int], list[TokenLogprob] | None]:
        """Append the sampled ``rows`` of ``seq`` from row ``first`` of a step's ``host``
        samples, until it finishes -> (the tokens to emit, their logprobs when wanted)."""
        new, lps = [], []
        want = seq.req.params.logprobs
        for r in range(first, first + rows):
            tok = host.tokens[r]
            got = self.append(seq, tok)
            if got and want is not None:
                top_ids = host.top_ids[r] if host.top_ids is not None else None
                top_lp = host.top_logprobs[r] if host.top_logprobs is not None else None
                lps.append(self.token_logprob(host.logprobs[r], top_ids, top_lp, tok, want))
            new += got
            if seq.finish_reason is not None:
                break
        return new, (lps if new and want is not None else None)

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
        """Logprob and vocabulary rank of each next prompt token given the prefix, with the
        top ``prompt_logprobs`` alternatives (position 0 has none). Each position is emitted
        once: a preempted request recomputes rows it already reported."""
        k = seq.req.params.prompt_logprobs or 0
        done = seq.prompt_logprobs_done
        out: list[TokenLogprob | None] = [None] if start == 0 and done == 0 else []
        # rows j whose next token p + 1 is a prompt token not reported before a preemption
        rows = [j for j, p in enumerate(positions) if done <= p + 1 < seq.num_prompt]
        if rows:
            logp = torch.log_softmax(logits[rows].float(), dim=-1)
            nxt = torch.tensor([seq.tokens[positions[j] + 1] for j in rows], device=logp.device)
            chosen = logp.gather(1, nxt[:, None])
            ranks = (logp > chosen).sum(dim=1) + 1
            top_ids = top_lp = None
            if k:
                t = torch.topk(logp, k, dim=-1)
                top_ids, top_lp = t.indices.tolist(), t.values.tolist()
            for i, (tok, lp, rank) in enumerate(
                zip(nxt.tolist(), chosen[:, 0].tolist(), ranks.tolist(), strict=True)
            ):
                top = tuple(zip(top_ids[i], top_lp[i], strict=True)) if k else ()
                out.append(TokenLogprob(tok, lp, top, rank))
        if positions:
            seq.prompt_logprobs_done = max(done, min(positions[-1] + 2, seq.num_prompt))
        return out or None

    @staticmethod
    def output(
        seq: Sequence, new: list[int], lp, finished: bool = False, prompt_logprobs=None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.output_id,
            index=seq.choice,
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
