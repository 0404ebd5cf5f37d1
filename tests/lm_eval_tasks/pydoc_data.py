"""Local data of the lm-eval tasks in this directory (the tasks' ``custom_dataset``): each
task's JSON Lines file beside this module, as its test split. No download, no dataset cache."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _split(name: str) -> dict[str, datasets.Dataset]:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line]
    return {"test": datasets.Dataset.from_list(rows)}


def choice(**_: object) -> dict[str, datasets.Dataset]:
    """Questions on the Python standard library, with choices and the index of the answer."""
    return _split("pydoc_choice.jsonl")


def gen(**_: object) -> dict[str, datasets.Dataset]:
    """Python prompts and the text that completes them."""
    return _split("pydoc_gen.jsonl")
