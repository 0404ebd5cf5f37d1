"""``logit_bias`` in the sampler: added on the device to each row's logits (a torch reference),
before the grammar mask (a bias never lets a masked token through), in the draft proposal as
in the target (greedy speculation decodes the same tokens as plain decoding, with the
checkpoint's drafters and with random drafts; the lossless test of rejection sampling with a
bias is in ``test_speculative``)."""

from __future__ import annotations

import re

import pytest
import torch

from app.engine.llm import LLM
from app.engine.request import EngineRequest, OutputConstraint, SamplingParams
from app.engine.sampler import RowState, add_bias, draw_proposal, sample
from bench.proposers import RandomProposer
from tests.unit.test_engine import make_engine, run_all
from tests.unit.test_speculative import DSPARK
from tests.unit.test_speculative import engine as spec_engine
from tools.op_bisect import prompts


def test_add_bias_matches_a_dense_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    ps = [
        SamplingParams(logit_bias=((3, 5.0), (49, -100.0))),
        SamplingParams(),
        SamplingParams(logit_bias=((0, 0.25),)),
        SamplingParams(logit_bias=tuple((t, float(t) - 20) for t in range(0, 50, 7))),
    ]
    dense = torch.zeros_like(logits)
    for i, p in enumerate(ps):
        for t, b in p.logit_bias:
            dense[i, t] = b
    got = logits.clone()
    add_bias(got, ps)
    torch.testing.assert_close(got, logits + dense, rtol=0, atol=0)
    unbiased = logits.clone()
    add_bias(unbiased, [SamplingParams()] * 4)  # no bias: untouched
    assert torch.equal(unbiased, logits)


def test_bias_steers_greedy_and_never_unmasks():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    rows = [
        RowState(SamplingParams(temperature=0, logit_bias=((2, 100.0),)), (1,), ()),
        RowState(SamplingParams(temperature=0, logit_bias=((0, -100.0),)), (1,), ()),
        RowState(SamplingParams(temperature=0, logit_bias=((3, 100.0),)), (1,), ()),
    ]

    def mask_token_3_of_row_2(lg: torch.Tensor) -> None:  # a grammar that forbids token 3
        lg[2, 3] = float("-inf")

    out = sample(logits.clone(), rows, mask_token_3_of_row_2)
    assert out.tokens.tolist() == [2, 1, 0]


def test_draw_proposal_draws_from_the_biased_logits_and_keeps_them():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    ps = [
        SamplingParams(temperature=0, logit_bias=((2, 10.0),)),
        SamplingParams(temperature=1.0, seed=1, logit_bias=((0, -100.0), (1, -100.0))),
    ]
    kept = logits.clone()
    d = draw_proposal(kept, ps, torch.zeros(2, dtype=torch.int64))
    assert d.tolist() == [2, 2]
    assert kept[0].tolist() == [3.0, 2.0, 11.0] and kept[1].tolist() == [-97.0, -98.0, 1.0]


def _biased(plain_tokens: list[int]) -> SamplingParams:
    """Greedy, with the unbiased answer's first tokens banned and a few others favoured."""
    ban = tuple((t, -100.0) for t in sorted(set(plain_tokens[:3])))
    favour = tuple((t, 4.0) for t in (11, 29, 57) if t not in dict(ban))
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                          logit_bias=tuple(sorted(ban + favour)))  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "speculative"),
    [
        ("v41", {"method": "dspark", "num_draft_tokens": 3}),
        ("v4", {"method": "mtp", "num_draft_tokens": 1}),
        ("v41", "random"),
    ],  # fmt: skip
)
def test_greedy_speculation_with_bias_equals_plain(tiny_ckpt, arch, speculative):
    path = tiny_ckpt(arch)
    ps = prompts((13, 6, 21), seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = [EngineRequest(f"r{i}", tuple(p), greedy) for i, p in enumerate(ps)]
    unbiased, _ = run_all(make_engine(path), base)
    reqs = [EngineRequest(f"r{i}", tuple(p), _biased(unbiased[f"r{i}"]))
            for i, p in enumerate(ps)]  # fmt: skip
    plain, _ = run_all(make_engine(path, overlap_schedule=False), reqs)
    for r in reqs:  # the bias took effect: banned tokens never come, the answer changed
        banned = {t for t, b in r.params.logit_bias if b < 0}
        assert not banned & set(plain[r.request_id])
        assert plain[r.request_id] != unbiased[r.request_id]
    if speculative == "random":
        vocab = make_engine(path).model.cfg.vocab_size
        eng = spec_engine(path, RandomProposer(vocab), speculative=DSPARK)
    else:
        eng = make_engine(path, speculative=speculative)
    got, _ = run_all(eng, reqs)
    assert got == plain
    assert eng.stats.spec_verifies > 0


def test_bias_within_a_grammar(tiny_ckpt):
    """A +100 bias on a token the regex allows makes it the answer; on a token the regex
    forbids it changes nothing: the output still matches."""
    llm = LLM(model=tiny_ckpt("v41"), kv_cache_bytes=1 << 23)
    (seven,), (x,) = (llm.tokenizer.encode(c).ids for c in "7x")

    def run(bias: dict[int, float]) -> str:
        p = SamplingParams(temperature=0, max_tokens=8, logit_bias=tuple(sorted(bias.items())),
                           constraint=OutputConstraint("regex", "[0-9]{4}"))  # fmt: skip
        return llm.generate(["Digits: "], p)[0].text

    plain = run({})
    assert re.fullmatch("[0-9]{4}", plain)
    assert run({x: 100.0}) == plain
    assert run({seven: 100.0}) == "7777"
