"""Where a model named in a config or ``LLM(model=...)`` lives: a checkpoint directory, a
built-in tiny model (random weights, official layout) made on first use, a trained demo
model kept in the repository's ``models/`` directory (``tiny-v41-chat``, made by
``tools/train_tiny.py``), or a shipped config of real shapes without weights
(``flash-rank``, for ``load_format: dummy``; its tokenizer is made on first use)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from app.model.tokenizer import build_tokenizer, write_tokenizer_files

TINY_MODELS = {"tiny-v41": "v41", "tiny-v4": "v4"}
DEFAULT_CACHE_DIR = "~/.cache/fathom"
REPO = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO / "models"
TRAINED_MODELS = {"tiny-v41-chat": "tools/train_tiny.py --config shipped --device cuda"}
# name -> shipped config.json (and generation_config.json); no weights: load_format dummy
CONFIG_MODELS = {"flash-rank": REPO / "configs" / "models" / "flash-rank"}
_SHIPPED_FILES = ("config.json", "generation_config.json")


def resolve_model(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """The checkpoint directory of ``model``: a directory with config.json, ``tiny-v41`` /
    ``tiny-v4`` (made into ``cache_dir`` on first use), ``tiny-v41-chat`` (``models/``) or
    ``flash-rank`` (the shipped config with its tokenizer, in ``cache_dir``)."""
    if model in CONFIG_MODELS:
        return config_model_dir(CONFIG_MODELS[model], Path(cache_dir).expanduser() / model)
    if model in TINY_MODELS:
        path = Path(cache_dir).expanduser() / model
        if not (path / "config.json").is_file():  # making one needs torch; resolving does not
            from app.model.tiny import make_tiny_checkpoint

            make_tiny_checkpoint(path, arch=TINY_MODELS[model], seed=0)
        return path
    if model in TRAINED_MODELS:
        path = MODELS_DIR / model
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model {model!r} is not in {MODELS_DIR}: train it with "
                f"`PYTHONPATH=. python {TRAINED_MODELS[model]} --out DIR` and copy "
                f"DIR/{model} there (docs/demo_model.md)"
            )
        return path
    path = Path(model).expanduser().resolve()  # absolute: replicas may run elsewhere
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither a built-in model "
            f"({', '.join([*TINY_MODELS, *CONFIG_MODELS])}) nor a directory with config.json"
        )
    return path


def config_model_dir(src: Path, out: Path) -> Path:
    """``out`` holding the shipped files of ``src`` (copied again when they change) and a
    tokenizer of the config's vocabulary (:func:`~app.model.tokenizer.build_tokenizer`,
    with as many Engram keys as the config names), written once."""
    out.mkdir(parents=True, exist_ok=True)
    for name in _SHIPPED_FILES:
        if not (out / name).is_file() or (out / name).read_bytes() != (src / name).read_bytes():
            shutil.copyfile(src / name, out / name)
    if not (out / "tokenizer.json").is_file():
        text = json.loads((src / "config.json").read_text())["text_config"]
        tok = build_tokenizer(text["vocab_size"], text.get("engram_compressed_vocab_size"))
        with tempfile.TemporaryDirectory(dir=out) as tmp:  # whole files only, tokenizer last
            write_tokenizer_files(tmp, tok)
            for name in ("tokenizer_config.json", "tokenizer.json"):
                os.replace(Path(tmp) / name, out / name)
    return out
