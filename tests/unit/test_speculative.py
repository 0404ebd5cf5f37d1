"""Speculative decoding in the engine (app/engine/spec): greedy outputs are unchanged by
speculation (DSpark drafts, the target's own continuation, random drafts) under chunked
prefill, prefix hits with bounded replay, preemption, constraints, stop tokens and logprobs;
the oracle proposer cuts target forwards in proportion; rejection sampling is lossless."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from app.config import EngineConfig, EngineConfigError, SpeculativeConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, FinishReason, OutputConstraint, SamplingParams
from app.engine.sampler import RowState, draw_proposal, sample
from app.engine.spec.proposer import DSparkProposer
from bench.proposers import OracleProposer, RandomProposer
from tests.unit.test_engine import GREEDY, prompts, run_all

DSPARK = {"method": "dspark", "num_draft_tokens": 3}


def engine(path: str, proposer=None, **opts) -> EngineCore:
    opts.setdefault("kv_cache_bytes", 1 << 22)
    opts.setdefault("bounded_replay", "off")
    return EngineCore(EngineConfig.from_options(path, **opts), proposer=proposer)


def requests(ps, params=GREEDY, tag="r"):
    return [EngineRequest(f"{tag}{i}", tuple(p), params) for i, p in enumerate(ps)]


@pytest.mark.parametrize("overlap", [True, False])
def test_dspark_greedy_equals_plain_under_chunked_prefill(tiny_ckpt, overlap):
    path = tiny_ckpt("v41")
    reqs = requests(prompts((23, 5, 37, 11, 1)))
    plain, _ = run_all(engine(path, max_num_batched_tokens=16, overlap_schedule=overlap), reqs)
    eng = engine(path, max_num_batched_tokens=16, overlap_schedule=overlap, speculative=DSPARK)
    got, finish = run_all(eng, reqs, random.Random(0))
    assert got == plain and set(finish.values()) == {FinishReason.LENGTH}
    st = eng.stats
    assert st.spec_verifies > 0 and st.spec_drafts > st.spec_verifies  # 16-token budget trims
    assert not eng.overlap  # speculating steps are not pipelined


def test_oracle_accepts_everything_with_proportionally_fewer_forwards(tiny_ckpt):
    path = tiny_ckpt("v41")
    ps = prompts((9, 14, 30))
    reqs = requests(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    base = engine(path, overlap_schedule=False)
    plain, _ = run_all(base, reqs)
    truth = {r.request_id: list(r.prompt_token_ids) + plain[r.request_id] for r in reqs}
    oracle = OracleProposer(truth, base.model.cfg.vocab_size, accept_rate=1.0)
    eng = engine(path, proposer=oracle, speculative=DSPARK)
    got, _ = run_all(eng, reqs)
    assert got == plain
    st = eng.stats
    # one prefill step, then verifies of 4 tokens: the 11 tokens after the first take three
    # (4 + 4 + 3: max_tokens leaves room for 2 drafts in the last)
    assert (base.stats.steps, eng.stats.steps) == (12, 4)
    assert st.spec_verifies == 9 and st.spec_drafts == st.spec_accepted == 3 * (3 + 3 + 2)
    assert st.spec_accepted_at == [9, 9, 6]
    rep = st.report()  # what the rank's metrics carry (fathom_rank_stat{stat=...})
    assert rep["spec_accept_length"] == pytest.approx(1 + 24 / 9)
    assert rep["spec_acceptance"] == 1.0 and rep["spec_accepted_at_3"] == 6
    assert rep["spec_verify_tokens_per_step"] == pytest.approx(st.spec_verify_tokens / 4)
    assert all(isinstance(v, int | float) for v in rep.values())


def test_random_drafts_are_rejected_and_rolled_back(tiny_ckpt):
    path = tiny_ckpt("v41")
    reqs = requests(prompts((17, 40, 6), seed=3))
    plain, _ = run_all(engine(path, overlap_schedule=False), reqs)
    vocab = engine(path).model.cfg.vocab_size
    eng = engine(path, proposer=RandomProposer(vocab), speculative={"method": "dspark",
                 "num_draft_tokens": 5})  # fmt: skip
    got, _ = run_all(eng, reqs)
    assert got == plain
    assert eng.stats.spec_drafts > 50 and eng.stats.spec_accepted < eng.stats.spec_drafts / 10
    # half-right oracle drafts: accepted prefixes of every length, each followed by rollback
    truth = {r.request_id: list(r.prompt_token_ids) + plain[r.request_id] for r in reqs}
    eng = engine(path, proposer=OracleProposer(truth, vocab, accept_rate=0.6, seed=1),
                 speculative=DSPARK)  # fmt: skip
    got, _ = run_all(eng, reqs)
    assert got == plain
    at = eng.stats.spec_accepted_at
    assert 0 < at[2] < at[1] < at[0] < eng.stats.spec_verifies


def test_prefix_hit_with_bounded_replay_writes_the_draft_context(tiny_ckpt):
    """With encoder+decoder replay a prefix hit skips most of the prompt; the DSpark context
    rings must still be written for the whole window before the anchor (from the replayed
    rows' features). The rings are poisoned with NaN before the hitting request: its draft
    blocks stay finite, and greedy outputs equal the plain engine's under the same replay
    (bounded replay itself is approximate: docs/performance.md)."""
    path = tiny_ckpt("v41")
    shared = prompts((50,), seed=7)[0]
    reqs = requests([shared + [11, 12, 13], shared + [21, 22]])
    opts = dict(bounded_replay="encoder+decoder", block_size=16)
    plain = engine(path, **opts)
    want = {}
    for r in reqs:
        want.update(run_all(plain, [r])[0])
    eng = engine(path, speculative=DSPARK, **opts)
    first, _ = run_all(eng, [reqs[0]])
    for ring in eng.cache.pools.draft:
        ring.data.fill_(float("nan"))
    blocks = []
    eng.on_draft = lambda rids, anchors, block: blocks.append(block.logits.clone())
    second, _ = run_all(eng, [reqs[1]])
    assert eng.cache.index.stats.hit_tokens >= 48
    assert {**first, **second} == want
    assert len(blocks) > 2 and all(bool(torch.isfinite(b).all()) for b in blocks)


def test_preemption_under_speculation_keeps_outputs(tiny_ckpt):
    path = tiny_ckpt("v41")
    reqs = requests(prompts((58, 60, 57, 59), seed=1))
    plain, _ = run_all(engine(path, max_num_batched_tokens=32, overlap_schedule=False), reqs)
    probe = engine(path, block_size=64, speculative=DSPARK)
    per_block, per_slot = probe.cache.kv.bytes_per_block(), probe.cache.kv.bytes_per_slot()
    eng = engine(path, max_num_batched_tokens=32, block_size=64, max_num_seqs=4,
                 kv_cache_bytes=4 * per_block + 5 * per_slot, speculative=DSPARK)  # fmt: skip
    assert eng.cache.pool.num_blocks == 3
    got, finish = run_all(eng, reqs)
    assert eng.stats.num_preemptions > 0 and eng.stats.spec_verifies > 0
    assert got == plain and set(finish.values()) == {FinishReason.LENGTH}
    assert eng.cache.pool.num_available == 3


def test_stops_logprobs_and_constraints_compose(tiny_ckpt):
    path = tiny_ckpt("v41")
    ps = prompts((12, 30, 7), seed=11)
    plain_eng = engine(path, overlap_schedule=False)
    free, _ = run_all(plain_eng, requests(ps, SamplingParams(temperature=0, max_tokens=16,
                                                             ignore_eos=True)))  # fmt: skip
    stop_tok = free["r1"][5]  # request 1 stops at its 6th token (others when they meet it)
    params = [
        SamplingParams(temperature=0, max_tokens=16, logprobs=2, stop_token_ids=(stop_tok,)),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(stop_tok,), min_tokens=3),
        SamplingParams(temperature=0, max_tokens=9,
                       constraint=OutputConstraint("regex", "[a-z ]{3,12}")),
    ]  # fmt: skip

    def go(eng):
        reqs = [EngineRequest(f"r{i}", tuple(p), sp) for i, (p, sp) in
                enumerate(zip(ps, params, strict=True))]  # fmt: skip
        outs, lps, fin = {}, {}, {}
        for r in reqs:
            eng.add_request(r)
        while eng.has_unfinished:
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
                lps.setdefault(o.request_id, []).extend(o.logprobs or [])
                if o.finished:
                    fin[o.request_id] = (o.finish_reason, o.stop_reason)
        return outs, lps, fin

    a_out, a_lp, a_fin = go(engine(path, overlap_schedule=False))
    spec = engine(path, proposer=OracleProposer(
        {f"r{i}": list(p) + free[f"r{i}"] for i, p in enumerate(ps)},
        plain_eng.model.cfg.vocab_size), speculative=DSPARK)  # fmt: skip
    b_out, b_lp, b_fin = go(spec)
    assert a_out == b_out and a_fin == b_fin
    assert a_fin["r1"] == (FinishReason.STOP, stop_tok)
    assert len(a_lp["r0"]) == len(a_out["r0"]) > 0
    for x, y in zip(a_lp["r0"], b_lp["r0"], strict=True):
        assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert spec.stats.spec_accepted > 0
    spec.cache.check_integrity()


def test_speculation_options_fail_at_config_time(tiny_ckpt):
    v41, v4 = tiny_ckpt("v41"), tiny_ckpt("v4")
    with pytest.raises(EngineConfigError, match="num_draft_tokens must be an integer in"):
        EngineConfig.from_options(v41, speculative={"method": "dspark", "num_draft_tokens": 6})
    with pytest.raises(EngineConfigError, match="must be 1 with method 'mtp'"):
        SpeculativeConfig("mtp", 2)
    with pytest.raises(EngineConfigError, match="method must be one of"):
        EngineConfig.from_options(v41, speculative={"method": "eagle"})
    with pytest.raises(EngineConfigError, match=r"unknown speculative option\(s\) \['k'\]"):
        EngineConfig.from_options(v41, speculative={"k": 3})
    with pytest.raises(EngineConfigError, match="DSpark drafts with DeepSeek-V4.1"):
        engine(v4, speculative=DSPARK)
    eng = engine(v41, speculative=DSPARK)
    assert isinstance(eng.proposer, DSparkProposer)
    # headroom and the draft rings are in the layout the pool was sized from
    plain = engine(v41)
    assert eng.cache.kv.bytes_per_slot() > plain.cache.kv.bytes_per_slot()


# ---- lossless rejection sampling -------------------------------------------------------------


def _chi2_critical(df: int, alpha: float) -> float:
    """Upper ``alpha`` point of chi-square(df), Wilson-Hilferty (within 1% for df >= 3)."""
    z = {1e-3: 3.0902, 1e-4: 3.7190}[alpha]
    h = 2.0 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def _verify_once(p_logits, q_logits, params, n, seeded):
    """n independent rows: a draft d ~ Q, then one verify row -> (emitted, accepted)."""
    V = p_logits.numel()
    ps = [params] * n
    if seeded:
        ps = [SamplingParams(**{**params.__dict__, "seed": i}) for i in range(n)]
    Q = q_logits.expand(n, V).contiguous()  # the proposer keeps what it drew from (biased)
    d = draw_proposal(Q, ps, torch.zeros(n, dtype=torch.int64))
    rows = [RowState(p, (1,), ()) for p in ps]
    res = sample(p_logits.expand(n, V).clone(), rows, drafts=d.numpy(), draft_logits=Q)
    return res.tokens, res.accepted


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
                                    SamplingParams(temperature=1.0, top_k=5,
                                                   logit_bias=((0, -1.5), (3, 2.0)))])
def test_rejection_sampling_is_lossless(params, seeded):
    """The emitted token of a verify row is distributed as the target's P (after temperature
    and filters) whatever the proposal Q: a chi-square goodness-of-fit test of 60,000 rows
    against P over a 6-token vocabulary, alpha = 1e-3 (df = 5, critical value 20.5). With a
    logit bias, P and Q are the biased distributions (the bias in the target and the draft).

    Power (temperature 1): a sampler that accepted every draft (emitting Q) gives a
    statistic of about 60,000 * chi2-distance(Q, P) = 188,000, one that redrew rejected rows
    from P instead of the residual about 8,600: both fail with probability ~1. A deviation of
    chi2-distance 5.0e-4 (noncentral chi-square, df 5, lambda 30) is caught with power 0.91
    (simulated)."""
    torch.manual_seed(0)
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    q_logits = torch.tensor([-1.0, 0.5, 2.0, 1.0, 0.0, -0.5])
    n = 60_000
    tokens, accepted = _verify_once(p_logits, q_logits, params, n, seeded)
    P, Q = _filtered(p_logits, params), _filtered(q_logits, params)
    counts = torch.bincount(tokens, minlength=6).double()
    expected = n * P
    live = expected > 0
    assert counts[~live].sum() == 0, "a filtered-out token was emitted"
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    assert stat < _chi2_critical(df, 1e-3), (stat, counts.tolist(), expected.tolist())
    # the acceptance rate is sum(min(P, Q)) (within 6 standard errors)
    e = float(torch.minimum(P, Q).sum())
    rate = float(accepted.double().mean())
    assert abs(rate - e) < 6 * math.sqrt(e * (1 - e) / n), (rate, e)


def _filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution by hand: the logit bias, temperature, then top_k and top_p
    on the sorted probabilities (the token crossing top_p stays), renormalized (fp64)."""
    logits = logits.double().clone()
    for t, b in params.logit_bias:
        logits[t] += b
    p = torch.softmax(logits / params.temperature, -1)
    order = p.argsort(descending=True)
    cum = torch.cumsum(p[order], 0)
    keep = torch.zeros_like(p, dtype=torch.bool)
    for r, t in enumerate(order.tolist()):
        in_k = params.top_k <= 0 or r < params.top_k
        if in_k and (params.top_p >= 1 or cum[r] - p[t] < params.top_p):
            keep[t] = True
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def test_lossless_through_the_engine(tiny_ckpt):
    """Seeded random requests (temperature 1, top_k 3) verifying a draft of the greedy
    continuation (accepted with probability P(draft) / Q(draft), the residual drawn
    otherwise) vs no speculation: the joint law of the 2nd and 3rd tokens of 256
    requests per arm agrees by a two-sample chi-square test (cells with < 10 expected pooled,
    alpha 1e-3); the tokens themselves differ request by request."""
    path = tiny_ckpt("v41")
    prompt = tuple(prompts((4,), seed=2)[0])  # short: 256 prefills are the test's cost
    n = 256
    base = engine(path, overlap_schedule=False)
    greedy, _ = run_all(base, [EngineRequest("g", prompt, SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))])  # fmt: skip

    def draw(proposer):
        spec = DSPARK if proposer is not None else None
        eng = engine(path, max_num_seqs=n, kv_cache_bytes=1 << 24, speculative=spec,
                     proposer=proposer, overlap_schedule=False)  # fmt: skip
        reqs = [EngineRequest(f"s{i}", prompt, SamplingParams(temperature=1.0, top_k=3,
                max_tokens=3, ignore_eos=True, seed=i)) for i in range(n)]  # fmt: skip
        outs, _ = run_all(eng, reqs)
        return [tuple(outs[r.request_id][1:]) for r in reqs], eng

    truth = {f"s{i}": list(prompt) + greedy["g"] for i in range(n)}
    plain, _ = draw(None)
    spec, eng = draw(OracleProposer(truth, base.model.cfg.vocab_size, accept_rate=1.0))
    st = eng.stats
    assert st.spec_verifies == n and n // 10 < st.spec_accepted < n  # both paths run
    assert sum(x != y for x, y in zip(plain, spec, strict=True)) > n // 10
    cells = sorted(set(plain) | set(spec))
    a = np.array([plain.count(c) for c in cells], dtype=np.float64)
    b = np.array([spec.count(c) for c in cells], dtype=np.float64)
    small = (a + b) < 20  # expected < 10 per arm: pooled into one cell
    a = np.append(a[~small], a[small].sum())
    b = np.append(b[~small], b[small].sum())
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    half = (a + b) / 2
    stat = float((((a - half) ** 2 + (b - half) ** 2) / half).sum())
    assert a.size >= 4
    assert stat < _chi2_critical(a.size - 1, 1e-3), (stat, a.tolist(), b.tolist())
