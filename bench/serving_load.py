"""The serving benchmark's load: its workloads, the NVIDIA ``aiperf`` command line that runs
one of them at one concurrency, the reader of aiperf's JSON export, and the requests aiperf
sent (in the order it sent them), which the offline peer replays.

Workloads (synthetic text from aiperf's corpus, token counts from the server's ``usage``):

    random      completions, ``isl`` tokens in, ``osl`` out
    prefix      completions, one ``prefix``-token shared prefix + ``isl`` new tokens, ``osl``
                out (the prefix cache's case: the warmup requests cache the prefix, every
                measured request hits it and prefills its new tokens only)
    multi_turn  chat, ``turns`` turns of ``isl`` new tokens each, ``osl`` out per turn; every
                turn resends the conversation so far (the previous turns' prefix hits)

Every request generates exactly ``osl`` tokens (``ignore_eos``, and on chat ``min_tokens``),
greedy by default, thinking off on chat. Each run has its own seed, so no run's prompts hit
an earlier run's cache; warmup requests are separate dataset entries (completions) or carry
aiperf's warmup marker (chat), so they cache nothing a measured request reads but the shared
prefix of the prefix workload.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

STATS = ("p50", "p90", "p99")
# record metric -> (aiperf export key, statistic); TPOT is aiperf's per-request
# ``inter_token_latency`` ((latency - TTFT) / (tokens - 1)), ITL its gaps between chunks
LATENCIES = {"ttft": "time_to_first_token", "tpot": "inter_token_latency",
             "itl": "inter_chunk_latency"}  # fmt: skip
THROUGHPUTS = {"output_tokens_per_s": "output_token_throughput",
               "requests_per_s": "request_throughput"}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One workload: its endpoint, lengths (tokens) and the concurrencies it runs at."""

    name: str
    endpoint: str  # "completions" or "chat"
    isl: int  # new input tokens per request (per turn)
    osl: int  # output tokens per request
    concurrencies: tuple[int, ...]
    prefix: int = 0  # shared prefix tokens (prefix workload)
    turns: int = 1  # turns per conversation (multi_turn)


WORKLOADS: dict[str, Workload] = {
    "random": Workload("random", "completions", 1024, 256, (1, 8, 32, 64, 128, 256)),
    "prefix": Workload("prefix", "completions", 256, 256, (1, 8, 32, 64), prefix=8192),
    "multi_turn": Workload("multi_turn", "chat", 256, 256, (1, 8, 32, 64), turns=4),
}


@dataclass(frozen=True)
class Run:
    """One aiperf run: a workload at one concurrency. ``requests`` are the measured requests
    (multi_turn: rounded up to whole conversations); ``warmup`` requests (conversations on
    chat) go first and are not measured."""

    workload: Workload
    concurrency: int
    requests: int
    warmup: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.workload.name}-c{self.concurrency}"

    @property
    def sessions(self) -> int:
        """Conversations of a multi-turn run (one request each otherwise)."""
        return math.ceil(self.requests / self.workload.turns)


def plan_runs(
    workloads: list[Workload], per_slot: int, min_requests: int, warmup_per_slot: float,
    seed: int,
) -> list[Run]:  # fmt: skip
    """Every (workload, concurrency) run with a seed of its own: ``max(min_requests,
    per_slot * concurrency)`` measured requests, where on a multi-turn workload a slot is a
    conversation (``turns`` requests each, so every slot stays busy); ``ceil(warmup_per_slot
    * concurrency)`` warmup ones (conversations on chat), at least one on the prefix
    workload (it caches the shared prefix)."""
    runs = []
    for i, w in enumerate(workloads):
        for j, c in enumerate(w.concurrencies):
            n = max(min_requests, per_slot * c * w.turns)
            n = w.turns * math.ceil(n / w.turns)
            warm = math.ceil(warmup_per_slot * c)
            if w.prefix:
                warm = max(1, warm)
            runs.append(Run(w, c, n, warm * w.turns if w.turns > 1 else warm, seed + 1000 * i + j))
    return runs


def with_lengths(w: Workload, **changes: Any) -> Workload:
    """``w`` with the given fields replaced; None keeps the workload's own, and ``prefix`` /
    ``turns`` change only a workload that has a prefix / several turns."""
    keep = {"prefix"} if not w.prefix else set()
    keep |= {"turns"} if w.turns == 1 else set()
    return replace(w, **{k: v for k, v in changes.items() if v is not None and k not in keep})


def extra_body(w: Workload, temperature: float) -> dict[str, Any]:
    """Fields aiperf adds to every request body: exactly ``osl`` tokens, the temperature, and
    on chat ``min_tokens`` (stop strings wait too) and thinking off."""
    body: dict[str, Any] = {"ignore_eos": True, "temperature": temperature}
    if w.endpoint == "chat":
        body |= {"min_tokens": w.osl, "thinking": {"type": "disabled"}}
    return body


