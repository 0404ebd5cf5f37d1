"""Chat's ``n`` > 1: one stream processor per choice over the engine deltas of its ``index``.

    deltas (index i) --processor i--> chat chunks, "index" set to i --> one SSE stream
                                                                    or one response

The engine forks the choices after one prefill (``app.engine.fork``) and interleaves their
deltas. Every chunk keeps its choice's ``index``; usage is counted as OpenAI does: the prompt
once, the choices' completion (and reasoning) tokens summed. Streamed, the per-choice usage is
left out of the choices' chunks and one usage chunk (``choices: []``) closes the stream when
``stream_options.include_usage`` asked for it; a response carries the choices in index order.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import deepseek_recipe as dr

from app.api.client import EngineStream
from app.api.protocols import (
    Prepared,
    UsageFix,
    chat_logprobs_present,
    compact_json,
    finish_reason,
    patch_usage,
    tokens_chunk,
)


class Choices:
    """The choices of one prepared chat request (module doc)."""

    def __init__(self, prep: Prepared, stop_ids: frozenset[int], usages: list[UsageFix]) -> None:
        self.prep, self.stop_ids, self.usages = prep, stop_ids, usages

    async def events(self, stream: EngineStream) -> AsyncIterator[tuple[int, Any]]:
        """(choice, recipe event) pairs; raises :class:`ApiError` if the engine fails."""
        procs, prep = self.prep.processors, self.prep
        ready = dr.PromptUsage(prompt_tokens=self.usages[0].prompt_tokens,
                               prompt_cache_hit_tokens=0)  # fmt: skip
        for i, proc in enumerate(procs):
            for ev in proc.push(dr.InferenceChunk.ready(prompt_usage=ready)):
                yield i, ev
        done = [False] * len(procs)
        async for out in stream:
            i, proc = out.index, procs[out.index]
            if done[i]:  # a stop sequence ended it (the engine stops it too)
                continue
            self.usages[i].count(out)
            chunk = tokens_chunk(out, self.stop_ids, prep.logprobs)
            if chunk is not None:
                for ev in proc.push(chunk):
                    yield i, ev
            if proc.finished:  # a stop sequence: the processor closed the choice itself
                done[i] = True
            elif out.finish_reason is not None:
                done[i] = True
                for ev in self._finish(proc, finish_reason(out)):
                    yield i, ev
        for i, proc in enumerate(procs):
            if not done[i]:  # the request timed out
                for ev in self._finish(proc, dr.InferenceFinishReason.Length):
                    yield i, ev

    @staticmethod
    def _finish(proc: dr.StreamProcessor, reason: dr.InferenceFinishReason) -> list[Any]:
        return [*proc.push(dr.InferenceChunk.finish(reason)), *proc.finish()]

    def total(self) -> UsageFix:
        """The request's usage: the prompt once, the choices' tokens summed."""
        first = self.usages[0]
        total = UsageFix(first.prompt_tokens, None)
        total.cached = max(u.cached for u in self.usages)
        total.generated = sum(u.generated for u in self.usages)
        if first.reasoning is not None:
            total.reasoning = sum(u.reasoning or 0 for u in self.usages)
        return total

    async def chunks(self, stream: EngineStream) -> AsyncIterator[str]:
        """The SSE data of the stream: the choices' chunks, then the usage chunk if asked."""
        usage = head = None
        async for i, ev in self.events(stream):
            obj = json.loads(ev.to_json())
            for c in obj.get("choices", []):
                c["index"] = i
            if obj.get("usage") is not None:  # the request's usage comes last, once
                usage, obj["usage"] = obj["usage"], None
                head = {k: v for k, v in obj.items() if k not in ("choices", "usage")}
                if not obj.get("choices"):
                    continue
            yield compact_json(obj)
        if usage is not None:
            yield compact_json({**head, "choices": [], "usage": patch_usage(usage, self.total())})

    async def response(self, stream: EngineStream) -> str:
        """The non-streamed response: each choice accumulated on its own, then merged."""
        prep = self.prep
        accs = [prep.proto.response_cls(prep.response_id, prep.model, prep.created,
                                        self.usages[0].prompt_tokens, 0)
                for _ in prep.processors]  # fmt: skip
        async for i, ev in self.events(stream):
            accs[i].accumulate(ev)
        parts = [json.loads(a.to_json()) for a in accs]
        obj = parts[0]
        obj["choices"] = [{**p["choices"][0], "index": i} for i, p in enumerate(parts)]
        obj = patch_usage(obj, self.total())
        return compact_json(chat_logprobs_present(obj) if prep.logprobs else obj)
