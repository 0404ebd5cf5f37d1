"""The deterministic mode (``EngineConfig.deterministic``): its option and refusals, the
batch-invariant ops of the CPU step (``kernels.invariant``), and the engine giving one
request the same tokens and logprobs bitwise in any company: SGLang's test (one prompt run
50 times among varying companions, one unique output) and vLLM's (logprobs at batch 1 ==
batch N), with chunked prefill, overlap, prefix hits, preemption, speculation and a PD
handoff in the matrix. ``FATHOM_DETERMINISTIC=0`` runs them with the mode off (the control:
the engine tests then fail)."""

from __future__ import annotations

import json
import os
import pickle
import random
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import httpx
import pytest
import torch
from pydantic import ValidationError

from app.api import FrontDoor, build_api
from app.config import EngineConfig, EngineConfigError
from app.deployments.engine_host import LocalEngineClient
from app.deployments.pd import _HostTensor
from app.engine.core import EngineCore
from app.engine.engine import AsyncEngine
from app.engine.handoff import DecodeState, Handoff
from app.engine.llm import LLM
from app.engine.request import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from app.serve_args import ServeArgs
from kernels.attention import sparse_attention, sparse_attention_ref
from kernels.compressor import compress_pool, compress_pool_ref
from kernels.dispatch import batch_invariant
from kernels.gate import moe_gate_fused, moe_gate_fused_ref, moe_gate_ref
from kernels.indexer import indexer_scores_paged, indexer_scores_paged_ref
from kernels.invariant import grouped_linear, linear, pointwise, rows_gemm
from kernels.linear import dense_linear, linear_f32
from kernels.mhc import hc_post_pre, hc_pre
from kernels.mhc_ref import hc_expand_ref, hc_post_pre_ref, hc_pre_ref
from kernels.moe import moe_fp8
from kernels.moe_ref import moe_fp8_ref
from kernels.norm import norm_rope_ref, rms_norm_ref
from kernels.quant import quantize_fp8_block
from kernels.topk import topk_ref
from tests.unit.test_api import Server
from tools.op_bisect import prompts

DET = {"deterministic": True, "bounded_replay": "off"}
DSPARK = {"method": "dspark", "num_draft_tokens": 3}


# ---- the option ------------------------------------------------------------------------
def test_the_option_and_its_refusals(tiny_ckpt):
    assert LLM(tiny_ckpt("v41"), **DET).engine.cfg.deterministic
    cfg = EngineConfig.from_options("/m", **DET)
    assert cfg.deterministic and cfg.deterministic_problem() is None
    assert not EngineConfig.from_options("/m").deterministic  # off by default
    with pytest.raises(EngineConfigError, match="deterministic: true needs bounded_replay 'off'"):
        EngineConfig.from_options("/m", deterministic=True)  # replay is on by default
    with pytest.raises(EngineConfigError, match="bounded_replay 'off', got 'encoder'"):
        EngineConfig.from_options("/m", deterministic=True, bounded_replay="encoder")
    with pytest.raises(EngineConfigError, match="moe_prefill_act 'bf16'"):
        EngineConfig.from_options("/m", **DET, expert_layout="fp8_rows", moe_prefill_act="fp8")
    with pytest.raises(EngineConfigError, match="experimental.packed_dense"):
        EngineConfig.from_options("/m", **DET, experimental={"packed_dense": "on"})
    with pytest.raises(EngineConfigError, match="engine option 'deterministic' must be bool"):
        EngineConfig.from_options("/m", deterministic="yes", bounded_replay="off")


def test_serve_args_take_it_and_refuse_what_cannot_be_invariant():
    sa = ServeArgs.model_validate({"engine": DET})
    assert sa.engine_config(sa.model_path()).deterministic
    with pytest.raises(ValidationError, match="bounded_replay 'off'"):
        ServeArgs.model_validate({"engine": {"deterministic": True}})
    with pytest.raises(ValidationError, match="deterministic: true needs ep_size 1"):
        ServeArgs.model_validate({"engine": DET, "ep_size": 2, "dp_size": 2})
    pd = {"prefill": {"ranks": 1}, "decode": {"ranks": 1, "engine": {"deterministic": False}}}
    with pytest.raises(ValidationError, match="'deterministic' differs between prefill"):
        ServeArgs.model_validate({"engine": DET, "pd": pd})


