"""The static-shape draft step (app/engine/spec/step.py, run by app/engine/spec/graphs.py
eagerly on the CPU) against the eager protocol path it replaces (``observe`` + ``propose``
after ``accepted_lengths``): bit for bit the same drafts, proposal logits, confidences,
anchors, tokens and logprobs, for DSpark and MTP, greedy and seeded sampling, over batch
sizes that change as requests arrive and finish, chunked prefill beside verify chunks,
constrained rows, and every acceptance length; padding a step to a larger bucket leaves its
requests' results unchanged; the deterministic mode stays batch-invariant."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from app.config import EngineConfig
from app.engine.core import EngineCore
from app.engine.request import EngineRequest, OutputConstraint, SamplingParams
from app.engine.sampler import PickKind, ProposalRows, draw_proposal, proposal_arrays
from app.engine.spec.graphs import DraftGraphs
from app.engine.spec.step import DraftInputs
from kernels.dispatch import batch_invariant
from tests.unit.test_engine import prompts

CHAT = str(Path(__file__).resolve().parents[2] / "models" / "tiny-v41-chat")  # trained DSpark
DSPARK = {"method": "dspark", "num_draft_tokens": 3}
MTP = {"method": "mtp", "num_draft_tokens": 1}
SEEDED = SamplingParams(temperature=1.5, top_p=0.9, seed=5, max_tokens=14, ignore_eos=True,
                        logprobs=2)  # fmt: skip


def engine(path: str, spec: dict, static: bool, pad: bool = False, **opts) -> EngineCore:
    """A speculating engine whose draft step is the static function (padded to the buckets
    with ``pad``, as under CUDA graphs) or the protocol path (observe, then propose)."""
    opts = {"kv_cache_bytes": 1 << 26, "bounded_replay": "off", "max_num_batched_tokens": 24,
            "max_num_seqs": 16, **opts}  # fmt: skip
    eng = EngineCore(EngineConfig.from_options(path, speculative=spec, **opts))
    assert eng.spec.steps is not None
    eng.spec.steps.pad = pad
    if not static:
        eng.spec.steps = None
    return eng


def requests(n: int, seed: int) -> list[EngineRequest]:
    """``n`` requests of mixed lengths and settings: greedy, seeded (top-p, logprobs), a
    longer greedy one with logprobs, a constrained one (no drafts)."""
    rng = random.Random(seed)
    ps = prompts(tuple(rng.randint(1, 40) for _ in range(n)), seed=seed)
    out = []
    for i, p in enumerate(ps):
        if i % 4 == 0:
            params = SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True)
        elif i % 4 == 1:
            params = SamplingParams(**{**SEEDED.__dict__, "seed": 100 + i})
        elif i % 4 == 2:
            params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
        else:
            regex = OutputConstraint("regex", "[a-c ]{3,12}")
            params = SamplingParams(temperature=0.7, seed=i, max_tokens=10, ignore_eos=True,
                                    constraint=regex)
        out.append(EngineRequest(f"r{i}", tuple(p), params))
    return out


def run(eng: EngineCore, reqs: list[EngineRequest], seed: int):
    """Requests arriving at random steps -> (per request: tokens and logprobs; every block
    proposed, in order: request ids, anchors, ids, logits, confidence)."""
    blocks = []

    def record(rids, anchors, block):
        conf = block.confidence.clone() if block.confidence is not None else None
        blocks.append((list(rids), anchors.clone(), block.ids.clone(), block.logits.clone(),
                       conf))  # fmt: skip

    eng.on_draft = record
    rng = random.Random(seed)
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    queue = list(reqs)
    while queue or eng.has_unfinished:
        if queue and (rng.random() < 0.4 or not eng.has_unfinished):
            eng.add_request(queue.pop(0))
        for o in eng.step():
            lp = [(x.token_id, x.logprob) for x in o.logprobs] if o.logprobs else None
            got[o.request_id].append((o.token_ids, lp))
    return got, blocks


def same_blocks(a, b) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b, strict=True):
        assert x[0] == y[0]
        for s, t in zip(x[1:], y[1:], strict=True):
            assert (s is None) == (t is None)
            if s is not None:
                assert s.dtype == t.dtype and torch.equal(s, t)


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("arch,spec", [("chat", DSPARK), ("v4", MTP)])
def test_static_step_equals_the_protocol_path(tiny_ckpt, arch, spec, pad):
    """At the step's own sizes (the CPU's default), and padded to the buckets as under CUDA
    graphs in the deterministic mode, whose kernels make padding rows change no other row's
    bits. DSpark on the trained demo model (its drafts are accepted up to k), MTP on the
    random V4 model."""
    path = CHAT if arch == "chat" else tiny_ckpt(arch)
    reqs = requests(9, seed=3)
    static = engine(path, spec, static=True, pad=pad, deterministic=pad)
    eager = engine(path, spec, static=False, deterministic=pad)
    got, blocks = run(static, reqs, seed=1)
    want, want_blocks = run(eager, reqs, seed=1)
    assert got == want
    same_blocks(blocks, want_blocks)
    st = static.stats
    spec_stats = [f for f in st.report() if f.startswith("spec_")]
    assert {f: st.report()[f] for f in spec_stats} == {
        f: eager.stats.report()[f] for f in spec_stats}
    # every acceptance length (0 .. k accepted drafts), at several batch sizes
    assert st.spec_verifies > st.spec_accepted_at[0] and st.spec_accepted_at[-1] > 0
    assert len({len(b[0]) for b in blocks}) >= 3
    assert static.spec.steps.captures == 0  # no graphs on the CPU: the function ran eagerly


def draft_inputs(R: int, k: int, rng: np.random.Generator, ps=None) -> DraftInputs:
    """Host inputs of R requests in slots 0 .. R-1 verifying up to k drafts at random
    positions (draws of ``ps``, default: greedy and seeded top-k ones), with context rows:
    the step's rows of each request, then 3 rows of no request in slots R .. R + 2 (no two
    rows write one ring row, as in a step)."""
    counts = rng.integers(1, k + 2, R)
    N = int(counts.sum()) + 3
    bases = np.concatenate(([0], np.cumsum(counts)[:-1]))
    starts = rng.integers(k + 2, 60, R)
    if ps is None:
        ps = [SamplingParams(temperature=0) if i % 2 else
              SamplingParams(temperature=1.2, top_k=9, seed=i) for i in range(R)]  # fmt: skip
    ints, floats = proposal_arrays(ps, 512)
    req = np.stack([np.arange(R), starts, bases, counts, starts + 2 - 5,
                    np.zeros(R, np.int64), *ints])  # fmt: skip
    pos = np.concatenate([starts[i] + np.arange(counts[i]) for i in range(R)])
    pos = np.concatenate((pos, rng.integers(0, 60, N - pos.size)))
    reqs = np.concatenate([np.full(counts[i], i) for i in range(R)] + [-np.ones(N - counts.sum(),
                          np.int64)])  # fmt: skip
    slots = np.where(reqs >= 0, reqs, R + np.arange(N) - counts.sum())
    ctx = np.stack((pos, slots, reqs, np.zeros(N, np.int64), np.full(N, -1)))
    return DraftInputs(req.astype(np.int64), floats, ctx.astype(np.int64), int(counts.sum()),
                       PickKind.of(ps))  # fmt: skip


@pytest.mark.parametrize("deterministic", [True, False])
def test_padding_to_a_larger_bucket_changes_no_request(tiny_ckpt, deterministic):
    """The same draft step at its own sizes, at its bucket and padded to larger ones
    (padding requests and context rows in the trash slot): the same m, anchors, drafts of
    its requests, and in the deterministic mode the same logits, confidences and ring bytes
    bit for bit (otherwise logits within float rounding: the CPU's GEMMs round by the row
    count)."""
    eng = engine(tiny_ckpt("v41"), DSPARK, static=True, pad=True, deterministic=deterministic)
    steps: DraftGraphs = eng.spec.steps
    k, rng = steps.k, np.random.default_rng(0)
    feats_w, dt = steps.proposer.feature_width, steps.dtype
    trash = steps.trash_slot
    rings = eng.cache.pools.draft
    base = [r.data.clone() for r in rings]
    for R in (1, 3, 5):
        inp = draft_inputs(R, k, rng)
        N, S = inp.num_context, inp.num_sampled
        g = torch.Generator().manual_seed(R)
        tokens = torch.randint(0, 500, (S,), generator=g)
        accepted = torch.rand(S, generator=g) < 0.6
        feats = torch.randn(N, feats_w, generator=g).to(dt)
        outs = []
        for b in (None, steps.bucket(inp), 8, 16):  # None: its own sizes
            for r, d in zip(rings, base, strict=True):
                r.data.copy_(d)
            steps.pad = b is not None
            padded = inp.padded(b, b * (k + 1), b * (k + 1), trash) if b else inp
            with batch_invariant(deterministic):
                out = steps.run(padded, tokens, accepted, feats).head(R)
            W = eng.model.cfg.sliding_window
            outs.append((out, [r.data[: (R + 3) * W].view(torch.uint8).clone()
                               for r in rings]))  # fmt: skip
        (first, first_rings), rest = outs[0], outs[1:]
        for out, rs in rest:
            assert torch.equal(first.m, out.m) and torch.equal(first.anchors, out.anchors)
            assert torch.equal(first.ids, out.ids)
            for a, b_ in zip(first.tensors()[3:], out.tensors()[3:], strict=True):
                if deterministic:
                    assert torch.equal(a, b_)
                else:
                    torch.testing.assert_close(a, b_, rtol=0, atol=1e-5 * a.abs().max().item())
            if deterministic:  # the context rows' bytes in the rings
                assert all(torch.equal(a, b_) for a, b_ in zip(first_rings, rs, strict=True))


def test_static_draws_equal_draw_proposal():
    """ProposalRows.draw from static settings equals draw_proposal of the rows' params for
    every kind: greedy, temperature, top-k / top-p, min-p, seeded (bit for bit where the
    draw is seeded or greedy)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    kinds = [
        [SamplingParams(temperature=0)] * 6,
        [SamplingParams(temperature=0.8, seed=i) for i in range(6)],
        [SamplingParams(temperature=0.8, top_k=7, seed=i) if i % 2 else
         SamplingParams(temperature=0) for i in range(6)],
        [SamplingParams(temperature=1.3, top_p=0.6, min_p=0.05, seed=i) for i in range(6)],
    ]  # fmt: skip
    for ps in kinds:
        counters = torch.arange(6) * 3
        rows = ProposalRows.of(ps, 300, torch.device("cpu"))
        assert rows.kind == PickKind.of(ps)
        want = draw_proposal(logits.clone(), ps, counters)
        assert torch.equal(rows.draw(logits.clone(), counters), want)
