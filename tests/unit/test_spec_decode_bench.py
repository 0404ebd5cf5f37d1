"""``bench.spec_decode``'s step timings on the CPU (the tiny rank): every record the lead
reads on the flash rank is written, with its floor, card and floor kind; the draft step's
host inputs the bench builds have the layout ``Speculator.draft_inputs`` gives a verify step
of k drafts per request."""

from __future__ import annotations

import argparse

import numpy as np

from bench import spec_decode as sd
from bench.engine_steps import Rank
from bench.flash_rank import load_rank, tiny_rank_dir


def test_steps_write_every_record(tmp_path):
    model = load_rank(tiny_rank_dir(tmp_path), "cpu")
    rank = Rank(max_seqs=8, kv_bytes=1 << 26, ep=1, max_tokens=256, model=model, device="cpu",
                ring_headroom=3, draft_stages=3, context=128)  # fmt: skip
    args = argparse.Namespace(drafts=3, context=64, batches="2", reps=1)
    records, t_draft = sd.steps(rank, args, 1e12)
    by = {}
    for r in records:
        by.setdefault(r["name"], []).append(r)
    assert {r["params"]["cuda_graph"] for r in by["spec.draft_step"]} == {False, True}
    assert {r["params"]["cuda_graph_draft"] for r in by["spec.step"]} == {False, True}
    for r in by["spec.draft_step"] + by["spec.step"]:
        assert r["value"] > 0 and r["ratio_to_floor"] > 0
        assert r["params"]["card"] == "cpu" and r["params"]["floor_kind"]
    for r in by["spec.step"]:
        assert r["peer"]["ratio_to_plain_decode"] > 0
    assert len(by["spec.tpot_eff"]) == 4 and t_draft[2] > 0


def test_step_inputs_are_the_speculators():
    """Three requests verifying 3 drafts at position 40: each request's rows, context rows
    and draw settings where ``app.engine.spec.step`` reads them."""
    slots = np.array([4, 1, 6])
    inp = sd.step_inputs(slots, 40, 3, 1000)
    req = dict(zip(sd.REQ_ROWS, inp.req, strict=True))
    assert req["slots"].tolist() == [4, 1, 6] and req["starts"].tolist() == [40] * 3
    assert req["bases"].tolist() == [0, 4, 8] and req["counts"].tolist() == [4] * 3
    assert req["anchor_rows"].tolist() == [0, 4, 8] and req["greedy"].tolist() == [1] * 3
    pos, cslots, creq = inp.ctx[:3]
    assert pos.tolist() == [40, 41, 42, 43] * 3
    assert cslots.tolist() == [4] * 4 + [1] * 4 + [6] * 4
    assert creq.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert inp.num_sampled == 12 and not inp.kind.random