# ---- the ops: each row's bits depend on that row only ----------------------------------
ROWS = (1, 2, 3, 16, 17, 40)  # row counts of a call; row 0 is the same input in each


def same_rows(fn, *full: torch.Tensor, mode: bool = True) -> None:
    """``fn`` of the first M rows (of every tensor argument) for each M in ROWS, in the mode
    (or, ``mode`` False, outside it): row 0 of the result has the same bits every time."""
    with batch_invariant(mode):
        outs = [fn(*(a[:m] for a in full)) for m in ROWS]
    for m, o in zip(ROWS, outs, strict=True):
        o = o[0] if isinstance(o, tuple) else o
        first = outs[0][0] if isinstance(outs[0], tuple) else outs[0]
        assert torch.equal(o[:1], first[:1]), f"row 0 differs at {m} rows"


@pytest.mark.parametrize("k,n", [(256, 8), (64, 2048), (96, 40), (512, 256)])
def test_linear_rows_are_batch_invariant_on_cpu(k, n):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g)
    same_rows(lambda x: linear(x, w), torch.randn(40, k, generator=g))
    x = torch.randn(40, k, generator=g)
    with batch_invariant():  # a row's place in its tile does not matter either
        for j in (1, 7, 15, 16, 33):
            assert torch.equal(linear(x.roll(j, 0), w).roll(-j, 0), linear(x, w))
        wg = torch.randn(3, n // 2, k, generator=g)
        xg = torch.randn(40, 3, k, generator=g)
        y = grouped_linear(xg, wg)
    torch.testing.assert_close(y, torch.einsum("tgi,goi->tgo", xg, wg))
    torch.testing.assert_close(linear(x, w), x @ w.t())


@pytest.mark.parametrize("dtype,out,split", [(torch.float32, torch.float32, 1),
                                             (torch.float32, torch.float32, 3),
                                             (torch.bfloat16, torch.bfloat16, 2),
                                             (torch.bfloat16, torch.float32, 1)])  # fmt: skip
def test_the_cuda_gemm_of_the_mode_matches_torch(dtype, out, split):
    """``kernels.invariant.rows_gemm`` (the mode's GEMM on CUDA) under the interpreter:
    rows past a tile, N and K past a block, K splits summed in order."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 40, generator=g).to(dtype), torch.randn(24, 40, generator=g).to(dtype)
    y = rows_gemm(x, w, out, split=split)
    assert y.dtype == out and y.shape == (20, 24)
    tol = {"atol": 2e-2, "rtol": 2e-2} if torch.bfloat16 in (dtype, out) else {}
    torch.testing.assert_close(y.float(), x.float() @ w.float().t(), **tol)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.nn.functional.silu,
                                torch.nn.functional.softplus, torch.exp2])  # fmt: skip
def test_pointwise_ops_have_no_size_dependent_tail(fn):
    """torch's vector and scalar CPU code differ for these; in the mode no value falls in a
    tail, whatever the size (:func:`kernels.invariant.pointwise`)."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 4
    with batch_invariant():
        full = pointwise(fn, x)
        for n in (1, 17, 31, 33, 60, 100, 4097):
            assert torch.equal(pointwise(fn, x[:n]), full[:n]), n
    torch.testing.assert_close(full, fn(x))


def test_the_ops_already_invariant_stay_so():
    """The ops the table of ``kernels.invariant`` calls invariant on the CPU without the
    mode: attention and the paged indexer (each token's products alone), the norms, RoPE,
    mHC's expand, the compressor's pooling, softmax / log-softmax and top-k: row 0 of 1 ..
    40 rows has the same bits. (The gate needs the mode for its softplus.)"""
    g = torch.Generator().manual_seed(1)
    T, H, D, N = 40, 4, 64, 300
    kv = torch.randn(N, D, generator=g)
    sink = torch.randn(H, generator=g)
    ang = torch.rand(T, 8, generator=g)
    plain = {"mode": False}
    same_rows(lambda q, i, a: sparse_attention_ref(q, kv, i, sink, 0.125, inv_rope_angles=a,
                                                   kv2=kv, idx2=i.flip(1)),
              torch.randn(T, H, D, generator=g), torch.randint(-1, N, (T, 24), generator=g),
              ang, **plain)  # fmt: skip
    keys, table = torch.randn(64 * 4, 32, generator=g), torch.arange(4).view(1, 4)
    same_rows(lambda q, w, vis, seq: indexer_scores_paged_ref(q, keys, None, w, vis, seq, table,
                                                              2, 64, 128),
              torch.randn(T, 4, 32, generator=g), torch.randn(T, 4, generator=g),
              torch.randint(1, 128, (T,), generator=g), torch.zeros(T, dtype=torch.int64),
              **plain)  # fmt: skip
    x, w = torch.randn(T, 256, generator=g), torch.rand(256, generator=g)
    same_rows(lambda x: rms_norm_ref(x, w, 1e-6), x, **plain)
    same_rows(lambda x, c: norm_rope_ref(x, w[:64], 1e-6, c.cos(), c.sin()), x[:, :64], ang,
              **plain)  # fmt: skip
    same_rows(hc_expand_ref, x, torch.randn(T, 4, 256, generator=g),
              torch.rand(T, 4, generator=g), torch.rand(T, 4, 4, generator=g), **plain)  # fmt: skip
    v, gt = torch.randn(T, 2, 32, generator=g), torch.randn(T, 2, 32, generator=g)
    same_rows(lambda v, gt: compress_pool_ref(v, gt, None, w[:32], 1e-6, overlap=False, ratio=2,
                                              dim=32), v, gt, **plain)  # fmt: skip
    same_rows(lambda lg: torch.log_softmax(lg, -1), torch.randn(T, 2048, generator=g), **plain)
    same_rows(lambda lg: torch.softmax(lg, -1), torch.randn(T, 97, generator=g), **plain)
    same_rows(lambda s: topk_ref(s, 16), torch.randn(T, 128, generator=g), **plain)
    same_rows(lambda lg: moe_gate_ref(lg, w[:8], 2, 1.5), torch.randn(T, 8, generator=g))


# ---- the mode's CUDA entries, under the interpreter: still the references' function ----------
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton interpreter runs these on the CPU")  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@interpreted
def test_the_cuda_entries_of_the_mode_match_their_references():
    """Each op's ``invariant`` entry (what the mode runs on CUDA) computes its reference's
    function: dense and head GEMMs, both mHC ops, attention, the paged indexer, the
    compressor's pooling, the gate and the fp8 experts."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 32, generator=g), torch.randn(24, 32, generator=g)
    assert rel(dense_linear.invariant(x, w), x @ w.t()) < 1e-6
    xb, wb = x.bfloat16(), w.bfloat16()
    assert rel(linear_f32.invariant(xb, wb), xb.float() @ wb.float().t()) < 1e-6
    n, d = 4, 64
    X = torch.randn(3, n, d, generator=g)
    mix = (torch.randn(n * (n + 2), n * d, generator=g) / (n * d) ** 0.5,
           0.5 * torch.randn(n * (n + 2), generator=g), 1 + 0.2 * torch.randn(3, generator=g),
           1 + 0.1 * torch.randn(d, generator=g), 20, 1e-6, 1e-6, 1e-6)  # fmt: skip
    for got, ref in zip(hc_pre.invariant(X, *mix), hc_pre_ref(X, *mix), strict=True):
        assert rel(got, ref) < 1e-5
    post = (torch.randn(3, d, generator=g), X, torch.rand(3, n, generator=g),
            torch.rand(3, n, n, generator=g))  # fmt: skip
    for got, ref in zip(hc_post_pre.invariant(*post, *mix), hc_post_pre_ref(*post, *mix),
                        strict=True):  # fmt: skip
        assert rel(got, ref) < 1e-5
    q, kv = torch.randn(3, 4, 32, generator=g), torch.randn(40, 32, generator=g)
    idx, sink = torch.randint(-1, 40, (3, 20), generator=g), torch.randn(4, generator=g)
    args = (q, kv, idx, sink, 0.2)
    kw = {"kv2": kv, "idx2": idx.flip(1), "inv_rope_angles": torch.rand(3, 4, generator=g)}
    assert rel(sparse_attention.invariant(*args, **kw), sparse_attention_ref(*args, **kw)) < 1e-5
    keys, table = torch.randn(64 * 2, 32, generator=g), torch.tensor([[1, 0]])
    zero = torch.zeros(3, dtype=torch.int64)
    sargs = (torch.randn(3, 4, 32, generator=g), keys, None, torch.randn(3, 4, generator=g),
             torch.tensor([5, 17, 60]), zero, table, 1, 64, 64)  # fmt: skip
    got = indexer_scores_paged.invariant(*sargs, seq_start=zero[:1])
    ref = indexer_scores_paged_ref(*sargs)
    seen = ~ref.isinf()
    assert torch.equal(~got.isinf(), seen) and rel(got[seen], ref[seen]) < 1e-5
    v, gt, nw = (torch.randn(6, 2, 32, generator=g), torch.randn(6, 2, 32, generator=g),
                 torch.rand(32, generator=g))  # fmt: skip
    pool = {"overlap": False, "ratio": 2, "dim": 32}
    assert rel(compress_pool.invariant(v, gt, None, nw, 1e-6, **pool),
               compress_pool_ref(v, gt, None, nw, 1e-6, **pool)) < 1e-5  # fmt: skip
    xg, wg, bias = (torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g),
                    torch.randn(8, generator=g))  # fmt: skip
    ids, wts = moe_gate_fused.invariant(xg, wg, bias, 2, 1.5)
    rids, rwts = moe_gate_fused_ref(xg, wg, bias, 2, 1.5)
    assert torch.equal(ids, rids) and rel(wts, rwts) < 1e-5
    d, inter = 64, 32
    w13 = [quantize_fp8_block(torch.randn(2 * inter, d, generator=g) / 8, (32, 32))
           for _ in range(4)]  # fmt: skip
    w2 = [quantize_fp8_block(torch.randn(d, inter, generator=g) / 6, (32, 32)) for _ in range(4)]
    experts = (torch.stack([a for a, _ in w13]), torch.stack([b for _, b in w13]),
               torch.stack([a for a, _ in w2]), torch.stack([b for _, b in w2]))  # fmt: skip
    xm = torch.randn(5, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    wts = torch.rand(5, 2, generator=g)
    got = moe_fp8.invariant(xm, ids, wts, *experts, (32, 32), 0.7)
    ref = moe_fp8_ref(xm.double(), ids, wts.double(), *experts, (32, 32), 0.7)
    assert rel(got, ref) < 1e-2


# ---- the engine: one request, one result, whatever else runs ------------------------------
# The control run: ``FATHOM_DETERMINISTIC=0`` builds every engine of these tests (and of
# tests/gpu/test_deterministic_cuda.py) with the mode off, which the engine tests must then fail.
MODE = os.environ.get("FATHOM_DETERMINISTIC", "1") != "0"


def engine(path: str, deterministic: bool = MODE, **opts: object) -> EngineCore:
    opts.setdefault("kv_cache_bytes", 1 << 22)
    return EngineCore(EngineConfig.from_options(path, deterministic=deterministic,
                                                bounded_replay="off", **opts))  # fmt: skip


def _lp(t: TokenLogprob | None) -> tuple | None:
    """A logprob entry with its floats as their exact bits."""
    if t is None:
        return None
    return (t.token_id, t.logprob.hex(), tuple((i, v.hex()) for i, v in t.top))


class Result(NamedTuple):
    """One request's tokens, logprobs and prompt logprobs, the floats as their exact bits
    (``bits``), and how many of its prompt tokens were a prefix-cache hit."""

    bits: tuple
    cached: int


class Collected:
    """Each request's outputs as steps give them: tokens, logprobs and prompt logprobs (the
    floats as their exact bits) and its prefix-cache hit."""

    def __init__(self) -> None:
        self.acc: dict[str, tuple[list, list, list]] = {}
        self.cached: dict[str, int] = {}

    def take(self, o: RequestOutput) -> None:
        toks, lps, plps = self.acc.setdefault(o.request_id, ([], [], []))
        toks += o.token_ids
        lps += map(_lp, o.logprobs or ())
        plps += map(_lp, o.prompt_logprobs or ())
        self.cached[o.request_id] = max(self.cached.get(o.request_id, 0), o.num_cached_tokens)

    def result(self, rid: str) -> Result:
        return Result(tuple(map(tuple, self.acc[rid])), self.cached[rid])


def run(eng: EngineCore, reqs: list[EngineRequest], stagger: int = 0, wave: int = 1
        ) -> dict[str, Result]:  # fmt: skip
    """Every request's :class:`Result`; ``stagger``: steps between arrivals of ``wave``
    requests each (0 = all at once), so requests join others mid-prefill or mid-decode."""
    got = Collected()
    queue = list(reqs)
    while queue or eng.has_unfinished:
        for _ in range(min(wave, len(queue)) if stagger else len(queue)):
            eng.add_request(queue.pop(0))
        for _ in range(max(stagger, 1)):
            for o in eng.step():
                got.take(o)
    eng.cache.check_integrity()
    return {r.request_id: got.result(r.request_id) for r in reqs}


def greedy(n: int, **kw: object) -> SamplingParams:
    """Greedy, ``n`` tokens, the chosen token's logprob and the top 2."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2, **kw)


