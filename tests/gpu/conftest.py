"""GPU tests: everything marked ``cuda`` is skipped on machines without a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (and Triton's compiler)")
    # The CPU references these tests compare with run in every xdist worker at once: torch's
    # default of one thread per core in each of them oversubscribes the host (on the 16-core
    # H200 machine a 60-forward reference went past a 400 s timeout with 6 workers).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny official-layout V4.1 and V4 checkpoints (seed 0)."""
    from app.model.tiny import make_tiny_checkpoint

    out = {}
    for arch in ("v41", "v4"):
        d = tmp_path_factory.mktemp(arch)
        make_tiny_checkpoint(d, arch=arch, seed=0)
        out[arch] = str(d)
    return out
