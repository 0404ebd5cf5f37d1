"""Tiny byte-level BPE tokenizer with DeepSeek's special-token spellings at stable ids.

Real checkpoints ship their own ``tokenizer.json``; this module makes a small, deterministic
one for the tiny test checkpoints. Ids 0/1/2 are bos/eos/pad, then the remaining special
tokens of ``deepseek-recipe`` in a fixed order, then 256 byte tokens and learned merges.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> Tokenizer:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size)
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
    return tok
