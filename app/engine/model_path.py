"""Where a model named in a config or ``LLM(model=...)`` lives: a checkpoint directory, or a
built-in tiny model (random weights, official layout) made on first use."""

from __future__ import annotations

from pathlib import Path

TINY_MODELS = {"tiny-v41": "v41", "tiny-v4": "v4"}
DEFAULT_CACHE_DIR = "~/.cache/fathom"


def resolve_model(model: str, cache_dir: str = DEFAULT_CACHE_DIR) -> Path:
    """The checkpoint directory of ``model``: a directory with config.json, or ``tiny-v41`` /
    ``tiny-v4``, made into ``cache_dir`` on first use."""
    if model in TINY_MODELS:
        path = Path(cache_dir).expanduser() / model
        if not (path / "config.json").is_file():
            from app.model.tiny import make_tiny_checkpoint

            make_tiny_checkpoint(path, arch=TINY_MODELS[model], seed=0)
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is neither a built-in tiny model "
            f"({', '.join(TINY_MODELS)}) nor a directory with config.json"
        )
    return path
