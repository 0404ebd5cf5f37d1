"""Where a model named in a config or ``LLM(model=...)`` lives: a checkpoint directory, a
built-in tiny model (random weights, official layout) made on first use, or a trained demo
model kept in the repository's ``models/`` directory (``tiny-v41-chat``, made by
``tools/train_tiny.py``)."""

from __future__ import annotations

from pathlib import Path

TINY_MODELS = {"tiny-v41": "v41", "tiny-v4": "v4"}
DEFAULT_CACHE_DIR = "~/.cache/fathom"
MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
TRAINED_MODELS = {"tiny-v41-chat": "tools/train_tiny.py --config shipped --device cuda"}


def resolve_model(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """The checkpoint directory of ``model``: a directory with config.json, ``tiny-v41`` /
    ``tiny-v4`` (made into ``cache_dir`` on first use), or ``tiny-v41-chat`` (``models/``)."""
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
            f"model {model!r} is neither a built-in tiny model "
            f"({', '.join(TINY_MODELS)}) nor a directory with config.json"
        )
    return path
