"""The loader's packing plan from a checkpoint's headers: which MoE layers
:func:`app.model.loader.load_model` would keep packed, without reading a weight."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from app.model.config import ModelConfig
from app.model.loader import (
    ExpertPacking,
    _Checkpoint,
    _empty_model,
    _plan,
    _plan_packing,
    tensor_specs,
)


def expert_packing(
    path: str | Path, device: str | torch.device = "cpu", packed_experts: bool | None = None
) -> dict[str, ExpertPacking]:
    """Which MoE layers ``load_model`` would keep packed, from the headers only (no
    weight is read); raises what it would raise."""
    cfg = ModelConfig.from_file(path)
    specs = tensor_specs(_empty_model(path, cfg, kv_quant=False))
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(Path(path), stack)
        loads = _plan(ckpt, specs, cfg, torch.float32)
        return _plan_packing(ckpt, loads, packed_experts, torch.device(device))
