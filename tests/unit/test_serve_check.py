"""The one-process server (``bench.rank_server``: the front door and one engine, no Ray)
checked the way ``tools.serve_check`` checks a GPU deployment: the README's request, a
client leaving mid-stream (its KV returns, seen through the server's ``/metrics``), a prompt
over the context limit (400), and a burst beyond the rank's queue bound (429s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.ports import free_port
from tools.serve_check import main as serve_check

ROOT = Path(__file__).resolve().parents[2]


def test_one_process_server_passes_serve_check(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.rank_server", "--port", str(port),
           "--kv-bytes", "4333568"]  # fmt: skip
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.5)
        out = tmp_path / "report.json"
        rows = "curl,disconnect,too_long,overload"
        rc = serve_check(["--url", url, "--model", "tiny-v41", "--overload", "64",
                          "--only", rows, "--out", str(out)])  # fmt: skip
        report = json.loads(out.read_text())
        assert rc == 0, report
        assert set(report) == {"curl", "disconnect", "too_long", "overload"}
        gone = report["disconnect"]
        assert gone["free_blocks_after"] == gone["free_blocks_before"]
        assert report["overload"]["statuses"].get("429")
    finally:
        proc.terminate()
        proc.wait(30)