# companions of the target in SGLang's test: batches of 1 .. 256 on CUDA; on the CPU batches of
# 1 .. 64 (steps of 256 rows take ~60 ms there: 50 runs up to 256 take ~4 min on 2 cores)
SWEEP = (0, 255, 1, 63, 2, 127, 3, 16, 200, 7, 31, 100, 17)
SWEEP_CPU = (0, 1, 3, 17, 63, 2, 7, 31)
SWEEP_ENGINES = (  # chunked prefill with overlap; overlap off; speculation
    {"max_num_batched_tokens": 32},
    {"max_num_batched_tokens": 256, "overlap_schedule": False},
    {"max_num_batched_tokens": 64, "speculative": DSPARK},
)


def companions(n: int, head: list[int], rng: random.Random, seed: int) -> list[EngineRequest]:
    """``n`` other requests of 1-16 prompt tokens (every fourth after ``head``, the target's
    first block), greedy or seeded, of 2-8 output tokens."""
    out = []
    for j, q in enumerate(prompts([rng.randint(1, 16) for _ in range(n)], seed=seed)):
        q = head + q if j % 4 == 1 else q
        n_out = rng.randint(2, 8)
        p = greedy(n_out) if j % 3 else SamplingParams(temperature=0.8, seed=j, max_tokens=n_out,
                                                       ignore_eos=True)  # fmt: skip
        out.append(EngineRequest(f"o{j}", tuple(q), p))
    return out


