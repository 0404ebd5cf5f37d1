"""Shared helper of the Triton kernel tests (the NaN-poisoning fixture is in tests/conftest.py)."""

from __future__ import annotations

import torch


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())
