"""The deterministic mode on CUDA: every op the mode changes gives a row the same bits at any
row count (bf16, shapes of the flash rank's order), and the engine (a tiny V4.1 checkpoint
with packed fp4 experts, bf16, CUDA graphs on: decode batches padded to graph buckets) gives a
request the same tokens and logprobs bitwise among any companions (50 runs, batches of 1 ..
256), at batch 1 and batch N, with chunked prefill, overlap, prefix hits, speculation and a
PD handoff. The CPU twins of these tests are tests/unit/test_deterministic.py (whose helpers
these reuse; ``FATHOM_DETERMINISTIC=0`` runs both with the mode off, the control)."""

from __future__ import annotations

import pytest
import torch

from app.engine.request import EngineRequest, SamplingParams
from kernels.attention import sparse_attention
from kernels.compressor import compress_pool
from kernels.dispatch import batch_invariant
from kernels.gate import moe_gate_fused
from kernels.indexer import indexer_scores_paged
from kernels.kv_quant import kv_pack
from kernels.linear import dense_linear, linear_f32
from kernels.mhc import hc_post_pre, hc_pre
from kernels.moe import moe_fp4, moe_fp8
from kernels.quant import quantize_fp4, quantize_fp8_block
from tests.unit.test_deterministic import (
    DSPARK,
    PD_CASES,
    SWEEP,
    engine,
    greedy,
    pd_vs_colocated,
    run,
    sweep,
    sweep_engines,
)
from tools.op_bisect import prompts

pytestmark = pytest.mark.cuda
ROWS = (1, 2, 3, 7, 16, 17, 64, 65, 200)  # row counts of a call; row 0 the same input in each


def same_rows(fn, *full: torch.Tensor) -> None:
    """In the mode, ``fn`` of the first M rows of every tensor argument, for each M in ROWS:
    row 0 of every output has the same bits."""
    with batch_invariant():
        outs = [fn(*(a[:m] for a in full)) for m in ROWS]
    outs = [o if isinstance(o, tuple) else (o,) for o in outs]
    for m, o in zip(ROWS, outs, strict=True):
        for j, (a, b) in enumerate(zip(o, outs[0], strict=True)):
            assert torch.equal(a[:1], b[:1]), f"output {j}: row 0 differs at {m} rows"


def _g(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def rand(*shape: int, g: torch.Generator, dtype=torch.bfloat16, scale: float = 1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.gpu_mem(4)
def test_gemms_rows_are_invariant():
    g = _g(0)
    M = ROWS[-1]
    for k, n in ((4096, 1024), (1024, 4096), (7168, 512)):
        w = rand(n, k, g=g, scale=k**-0.5)
        same_rows(lambda x, w=w: dense_linear(x, w), rand(M, k, g=g))
    head = rand(8192, 1024, g=g, scale=1024**-0.5)
    same_rows(lambda x: linear_f32(x, head), rand(M, 1024, g=g))


@pytest.mark.gpu_mem(4)
def test_mhc_rows_are_invariant():
    g = _g(1)
    n, d, M = 4, 4096, ROWS[-1]
    mix = (rand(n * (n + 2), n * d, g=g, dtype=torch.float32, scale=(n * d) ** -0.5),
           rand(n * (n + 2), g=g, dtype=torch.float32, scale=0.5),
           1 + rand(3, g=g, dtype=torch.float32, scale=0.2),
           1 + rand(d, g=g, dtype=torch.float32, scale=0.1), 20, 1e-6, 1e-6, 1e-6)  # fmt: skip
    X = rand(M, n, d, g=g)
    pre_in = torch.rand(M, n, generator=g, device="cuda") + 0.1
    same_rows(lambda x, p: hc_pre(x, *mix, pre_in=p), X, pre_in)
    out, post = rand(M, d, g=g), torch.rand(M, n, generator=g, device="cuda")
    comb = torch.rand(M, n, n, generator=g, device="cuda")
    same_rows(lambda o, x, po, c: hc_post_pre(o, x, po, c, *mix), out, X, post, comb)


@pytest.mark.gpu_mem(6)
def test_attention_indexer_compressor_rows_are_invariant():
    g = _g(2)
    M, H, D, N = ROWS[-1], 64, 512, 4096
    q, kv = rand(M, H, D, g=g), rand(N, D, g=g, scale=0.5)
    idx = torch.randint(-1, N, (M, 128), generator=g, device="cuda")
    idx2 = torch.randint(-1, N, (M, 512), generator=g, device="cuda")
    sink = torch.randn(H, generator=g, device="cuda")
    ang = torch.rand(M, 32, generator=g, device="cuda")

    def attend(q, i, i2, a):
        return sparse_attention(q, kv, i, sink, D**-0.5, kv2=kv, idx2=i2, inv_rope_angles=a)

    same_rows(attend, q, idx, idx2, ang)
    # the indexer: one sequence's keys through a block table, 64-entry blocks (ratio 1)
    keys = rand(64 * 40, 128, g=g)
    table = torch.randperm(40, generator=g, device="cuda").view(1, 40)
    vis = torch.randint(1, 64 * 40, (M,), generator=g, device="cuda")
    seq = torch.zeros(M, dtype=torch.int64, device="cuda")
    same_rows(lambda q, w, v, s: indexer_scores_paged(q, keys, None, w, v, s, table, 1, 64,
                                                      64 * 40, seq_start=s[:1]),
              rand(M, 32, 128, g=g), rand(M, 32, g=g, dtype=torch.float32), vis, seq)  # fmt: skip
    # mxfp4 keys (the cache's): one row alone is a decode step, more are a prefill chunk
    codes, scale = kv_pack(rand(64 * 40, 128, g=g, dtype=torch.float32), "mxfp4")
    same_rows(lambda q, w, v, s: indexer_scores_paged(q, codes, scale, w, v, s, table, 1, 64,
                                                      64 * 40, seq_start=s[:1]),
              rand(M, 32, 128, g=g), rand(M, 32, g=g, dtype=torch.float32), vis, seq)  # fmt: skip
    nw = 1 + rand(512, g=g, dtype=torch.float32, scale=0.1)
    same_rows(lambda v, gt: compress_pool(v, gt, None, nw, 1e-6, overlap=False, ratio=2,
                                          dim=512),
              rand(M, 2, 512, g=g), rand(M, 2, 512, g=g))  # fmt: skip


@pytest.mark.gpu_mem(6)
def test_gate_and_experts_rows_are_invariant():
    g = _g(3)
    M, d, inter, E, k = ROWS[-1], 1024, 512, 16, 4
    wg = rand(E, d, g=g, dtype=torch.float32, scale=d**-0.5)
    bias = rand(E, g=g, dtype=torch.float32, scale=0.1)
    same_rows(lambda x: moe_gate_fused(x, wg, bias, k, 1.5), rand(M, d, g=g))
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(M)])
    w = torch.rand(M, k, generator=g, device="cuda")
    cpu = torch.Generator().manual_seed(3)
    w13 = [torch.randn(2 * inter, d, generator=cpu) * d**-0.5 for _ in range(E)]
    w2 = [torch.randn(d, inter, generator=cpu) * inter**-0.5 for _ in range(E)]

    def stacked(fn, ws):
        q, s = zip(*(fn(x) for x in ws), strict=True)
        return torch.stack(q).cuda(), torch.stack(s).cuda()

    fp8 = (*stacked(lambda x: quantize_fp8_block(x, (128, 128)), w13),
           *stacked(lambda x: quantize_fp8_block(x, (128, 128)), w2))  # fmt: skip
    same_rows(lambda x, i, ww: moe_fp8(x, i, ww, *fp8, (128, 128), 10.0), rand(M, d, g=g), ids,
              w)  # fmt: skip
    fp4 = (*stacked(quantize_fp4, w13), *stacked(quantize_fp4, w2))
    same_rows(lambda x, i, ww: moe_fp4(x, i, ww, *fp4, 10.0), rand(M, d, g=g), ids, w)


