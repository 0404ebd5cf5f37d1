"""The serving benchmark's plumbing (bench/serving*.py), without aiperf or a server: its
aiperf command lines, the reader of aiperf's export (a real export of a short CPU run, kept
in tests/golden/aiperf_multi_turn), the record names, units and params, the overhead
arithmetic, and the offline replay of the requests aiperf sent (over a stand-in engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from app.api.server import FrontDoor
from app.engine.request import FinishReason, RequestOutput
from bench.serving import (
    apply_overrides,
    collect_records,
    merge_previous,
    overhead_records,
    rank_stats,
    run_records,
)
from bench.serving_load import (
    WORKLOADS,
    Run,
    Summary,
    Workload,
    aiperf_command,
    parse_export,
    plan_runs,
    sent_sessions,
    with_lengths,
)
from bench.serving_offline import Frontends, _drive

ROOT = Path(__file__).resolve().parents[2]
EXPORT = ROOT / "tests" / "golden" / "aiperf_multi_turn"


def _flags(cmd: list[str]) -> dict[str, str]:
    """``--flag value`` pairs of a command line (a flag with no value maps to "")."""
    out, i = {}, 0
    while i < len(cmd):
        if cmd[i].startswith("--"):
            has_value = i + 1 < len(cmd) and not cmd[i + 1].startswith("--")
            out[cmd[i]] = cmd[i + 1] if has_value else ""
            i += 2 if has_value else 1
        else:
            i += 1
    return out


def _cmd(run: Run, **kw) -> list[str]:
    return aiperf_command(run, url="http://h:8000", model="m", tokenizer="/models/m",
                          artifacts=Path("/tmp/a"), **kw)  # fmt: skip


# ---- workloads -> aiperf command lines --------------------------------------------------
def test_random_workload_command() -> None:
    w = WORKLOADS["random"]
    assert (w.endpoint, w.isl, w.osl, w.concurrencies) == (
        "completions", 1024, 256, (1, 8, 32, 64, 128, 256))
    cmd = _cmd(Run(w, 32, requests=128, warmup=32, seed=7), aiperf=("python3", "-m", "aiperf"))
    assert cmd[:4] == ["python3", "-m", "aiperf", "profile"]
    f = _flags(cmd)
    assert f["--endpoint-type"] == "completions" and "--streaming" in f
    lengths = (f["--isl"], f["--isl-stddev"], f["--osl"], f["--osl-stddev"])
    assert lengths == ("1024", "0", "256", "0")
    assert (f["--concurrency"], f["--request-count"], f["--random-seed"]) == ("32", "128", "7")
    # warmup prompts are dataset entries of their own: sequential, requests + warmup entries
    assert f["--num-dataset-entries"] == "160" and f["--warmup-request-count"] == "32"
    assert f["--dataset-sampling-strategy"] == "sequential"
    assert f["--tokenizer"] == "/models/m" and "--use-server-token-count" in f
    assert "--use-legacy-max-tokens" in f  # the chat route reads max_tokens only
    assert json.loads(f["--extra-inputs"]) == {"ignore_eos": True, "temperature": 0.0}
    assert "--prefix-prompt-length" not in f and "--conversation-num" not in f


def test_prefix_and_multi_turn_commands() -> None:
    f = _flags(_cmd(Run(WORKLOADS["prefix"], 8, requests=32, warmup=0, seed=1)))
    assert (f["--prefix-prompt-pool-size"], f["--prefix-prompt-length"]) == ("1", "8192")
    assert f["--isl"] == "256" and "--warmup-request-count" not in f
    mt = WORKLOADS["multi_turn"]
    f = _flags(_cmd(Run(mt, 8, requests=32, warmup=8, seed=2), temperature=0.5))
    assert f["--endpoint-type"] == "chat"
    assert (f["--conversation-num"], f["--conversation-turn-mean"]) == ("8", str(mt.turns))
    assert f["--num-warmup-sessions"] == "2"  # 8 warmup requests of 4 turns
    assert f["--cache-bust"] == "warmup-isolation-first-turn"
    assert json.loads(f["--extra-inputs"]) == {
        "ignore_eos": True, "temperature": 0.5, "min_tokens": mt.osl,
        "thinking": {"type": "disabled"}}  # fmt: skip
    assert "--request-count" not in f


def test_plan_runs_and_overrides() -> None:
    w = with_lengths(WORKLOADS["multi_turn"], isl=64, osl=16, prefix=256, turns=2,
                     concurrencies=(1, 4))  # fmt: skip
    assert (w.isl, w.osl, w.prefix, w.turns) == (64, 16, 0, 2)  # prefix: prefix workload only
    assert with_lengths(WORKLOADS["random"], turns=3).turns == 1
    r, m = WORKLOADS["random"], Workload("m", "chat", 8, 8, (3,), turns=4)
    runs = plan_runs([r, m], per_slot=4, min_requests=16, warmup_per_slot=1, seed=10)
    assert [x.key for x in runs][:2] == ["random-c1", "random-c8"]
    assert [x.requests for x in runs[:3]] == [16, 32, 128]
    assert runs[-1].requests == 48 and runs[-1].sessions == 12  # 4 conversations a slot
    assert runs[-1].warmup == 12  # 3 warmup conversations of 4 turns
    lean = plan_runs([r, WORKLOADS["prefix"]], per_slot=1, min_requests=4, warmup_per_slot=0,
                     seed=0)  # fmt: skip
    assert [x.warmup for x in lean][:1] == [0] and all(x.warmup == 1 for x in lean[6:])
    assert [x.requests for x in lean[:3]] == [4, 8, 32]
    assert len({x.seed for x in runs}) == len(runs)  # no run replays another's prompts


# ---- aiperf's export --------------------------------------------------------------------
def test_parse_real_export() -> None:
    s = parse_export(EXPORT)
    raw = json.loads((EXPORT / "profile_export_aiperf.json").read_text())
    assert s.requests == 8 and s.errors == 0
    assert s.values["ttft_p50"] == raw["time_to_first_token"]["p50"]
    assert s.values["tpot_p99"] == raw["inter_token_latency"]["p99"]
    assert s.values["itl_p90"] == raw["inter_chunk_latency"]["p90"]
    assert s.values["output_tokens_per_s"] == raw["output_token_throughput"]["avg"]
    assert s.values["requests_per_s"] == raw["request_throughput"]["avg"]
    hit = s.values["prefix_hit_rate"]  # cached / prompt tokens, as aiperf's own percentage
    assert 0 < hit < 1
    assert hit * 100 == pytest.approx(raw["overall_usage_prompt_cache_read_pct"]["avg"])
    assert s.output_tokens == 8 * 16  # exact output lengths: ignore_eos + min_tokens


def test_parse_export_refuses_an_unfinished_run(tmp_path: Path) -> None:
    raw = json.loads((EXPORT / "profile_export_aiperf.json").read_text())
    (tmp_path / "profile_export_aiperf.json").write_text(json.dumps(raw | {"is_complete": False}))
    with pytest.raises(ValueError, match="did not complete"):
        parse_export(tmp_path)


def test_sent_sessions_in_aiperf_order() -> None:
    warmup, measured = sent_sessions(EXPORT)
    records = [json.loads(x)["metadata"] for x in
               (EXPORT / "profile_export.jsonl").read_text().splitlines()]  # fmt: skip
    assert len(warmup) == 2 and len(measured) == 4
    assert all(len(s.payloads) == 2 for s in measured)  # two turns each
    firsts = {}
    for m in records:
        if m["benchmark_phase"] == "profiling":
            t = int(m["credit_issued_ns"])
            firsts[m["conversation_id"]] = min(t, firsts.get(m["conversation_id"], t))
    assert [s.session_id for s in measured] == sorted(firsts, key=firsts.__getitem__)
    assert measured[0].payloads[0]["messages"][0]["role"] == "user"


# ---- records ----------------------------------------------------------------------------
SUMMARY = Summary({"ttft_p50": 40.0, "ttft_p90": 50.0, "ttft_p99": 60.0, "tpot_p50": 5.0,
                   "itl_p50": 4.0, "output_tokens_per_s": 950.0, "requests_per_s": 3.7,
                   "prefix_hit_rate": 0.5}, requests=99, errors=1, output_tokens=0,
                  duration_s=1.0)  # fmt: skip
RUN = Run(WORKLOADS["prefix"], 32, requests=128, warmup=32, seed=0)


def test_run_records_names_units_params() -> None:
    recs = run_records(RUN, SUMMARY, {"spec": "on", "card": "H100"},
                       {"spec_verifies": 10.0, "spec_accepted": 15.0})  # fmt: skip
    by = {r["name"]: r for r in recs}
    assert by["serving.prefix.ttft_p50"]["value"] == 40.0
    assert by["serving.prefix.ttft_p50"]["unit"] == "ms"
    assert by["serving.prefix.output_tokens_per_s"]["unit"] == "tokens/s"
    assert by["serving.prefix.requests_per_s"]["unit"] == "requests/s"
    assert by["serving.prefix.prefix_hit_rate"]["unit"] == "ratio"
    assert by["serving.prefix.error_rate"]["value"] == pytest.approx(0.01)
    assert by["serving.prefix.spec_accept_length"]["value"] == 2.5  # 1 + 15 / 10
    assert "serving.prefix.tpot_p90" not in by  # only what aiperf reported
    p = by["serving.prefix.itl_p50"]["params"]
    assert p == {"spec": "on", "card": "H100", "concurrency": 32, "input_tokens": 256,
                 "output_tokens": 256, "requests": 99, "prefix_tokens": 8192}  # fmt: skip
    off = run_records(RUN, SUMMARY, {"spec": "off", "card": "H100"}, {})
    assert not any(r["name"].endswith("spec_accept_length") for r in off)


def test_overhead_arithmetic() -> None:
    offline = {"output_tokens_per_s": 1000.0, "ttft_p50": 37.5}
    over, added = overhead_records(RUN, SUMMARY, offline, {"spec": "off", "card": "H100"})
    assert over["name"] == "serving.overhead" and over["unit"] == "ratio"
    assert over["value"] == pytest.approx(0.95)  # served / offline output tokens/s
    assert added["name"] == "serving.ttft_added_p50" and added["unit"] == "ms"
    assert added["value"] == pytest.approx(2.5)  # served minus offline TTFT p50
    assert over["params"] == {"spec": "off", "card": "H100", "workload": "prefix",
                              "concurrency": 32}  # fmt: skip
    assert over["peer"] == {"served_tokens_per_s": 950.0, "offline_tokens_per_s": 1000.0}


def test_collect_and_merge() -> None:
    delta = {"spec_drafts": 30.0, "spec_verifies": 10.0, "spec_accepted": 5.0}
    results = [("off", None, [(RUN, SUMMARY, {})], {RUN.key: {"output_tokens_per_s": 1000.0,
                                                           "ttft_p50": 30.0}}),
               (None, None, [(RUN, SUMMARY, delta)], {})]  # fmt: skip
    recs = collect_records(results, "H100")
    specs = {r["params"]["spec"] for r in recs}
    assert specs == {"off", "on"}  # None: read from the ranks' draft counters
    assert sum(r["name"] == "serving.overhead" for r in recs) == 1
    prev = {"card": "H100", "records": [r for r in recs if r["params"]["spec"] == "off"]}
    on = [r for r in recs if r["params"]["spec"] == "on"]
    assert merge_previous(prev, on, "H100") == prev["records"] + on
    assert merge_previous(prev, recs, "H100") == recs  # "off" ran again: replaced
    with pytest.raises(SystemExit):
        merge_previous(prev, on, "H200")


# ---- the server -------------------------------------------------------------------------
def test_apply_overrides() -> None:
    cfg = {"applications": [{"args": {"dp_size": 2, "engine": {"device": "cpu"}}}]}
    spec = {"method": "dspark", "num_draft_tokens": 3}
    apply_overrides(cfg, ["dp_size=1", "engine.max_num_seqs=64", "api.x=[1, 2]"], "on", spec)
    args = cfg["applications"][0]["args"]
    assert args["dp_size"] == 1 and args["api"] == {"x": [1, 2]}
    assert args["engine"] == {"device": "cpu", "max_num_seqs": 64, "speculative": spec}
    apply_overrides(cfg, [], "off", None)
    assert "speculative" not in args["engine"]
    with pytest.raises(SystemExit):
        apply_overrides(cfg, [], "on", None)  # nothing to draft with


def test_rank_stats_sums_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    text = ('# HELP fathom_rank_stat x\nfathom_rank_stat{rank="a",stat="spec_drafts"} 3.0\n'
            'fathom_rank_stat{rank="b",stat="spec_drafts"} 4.0\n'
            'fathom_rank_stat{rank="b",stat="steps"} 1e3\nfathom_ttft_count 2\n')  # fmt: skip

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

        def read(self) -> bytes:
            return text.encode()

    monkeypatch.setattr("urllib.request.urlopen", lambda *a, **k: Resp())
    assert rank_stats("http://h") == {"spec_drafts": 7.0, "steps": 1000.0}


# ---- the offline peer -------------------------------------------------------------------
class _Engine:
    """Stands in for AsyncEngine: answers every request with ``answer`` in two deltas."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.prompts: list[tuple[int, ...]] = []

    async def generate(self, req):
        self.prompts.append(req.prompt_token_ids)
        half = len(self.answer) // 2
        yield RequestOutput(req.request_id, self.answer[:half], num_cached_tokens=3)
        yield RequestOutput(req.request_id, self.answer[half:], finished=True,
                            finish_reason=FinishReason.LENGTH, num_cached_tokens=3)  # fmt: skip


