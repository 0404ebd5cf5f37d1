"""Offline API: ``LLM(model=DIR, device="cpu", dtype="float32", **engine options).generate()``.
``model`` is a checkpoint directory or a built-in tiny model name (``tiny-v41``, ``tiny-v4``:
made into ``~/.cache/fathom`` on first use).

>>> from app.engine.llm import LLM
>>> from app.engine.request import SamplingParams
>>> llm = LLM(model="tiny-v41", enable_prefix_caching=True)
>>> outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
>>> outs[0].text, outs[0].token_ids, outs[0].finish_reason
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.model_path import resolve_model
from app.engine.request import EngineRequest, RequestError, RequestOutput, SamplingParams

_ids = itertools.count()


@dataclass
class Draft:
    """One proposed block after a prompt: ``bonus`` the target's greedy token after it,
    ``ids`` [k] the drafts for the positions after the bonus, ``logits`` [k, V] fp32 the
    drafter's logits for them (before temperature)."""

    bonus: int
    ids: list[int]
    logits: torch.Tensor


class LLM:
    """Batch generation with one engine, no Ray. Engine options are the config fields."""

    def __init__(
        self, model: str, device: str = "cpu", dtype: str = "float32", **options: object
    ) -> None:
        path = str(resolve_model(model))
        self.engine = EngineCore(
            EngineConfig.from_options(path, device=device, dtype=dtype, **options)
        )
        self.tokenizer = self.engine.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (bos first when the model defines one)."""
        if self.tokenizer is None:
            raise RequestError("prompts", "this model has no tokenizer.json: pass token ids")
        return [self.engine.model.cfg.bos_token_id, *self.tokenizer.encode(text).ids]

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order, each with
        all its tokens, text, logprobs, finish reason and cached-prompt-token count (a prompt
        whose params ask for ``n`` > 1 gives its n choices in a row, in ``index`` order)."""
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("prompts", "pass exactly one of prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.encode(p) for p in prompts] if prompts is not None else prompt_token_ids
        n = len(ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * n
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != n:
            raise RequestError("sampling_params", f"{len(params)} params for {n} prompts")
        rids = [f"llm-{next(_ids)}" for _ in range(n)]
        keys = [(r, i) for r, p in zip(rids, params, strict=True) for i in range(p.n)]
        results = {(r, i): RequestOutput(r, index=i) for r, i in keys}
        try:
            for rid, toks, p in zip(rids, ids, params, strict=True):
                self.engine.add_request(EngineRequest(rid, tuple(toks), p))
            pending = set(rids)
            while pending:
                for o in self.engine.step():
                    self._merge(results[o.request_id, o.index], o)
                    if o.finished:
                        pending.discard(o.request_id)
        finally:
            for rid in rids:
                self.engine.abort(rid)
        out = [results[k] for k in keys]
        if self.tokenizer is not None:
            by_rid = dict(zip(rids, params, strict=True))
            for o in out:
                o.text = self._text(o, by_rid[o.request_id])
        return out

    def draft(self, prompt_ids: Sequence[int], anchor: int | None = None) -> Draft:
        """The drafter's first block after ``prompt_ids[: anchor + 1]`` (default: the whole
        prompt), as the engine computes it: the target prefills the prompt (chunked like any
        request) and emits its greedy token, then the configured drafter (``speculative=``)
        proposes the block after that token. For checking a drafter against a reference."""
        eng = self.engine
        if eng.proposer is None:
            raise RequestError("speculative", "this LLM was made without speculative=...")
        ids = list(prompt_ids if anchor is None else prompt_ids[: anchor + 1])
        if not ids:
            raise RequestError("prompt_ids", "the prompt is empty")
        rid = f"llm-draft-{next(_ids)}"
        got: dict[str, tuple[list[int], torch.Tensor]] = {}
        bonus: list[int] = []

        def record(rids: list[str], anchors: torch.Tensor, block) -> None:
            if rid in rids and not got:
                r = rids.index(rid)
                got[rid] = (block.ids[r].tolist(), block.logits[r].float().cpu())

        k = eng.spec.num_drafts
        params = SamplingParams(temperature=0.0, max_tokens=k + 2, ignore_eos=True)
        eng.on_draft = record
        try:
            eng.add_request(EngineRequest(rid, tuple(ids), params))
            while not got:
                for o in eng.step():
                    if o.request_id == rid:
                        bonus.extend(o.token_ids)
                        if o.finished and not got:
                            raise RuntimeError(f"{rid} finished without a draft: {o.error}")
        finally:
            eng.on_draft = None
            eng.abort(rid)
        drafts, logits = got[rid]
        return Draft(bonus[0], drafts, logits)

    dspark_draft = draft  # the same call under its DSpark name

    @staticmethod
    def _merge(acc: RequestOutput, delta: RequestOutput) -> None:
        acc.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + delta.logprobs
        if delta.prompt_logprobs is not None:
            acc.prompt_logprobs = (acc.prompt_logprobs or []) + delta.prompt_logprobs
        acc.num_prompt_tokens = delta.num_prompt_tokens
        acc.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:  # the choice's last delta
            acc.finished, acc.finish_reason = True, delta.finish_reason
            acc.stop_reason, acc.error = delta.stop_reason, delta.error

    def _text(self, o: RequestOutput, p: SamplingParams) -> str:
        text = self.tokenizer.decode(o.token_ids, skip_special_tokens=p.skip_special_tokens)
        if isinstance(o.stop_reason, str) and o.stop_reason in text:
            text = text[: text.index(o.stop_reason)]
        return text
