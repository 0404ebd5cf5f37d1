"""Teacher-forced chunked forward over a :class:`CacheManager`: feeds known token sequences
through the model's batched step in random-size chunks, every request batched together each
step, with the engine's own batch builder (``app.engine.batch``).

Used by the cache tests and ``bench/replay_fidelity.py`` to compare incremental forward
(chunked prefill, decode, prefix hits, bounded replay) with the full-sequence reference. The
engine's scheduler and runner do the same with sampled tokens.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from app.cache.manager import CacheManager
from app.engine.batch import BatchBuilder, StepSpec
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
    dev = model.embed.weight.device
    builder = BatchBuilder(mgr.pools, dev)
    done, out = {}, {r: {} for r in seqs}
    for rid, toks in seqs.items():
        plan = mgr.admit(rid, toks.tolist())
        done[rid] = plan.start
    while any(done[r] < seqs[r].numel() for r in seqs):
        act = [r for r in seqs if done[r] < seqs[r].numel()]
        rows = []
        for r in act:
            a, toks = done[r], seqs[r]
            n = min(rng.randint(1, max_chunk), toks.numel() - a)
            mgr.ensure(r, a + n)
            L = (prompt_lens or {}).get(r, 0)
            hist = [int(toks[a - 1 - k]) if a - 1 - k >= 0 else -1 for k in range(n_back)]
            rows.append((r, a, n, L, hist))
        width = max(mgr.num_blocks_of(r) for r in act)
        lens = np.array([n for _, _, n, _, _ in rows], dtype=np.int64)
        T = int(lens.sum())
        spec = StepSpec(
            slots=np.array([mgr.slot_of(r) for r in act], dtype=np.int64),
            starts=np.array([a for _, a, _, _, _ in rows], dtype=np.int64),
            lens=lens,
            floors=np.array([mgr.window_floor(r) for r in act], dtype=np.int64),
            cached=np.array([max(a, mgr.num_cached(r)) for r, a, *_ in rows], dtype=np.int64),
            decoder_floors=np.array(
                [mgr.decoder_floor(L, a) if L else 0 for _, a, _, L, _ in rows], dtype=np.int64
            ),
            history=np.array([h for *_, h in rows], dtype=np.int64).reshape(len(act), n_back),
            ids=np.concatenate([seqs[r][a : a + n].numpy() for r, a, n, _, _ in rows]),
            pending=np.full(T, -1, dtype=np.int64),
            logit_rows=np.arange(T, dtype=np.int64),
            tables=mgr.tables[[mgr.slot_of(r) for r in act], :width],
        )
        owner = np.repeat(np.arange(len(act)), lens)
        flat_pos = np.concatenate([np.arange(a, a + n) for _, a, n, _, _ in rows])
        if spec.decoder_floors.any():  # rows below the floors never reach the head
            keep = np.concatenate(
                [np.arange(max(a, f), a + n) - a + o for (_, a, n, _, _), f, o in
                 zip(rows, spec.decoder_floors, np.cumsum(lens) - lens, strict=True)]
            )  # fmt: skip
            spec.logit_rows = keep.astype(np.int64)
            owner, flat_pos = owner[keep], flat_pos[keep]
        with torch.no_grad():
            logits = model(builder.build(spec)).cpu()
        for lg, p, o in zip(logits, flat_pos.tolist(), owner.tolist(), strict=True):
            out[act[o]][p] = lg
        for r, _, n, _, _ in rows:
            done[r] += n
            mgr.commit(r, seqs[r].tolist(), done[r])
        mgr.check_integrity()
    return out