def aiperf_command(
    run: Run, *, url: str, model: str, tokenizer: str, artifacts: Path,
    aiperf: tuple[str, ...] = ("aiperf",), temperature: float = 0.0,
    extra: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """The ``aiperf profile`` command line of ``run`` (streaming, the server's token counts,
    a local tokenizer directory, no telemetry scraping; ``max_tokens``, which the server's
    chat route reads)."""
    w = run.workload
    cmd = [
        *aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", w.endpoint,
        "--streaming", "--tokenizer", tokenizer, "--use-server-token-count",
        "--use-legacy-max-tokens", "--isl", str(w.isl), "--isl-stddev", "0",
        "--osl", str(w.osl), "--osl-stddev", "0",
        "--extra-inputs", json.dumps(extra_body(w, temperature)),
        "--concurrency", str(run.concurrency), "--random-seed", str(run.seed),
        "--artifact-dir", str(artifacts), "--export-level", "records", "--ui-type", "none",
        "--no-server-metrics", "--no-gpu-telemetry",
    ]  # fmt: skip
    if w.turns > 1:
        cmd += ["--conversation-num", str(run.sessions), "--conversation-turn-mean",
                str(w.turns), "--conversation-turn-stddev", "0"]  # fmt: skip
        if run.warmup:
            cmd += ["--num-warmup-sessions", str(math.ceil(run.warmup / w.turns)),
                    "--cache-bust", "warmup-isolation-first-turn"]  # fmt: skip
    else:
        cmd += [
            "--request-count",
            str(run.requests),
            "--num-dataset-entries",
            str(run.requests + run.warmup),
            "--dataset-sampling-strategy",
            "sequential",
        ]
        if run.warmup:
            cmd += ["--warmup-request-count", str(run.warmup)]
    if w.prefix:
        cmd += ["--prefix-prompt-pool-size", "1", "--prefix-prompt-length", str(w.prefix)]
    return cmd + list(extra)


@dataclass(frozen=True)
class Summary:
    """What one aiperf run measured: ``values`` by record metric (ms, tokens/s, requests/s,
    ``prefix_hit_rate`` in [0, 1] or absent without usage), and the counts."""

    values: dict[str, float]
    requests: int
    errors: int
    output_tokens: int
    duration_s: float


def _avg(export: dict[str, Any], key: str) -> float | None:
    m = export.get(key)
    return float(m["avg"]) if isinstance(m, dict) and m.get("avg") is not None else None


def parse_export(path: Path) -> Summary:
    """Read ``profile_export_aiperf.json`` (a file, or the run's artifact directory)."""
    if path.is_dir():
        path = path / "profile_export_aiperf.json"
    export = json.loads(path.read_text())
    if not export.get("is_complete", True) or export.get("was_cancelled"):
        raise ValueError(f"{path}: the aiperf run did not complete")
    values: dict[str, float] = {}
    for name, key in LATENCIES.items():
        m = export.get(key) or {}
        for s in STATS:
            if m.get(s) is not None:
                values[f"{name}_{s}"] = float(m[s])
    for name, key in THROUGHPUTS.items():
        if (v := _avg(export, key)) is not None:
            values[name] = v
    read = _avg(export, "total_usage_prompt_cache_read_tokens")
    prompt = _avg(export, "total_usage_prompt_tokens")
    if read is not None and prompt:
        values["prefix_hit_rate"] = read / prompt
    errors = sum(int(e.get("count", 1)) for e in export.get("error_summary") or [])
    return Summary(
        values=values,
        requests=int(_avg(export, "request_count") or 0),
        errors=errors,
        output_tokens=int(_avg(export, "total_output_tokens") or 0),
        duration_s=float(_avg(export, "benchmark_duration") or 0.0),
    )


@dataclass(frozen=True)
class Session:
    """One conversation as aiperf sent it: its request bodies (a turn's user message only;
    the conversation so far is prepended on chat when the turn is sent)."""

    session_id: str
    payloads: list[dict[str, Any]]


def sent_sessions(artifacts: Path) -> tuple[list[Session], list[Session]]:
    """(warmup, measured) conversations of a run, each list in the order aiperf started
    them: the bodies from ``inputs.json``, the order and phase from the per-request records
    ``profile_export.jsonl``."""
    inputs = json.loads((artifacts / "inputs.json").read_text())["data"]
    bodies = {d["session_id"]: d["payloads"] for d in inputs}
    started: dict[str, dict[str, int]] = {"warmup": {}, "profiling": {}}
    for line in (artifacts / "profile_export.jsonl").read_text().splitlines():
        meta = json.loads(line)["metadata"]
        phase = started.setdefault(meta["benchmark_phase"], {})
        sid, t = meta["conversation_id"], int(meta["credit_issued_ns"])
        phase[sid] = min(t, phase.get(sid, t))

    def ordered(phase: dict[str, int]) -> list[Session]:
        return [Session(s, bodies[s]) for s in sorted(phase, key=phase.__getitem__)]

    return ordered(started["warmup"]), ordered(started["profiling"])
