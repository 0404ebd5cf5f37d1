"""GPU tests: everything marked ``cuda`` is skipped on machines without a CUDA device.

Under pytest-xdist (``-n 16`` on one 80 GB card) the workers share the card's memory through
a ledger (:class:`GpuLedger`): before a test runs, its worker reserves the test's peak
(``@pytest.mark.gpu_mem(GiB)``, else ``DEFAULT_GIB``; raised to the peak a previous run
measured, kept in pytest's cache) on top of what every worker holds between tests (module
fixtures, its CUDA context); a test that does not fit waits, first come first served, until
the running ones release theirs. After each test the worker returns its cached blocks to
the device (``empty_cache``), so what it holds is what it still references.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

DEFAULT_GIB = 3.0  # a test without a gpu_mem mark: tiny models, kernels at small shapes
CONTEXT_GIB = 0.75  # a worker's CUDA context, compiled kernels, allocator slack
SHARE = 0.92  # of the card's memory the ledger hands out
POLL_S = 0.2
G = 1 << 30
_NEED, _BASE = pytest.StashKey[int](), pytest.StashKey[int]()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (and Triton's compiler)")
    config.addinivalue_line(
        "markers", "gpu_mem(gib): the test's peak GPU memory beyond what its worker holds "
        "between tests (xdist workers share the card through tests/gpu/conftest.py's ledger)")
    # The CPU references these tests compare with run in every xdist worker at once: torch's
    # default of one thread per core in each of them oversubscribes the host (on the 16-core
    # H200 machine a 60-forward reference went past a 400 s timeout with 6 workers).
    # Only where the GPU tests run: on a CPU machine this conftest is loaded by any run that
    # collects tests/ and would override the thread count the CPU suite chose.
    if torch.cuda.is_available():
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


class GpuLedger:
    """What each xdist worker of this run holds and reserves on the card: one JSON file per
    worker process beside a lock file; a worker that died is dropped (its process is gone).

    A test is admitted when what the others hold and reserve, what the waiters before it
    need, what its worker holds and its own need fit ``budget``; or when no other worker is
    running a test (nothing will be released by waiting)."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.budget = root, budget
        root.mkdir(parents=True, exist_ok=True)
        self.me = root / f"{os.getpid()}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _others(self) -> list[dict]:
        out = []
        for p in self.root.glob("*.json"):
            if p == self.me:
                continue
            try:
                os.kill(int(p.stem), 0)
                out.append(json.loads(p.read_text()))
            except ProcessLookupError:  # a worker that died: its memory is back
                p.unlink(missing_ok=True)
            except (ValueError, OSError):
                continue
        return out

    def _write(self, state: dict) -> None:
        tmp = self.me.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.me)

    def acquire(self, held: int, need: int) -> None:
        """Wait until a test needing ``need`` bytes on top of this worker's ``held`` fits."""
        state = {"held": held, "need": need, "state": "waiting", "since": time.time()}
        while True:
            with self._locked():
                others = self._others()
                used = sum(o["held"] + (o["need"] if o["state"] == "running" else 0)
                           for o in others)  # fmt: skip
                ahead = sum(o["need"] for o in others
                            if o["state"] == "waiting" and o["since"] < state["since"])
                running = any(o["state"] == "running" for o in others)
                if used + ahead + held + need <= self.budget or not running:
                    self._write({**state, "state": "running"})
                    return
                self._write(state)
            time.sleep(POLL_S)

    def release(self, held: int) -> None:
        with self._locked():
            self._write({"held": held, "need": 0, "state": "idle", "since": time.time()})


def _held() -> int:
    """What this worker holds on the card between tests."""
    if not torch.cuda.is_initialized():
        return 0
    return torch.cuda.memory_reserved() + int(CONTEXT_GIB * G)


_LEDGER: list[GpuLedger | None] = []  # this process's, made at its first test


def _ledger() -> GpuLedger | None:
    if not _LEDGER:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        ok = torch.cuda.is_available() and run is not None
        root = Path(tempfile.gettempdir()) / f"fathom-gpu-{run}"
        _LEDGER.append(GpuLedger(root, int(SHARE * torch.cuda.mem_get_info()[1])) if ok else None)
    return _LEDGER[0]


def _cache_key(item: pytest.Item) -> str:
    return f"fathom/gpu_mem/{item.nodeid}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the test's fixtures are made: reserve its GPU memory (module doc)."""
    ledger = _ledger()
    if ledger is None:
        return
    mark = item.get_closest_marker("gpu_mem")
    cache = getattr(item.config, "cache", None)
    seen = cache.get(_cache_key(item), 0) if cache is not None else 0
    need = max(int((mark.args[0] if mark else DEFAULT_GIB) * G), seen)
    if not torch.cuda.is_initialized():
        need += int(CONTEXT_GIB * G)  # the test creates this worker's context
    ledger.acquire(_held(), need)
    item.stash[_NEED] = need
    if torch.cuda.is_initialized():
        item.stash[_BASE] = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the test's fixtures are gone: its peak kept for the next run when over its
    reservation, the worker's cached blocks back to the device, the reservation released."""
    yield
    ledger = _ledger()
    if ledger is None or _NEED not in item.stash:
        return
    try:
        if torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_reserved() - item.stash.get(_BASE, 0)
            cache = getattr(item.config, "cache", None)
            if cache is not None and peak > item.stash[_NEED]:
                cache.set(_cache_key(item), peak)
            torch.cuda.synchronize()
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        ledger.release(_held())


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


def steps_without_host_sync(eng, n: int, monkeypatch) -> None:
    """``n`` steps of ``eng`` under sync debug mode "error": nothing in a step may synchronize
    with the device; only the wait for the copied tokens (``HostSamples.wait``, outside the
    step) may block."""
    from app.engine.flight import HostSamples

    wait = HostSamples.wait

    def unchecked_wait(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(HostSamples, "wait", unchecked_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(n):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