def test_offline_replay_sends_what_the_server_got() -> None:
    tok = str(ROOT / "models" / "tiny-v41-chat" / "tokenizer.json")
    fronts = Frontends(FrontDoor(("tiny-v41-chat",), tokenizer_path=tok, context_limit=4096))
    answer = fronts.completions.tokenizer.encode("Gentle lady, hear me", add_special_tokens=False)
    engine = _Engine(answer.ids)
    _, measured = sent_sessions(EXPORT)
    acc = asyncio.run(_drive(engine, fronts, "chat", measured, concurrency=2))
    report = acc.report()
    assert report["requests"] == 8 and acc.output_tokens == 8 * len(answer.ids)
    assert report["prefix_hit_rate"] == pytest.approx(8 * 3 / acc.prompt_tokens)
    # first turns: the same token counts the server reported for the same bodies
    served = {}
    for line in (EXPORT / "profile_export.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["metadata"]["benchmark_phase"] == "profiling" and r["metadata"]["turn_index"] == 0:
            served[r["metadata"]["conversation_id"]] = r["metrics"]["usage_prompt_tokens"]["value"]
    firsts = [len(p) for p in engine.prompts if len(p) < min(served.values()) + 8]
    assert sorted(firsts) == sorted(served.values())
    # a second turn is its first turn's prompt + the answer as the server streams it + more
    seconds = [p for p in engine.prompts if len(p) > max(firsts)]
    assert len(seconds) == 4
    for p in seconds:
        q = next(q for q in engine.prompts if len(q) in firsts and p[: len(q)] == q)
        assert p[len(q) : len(q) + len(answer.ids)] == tuple(answer.ids)
    prep = fronts.prepare("chat", measured[0].payloads[0])[1]
    done = RequestOutput("r", answer.ids, finished=True, finish_reason=FinishReason.LENGTH)
    text = asyncio.run(fronts.answer(prep, [done]))
    assert text == fronts.completions.tokenizer.decode(answer.ids)
