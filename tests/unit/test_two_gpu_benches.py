"""The two-GPU benchmarks of issue 21 (``bench.ep_nccl``, ``bench.pd_transfer``) in their
``--cpu-smoke`` mode: two gloo processes run the real engine, the real EP exchanges and the
real KV export / transfer / import; the result files must say what the GPU run has to show
(EP2 greedy = EP1, the EP2 layer = the one-process layer, every phase timed, the state's
bytes all moved, PD tokens = colocated tokens)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import ep_nccl, pd_transfer


def _records(path: Path) -> dict[str, list[dict]]:
    doc = json.loads(path.read_text())
    recs = doc["records"]
    errors = [r for r in recs if "error" in r]
    assert not errors, errors[:2]
    assert doc["machine"]["backend"] == "gloo" and "--cpu-smoke" in doc["command"]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r["name"], []).append(r)
    return by


def test_ep_nccl_smoke(tmp_path: Path) -> None:
    ep_nccl.main(["--cpu-smoke", "--out", str(tmp_path), "--shm-dir", str(tmp_path)])
    by = _records(tmp_path / "ep_nccl.json")
    assert not (tmp_path / "ep_nccl.rank1.json").exists()  # merged into the result file
    greedy = by["ep.greedy_equal"]
    assert len(greedy) == len(ep_nccl.SMOKE_CASES)
    for r in greedy:
        p = r["params"]
        assert r["value"] == 1.0 and p["all_tokens"] and p["loads_as_planned"], p
        assert p["tokens"] == p["ep1_tokens"]
        assert p["tokens"][0]["r0"] != p["tokens"][0]["r1"]  # two prompts, two outputs
    shape = ep_nccl.SMOKE_MOE
    n_points = len(shape["layers"]) * len(shape["tokens"])
    layers = by["ep.moe.layer"]
    assert len(layers) == 2 * n_points  # dense and sized at every point
    for r in layers:
        p = r["params"]
        assert p["rel_err_vs_one_process"] < 1e-5 and p["one_process_abs_max"] > 0.01, p
        assert p["phased_equal"] and r["value"] > 0
        assert p["capacity"] == (p["tokens_per_rank"] if p["mode"] == "dense" else None)
    for phase in ep_nccl.PHASES:
        assert len(by[f"ep.moe.{phase}"]) == 2 * n_points
        assert all(r["value"] > 0 and len(r["params"]["per_rank"]) == 2
                   for r in by[f"ep.moe.{phase}"])  # fmt: skip
    assert len(by["ep.moe.one_gpu"]) == len(by["ep.agree"]) == n_points
    sizes = ep_nccl.SMOKE_BW["sizes"]
    copies = {r["params"]["bytes"]: r["value"] for r in by["ep.bw.peer_copy"]}
    assert sorted(copies) == sorted(sizes) and min(copies.values()) > 0
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        recs = by[f"ep.bw.{op}"]
        assert sorted(r["params"]["bytes_per_rank"] for r in recs) == sorted(sizes)
        for r in recs:
            assert r["floor"] == copies[r["params"]["bytes_per_rank"]] and r["value"] > 0


def test_pd_transfer_smoke(tmp_path: Path) -> None:
    pd_transfer.main(["--cpu-smoke", "--out", str(tmp_path)])
    by = _records(tmp_path / "pd_transfer.json")
    equal = by["pd.tokens_equal"]
    assert len(equal) == pd_transfer.SMOKE["reps"] + 1  # the warm-up request is checked too
    for r in equal:
        p = r["params"]
        assert r["value"] == 1.0 and p["installed"], p  # imported, not recomputed
        assert p["pd_tokens"] == p["colocated_tokens"]
        assert len(p["pd_tokens"]) == pd_transfer.SMOKE["max_tokens"]
    sources = {"tiny_v41_engine", "scaled_v41_flash_synthetic"}
    states = {r["params"]["source"]: r for r in by["pd.state_bytes"]}
    assert set(states) == sources
    for r in states.values():
        p = r["params"]
        assert r["value"] > 0 and r["value"] == p["nbytes_state"] == p["nbytes_imported"], p
    tiny = states["tiny_v41_engine"]["params"]
    assert tiny["num_blocks"] == -(-pd_transfer.SMOKE["prompt_tokens"] // 64)
    assert by["pd.scaled_roundtrip_equal"][0]["value"] == 1.0
    ttft = {r["params"]["mode"]: r for r in by["pd.ttft"]}
    assert set(ttft) == {"pd", "colocated"} and all(r["value"] > 0 for r in ttft.values())
    pd = ttft["pd"]["params"]
    assert all(pd[k] >= 0 for k in ("prefill_s", "transfer_s", "import_s", "first_decode_s"))
    transfers = by["pd.transfer"]
    assert {(r["params"]["source"], r["params"]["method"]) for r in transfers} == {
        (s, m) for s in sources for m in ("p2p_per_tensor", "p2p_flat")
    }
    for r in transfers:
        assert r["value"] > 0 and r["floor"] > 0
        assert r["params"]["bytes"] == states[r["params"]["source"]]["value"]
    assert len(by["pd.copy"]) == 4
