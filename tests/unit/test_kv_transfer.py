"""KV export / import between two engines (app/cache/transfer.py, app/engine/handoff.py): a
request prefilled on one engine and decoded on another gives the tokens one engine gives
(greedy, replay off), with packed KV formats, chunked prefill, speculation and a grammar;
the prefill engine keeps no KV of it; a header mismatch is a clear error; a missing state
resumes as a local prefill; an imported request aborted mid-decode frees its KV."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from app.cache.transfer import KVTransferError
from app.deployments.pd import _HostTensor
from app.engine.core import EngineCore
from app.engine.handoff import DecodeState, Handoff
from app.engine.request import (
    EngineRequest,
    FinishReason,
    OutputConstraint,
    RequestOutput,
    SamplingParams,
)
from tests.unit.test_engine import make_engine, prompts, run_all

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
DSPARK = {"method": "dspark", "num_draft_tokens": 3}


def requests(ps, params=GREEDY) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", tuple(p), params) for i, p in enumerate(ps)]


def prefill(eng: EngineCore, reqs: list[EngineRequest]) -> dict[str, RequestOutput]:
    """Run ``reqs`` on ``eng`` in export mode -> the handoff output of each."""
    for r in reqs:
        eng.add_request(r, export=True)
    got = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o
    return got


def decode(eng: EngineCore, reqs, handoffs: dict[str, Handoff]) -> tuple[dict, list]:
    """Import every handoff into ``eng`` and decode -> (tokens per request incl. the
    handed-off ones, the import results)."""
    why = [eng.add_handoff(r, handoffs[r.request_id]) for r in reqs]
    outs = {r.request_id: list(handoffs[r.request_id].output_ids) for r in reqs}
    while eng.has_unfinished:
        for o in eng.step():
            outs[o.request_id] += o.token_ids
    eng.cache.check_integrity()
    return outs, why


def assert_released(eng: EngineCore) -> None:
    assert eng.cache.pool.usage == 0.0  # prompt blocks may stay cached, none referenced
    assert eng.cache.kv.num_free_slots == eng.cache.kv.max_slots
    eng.cache.check_integrity()


@pytest.mark.parametrize("overlap,kv_quant", [(True, False), (False, True)])
def test_prefill_here_decode_there_equals_one_engine(tiny_ckpt, overlap, kv_quant):
    path = tiny_ckpt("v41")
    opts = dict(max_num_batched_tokens=48, overlap_schedule=overlap, kv_quant=kv_quant)
    reqs = requests(prompts((150, 9, 70)))  # 150 and 70: chunked prefill, several blocks
    want, _ = run_all(make_engine(path, **opts), reqs)
    pre = make_engine(path, **opts)
    outs = prefill(pre, reqs)
    assert {o.finish_reason for o in outs.values()} == {FinishReason.HANDOFF}
    states = {k: o.handoff for k, o in outs.items()}
    assert all(isinstance(s, DecodeState) for s in states.values())
    s0 = states["r0"]
    assert s0.kv.num_blocks == 3 and s0.kv.num_computed == 150  # 64-position blocks
    assert {n.split(".")[0] for n in s0.kv.tensors} == {"entries", "keys", "window", "tail:kv"}
    assert ("entries.2.scale" in s0.kv.tensors) == kv_quant  # packed rows travel as stored
    assert_released(pre)
    # as the object-store transport carries them: uint8 numpy buffers, pickled
    wire = {k: pickle.loads(pickle.dumps(s.map_tensors(_HostTensor.of))) for k, s in
            states.items()}  # fmt: skip
    back = {k: s.map_tensors(lambda h: h.tensor(torch.device("cpu"))) for k, s in wire.items()}
    handoffs = {k: Handoff(tuple(o.token_ids), back[k]) for k, o in outs.items()}
    got, why = decode(make_engine(path, **opts), reqs, handoffs)
    assert why == [None, None, None]  # installed, not recomputed
    assert got == want


def test_speculation_and_grammar_state_travel(tiny_ckpt):
    path = tiny_ckpt("v41")
    opts = dict(speculative=DSPARK)
    ps = prompts((40, 23))
    regex = SamplingParams(temperature=0, max_tokens=12,
                           constraint=OutputConstraint("regex", "[a-e ]{4,20}"))  # fmt: skip
    reqs = [EngineRequest("spec", tuple(ps[0]), GREEDY), EngineRequest("re", tuple(ps[1]), regex)]
    want, _ = run_all(make_engine(path, **opts), reqs)
    outs = prefill(make_engine(path, **opts), reqs)
    spec = outs["spec"].handoff
    assert len(spec.drafts) == 3 and spec.draft_logits is not None  # the next verify's drafts
    assert {"draft.0.data", "draft.2.data"} <= set(spec.kv.tensors)  # DSpark context rings
    handoffs = {k: Handoff(tuple(o.token_ids), o.handoff) for k, o in outs.items()}
    dec = make_engine(path, **opts)
    got, why = decode(dec, reqs, handoffs)
    assert why == [None, None] and got == want
    assert dec.stats.spec_verifies > 0


def test_header_mismatch_is_a_clear_error(tiny_ckpt):
    path = tiny_ckpt("v41")
    req = requests(prompts((30,)))[0]
    out = prefill(make_engine(path), [req])["r0"]
    state: DecodeState = out.handoff
    other = make_engine(path, block_size=128)
    with pytest.raises(KVTransferError, match=r"block_size 64 \(state\) != 128"):
        other.add_handoff(req, Handoff(tuple(out.token_ids), state))
    assert_released(other)
    same = make_engine(path)
    bad = dataclasses.replace(state.kv, header=dataclasses.replace(state.kv.header, model="x"))
    with pytest.raises(KVTransferError, match="model 'x' \\(state\\)"):
        same.add_handoff(req, Handoff(tuple(out.token_ids), dataclasses.replace(state, kv=bad)))
    spec = make_engine(path, speculative=DSPARK)
    with pytest.raises(KVTransferError, match="draft '' \\(state\\) != 'dspark:3'"):
        spec.add_handoff(req, Handoff(tuple(out.token_ids), state))
    assert not same.has_unfinished and not spec.has_unfinished


def test_missing_state_resumes_locally_and_abort_frees_an_import(tiny_ckpt):
    path = tiny_ckpt("v41")
    reqs = requests(prompts((90, 12)))
    want, _ = run_all(make_engine(path), reqs)
    outs = prefill(make_engine(path), reqs)
    dec = make_engine(path)
    lost = {k: Handoff(tuple(o.token_ids)) for k, o in outs.items()}  # the transfer failed
    got, why = decode(dec, reqs, lost)
    assert why == ["no_state", "no_state"] and got == want
    full = {k: Handoff(tuple(o.token_ids), o.handoff) for k, o in outs.items()}
    got, why = decode(make_engine(path, max_num_seqs=1), reqs, full)  # one slot for two
    assert why == [None, "no_room"] and got == want
    again = dataclasses.replace(reqs[0], request_id="again")
    state = dataclasses.replace(outs["r0"].handoff, request_id="again")
    assert dec.add_handoff(again, Handoff(tuple(outs["r0"].token_ids), state)) is None
    dec.step()
    assert dec.cache.pool.usage > 0
    dec.abort("again")
    while dec.has_unfinished:
        dec.step()
    assert_released(dec)


def test_prompt_logprobs_come_once_when_the_decode_engine_prefills_again(tiny_ckpt):
    """The prefill engine sends a prompt's logprobs; a decode engine that resumes the request
    as a local prefill (its state lost, or no room for it) does not send them again."""
    path = tiny_ckpt("v41")
    params = dataclasses.replace(GREEDY, prompt_logprobs=1)
    reqs = requests(prompts((40, 12)), params)
    pre = make_engine(path, max_num_batched_tokens=16)
    for r in reqs:
        pre.add_request(r, export=True)
    plp: dict[str, list] = {r.request_id: [] for r in reqs}
    outs = {}
    while pre.has_unfinished:
        for o in pre.step():
            plp[o.request_id] += o.prompt_logprobs or []
            if o.finished:
                outs[o.request_id] = o
    assert [len(plp[r.request_id]) for r in reqs] == [40, 12]
    dec = make_engine(path)
    lost = {k: Handoff(tuple(o.token_ids)) for k, o in outs.items()}
    assert [dec.add_handoff(r, lost[r.request_id]) for r in reqs] == ["no_state", "no_state"]
    n_out = 0
    while dec.has_unfinished:
        for o in dec.step():
            assert o.prompt_logprobs is None, o.request_id
            n_out += len(o.token_ids)
    assert n_out == 2 * (GREEDY.max_tokens - 1)


def test_pd_args_are_validated():
    from pydantic import ValidationError

    from app.serve_args import ServeArgs

    sa = ServeArgs.model_validate(
        {
            "engine": {"max_num_seqs": 8},
            "pd": {"decode": {"ranks": 2, "engine": {"max_num_seqs": 32}}},
        }
    )
    assert sa.pd.role_options(sa.engine, "decode") == {"max_num_seqs": 32}
    assert sa.pd.role_options(sa.engine, "prefill") == {"max_num_seqs": 8}
    for bad, words in [
        ({"pd": {"decode": {"engine": {"block_size": 128}}}}, "'block_size' differs"),
        ({"pd": {"prefill": {"engine": {"speculative": DSPARK}}}}, "'speculative' differs"),
        ({"pd": {"prefill": {"engine": {"max_num_seqs": 0}}}}, "pd.prefill.engine"),
        ({"pd": {"transport": "tcp"}}, "transport"),
        ({"pd": {}, "autoscaling": {}}, "pd and autoscaling"),
    ]:
        with pytest.raises(ValidationError, match=words):
            ServeArgs.model_validate(bad)
