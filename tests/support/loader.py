"""The loader's packing plan from a checkpoint's headers: which MoE layers
:func:`app.model.loader.load_model` would keep packed, without reading a weight."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from app.model.checkpoint import Checkpoint, ExpertPacking, plan_loads, plan_packing
from app.model.config import ModelConfig
from app.model.loader import _empty_model, tensor_specs


def expert_packing(
    path: str | Path, device: str | torch.device = "cpu", packed_experts: bool | None = None
) -> dict[str, ExpertPacking]:
    """Which MoE layers ``load_model`` would keep packed, from the headers only (no
    weight is read); raises what it would raise."""
    cfg = ModelConfig.from_file(path)
    specs = tensor_specs(_empty_model(path, cfg, kv_quant=False))
    with contextlib.ExitStack() as stack:
        ckpt = Checkpoint(Path(path), stack)
        loads = plan_loads(ckpt, specs, cfg, torch.float32)
        return plan_packing(ckpt, loads, packed_experts, torch.device(device))
