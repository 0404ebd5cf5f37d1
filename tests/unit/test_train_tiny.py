"""tools/train_tiny.py on CPU: a few steps of the small config train (loss falls), DSpark
trains through the engine's drafter, the export loads with the project's loader; the chat
rendering of the corpus equals deepseek-recipe's."""

from __future__ import annotations

import json

import pytest
import torch

from tools import demo_data
from tools.train_tiny import main as train_main


@pytest.mark.parametrize("question,thinking", [("What is a lambda?", False), ("Hello", True)])
def test_prompt_rendering_equals_deepseek_recipe(question, thinking):
    rendered = demo_data.render_prompt(question, thinking)
    assert rendered == demo_data.render_prompt_recipe(question, thinking)


def test_heldout_split_is_by_document():
    recs = demo_data.read_records(demo_data.DEFAULT_DATA)  # the shipped corpus
    split = {}
    for r in recs:
        assert split.setdefault(r["doc"], r["split"]) == r["split"]
    held = {d for d, s in split.items() if s == "heldout"}
    assert 0.02 < len(held) / len(split) < 0.1
    chat = [r for r in recs if r["kind"] == "chat"]
    assert all(r["text"].endswith(demo_data.EOS) for r in chat)


def test_train_small_loss_falls_and_export_loads(tmp_path):
    from app.model.loader import load_model
    from tests.support.reference import reference_logits

    out = tmp_path / "run"
    train_main(["--config", "small", "--steps", "12", "--dspark-steps", "2", "--seq-len", "48",
                "--data-limit", "300", "--eval-tokens", "256", "--answer-tokens", "3",
                "--chat-prompts", "1", "--log-every", "100", "--out", str(out)])  # fmt: skip
    rec = json.loads((out / "train_record.json").read_text())
    losses = rec["target"]["losses"]
    assert len(losses) == 12 and rec["dspark"]["steps"] == 2
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert rec["heldout"]["ppl"] > 1 and rec["heldout"]["unigram_ppl"] > 1
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = out / "tiny-v41-chat"
    files = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= files
    model = load_model(ckpt)  # the real loader: fp8 blocks + e8m0, packed fp4 experts
    assert len(model.mtp) == 3
    logits = reference_logits(model, torch.tensor([0, 3, 5, 7]))
    assert torch.isfinite(logits).all()
    assert rec["export"]["greedy_answers_identical"].endswith("/1")


def test_trained_demo_model_name_resolves_to_models_dir(tmp_path, monkeypatch):
    from app.engine import model_path

    monkeypatch.setattr(model_path, "MODELS_DIR", tmp_path)
    with pytest.raises(ValueError, match="tools/train_tiny.py"):
        model_path.resolve_model("tiny-v41-chat")
    (tmp_path / "tiny-v41-chat").mkdir()
    (tmp_path / "tiny-v41-chat" / "config.json").write_text("{}")
    assert model_path.resolve_model("tiny-v41-chat") == tmp_path / "tiny-v41-chat"