def sweep_engines(path: str, **opts: object) -> list[EngineCore]:
    """An engine of each of ``SWEEP_ENGINES``, room for 256 requests."""
    return [engine(path, **{**opts, "max_num_seqs": 256, **e}) for e in SWEEP_ENGINES]


def sweep(engs: list[EngineCore], batches: tuple[int, ...], runs: int = 50
          ) -> tuple[dict[str, set], set[bool]]:  # fmt: skip
    """SGLang's test: ``runs`` runs of one greedy and one seeded prompt among ``batches``
    companions in turn (some sharing the greedy target's first block), on ``engs`` in turn,
    the requests arriving at once or in waves while others run. -> each target's outputs
    (the seeded one's with and without speculation apart: its rejection sampling draws
    other numbers) and whether the greedy one's prompt was a prefix hit."""
    target = prompts((70,), seed=3)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    rng = random.Random(0)
    seen: dict[str, set] = {"greedy": set(), "seeded": set(), "seeded, speculating": set()}
    hits = set()
    for i in range(runs):
        n, eng = batches[i % len(batches)], engs[i % len(engs)]
        reqs = companions(n, target[:64], rng, seed=100 + i)
        reqs.insert(rng.randint(0, n), EngineRequest("t", tuple(target), greedy(10)))
        reqs.insert(rng.randint(0, n + 1), EngineRequest("s", tuple(target[::-1]), seeded))
        got = run(eng, reqs, stagger=i % 3, wave=1 + n // 8)
        seen["greedy"].add(got["t"].bits)
        seen["seeded, speculating" if eng.cfg.speculative else "seeded"].add(got["s"].bits)
        hits.add(got["t"].cached > 0)
    return seen, hits


def test_fifty_runs_among_varying_companions_give_one_output(tiny_ckpt):
    """SGLang's test on the CPU: the same prompts run 50 times, alone or among up to 63
    companions (``SWEEP_CPU``; the GPU test runs batches up to 256) of other lengths and
    settings, some sharing the target's first block (so its prefix is sometimes a cold
    prefill and sometimes a hit), arriving together or while others run, on an engine with
    chunked prefill and overlap, one with overlap off and one speculating: one unique
    output (tokens and logprobs) per target."""
    seen, hits = sweep(sweep_engines(tiny_ckpt("v41"), kv_cache_bytes=1 << 24), SWEEP_CPU)
    assert hits == {False, True}  # cold prefills and prefix hits both
    assert {k: len(v) for k, v in seen.items()} == dict.fromkeys(seen, 1)


@pytest.mark.parametrize("arch", ["v41", "v4"])
def test_logprobs_at_batch_one_equal_batch_n(tiny_ckpt, arch):
    """vLLM's test: each prompt alone (overlap scheduling off), then all of them at once
    through a 16-token budget (chunked prefill, decodes beside prefills, overlap on):
    bitwise the same tokens, logprobs, top-2 and prompt logprobs."""
    path = tiny_ckpt(arch)
    one = engine(path, max_num_batched_tokens=16, overlap_schedule=False)
    reqs = [EngineRequest(f"r{i}", tuple(p), greedy(6, prompt_logprobs=1))
            for i, p in enumerate(prompts((23, 5, 37, 11, 1, 30), seed=4))]  # fmt: skip
    alone = {r.request_id: run(one, [r])[r.request_id] for r in reqs}
    together = run(engine(path, max_num_batched_tokens=16), reqs)
    assert together == alone


def test_prefix_hit_equals_cold_prefill(tiny_ckpt):
    """A hit reads the KV another request stored, here partly computed by its decode steps
    (one row each): the same bits as the target's own cold prefill."""
    path = tiny_ckpt("v41")
    eng = engine(path)
    head = prompts((60,), seed=5)[0]
    gen = run(eng, [EngineRequest("o", tuple(head), greedy(10))])["o"].bits[0]
    t = EngineRequest("t", (*head, *gen), greedy(8))  # (prompt logprobs skip the cache)
    hit = run(eng, [t])["t"]
    cold = run(engine(path), [t])["t"]
    assert cold.cached == 0 and hit.cached == 64 and hit.bits == cold.bits


# ---- prefill/decode disaggregation: a handed-off request vs the same request colocated -----
def wire(state: DecodeState, device: torch.device) -> DecodeState:
    """``state`` as the object-store transport carries it (``app.deployments.pd``: uint8
    numpy buffers, pickled) and a decode rank on ``device`` receives it."""
    state.wait_ready()
    host = pickle.loads(pickle.dumps(state.map_tensors(_HostTensor.of)))
    return host.map_tensors(lambda h: h.tensor(device))


def pd_run(pre: EngineCore, dec: EngineCore, reqs: list[EngineRequest],
           lost: frozenset[str] = frozenset()) -> dict[str, Result]:  # fmt: skip
    """The PD path on two engines: every request prefilled on ``pre`` in export mode (as on
    a prefill rank; all arriving at once), its decode state carried by :func:`wire` to
    ``dec``, where the handoffs arrive one per step in the order they came, beside the
    decodes of those before (the states of ``lost`` are dropped: those resume as local
    prefills there). -> each request's :class:`Result` over both engines."""
    got, handoffs = Collected(), []
    for r in reqs:
        pre.add_request(r, export=True)
    while pre.has_unfinished:
        for o in pre.step():
            got.take(o)
            if o.finish_reason is FinishReason.HANDOFF:
                state = None if o.request_id in lost else wire(o.handoff, dec.device)
                handoffs.append((o.request_id, Handoff(tuple(o.token_ids), state)))
    assert len(handoffs) == len(reqs) and pre.stats.kv_exports == len(reqs)
    by_id = {r.request_id: r for r in reqs}
    while handoffs or dec.has_unfinished:
        if handoffs:
            rid, h = handoffs.pop(0)
            assert dec.add_handoff(by_id[rid], h) == (None if h.state else "no_state")
        for o in dec.step():
            got.take(o)
    dec.cache.check_integrity()
    assert dec.stats.kv_imports == len(reqs) - len(lost)
    return {r.request_id: got.result(r.request_id) for r in reqs}


def pd_vs_colocated(path: str, spec: dict | None, lost: frozenset[str] = frozenset({"o1", "o6"}),
                    **opts: object) -> tuple[Result, Result]:  # fmt: skip
    """One request ``t`` served alone on one engine (overlap off, no speculation) and through
    :func:`pd_run` among 9 others ``o0`` .. ``o8`` (chunked prefill on both sides, ``spec``
    on both, the states of ``lost`` lost): (colocated, PD)."""
    t = EngineRequest("t", tuple(prompts((90,), seed=7)[0]), greedy(10, prompt_logprobs=1))
    alone = run(engine(path, overlap_schedule=False, **opts), [t])["t"]
    others = companions(9, list(t.prompt_token_ids[:64]), random.Random(1), seed=8)
    reqs = [*others[:4], t, *others[4:]]
    both = {"max_num_batched_tokens": 24, "speculative": spec, **opts}
    got = pd_run(engine(path, **both), engine(path, **both), reqs, lost)
    return alone, got["t"]


PD_CASES = {
    "plain": (None, frozenset({"o1", "o6"})),
    "speculating": (DSPARK, frozenset({"o1", "o6"})),  # its pending drafts travel
    "state lost": (None, frozenset({"t", "o6"})),
}  # the decode engine prefills it again


@pytest.mark.parametrize("spec,lost", PD_CASES.values(), ids=PD_CASES)
def test_a_pd_request_equals_the_same_request_colocated(tiny_ckpt, spec, lost):
    """Prefilled on one engine in chunks among 9 others, its KV state over the wire, decoded
    on another among the others' decodes and local prefills: the same tokens, logprobs and
    prompt logprobs bitwise as served alone on one engine."""
    alone, pd = pd_vs_colocated(tiny_ckpt("v41"), spec, lost)
    assert len(alone.bits[2]) == 90 and pd.bits == alone.bits


def test_preemption_and_resume_keep_the_bits(tiny_ckpt):
    path = tiny_ckpt("v41")
    reqs = [EngineRequest(f"r{i}", tuple(p), greedy(10))
            for i, p in enumerate(prompts((58, 60, 57, 59), seed=1))]  # fmt: skip
    roomy = run(engine(path, max_num_batched_tokens=32), reqs)
    probe = engine(path, block_size=64)
    per_block, per_slot = probe.cache.kv.bytes_per_block(), probe.cache.kv.bytes_per_slot()
    # 3 blocks of 64: running requests cross a block boundary while the pool is full
    tight = engine(path, max_num_batched_tokens=32, block_size=64, max_num_seqs=4,
                   kv_cache_bytes=4 * per_block + 5 * per_slot)  # fmt: skip
    assert run(tight, reqs) == roomy and tight.stats.num_preemptions > 0


def test_speculation_keeps_greedy_tokens_and_logprobs(tiny_ckpt):
    """DSpark drafts verified three at a time against plain decoding: the verify rows are
    the decode rows' bits, so greedy tokens and their logprobs are the same."""
    path = tiny_ckpt("v41")
    reqs = [EngineRequest(f"r{i}", tuple(p), greedy(12))
            for i, p in enumerate(prompts((23, 5, 37, 11), seed=6))]  # fmt: skip
    plain = run(engine(path, max_num_batched_tokens=16), reqs)
    spec = engine(path, max_num_batched_tokens=16, speculative=DSPARK)
    assert run(spec, reqs, stagger=1) == plain
    assert spec.stats.spec_accepted > 0


# ---- over HTTP -----------------------------------------------------------------------------
def test_seeded_sampling_over_http_is_reproducible_in_any_company(tiny_ckpt):
    """The real front door (uvicorn, the API, an async engine in the mode): a seeded
    completion sent alone and among 2 or 5 concurrent others returns the same text and
    logprobs (JSON floats: the exact bits); /v1/models says the server is deterministic."""
    path = tiny_ckpt("v41")
    eng = AsyncEngine(EngineConfig.from_options(path, kv_cache_bytes=1 << 22,
                                                max_num_batched_tokens=32, **DET))  # fmt: skip
    front = FrontDoor(served_model_names=("tiny",), tokenizer_path=f"{path}/tokenizer.json",
                      context_limit=eng.core.max_model_len, deterministic=True)  # fmt: skip
    body = {
        "model": "tiny",
        "prompt": "the same request, whatever else runs",
        "max_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "logprobs": 2,
        "ignore_eos": True,
    }

    def post(client: httpx.Client, prompt: str | None = None) -> dict:
        r = client.post("/v1/completions", json=dict(body, prompt=prompt) if prompt else body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    try:
        with Server(build_api(front, LocalEngineClient(eng))) as srv, httpx.Client(
                base_url=srv.url, timeout=60) as client:  # fmt: skip
            assert client.get("/v1/models").json()["data"][0]["deterministic"] is True
            seen = set()
            for n in (0, 2, 5, 0):
                with ThreadPoolExecutor(n + 1) as pool:
                    others = [pool.submit(post, client, f"company {i} " * (i + 1))
                              for i in range(n)]  # fmt: skip
                    mine = pool.submit(post, client)
                    [f.result() for f in others]
                    seen.add(json.dumps(mine.result(), sort_keys=True))
            assert len(seen) == 1
    finally:
        eng.shutdown()


# ---- its cost: the bench's plumbing (timings are the GPU's to say) -----------------------------
def test_the_cost_bench_runs_on_the_cpu(tmp_path):
    from bench import deterministic as bench

    bench.main(["--model", "tiny", "--device", "cpu", "--batches", "1,3", "--context", "20",
                "--prefill", "0x1x16,8x2x8", "--reps", "1", "--out", str(tmp_path)])  # fmt: skip
    doc = json.loads((tmp_path / "deterministic.json").read_text())
    assert doc["benchmark"] == "deterministic" and doc["card"].startswith("CPU")
    recs = doc["records"]
    cases = [("deterministic.decode_step", 1), ("deterministic.decode_step", 3),
             ("deterministic.prefill_step", 16), ("deterministic.prefill_step", 8)]  # fmt: skip
    assert [(r["name"], r["params"].get("batch", r["params"].get("new_tokens"))) for r in recs] \
        == [c for c in cases for _ in bench.MODES]  # fmt: skip
    for off, on in zip(recs[::2], recs[1::2], strict=True):
        assert (off["params"]["mode"], on["params"]["mode"]) == bench.MODES
        assert off["value"] > 0 and on["value"] > 0 and on["peer"]["default"] == off["value"]
        assert on["peer"]["ratio"] > 0
