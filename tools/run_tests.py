"""The README's test command (``make test``): the unit tests and the Ray integration modules
in two pytest processes side by side, one per core (the integration modules share one Ray
cluster, tests/integration/conftest.py). Each process's output is printed when it ends;
the exit status is non-zero when either fails.

    python -m tools.run_tests [extra pytest args]
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time

SUITES = {
    "unit": ["tests", "--ignore=tests/integration"],
    "integration": ["tests/integration"],
}


def main(extra: list[str]) -> int:
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, args in SUITES.items():
            env = dict(os.environ)
            if name == "unit":  # torch's CPU threads: one, the other core runs the Ray modules
                env.setdefault("OMP_NUM_THREADS", "1")
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            cmd = [sys.executable, "-m", "pytest", *args, *extra]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            procs[name] = (proc, log)
        status = 0
        for name, (proc, log) in procs.items():
            rc = proc.wait()
            log.seek(0)
            print(f"===== {name} tests (exit {rc}, {time.time() - t0:.0f} s since start) =====")
            sys.stdout.write(log.read())
            sys.stdout.flush()
            status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
