"""Result files: ``bench/results/<benchmark>.json``, one per benchmark, the latest run.

A file is an object with ``"benchmark"`` (the module's name), ``"date"`` (UTC),
``"commit"`` (the tree that ran), ``"card"`` (the GPU, or the CPU), ``"machine"`` (models,
torch and triton versions; benchmarks add their measured ceilings), ``"command"`` (how to
reproduce) and ``"records"``: ``{name, params, value, unit, floor, ratio_to_floor, peer}``.
A run replaces its benchmark's file; older runs live in git history. The name is the
benchmark module's (``bench/<benchmark>.py``) and nothing else: a variant or an A/B side
goes in the records' params, or in another directory (``out_dir``). Logs go to
``bench/results/logs/`` (``log_path``), which git ignores.

The commit is ``$BENCH_COMMIT`` when set (a copy of the tree without ``.git``, as on a
device machine), else ``git rev-parse`` of this checkout (``+dirty`` with uncommitted
changes to tracked files), else ``"unknown"``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
LOGS = RESULTS / "logs"


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


def commit() -> str:
    """The tree that ran: ``$BENCH_COMMIT``, else git's short hash, else ``"unknown"``."""
    if env := os.environ.get("BENCH_COMMIT"):
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=BENCH,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=BENCH, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def result_path(benchmark: str, out_dir: str | Path | None = None) -> Path:
    """``<out_dir or bench/results>/<benchmark>.json``; ``benchmark`` must name a module of
    ``bench/`` (no suffixes: one file per benchmark)."""
    if not benchmark.isidentifier() or not (BENCH / f"{benchmark}.py").is_file():
        raise ValueError(f"{benchmark!r} is not a benchmark of bench/ (bench/<name>.py)")
    out = Path(out_dir) if out_dir else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    return out / f"{benchmark}.json"


def header(benchmark: str, command: str | None = None,
           info: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The stamped head of a result file: benchmark, date, commit, card, machine, command
    (by default this process's ``python -m bench.<module> <argv>``)."""
    info = info if info is not None else machine()
    argv = " ".join(["python", "-m", f"bench.{Path(sys.argv[0]).stem}", *sys.argv[1:]])
    return {
        "benchmark": benchmark,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "card": info.get("gpu") or f"CPU {info.get('cpu', '?')}, {info.get('threads')} threads",
        "machine": info,
        "command": command or argv,
    }


def write(benchmark: str, records: list[dict[str, Any]], out_dir: str | Path | None = None, *,
          command: str | None = None, info: dict[str, Any] | None = None,
          **extra: Any) -> Path:  # fmt: skip
    """Write ``<out_dir or bench/results>/<benchmark>.json`` (replacing the previous run's)
    and return its path; ``command`` and ``info`` as ``header``'s, ``extra`` keys go beside
    the records."""
    out = result_path(benchmark, out_dir)
    doc = {**header(benchmark, command, info), **extra, "records": records}
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out


def log_path(name: str) -> Path:
    """``bench/results/logs/<name>`` (made if missing; git ignores the folder)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    return LOGS / name
