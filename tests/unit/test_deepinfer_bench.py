"""``bench.deepinfer`` on the CPU: SGLang's timing window, the workloads of each setting,
the forced acceptance through the engine's sampler, the floors, and one tiny run end to end
(record fields, prefix hits, static verification, ``--merge``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from app.engine.request import SamplingParams
from app.engine.sampler import RowState, sample
from app.engine.startup import Startup
from app.model.dspark import DraftBlock
from bench import deepinfer as di
from bench.flash_rank import load_rank, tiny_rank_dir


def _steps(bounds: list[tuple[float, float]]) -> list[di.Step]:
    return [di.Step(a, b, 1, 1, 0, 1) for a, b in bounds]


def test_window_keeps_complete_steps_between_20_and_90_percent_finished() -> None:
    steps = _steps([(i, i + 1) for i in range(10)])
    finish = [float(i + 1) for i in range(10)]  # one request ends with each step
    win = di.window(steps, finish)  # 2nd finish at 2.0, 9th at 9.0
    assert [(s.start, s.end) for s in win] == [(i, i + 1) for i in range(2, 9)]
    # a step straddling either moment is not complete inside the window
    odd = _steps([(1.5, 2.5), (2.5, 8.5), (8.5, 9.5)])
    assert [(s.start, s.end) for s in di.window(odd, finish)] == [(2.5, 8.5)]
    # 8 requests: the ceil(1.6) = 2nd and the ceil(7.2) = 8th finish
    eight = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert [s.start for s in di.window(steps, eight)] == [2, 3, 4, 5, 6, 7]
    assert di.window(steps, [4.0, 4.0, 4.0]) == [] and di.window(steps, []) == []


def test_prefill_settings() -> None:
    big = di.prefill_case(65536, 131072, 4096, 10, block=64, window=128)
    assert (big.requests_per_step, big.requests, big.hit) == (16, 160, 126976)
    assert big.tokens_per_request == 4096 + 128 and big.budget == 16 * 4224
    one = di.prefill_case(4096, 131072, 4096, 10, block=64, window=128)
    assert (one.requests_per_step, one.requests, one.budget) == (1, 10, 4224)
    tiny = di.prefill_case(128, 256, 64, 4, block=64, window=8)
    assert (tiny.requests_per_step, tiny.hit, tiny.tokens_per_request) == (2, 192, 72)
    with pytest.raises(ValueError):
        di.prefill_case(6000, 131072, 4096, 10, block=64, window=128)  # not whole requests
    with pytest.raises(ValueError):
        di.prefill_case(8000, 131072, 4000, 10, block=64, window=128)  # cached part unaligned


def test_decode_settings() -> None:
    case = di.decode_case(256, 131072, 256, block=64)
    assert case.prefix == 131008 and len(case.lengths) == 256
    assert (min(case.lengths), max(case.lengths)) == (128, 384)
    gaps = {b - a for a, b in zip(case.lengths, case.lengths[1:], strict=False)}
    assert gaps <= {1, 2}  # evenly spaced
    assert di.decode_case(8, 256, 16, block=64).lengths == (8, 10, 13, 15, 17, 19, 22, 24)
    assert di.staggered(1, 100) == (100,)


@pytest.mark.parametrize("rate", [0.0, 0.6, 1.0])
def test_forced_acceptance_through_the_sampler(rate: float) -> None:
    torch.manual_seed(0)
    R, k, V = 16, 3, 4096
    ids = torch.randint(0, V, (R, k))
    block = DraftBlock(ids, torch.randn(R, k, V), None)
    acc = di.force_acceptance(block, rate, torch.Generator().manual_seed(1))
    rows = [RowState(SamplingParams(temperature=1.0), [5], [])] * (R * k)
    out = sample(torch.randn(R * k, V), rows, drafts=ids.flatten().numpy(),
                 draft_logits=block.logits.reshape(R * k, V))  # fmt: skip
    assert torch.equal(out.accepted, acc.flatten())
    if rate in (0.0, 1.0):
        assert bool(acc.all()) == (rate == 1.0) and bool(acc.any()) == (rate == 1.0)


def test_floors(tmp_path: Path) -> None:
    model = load_rank(tiny_rank_dir(tmp_path), "cpu")
    c = di.Ceilings(bandwidth=1e12, matmul=1e14)
    floor, b, f = di.decode_floor(model, 4, 16, 256, 3, c)
    assert floor == max(b, f) > 0
    _, b_more, f_more = di.decode_floor(model, 4, 64, 256, 3, c)
    assert f_more > f and b_more >= b
    case = di.prefill_case(128, 256, 64, 4, block=64, window=8)
    replay, every_row = di.prefill_floor(model, case, c)
    assert 0 < replay < every_row


def test_an_engine_short_of_the_context_does_not_start() -> None:
    args = di.parse_args(["--model", "tiny-v41"])
    model = Startup(torch.device("cpu")).load(di.engine_config(args), None)
    cfg = di.engine_config(args, max_num_seqs=2, max_num_batched_tokens=144, max_model_len=320)
    for check in (True, False):  # sized first (the probe), or built whole
        assert di.start(cfg, model, 321, check) == (None, "max_model_len 320 < 321")
    core, why = di.start(cfg, model, 320, check=True)
    assert core is not None and core.max_model_len == 320 and why == ""
    core.close()


def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = str(tmp_path)
    di.main(["--model", "tiny-v41", "--out", out, "--prefill-tokens", "64,128",
             "--prefill-batches", "5", "--decode-requests", "2,4", "--output-len", "16"])
    doc = json.loads((tmp_path / "deepinfer.json").read_text())
    assert doc["benchmark"] == "deepinfer" and doc["card"].startswith("CPU")
    recs = {di.setting(r): r for r in doc["records"]}
    assert sorted(recs) == [("deepinfer.decode_step", 2), ("deepinfer.decode_step", 4),
                            ("deepinfer.prefill_step", 64), ("deepinfer.prefill_step", 128)]
    for n in (64, 128):
        r = recs[("deepinfer.prefill_step", n)]
        p = r["params"]
        assert r["value"] > 0 and r["unit"] == "ms" and r["floor"] is None
        assert p["new_tokens_per_step"] == n and p["requests_per_step"] == n // 64
        assert p["hits"] == 1.0 and p["steps_in_window"] == 4 == len(p["step_ms"])
        assert p["context"] == 256 and p["card"] == "cpu" and p["tokens_per_s"] > 0
    for n in (2, 4):
        r = recs[("deepinfer.decode_step", n)]
        p = r["params"]
        assert r["value"] > 0 and p["steps_in_window"] >= 1 and p["hits"] == 1.0
        assert p["static_steps"] == 1.0 and p["drafts"] == 3 and p["verification"] == "static"
        assert 1.0 <= p["accept_length"] <= 4.0 and p["accept_length_target"] == 2.5
        assert p["tpot_ms"] == pytest.approx(r["value"] / p["accept_length"])
        assert p["output_lengths"] == [8, 24] and 0 < p["mean_batch"] <= n
    # a second process adds a setting; the file keeps the first one's records
    di.main(["--model", "tiny-v41", "--out", out, "--what", "decode", "--decode-requests", "8",
             "--output-len", "8", "--merge"])
    doc = json.loads((tmp_path / "deepinfer.json").read_text())
    procs = {di.setting(r): r["params"]["process"] for r in doc["records"]}
    assert procs[("deepinfer.decode_step", 8)] == 1 and procs[("deepinfer.prefill_step", 64)] == 0
    assert len(procs) == 5 and doc["command"].count("python -m bench.deepinfer") == 2