# ---- the engine ------------------------------------------------------------------------------
GPU = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 8, "kv_cache_bytes": 1 << 26}


@pytest.mark.gpu_mem(6)
def test_fifty_runs_among_batches_up_to_256_give_one_output_on_cuda(tiny_ckpt):
    """SGLang's test on CUDA, graphs on: the same prompts 50 times, alone or among up to 255
    companions (``SWEEP``: batches of 1 .. 256, some sharing the target's first block), on
    an engine with chunked prefill and overlap, one with overlap off and one speculating;
    decode batches replay graphs of padded buckets up to 256: one output per target."""
    engs = sweep_engines(tiny_ckpt("v41"), **GPU, max_model_len=512)  # 512: fewer graph widths
    seen, hits = sweep(engs, SWEEP)
    assert all(e.stats.graph_steps > 0 for e in engs) and hits == {False, True}
    assert {k: len(v) for k, v in seen.items()} == dict.fromkeys(seen, 1)


@pytest.mark.gpu_mem(4)
@pytest.mark.parametrize("spec,lost", PD_CASES.values(), ids=PD_CASES)
def test_a_pd_request_equals_the_same_request_colocated_on_cuda(tiny_ckpt, spec, lost):
    """Prefill on one CUDA engine, the KV state through host memory (the object-store
    transport's form), decode on another among the others' (graphs): the bits of the same
    request served alone."""
    alone, pd = pd_vs_colocated(tiny_ckpt("v41"), spec, lost, **{**GPU, "max_num_seqs": 16})
    assert pd.bits == alone.bits


@pytest.mark.gpu_mem(4)
def test_batch_one_equals_batch_n_on_cuda(tiny_ckpt):
    """Each prompt alone on an eager engine (no graphs, no overlap), then all at once with
    graphs and overlap: the same bits."""
    path = tiny_ckpt("v41")
    eager = engine(path, max_num_batched_tokens=16, cuda_graphs=False, overlap_schedule=False,
                   **GPU)  # fmt: skip
    reqs = [EngineRequest(f"r{i}", tuple(p), greedy(6, prompt_logprobs=1))
            for i, p in enumerate(prompts((23, 5, 37, 11, 1, 30), seed=4))]  # fmt: skip
    alone = {r.request_id: run(eager, [r])[r.request_id] for r in reqs}
    graphs = engine(path, max_num_batched_tokens=16, **GPU)
    assert run(graphs, reqs) == alone and graphs.stats.graph_steps > 0


@pytest.mark.gpu_mem(4)
def test_speculation_and_seeded_sampling_in_company_on_cuda(tiny_ckpt):
    path = tiny_ckpt("v41")
    reqs = [EngineRequest(f"r{i}", tuple(p), greedy(12))
            for i, p in enumerate(prompts((23, 5, 37, 11), seed=6))]  # fmt: skip
    plain = run(engine(path, max_num_batched_tokens=16, **GPU), reqs)
    spec = engine(path, max_num_batched_tokens=16, speculative=DSPARK, **GPU)
    assert run(spec, reqs, stagger=1) == plain
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    eng = engine(path, **GPU)
    t = EngineRequest("t", tuple(prompts((20,), seed=8)[0]), seeded)
    alone = run(eng, [t])["t"]
    crowd = [EngineRequest(f"c{i}", tuple(p), greedy(6)) for i, p in
             enumerate(prompts((9, 30, 4), seed=9))]  # fmt: skip
    assert run(eng, [*crowd, t], stagger=1)["t"] == alone
