"""Result files in the format of PERFORMANCE.md: machine, command, records."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What ran the benchmark."""
    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def record(
    name: str,
    value: float,
    unit: str,
    params: dict[str, Any] | None = None,
    floor: float | None = None,
    peer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "name": name,
        "params": params or {},
        "value": value,
        "unit": unit,
        "floor": floor,
        "ratio_to_floor": (value / floor) if floor else None,
        "peer": peer,
    }


def write(benchmark: str, records: list[dict[str, Any]]) -> Path:
    """Write ``bench/results/<benchmark>.json`` and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{benchmark}.json"
    doc = {
        "machine": machine(),
        "command": " ".join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]]),
        "records": records,
    }
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out
