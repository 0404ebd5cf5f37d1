"""Engram n-gram hashing constants (V4.1): compressed token map, primes, offsets, multipliers.

Shared by the model (row hashing itself: kernels/engram.py), the tiny-checkpoint maker and
(later) the router's Engram placement. MODEL_SPEC §2 "Engram".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tokenizers import Regex, Tokenizer, normalizers

_SENTINEL = "\ue000"


def _normalizer() -> normalizers.Normalizer:
    # NFKC -> NFD -> strip accents -> lowercase -> collapse whitespace runs -> strip
    # (Rust's notion of whitespace). A token that is exactly " " stays " ".
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def compressed_token_map(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """Map every token id of the tokenizer to its compressed id (ids in first-seen order);
    returns (map, number of distinct keys)."""
    norm = _normalizer()
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out: list[int] = []
    for tid in range(n_tok):
        text = tokenizer.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(tid) or text
        else:
            key = norm.normalize_str(text) or text
        out.append(keys.setdefault(key, len(keys)))
    return out, len(keys)


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


@dataclass(frozen=True)
class EngramHashSpec:
    """Per-layer hash constants: primes [L][H], offsets [L][H], multipliers [L][n_max]."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    primes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @property
    def hash_heads(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    def table_rows(self) -> tuple[int, ...]:
        """Rows each layer's table needs (sum of its primes)."""
        return tuple(sum(p) for p in self.primes)


def engram_hash_spec(
    layer_ids: tuple[int, ...],
    max_ngram: int,
    n_heads: int,
    engram_vocab_size: int,
    compressed_vocab_size: int,
) -> EngramHashSpec:
    """Successive unused primes above ``engram_vocab_size - 1`` (increasing across layers
    and n-gram orders), cumulative offsets, and seeded odd multipliers."""
    seen: set[int] = set()
    primes, offsets, mults = [], [], []
    bound = max(1, ((2**63 - 1) // compressed_vocab_size) // 2)
    for lid in layer_ids:
        layer: list[int] = []
        for _ in range(max_ngram - 1):
            cur = engram_vocab_size - 1
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                layer.append(cur)
        primes.append(tuple(layer))
        offsets.append(tuple(int(x) for x in np.cumsum([0, *layer[:-1]])))
        rng = np.random.default_rng(10007 * lid)
        vals = rng.integers(0, bound, size=(max_ngram,), dtype=np.int64)
        mults.append(tuple(int(v) * 2 + 1 for v in vals))
    return EngramHashSpec(
        tuple(layer_ids), max_ngram, n_heads, tuple(primes), tuple(offsets), tuple(mults)
    )
