"""Token sampling for a batch of rows with per-request parameters.

Order per row: penalties (repetition on prompt+output, presence/frequency on output) ->
grammar mask -> log-probabilities (of these processed logits, before temperature) ->
temperature -> min_p / top_k / top_p filters -> draw. Greedy rows take the argmax (lowest id
on ties). Random rows draw with the exponential race ``argmax(p / q), q ~ Exp(1)``; a seeded
request draws ``q`` from its own generator, so the same seed gives the same tokens whatever
else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.engine.request import SamplingParams


@dataclass
class RowState:
    """What the sampler needs of one request besides its params."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded requests only
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    mask_eos: bool = False  # min_tokens not reached yet
    eos_ids: tuple[int, ...] = ()


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32 of the chosen tokens (None if no row asked)
    top_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] fp32


def _penalize(logits: torch.Tensor, rows: Sequence[RowState]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(r.prompt_ids) | set(r.output_ids)),
                dtype=torch.long,
                device=logits.device,
            )
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.presence_penalty or p.frequency_penalty) and len(r.output_ids):
            ids = torch.tensor(list(r.output_ids), dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if r.mask_eos and r.eos_ids:
            logits[i, list(r.eos_ids)] = float("-inf")


def _filter(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Zero the probabilities outside min_p / top_k / top_p (rows: per-row parameters)."""
    V = probs.shape[1]
    if bool((min_p > 0).any()):
        thresh = probs.amax(dim=1, keepdim=True) * min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < thresh, 0.0)
    k_on, p_on = top_k > 0, top_p < 1.0
    if bool(k_on.any() | p_on.any()):
        sorted_p, order = probs.sort(dim=1, descending=True, stable=True)
        rank = torch.arange(V, device=probs.device).unsqueeze(0)
        drop = k_on.unsqueeze(1) & (rank >= top_k.unsqueeze(1))
        cum = sorted_p.cumsum(dim=1)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop |= p_on.unsqueeze(1) & (cum - sorted_p >= top_p.unsqueeze(1) * cum[:, -1:])
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    return probs


def sample(logits: torch.Tensor, rows: Sequence[RowState], bitmask_apply=None) -> SampleOutput:
    """Sample one token per row of ``logits`` [B, V] (fp32; modified in place).

    ``bitmask_apply(logits)`` applies the grammar masks of constrained rows in place.
    """
    dev = logits.device
    _penalize(logits, rows)
    if bitmask_apply is not None:
        bitmask_apply(logits)
    want_lp = [r.params.logprobs for r in rows]
    logp = None
    if any(k is not None for k in want_lp):
        logp = torch.log_softmax(logits, dim=-1)
    temp = torch.tensor([r.params.temperature for r in rows], device=dev)
    greedy = temp == 0
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        scaled = logits / torch.where(greedy, 1.0, temp).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        probs = _filter(
            probs,
            torch.tensor([r.params.top_k for r in rows], device=dev),
            torch.tensor([r.params.top_p for r in rows], device=dev),
            torch.tensor([r.params.min_p for r in rows], device=dev),
        )
        q = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows):
            if r.generator is not None and not bool(greedy[i]):
                q[i] = torch.empty(probs.shape[1], device=dev).exponential_(generator=r.generator)
        drawn = (probs / q).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    out = SampleOutput(tokens, None, None, None)
    if logp is not None:
        out.logprobs = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max((v or 0) for v in want_lp)
        if k:
            top = torch.topk(logp, k, dim=-1)
            out.top_ids, out.top_logprobs = top.indices, top.values
    return out
