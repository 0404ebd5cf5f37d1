"""Logprob objects of the responses that the HTTP layer renders itself (chat's per-token
``logprobs`` come from deepseek-recipe):

- the legacy Completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``,
  ``text_offset``) of generated tokens and, with ``echo``, of the prompt's (its first token has
  no logprob: ``null``);
- vLLM's ``prompt_logprobs`` extra field (chat, completions): per prompt token ``null`` (the
  first) or ``{token id: {"logprob", "rank", "decoded_token"}}``, the prompt token first, then
  the top alternatives.

``-inf`` is sent as -9999.0, as OpenAI and vLLM do (JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from app.engine.request import TokenLogprob

FLOOR = -9999.0  # a logprob of -inf, as a JSON number


def finite(logprob: float) -> float:
    """``logprob`` floored at :data:`FLOOR` (-inf and NaN become it)."""
    return logprob if logprob >= FLOOR else FLOOR


def token_texts(tokenizer: Tokenizer, ids: Sequence[int], skip_special: bool) -> dict[int, str]:
    """Each distinct id's text, decoded on its own (one batch call)."""
    distinct = list(dict.fromkeys(ids))
    texts = tokenizer.decode_batch([[i] for i in distinct], skip_special_tokens=skip_special)
    return dict(zip(distinct, texts, strict=True))


def legacy_logprobs(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    k: int,
    offset: int,
) -> dict[str, list[Any]]:
    """The legacy Completions ``logprobs`` of tokens ``ids`` (``entries[i]``: token i's logprob,
    None for a prompt's first token), the first at character ``offset`` of the choice's text.
    ``top_logprobs`` holds the token itself and the top ``k`` alternatives (so up to k + 1
    entries, as OpenAI documents). A token's text is its own decoding; special tokens are named
    in ``tokens`` but take no room in the text (it is decoded without them)."""
    alts = [i for e in entries if e is not None for i, _ in e.top[:k]]
    named = token_texts(tokenizer, [*ids, *alts], skip_special=False)
    shown = token_texts(tokenizer, ids, skip_special=True)
    offsets, tops, pos = [], [], offset
    for tok, e in zip(ids, entries, strict=True):
        offsets.append(pos)
        pos += len(shown[tok])
        if e is None:
            tops.append(None)
            continue
        top = {named[tok]: finite(e.logprob)}
        for i, lp in e.top[:k]:
            top.setdefault(named[i], finite(lp))
        tops.append(top)
    return {
        "tokens": [named[t] for t in ids],
        "token_logprobs": [None if e is None else finite(e.logprob) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob | None], k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a prompt's tokens (``entries``, the first None): the
    prompt token with its vocabulary rank, then the top ``k`` alternatives (rank 1..k)."""
    ids = [i for e in entries if e is not None for i in (e.token_id, *(t for t, _ in e.top[:k]))]
    named = token_texts(tokenizer, ids, skip_special=False)
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {str(e.token_id): _entry(e.logprob, e.rank, named[e.token_id])}
        for r, (i, lp) in enumerate(e.top[:k], start=1):
            d.setdefault(str(i), _entry(lp, r, named[i]))
        out.append(d)
    return out


def _entry(logprob: float, rank: int | None, text: str) -> dict[str, Any]:
    return {"logprob": finite(logprob), "rank": rank, "decoded_token": text}
