"""Byte-level BPE tokenizers with DeepSeek's special-token spellings at stable ids.

Real checkpoints ship their own ``tokenizer.json``; this module makes deterministic ones for
checkpoints without: a small trained one for the tiny test checkpoints
(:func:`build_tiny_tokenizer`) and one of any size built without training for configs of
real shapes (:func:`build_tokenizer`: the flash rank's 129,280 entries). Ids 0/1/2 are
bos/eos/pad, then the remaining special tokens of ``deepseek-recipe`` in a fixed order, then
256 byte tokens and merges.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from app.model.engram_hash import compressed_token_map

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# The 18 spellings of deepseek-recipe's SpecialToken.*.default_str(), bos and eos first, plus pad.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD,
    "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>", "｜DSML｜",
    "<｜latest_reminder｜>", "<｜image｜>", "<｜box｜>", "<｜/box｜>", "<｜point｜>",
    "<｜/point｜>", "<｜polygon｜>", "<｜/polygon｜>", "<｜ref｜>", "<｜/ref｜>",
)  # fmt: skip

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Hello, world! 你好，世界。",
    "DeepSeek serves mixture-of-experts models; the router picks a rank by cached prefix.",
    'def add(a, b):\n    return a + b\n\n{"name": "fathom", "value": 42, "ok": true, '
    '"items": [1, 2, 3]}',
    "Café naïve résumé — Ünïcödé façade. Tabs\tand\nnewlines\r\n  spaces    here.",
    "<tool_call> function get_weather(city: str) -> json; 0123456789 + - * / = < > ( ) [ ] { }",
    "The answer is: yes. No. Maybe? Think step by step, then answer in JSON.",
)


def build_tiny_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """Train a deterministic byte-level BPE of ``vocab_size`` entries (specials included)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer, length=len(_CORPUS) * 4)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, f"special token {s!r} not at id {i}"
    return tok


def _byte_level(vocab: list[str], merges: list[tuple[str, str]] | None = None) -> Tokenizer:
    """A byte-level BPE over ``vocab`` (ids in list order; the specials first)."""
    model = models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=merges or [],
                       unk_token=None, fuse_unk=False, byte_fallback=False)  # fmt: skip
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])  # fmt: skip
    return tok


def _words() -> Iterator[str]:
    """Lowercase ASCII words by length, then alphabetically: a, ..., z, aa, ab, ..."""
    for n in itertools.count(1):
        for w in itertools.product(string.ascii_lowercase, repeat=n):
            yield "".join(w)


def build_tokenizer(vocab_size: int, engram_keys: int | None = None) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` entries built without training: the specials, the
    256 byte tokens, then words over a-z in two kinds, each merging its one-shorter prefix
    with its last letter (every token decodes to text; plain text encodes to them):
    plain words of two letters or more ("ab", "abc") and words after a space (" a", " ab"),
    which the Engram token map (:func:`~app.model.engram_hash.compressed_token_map`) folds
    onto the plain word. ``engram_keys``: how many distinct keys that map must find (the
    config's ``engram_compressed_vocab_size``); default: as many spaced words as plain ones."""
    base = [*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    merged = vocab_size - len(base)
    base_keys = compressed_token_map(_byte_level(base))[1]
    plain_n = (merged + 1) // 2 if engram_keys is None else engram_keys - base_keys
    spaced_n = merged - plain_n
    letters = len(string.ascii_lowercase)
    if plain_n < 0 or spaced_n < 0 or spaced_n > plain_n + letters:
        raise ValueError(f"cannot build {vocab_size} tokens with {engram_keys} Engram keys "
                         f"(the base {len(base)} tokens give {base_keys})")  # fmt: skip
    space = "Ġ"  # the byte-level spelling of " "
    plain = list(itertools.islice((w for w in _words() if len(w) > 1), plain_n))
    spaced = [space + w for w in itertools.islice(_words(), spaced_n)]
    vocab = [*base, *plain, *spaced]
    merges = [(t[:-1], t[-1]) for t in (*plain, *spaced)]
    tok = _byte_level(vocab, merges)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def write_tokenizer_files(out_dir: str | Path, tok: Tokenizer) -> None:
    """Write ``tok`` as ``tokenizer.json`` with a ``tokenizer_config.json`` naming the
    specials (what Hugging Face tokenizer loaders read) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Tokenizer:
    """Write :func:`build_tiny_tokenizer`'s tokenizer files into ``out_dir``."""
    tok = build_tiny_tokenizer(vocab_size)
    write_tokenizer_files(out_dir, tok)
    return tok
