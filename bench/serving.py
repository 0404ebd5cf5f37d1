"""Serving benchmark: the Serve app (HTTP -> Ingress -> Router -> DP rank) under load from
NVIDIA ``aiperf`` (streaming, closed-loop concurrency), and the same requests through the
offline engine in the same run, which gives the Serve path's overhead.

    # start the app from a serve config, speculation off then on, every workload
    python -m bench.serving --config CONFIG --spec off,on \\
        --speculative '{"method": "dspark", "num_draft_tokens": 3}'
    # a server that already runs (no offline peer)
    python -m bench.serving --url http://127.0.0.1:8000 --model NAME --tokenizer MODEL_DIR

Workloads and how aiperf drives them: ``bench/serving_load.py``; the offline peer:
``bench/serving_offline.py``. With ``--config`` the app is started with ``python -m app.run``
(one start per ``--spec`` setting, ``--set`` overrides applied), stopped with SIGTERM after
the workloads, then the offline peer replays the requests in its own process.

Records (``bench/results/serving.json``), params {concurrency, spec, card, lengths}:
``serving.<workload>.{ttft,tpot,itl}_{p50,p90,p99}`` (ms), ``.output_tokens_per_s``,
``.requests_per_s``, ``.prefix_hit_rate`` (cached / prompt tokens, from the responses'
usage), ``.spec_accept_length`` (tokens per verify, speculation on), ``.error_rate``;
with the offline peer ``serving.overhead`` (served / offline output tokens/s) and
``serving.ttft_added_p50`` (served minus offline TTFT p50, ms).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from bench.common import header, log_path, record, write
from bench.serving_load import (
    LATENCIES,
    STATS,
    WORKLOADS,
    Run,
    Summary,
    aiperf_command,
    parse_export,
    plan_runs,
    with_lengths,
)

GOALS = {"serving.overhead": ">= 0.95 at concurrency >= 32",
         "serving.ttft_added_p50": "<= 5 ms"}  # fmt: skip
REPO = Path(__file__).resolve().parents[1]
SERVERS = {"serve": "app.run", "one-process": "bench.rank_server"}
HF_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_STAT = re.compile(r'^fathom_rank_stat\{[^}]*stat="([^"]+)"[^}]*\}\s+(\S+)$', re.M)


# ---- the server ------------------------------------------------------------------------
def apply_overrides(
    config: dict[str, Any], sets: list[str], spec: str, speculative: dict[str, Any] | None
) -> None:
    """Apply ``KEY=YAML`` overrides (dotted paths into the first application's args) and the
    speculation setting (``off``: no ``engine.speculative``; ``on``: ``speculative`` or the
    config's own) to a loaded serve config, in place."""
    args = config["applications"][0].setdefault("args", {})
    for item in sets:
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = args
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    engine = args.setdefault("engine", {})
    if spec == "off":
        engine.pop("speculative", None)
    elif spec == "on":
        engine["speculative"] = speculative or engine.get("speculative")
        if not engine["speculative"]:
            raise SystemExit('spec "on" needs --speculative or engine.speculative in the config')
    else:
        raise SystemExit(f"--spec takes off and on with --config, got {spec!r}")


def served_target(config: dict[str, Any]) -> tuple[str, str, str, str | None]:
    """(URL, served model name, tokenizer directory, draft method or None) of a config."""
    from app.serve_args import ServeArgs  # pydantic and the model resolver: with --config only

    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    sa = ServeArgs.model_validate(config["applications"][0].get("args") or {})
    spec = sa.engine.get("speculative")
    draft = f"{spec.get('method', 'dspark')} x{spec.get('num_draft_tokens', 3)}" if spec else None
    return f"http://{host}:{http.get('port', 8000)}", sa.names()[0], str(sa.model_path()), draft


def rank_stats(url: str) -> dict[str, float]:
    """The ranks' engine counters from ``/metrics``, summed over ranks ({} if unreachable)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for stat, value in _STAT.findall(text):
        out[stat] = out.get(stat, 0.0) + float(value)
    return out


class Server:
    """``python -m app.run CONFIG`` (or ``bench.rank_server --config CONFIG``: one process,
    no Ray) from the repository root, in its own process group:
    entered once ``/health`` answers 200, stopped with SIGTERM (SIGKILL to the group after
    ``stop_timeout_s``) on exit."""

    def __init__(self, config: Path, url: str, log: Path, startup_timeout_s: float,
                 stop_timeout_s: float = 120.0, module: str = "app.run") -> None:  # fmt: skip
        self.config, self.url, self.log, self.module = config, url, log, module
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        env = {"RAY_AUTH_MODE": "disabled", **os.environ}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        with open(self.log, "w") as log:
            cmd = [sys.executable, "-m", self.module, *self._args()]
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        print(f"[serving] server ready at {self.url}", flush=True)
                        return self
            except OSError:
                pass
            time.sleep(2)
        self.__exit__()
        raise TimeoutError(f"the server was not ready in {self.startup_timeout_s:.0f} s")

    def _args(self) -> list[str]:
        return [str(self.config)] if self.module == "app.run" else ["--config", str(self.config)]

    def __exit__(self, *exc: object) -> None:
        """SIGTERM, then wait for the whole process group (Ray's workers hold the GPU) to
        exit; SIGKILL to what is left after ``stop_timeout_s``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            self.proc.poll()
            time.sleep(0.5)
        if _group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        print(f"[serving] server stopped ({self.proc.returncode})", flush=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- records ---------------------------------------------------------------------------


def run_records(
    run: Run, s: Summary, params: dict[str, Any], spec_delta: dict[str, float] | None
) -> list[dict[str, Any]]:
    """The records of one served run (``params`` gains the run's own)."""
    w = run.workload
    p = {**params, "concurrency": run.concurrency, "input_tokens": w.isl, "output_tokens": w.osl,
         "requests": s.requests}  # fmt: skip
    if w.prefix:
        p["prefix_tokens"] = w.prefix
    if w.turns > 1:
        p["turns"] = w.turns
    name = f"serving.{w.name}"
    out = [record(f"{name}.{m}_{st}", s.values[f"{m}_{st}"], "ms", p)
           for m in LATENCIES for st in STATS if f"{m}_{st}" in s.values]  # fmt: skip
    units = {"output_tokens_per_s": "tokens/s", "requests_per_s": "requests/s",
             "prefix_hit_rate": "ratio"}  # fmt: skip
    out += [record(f"{name}.{m}", s.values[m], u, p) for m, u in units.items() if m in s.values]
    done = s.requests + s.errors
    out.append(record(f"{name}.error_rate", s.errors / done if done else 0.0, "ratio", p))
    if spec_delta and spec_delta.get("spec_verifies"):
        accept = 1 + spec_delta["spec_accepted"] / spec_delta["spec_verifies"]
        out.append(record(f"{name}.spec_accept_length", accept, "tokens/verify", p))
    return out


def overhead_records(
    run: Run, s: Summary, offline: dict[str, float], params: dict[str, Any]
) -> list[dict[str, Any]]:
    """``serving.overhead`` and ``serving.ttft_added_p50`` of one run against its offline
    replay (the offline figures ride along as each record's ``peer``)."""
    p = {**params, "workload": run.workload.name, "concurrency": run.concurrency}
    served_tps, off_tps = s.values["output_tokens_per_s"], offline["output_tokens_per_s"]
    served_ttft, off_ttft = s.values["ttft_p50"], offline["ttft_p50"]
    return [
        record("serving.overhead", served_tps / off_tps if off_tps else 0.0, "ratio", p,
               peer={"served_tokens_per_s": served_tps, "offline_tokens_per_s": off_tps}),
        record("serving.ttft_added_p50", served_ttft - off_ttft, "ms", p,
               peer={"served_ttft_p50": served_ttft, "offline_ttft_p50": off_ttft}),
    ]  # fmt: skip


Results = list[tuple[str | None, str | None, list[tuple[Run, Summary, dict[str, float]]],
                     dict[str, dict[str, float]]]]  # fmt: skip


def collect_records(results: Results, card: str, server: str = "serve") -> list[dict[str, Any]]:
    """Every record of a run: per (spec setting, draft, served runs, offline replays);
    ``server``: what served them (``--server``, or "url": a server this run did not start)."""
    records = []
    for spec, draft, served, offline in results:
        for run, s, delta in served:
            on = spec or ("on" if delta.get("spec_drafts") else "off")
            params = {"spec": on, "card": card, "server": server}
            if on == "on" and draft:
                params["draft"] = draft
            records += run_records(run, s, params, delta)
            if run.key in offline:
                records += overhead_records(run, s, offline[run.key], params)
    return records


def merge_previous(
    prev: dict[str, Any], records: list[dict[str, Any]], card: str
) -> list[dict[str, Any]]:
    """``records`` after the records of ``prev`` (an earlier result file of this benchmark,
    on the same card) whose spec setting this run did not measure."""
    if prev.get("card") != card:
        raise SystemExit(f"--append: that file ran on {prev.get('card')!r}, not {card!r}")
    ran = {r["params"]["spec"] for r in records}
    return [r for r in prev["records"] if r["params"].get("spec") not in ran] + records


def profile(
    runs: list[Run], url: str, model: str, tokenizer: str, work: Path, args: argparse.Namespace,
    out: list[tuple[Run, Summary, dict[str, float]]] | None = None,
    done: Callable[[], None] = lambda: None,
) -> list[tuple[Run, Summary, dict[str, float]]]:  # fmt: skip
    """Every run through aiperf against ``url``: its summary and the ranks' speculation
    counters over the run (from ``/metrics``), appended to ``out`` (returned), ``done``
    called after each."""
    out = [] if out is None else out
    for run in runs:
        artifacts = work / run.key
        cmd = aiperf_command(
            run,
            url=url,
            model=model,
            tokenizer=str(Path(tokenizer).resolve()),
            artifacts=artifacts,
            aiperf=tuple(shlex.split(args.aiperf)),
            temperature=args.temperature,
            extra=tuple(args.aiperf_arg),
        )
        before = rank_stats(url)
        artifacts.mkdir(parents=True, exist_ok=True)
        print(f"[serving] {run.key}: {run.requests} requests, seed {run.seed}", flush=True)
        # aiperf 0.13 loads a tokenizer directory given as an absolute path without the hub,
        # but in HF offline mode it looks every name up in the hub's cache (and fails)
        env = {k: v for k, v in os.environ.items() if k not in HF_OFFLINE}
        with open(artifacts / "aiperf.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        if rc:
            raise RuntimeError(f"aiperf failed ({rc}): see {artifacts / 'aiperf.log'}")
        after = rank_stats(url)
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith("spec")}
        s = parse_export(artifacts)
        print(f"[serving] {run.key}: {s.values}", flush=True)
        out.append((run, s, delta))
        done()
    return out


def machine_apart() -> dict[str, Any]:
    """``bench.common.machine()`` from a child process: this one holds no CUDA context
    while the server has the card."""
    code = "import json; from bench.common import machine; print(json.dumps(machine()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def offline_peer(config: Path, runs: list[Run], work: Path) -> dict[str, dict[str, float]]:
    """The offline replay of ``runs`` in a process of its own (``bench.serving_offline``)."""
    plan = {"config": str(config), "runs": [
        {"key": r.key, "endpoint": r.workload.endpoint, "concurrency": r.concurrency,
         "artifacts": str(work / r.key)} for r in runs]}  # fmt: skip
    (work / "offline_plan.json").write_text(json.dumps(plan, indent=2))
    cmd = [sys.executable, "-m", "bench.serving_offline", str(work / "offline_plan.json"),
           str(work / "offline.json")]  # fmt: skip
    with open(work / "offline.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"the offline peer failed ({rc}): see {work / 'offline.log'}")
    return json.loads((work / "offline.json").read_text())


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", type=Path, help="serve config to start (python -m app.run)")
    where.add_argument("--url", help="a running server (no offline peer)")
    ap.add_argument("--model", help="served model name (--url; default: from --config)")
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (--url)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=YAML",
        help="override an app arg of --config, e.g. dp_size=1, engine.max_num_seqs=64",
    )
    ap.add_argument(
        "--spec",
        default=None,
        help="--config: speculation settings to run, e.g. off,on (default off); "
        "--url: what the server runs (default: read from its metrics)",
    )
    ap.add_argument(
        "--speculative",
        type=json.loads,
        default=None,
        help='JSON engine.speculative for spec "on" (default: the config\'s)',
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", help="comma list for every workload (default: each its own)")
    for name in ("isl", "osl", "prefix", "turns"):
        ap.add_argument(f"--{name}", type=int, help=f"override every workload's {name}")
    ap.add_argument(
        "--requests-per-slot", type=int, default=4, help="measured requests per unit of concurrency"
    )
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument(
        "--warmup-per-slot",
        type=float,
        default=1.0,
        help="warmup requests (conversations on multi_turn) per unit of concurrency",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--aiperf", default="aiperf", help='its command, e.g. "python3 -m aiperf"')
    ap.add_argument(
        "--aiperf-arg",
        action="append",
        default=[],
        help="extra aiperf flag, e.g. --aiperf-arg=--workers-max=2",
    )
    ap.add_argument("--no-offline", action="store_true", help="skip the offline peer")
    ap.add_argument(
        "--offline-concurrency",
        default=None,
        help="comma list: replay offline only the runs at these concurrencies (default: every run)",
    )
    ap.add_argument("--server", choices=SERVERS, default="serve",
                    help="serve: the Ray Serve app (python -m app.run); one-process: the same "
                         "front door and engine without Ray (bench.rank_server), for hosts "
                         "where Ray cannot run")  # fmt: skip
    ap.add_argument("--startup-timeout-s", type=float, default=1200.0)
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="aiperf artifacts and logs (default bench/results/logs/serving)",
    )
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument(
        "--append",
        type=Path,
        default=None,
        metavar="RESULT",
        help="keep RESULT's records of the spec settings not run now",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    concurrency = args.concurrency and tuple(int(c) for c in args.concurrency.split(","))
    workloads = [with_lengths(WORKLOADS[n], isl=args.isl, osl=args.osl, prefix=args.prefix,
                              turns=args.turns, concurrencies=concurrency or None)
                 for n in args.workloads.split(",")]  # fmt: skip
    runs = plan_runs(workloads, args.requests_per_slot, args.min_requests,
                     args.warmup_per_slot, args.seed)  # fmt: skip
    offline_set = args.offline_concurrency and {int(c) for c in args.offline_concurrency.split(",")}
    work = args.work_dir or log_path("serving")
    results: Results = []
    info = machine_apart()
    card = header("serving", info=info)["card"]
    prev = json.loads(args.append.read_text()) if args.append else None

    def save() -> Path:
        """The result file of what ran so far (rewritten after every run)."""
        records, command = collect_records(results, card, "url" if args.url else args.server), None
        if prev is not None:  # a run in pieces (e.g. one call per --spec)
            records = merge_previous(prev, records, card)
            command = f"{prev['command']} ; {header('serving', info=info)['command']}"
        return write("serving", records, args.out_dir, command=command, info=info, goals=GOALS)

    if args.url:
        if not (args.model and args.tokenizer) or args.spec not in (None, "on", "off"):
            raise SystemExit("--url needs --model and --tokenizer, and --spec on or off if any")
        served: list[tuple[Run, Summary, dict[str, float]]] = []
        results.append((args.spec, None, served, {}))
        profile(runs, args.url, args.model, args.tokenizer, work, args, served, save)
    for spec in (args.spec or "off").split(",") if args.config else ():
        config = yaml.safe_load(args.config.read_text())
        apply_overrides(config, args.set, spec, args.speculative)
        spec_work = work / f"spec-{spec}"
        spec_work.mkdir(parents=True, exist_ok=True)
        derived = spec_work / "serve_config.yaml"
        derived.write_text(yaml.safe_dump(config, sort_keys=False))
        url, model, tokenizer, draft = served_target(config)
        served, offline = [], {}
        results.append((spec, draft, served, offline))
        with Server(
            derived,
            url,
            spec_work / "server.log",
            args.startup_timeout_s,
            module=SERVERS[args.server],
        ):
            profile(runs, url, model, tokenizer, spec_work, args, served, save)
        replay = [r for r in runs if offline_set is None or r.concurrency in offline_set]
        if replay and not args.no_offline:
            offline.update(offline_peer(derived, replay, spec_work))
            save()
    path = save()
    records = json.loads(path.read_text())["records"]
    print(f"[serving] {len(records)} records -> {path}")
    for r in records:
        if r["name"] in GOALS:
            print(
                f"  {r['name']} {r['params']['workload']} c={r['params']['concurrency']} "
                f"spec={r['params']['spec']}: {r['value']:.3f} {r['unit']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
