"""Acceptance and rollback of a verify step (speculative decoding).

A verify chunk of a request whose last committed position is s (its KV is written, its token
known) is [t_s, d_1 .. d_c] at positions s .. s + c; logits row j checks d_{j+1} and row c
draws the bonus. With m the number of leading accepted drafts:

    emitted    d_1 .. d_m and row m's token (the correction, or the bonus when m = c)
    committed  positions s .. s + m (their KV, compressor state and DSpark context stay)
    rollback   num_computed = s + m + 1: positions s + m + 1 .. s + c are recomputed later.
               The window ring keeps W + c rows and a compressor tail ring span + c rows
               (``CacheLayout.build(ring_headroom=c)``), so the rejected rows overwrote no
               row a later query reads; a compressed entry or index key of a group holding a
               rejected position is rewritten when that group is computed again, before any
               query reaches its end; prefix-cache blocks are committed only below
               num_done = s + m + 1; DSpark context rows are written only for committed
               positions; Engram history is read from the request's committed tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from app.engine.sampler import to_device


def accepted_lengths(
    accepted: torch.Tensor | None, bases: np.ndarray, counts: np.ndarray, device: torch.device
) -> torch.Tensor:
    """m per request (``device`` [R]): the leading accepted drafts of rows ``bases[i]`` ..
    ``bases[i] + counts[i] - 2`` of ``accepted`` (the last row of each carries no draft;
    None: no row had one)."""
    R = counts.size
    kmax = int(counts.max()) - 1 if R else 0
    dev = torch.device(device)
    if accepted is None or kmax <= 0:
        return torch.zeros(R, dtype=torch.int64, device=dev)
    j = np.arange(kmax)
    valid = j[None, :] < (counts - 1)[:, None]
    idx = np.where(valid, bases[:, None] + j[None, :], 0)
    a = accepted[to_device(idx, dev)] & to_device(valid, dev)
    return a.long().cumprod(dim=1).sum(dim=1)


def accepted_prefix(flags: list[bool]) -> int:
    """Host twin of :func:`accepted_lengths` for one request's draft rows."""
    m = 0
    while m < len(flags) and flags[m]:
        m += 1
    return m
