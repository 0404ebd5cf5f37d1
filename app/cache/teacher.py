"""Teacher-forced chunked forward over a :class:`CacheManager`: feeds known token sequences
through the model in random-size chunks, every request batched together each step.

Used by the cache tests and ``bench/replay_fidelity.py`` to compare incremental forward
(chunked prefill, decode, prefix hits, bounded replay) with full-sequence forward. The
engine's scheduler and runner do the same with sampled tokens.
"""

from __future__ import annotations

import random

import torch

from app.cache.manager import CacheManager
from app.model.forward_batch import ForwardBatch
from app.model.model import DeepseekModel


def drive(
    model: DeepseekModel,
    mgr: CacheManager,
    seqs: dict[str, torch.Tensor],
    rng: random.Random,
    max_chunk: int,
    prompt_lens: dict[str, int] | None = None,
) -> dict[str, dict[int, torch.Tensor]]:
    """Admit every sequence, then step until all are computed; chunk sizes are drawn from
    ``1..max_chunk``. ``prompt_lens`` marks prompt rows for V4.1 decoder replay.
    Returns ``{request: {position: logits}}`` for every position that reached the head."""
    hs = model.hash_spec
    n_back = hs.max_ngram - 1 if hs is not None else 0
    done, out = {}, {r: {} for r in seqs}
    for rid, toks in seqs.items():
        plan = mgr.admit(rid, toks.tolist())
        done[rid] = plan.start
    while any(done[r] < seqs[r].numel() for r in seqs):
        act = [r for r in seqs if done[r] < seqs[r].numel()]
        ids, pos, lens, pre, floors, cached, dec, hist = [], [], [], [], [], [], [], []
        for r in act:
            a, toks = done[r], seqs[r]
            n = min(rng.randint(1, max_chunk), toks.numel() - a)
            mgr.ensure(r, a + n)
            ids.append(toks[a : a + n])
            pos.append(torch.arange(a, a + n))
            lens.append(n)
            pre.append(a)
            floors.append(mgr.window_floor(r))
            cached.append(max(a, mgr.num_cached(r)))
            L = (prompt_lens or {}).get(r, 0)
            dec.append(mgr.decoder_floor(L, a) if L else 0)
            hist.append([int(toks[a - 1 - k]) if a - 1 - k >= 0 else -1 for k in range(n_back)])
        batch = ForwardBatch(
            torch.cat(ids), torch.cat(pos), tuple(lens), tuple(pre), kv=mgr.store(act),
            window_floors=tuple(floors), cached_lens=tuple(cached), decoder_floors=tuple(dec),
            history=torch.tensor(hist),
        )  # fmt: skip
        with torch.no_grad():
            logits, rows = model.forward_rows(batch)
        flat_pos = batch.positions[rows]
        owner = torch.repeat_interleave(torch.arange(len(act)), torch.tensor(lens))[rows]
        for lg, p, o in zip(logits, flat_pos.tolist(), owner.tolist(), strict=True):
            out[act[o]][p] = lg
        for r, n in zip(act, lens, strict=True):
            done[r] += n
            mgr.commit(r, seqs[r].tolist(), done[r])
        mgr.check_integrity()
    return out
