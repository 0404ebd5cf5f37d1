"""Engram hashing against a plain-Python computation of MODEL_SPEC's formulas."""

from __future__ import annotations

import math

import numpy as np
import torch

from app.model.engram_hash import compressed_token_map, engram_hash_spec
from kernels.engram import engram_rows_ref


def test_compressed_map_normalizes(tiny_tokenizer):
    tmap, n = compressed_token_map(tiny_tokenizer)
    assert len(tmap) == tiny_tokenizer.get_vocab_size() and max(tmap) == n - 1
    vocab = tiny_tokenizer.get_vocab()
    # case and accents fold: "H" and "h" share a compressed id, as do "é" pieces and "e"
    if "H" in vocab and "h" in vocab:
        assert tmap[vocab["H"]] == tmap[vocab["h"]]
    assert n < len(tmap)
    # ids are assigned in first-seen order
    seen = []
    for c in tmap:
        if c not in seen:
            seen.append(c)
    assert seen == list(range(n))


def test_spec_primes_offsets_multipliers():
    spec = engram_hash_spec((1, 14), 4, 8, 1000, 99092)
    flat = [p for layer in spec.primes for p in layer]
    assert len(flat) == len(set(flat)) == 2 * 3 * 8
    assert all(p > 999 and all(p % d for d in range(2, math.isqrt(p) + 1)) for p in flat)
    for layer, offs in zip(spec.primes, spec.offsets, strict=True):
        assert list(offs) == [sum(layer[:i]) for i in range(len(layer))]
    bound = (2**63 - 1) // 99092 // 2
    want = np.random.default_rng(10007 * 14).integers(0, bound, 4, dtype=np.int64) * 2 + 1
    assert list(spec.multipliers[1]) == [int(v) for v in want]


def test_real_table_sizes_match_release():
    # MODEL_SPEC: the cumulative prime sums reproduce the released table sizes exactly.
    spec = engram_hash_spec((1, 14), 4, 8, 16_000_000, 99092)
    assert spec.table_rows() == (384006168, 384016682)


def python_rows(comp: torch.Tensor, mult, primes, offsets, n_heads: int, pad: int):
    """Plain-Python 64-bit (wrap-around) hashing of MODEL_SPEC §2, as an independent check:
    once a shift is blocked (-1), it and every larger shift hash the pad id."""
    mask, out = (1 << 64) - 1, []
    for row in comp.tolist():
        toks, blocked = [], False
        for c in row:
            blocked = blocked or c < 0
            toks.append(pad if blocked else c)
        h, rows = 0, []
        for s, t in enumerate(toks):
            prod = (t * mult[s]) & mask
            h = prod if s == 0 else h ^ prod
            if s:
                signed = h - (1 << 64) if h >= 1 << 63 else h
                for k in range(n_heads):
                    i = (s - 1) * n_heads + k
                    rows.append(signed % primes[i] + offsets[i])
        out.append(rows)
    return torch.tensor(out)


def test_rows_match_python_loop():
    spec = engram_hash_spec((3,), 4, 2, 97, 50)
    ngram = torch.tensor([[7, -1, 5, 6], [7, 5, 9, 2], [0, 0, 0, 0]])
    consts = (spec.multipliers[0], spec.primes[0], spec.offsets[0])
    rows = engram_rows_ref(ngram, *(torch.tensor(c) for c in consts), spec.n_heads, 11)
    assert torch.equal(rows, python_rows(ngram, *consts, spec.n_heads, 11))
