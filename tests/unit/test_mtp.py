"""V4 MTP-1 speculative decoding (app/model/mtp.py, app/engine/spec): the drafter's window
KV and logits against the full-sequence reference of the MTP block, the engine's drafts
against that reference after chunked prefill and any history of accepted and rejected drafts
(sampling at a high temperature accepts often), greedy outputs unchanged by MTP, and the
configuration errors."""

from __future__ import annotations

import random

import pytest
import torch

from app.config import EngineConfigError
from app.engine.llm import LLM
from app.engine.request import EngineRequest, SamplingParams
from app.model.kv_store import KVRows
from app.model.mtp import MTPDrafter
from tests.support.reference import reference_logits, reference_mtp_logits
from tests.unit.test_engine import GREEDY, prompts, run_all
from tests.unit.test_speculative import engine, requests

MTP = {"method": "mtp", "num_draft_tokens": 1}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_drafter_equals_the_reference_block(tiny_model):
    """Commit positions one by one into a ring (other slots' rows zero, this slot's NaN until
    written) and draft at each anchor: the logits equal the reference MTP over the sequence."""
    model = tiny_model("v4")
    cfg, W = model.cfg, model.cfg.sliding_window
    ids = torch.randint(0, cfg.vocab_size, (3 * W,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = reference_mtp_logits(model, ids)
        streams: list[torch.Tensor] = []
        reference_logits(model, ids, streams)
        S = streams[0]
        data = torch.zeros(3 * W, cfg.head_dim)
        data[W : 2 * W] = float("nan")
        ring = KVRows(data, None, "float", cfg.head_dim)
        drafter, slot = MTPDrafter(model), torch.tensor([1])
        for a in range(ids.numel() - 1):
            at = torch.tensor([a])
            drafter.write_context(ring, slot, S[a : a + 1], ids[a + 1 : a + 2], at)
            got = drafter.draft(ring, slot, at, S[a : a + 1], ids[a + 1 : a + 2])
            assert _rel(got, ref[a : a + 1]) < 1e-5, a


@pytest.mark.parametrize("budget", [6, 64])
def test_llm_draft_after_a_chunked_prompt_equals_the_reference(tiny_ckpt, budget):
    """``LLM.draft``: the engine's first MTP draft after a 23-token prompt prefilled in chunks
    of ``budget`` tokens (the ring is filled across chunks) equals the reference."""
    llm = LLM(tiny_ckpt("v4"), speculative=MTP, max_num_batched_tokens=budget,
              kv_cache_bytes=1 << 22)  # fmt: skip
    prompt = prompts((23,), seed=5)[0]
    d = llm.draft(prompt)
    with torch.no_grad():
        ref = reference_mtp_logits(llm.engine.model, torch.tensor(prompt + [d.bonus]))[-1]
        target = reference_logits(llm.engine.model, torch.tensor(prompt))[-1]
    assert d.bonus == int(target.argmax())
    assert len(d.ids) == 1 and d.ids[0] == int(d.logits[0].argmax())
    assert _rel(d.logits[0], ref) < 1e-5
    # an anchor inside the prompt: the block after its first 12 tokens
    d12 = llm.dspark_draft(prompt, anchor=11)
    with torch.no_grad():
        ref12 = reference_mtp_logits(llm.engine.model, torch.tensor(prompt[:12] + [d12.bonus]))
    assert _rel(d12.logits[0], ref12[-1]) < 1e-5


def test_engine_drafts_follow_accepts_and_rollbacks(tiny_ckpt):
    """At temperature 3 the target and the MTP block are both spread out, so drafts are often
    accepted and often rejected. Every draft the engine proposed must equal the reference MTP
    at its anchor over the final sequence: the ring kept exactly the committed rows."""
    path = tiny_ckpt("v4")
    eng = engine(path, speculative=MTP, max_num_batched_tokens=16)
    seen: list[tuple[str, int, torch.Tensor]] = []

    def record(rids, anchors, block):
        for r, a, lg in zip(rids, anchors.tolist(), block.logits[:, 0], strict=True):
            seen.append((r, a, lg.float().clone()))

    eng.on_draft = record
    params = SamplingParams(temperature=3.0, seed=11, max_tokens=24, ignore_eos=True)
    reqs = requests(prompts((19, 5, 30), seed=2), params)
    outs, _ = run_all(eng, reqs)
    st = eng.stats
    assert st.spec_verifies > 20 and 0 < st.spec_accepted < st.spec_drafts
    full = {r.request_id: list(r.prompt_token_ids) + outs[r.request_id] for r in reqs}
    with torch.no_grad():
        refs = {rid: reference_mtp_logits(eng.model, torch.tensor(t)) for rid, t in full.items()}
    checked = 0
    for rid, a, lg in seen:
        if a + 1 < len(full[rid]):  # the bonus of the last step may be past max_tokens
            assert _rel(lg, refs[rid][a]) < 1e-5, (rid, a)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("overlap", [True, False])
def test_mtp_greedy_equals_plain(tiny_ckpt, overlap):
    path = tiny_ckpt("v4")
    reqs = requests(prompts((23, 5, 37, 11, 1)))
    plain, _ = run_all(engine(path, max_num_batched_tokens=16, overlap_schedule=overlap), reqs)
    eng = engine(path, max_num_batched_tokens=16, overlap_schedule=overlap, speculative=MTP)
    got, _ = run_all(eng, reqs, random.Random(0))
    assert got == plain
    assert eng.stats.spec_verifies > 0 and eng.stats.spec_drafts == eng.stats.spec_verifies


def test_mtp_with_a_prefix_hit_and_stops(tiny_ckpt):
    path = tiny_ckpt("v4")
    shared = prompts((40,), seed=9)[0]
    reqs = [EngineRequest("a", tuple(shared + [7, 8]), GREEDY),
            EngineRequest("b", tuple(shared + [9]), GREEDY)]  # fmt: skip
    plain = engine(path, block_size=16)
    want = {}
    for r in reqs:
        want.update(run_all(plain, [r])[0])
    eng = engine(path, block_size=16, speculative=MTP)
    got = {}
    for r in reqs:
        got.update(run_all(eng, [r])[0])
    assert eng.cache.index.stats.hit_tokens >= 32 and got == want


def test_config_errors_name_the_option(tiny_ckpt):
    with pytest.raises(EngineConfigError, match="MTP drafts with DeepSeek-V4 checkpoints"):
        engine(tiny_ckpt("v41"), speculative=MTP)
    with pytest.raises(EngineConfigError, match="DSpark drafts with DeepSeek-V4.1"):
        engine(tiny_ckpt("v4"), speculative={"method": "dspark", "num_draft_tokens": 2})
    with pytest.raises(EngineConfigError, match="must be 1 with method 'mtp'"):
        engine(tiny_ckpt("v4"), speculative={"method": "mtp", "num_draft_tokens": 2})


def test_serve_args_take_speculative_and_check_the_checkpoint(tiny_ckpt):
    """serve_config's ``engine: {speculative: ...}``: the option's own errors at validation,
    a method the checkpoint cannot run when the app's configs are resolved (before any rank
    starts)."""
    from pydantic import ValidationError

    from app.builder import app_configs
    from app.serve_args import ServeArgs

    ok = app_configs(ServeArgs(model=tiny_ckpt("v4"), engine={"speculative": MTP}))
    assert ok.engine.speculative.method == "mtp"
    with pytest.raises(ValidationError, match="num_draft_tokens must be an integer in"):
        ServeArgs(model="tiny-v41", engine={"speculative": {"num_draft_tokens": 9}})
    with pytest.raises(ValidationError, match="must be a mapping like"):
        ServeArgs(model="tiny-v41", engine={"speculative": "dspark"})
    with pytest.raises(EngineConfigError, match="MTP drafts with DeepSeek-V4 checkpoints"):
        app_configs(ServeArgs(model=tiny_ckpt("v41"), engine={"speculative": MTP}))
