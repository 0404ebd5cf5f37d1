"""Torch reference ops against independent (loop / dense) computations."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import sparse_attention_ref
from kernels.gate import moe_gate_ref
from kernels.indexer import indexer_scores_ref
from kernels.kv_quant import kv_qdq, pow2_ceil
from kernels.mhc_ref import hc_collapse_ref, hc_expand_ref, hc_mix_ref, sinkhorn_ref
from kernels.moe_ref import moe_experts_ref
from kernels.rope import apply_rope_ref
from kernels.topk import topk_ref


def test_sparse_attention_matches_dense_loop():
    g = torch.Generator().manual_seed(0)
    T, H, D, N, K = 5, 3, 8, 11, 4
    q, kv = torch.randn(T, H, D, generator=g), torch.randn(N, D, generator=g)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(0, N, (T, K), generator=g)
    idx[0, 1:] = -1
    idx[3, 2] = -1
    out = sparse_attention_ref(q, kv, idx, sink, 0.7)
    for t in range(T):
        rows = [int(r) for r in idx[t] if r >= 0]
        for h in range(H):
            logits = [float(q[t, h] @ kv[r]) * 0.7 for r in rows]
            denom = sum(math.exp(v) for v in logits) + math.exp(float(sink[h]))
            ref = sum(math.exp(v) / denom * kv[r] for v, r in zip(logits, rows, strict=True))
            assert torch.allclose(out[t, h], ref, atol=1e-5)


def test_topk_ties_lower_index_and_invalid():
    s = torch.tensor([[1.0, 3.0, 3.0, float("-inf")], [0.0, 0.0, 0.0, 0.0]])
    assert topk_ref(s, 2).tolist() == [[1, 2], [0, 1]]
    assert topk_ref(s, 4).tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]
    assert topk_ref(torch.tensor([[float("inf"), 1.0, 2.0]]), 2).tolist() == [[0, 2]]


def test_indexer_scores_loop():
    g = torch.Generator().manual_seed(1)
    q, k, w = torch.randn(4, 2, 3, generator=g), torch.randn(5, 3, generator=g), torch.randn(4, 2)
    vis = torch.tensor([0, 2, 5, 3])
    s = indexer_scores_ref(q, k, w, vis)
    for t in range(4):
        for c in range(5):
            want = sum(float(w[t, h]) * max(float(q[t, h] @ k[c]), 0.0) for h in range(2))
            assert (s[t, c] == float("-inf")) if c >= vis[t] else abs(float(s[t, c]) - want) < 1e-5


def test_sinkhorn_is_doubly_stochastic_and_mix_loops():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 4, 4, generator=g)
    c = sinkhorn_ref(logits, 20, 1e-6)
    assert torch.allclose(c.sum(-2), torch.ones(6, 4), atol=1e-5)  # last pass: columns
    assert torch.allclose(c.sum(-1), torch.ones(6, 4), atol=1e-2)
    e = torch.exp(logits[0].double())
    m = [[float(e[i, j] / e[i].sum()) + 1e-6 for j in range(4)] for i in range(4)]
    for it in range(20):
        if it:  # rows
            m = [[v / (sum(r) + 1e-6) for v in r] for r in m]
        cols = [sum(m[i][j] for i in range(4)) + 1e-6 for j in range(4)]
        m = [[m[i][j] / cols[j] for j in range(4)] for i in range(4)]
    assert torch.allclose(c[0].double(), torch.tensor(m, dtype=torch.float64), atol=1e-6)
    n, d = 4, 5
    x = torch.randn(3, n, d, generator=g)
    fn, base, scale = torch.randn(n * (n + 2), n * d, generator=g), torch.randn(24), torch.rand(3)
    pre, post, comb = hc_mix_ref(x, fn, base, scale, 20, 1e-6, 1e-6)
    v = x.flatten(1)
    m = (v @ fn.t()) / torch.sqrt(v.square().mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(pre, torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + 1e-6, atol=1e-6)
    assert torch.allclose(post, 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n]))
    o = torch.randn(3, d, generator=g)
    y = hc_expand_ref(o, x, post, comb)
    for t in range(3):
        for k in range(n):
            want = post[t, k] * o[t] + sum(comb[t, j, k] * x[t, j] for j in range(n))
            assert torch.allclose(y[t, k], want, atol=1e-5)
    assert torch.allclose(hc_collapse_ref(x, pre), (pre.unsqueeze(-1) * x).sum(1), atol=1e-6)


def test_gate_and_experts_loop():
    g = torch.Generator().manual_seed(3)
    T, E, k, d, inter = 6, 5, 2, 4, 3
    logits, bias = torch.randn(T, E, generator=g), torch.randn(E, generator=g)
    ids, w = moe_gate_ref(logits, bias, k, 1.5)
    s = torch.sqrt(torch.nn.functional.softplus(logits))
    for t in range(T):
        order = sorted(range(E), key=lambda e: (-float(s[t, e] + bias[e]), e))[:k]
        assert ids[t].tolist() == order
        assert torch.allclose(w[t], s[t, order] / s[t, order].sum() * 1.5)
    hids, _ = moe_gate_ref(logits, None, k, 1.0, hash_idx=torch.tensor([[4, 0]] * T))
    assert hids.tolist() == [[4, 0]] * T
    x = torch.randn(T, d, generator=g) * 3
    w1 = [torch.randn(inter, d, generator=g) for _ in range(E)]
    w3 = [torch.randn(inter, d, generator=g) for _ in range(E)]
    w2 = [torch.randn(d, inter, generator=g) for _ in range(E)]
    out = moe_experts_ref(x, ids, w, w1, w2, w3, 1.0)
    for t in range(T):
        want = torch.zeros(d)
        for j in range(k):
            e = int(ids[t, j])
            h1, h3 = (w1[e] @ x[t]).clamp(max=1.0), (w3[e] @ x[t]).clamp(-1.0, 1.0)
            want += w[t, j] * (w2[e] @ (h1 * torch.sigmoid(h1) * h3))
        assert torch.allclose(out[t], want, atol=1e-5)


def test_rope_rotates_last_pairs_and_inverts():
    g = torch.Generator().manual_seed(4)
    x, ang = torch.randn(3, 2, 10, generator=g), torch.randn(3, 2, generator=g)
    y = apply_rope_ref(x, ang)
    assert torch.equal(y[..., :6], x[..., :6])
    c, s = torch.cos(ang[0, 1]), torch.sin(ang[0, 1])
    a, b = x[0, 1, 8], x[0, 1, 9]
    assert torch.allclose(y[0, 1, 8:], torch.stack((a * c - b * s, a * s + b * c)), atol=1e-6)
    assert torch.allclose(apply_rope_ref(y, ang, inverse=True), x, atol=1e-6)


@pytest.mark.parametrize("fmt,block", [("fp8", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_kv_qdq_error_bounds_and_fixed_points(fmt, block):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=g)
    y = kv_qdq(x, fmt, block)
    rel = (y - x).norm() / x.norm()
    assert rel < (0.05 if fmt == "fp8" else 0.2)
    if fmt == "nvfp4":
        # not a fixed point (the e4m3 scale is re-derived from the rounded amax), but every
        # value is an E2M1 level times its block's scale e4m3(amax / 6)
        xb, yb = x.unflatten(-1, (-1, block)), y.unflatten(-1, (-1, block))
        scale = (xb.abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
        levels = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        q = (yb / scale).abs()
        assert torch.isclose(q.unsqueeze(-1), levels, rtol=0, atol=1e-6).any(-1).all()
        assert q.amax() <= 6.0
    else:
        assert torch.equal(kv_qdq(y, fmt, block), y)


def test_e2m1_ties_to_even_and_pow2():
    assert pow2_ceil(torch.tensor([3.0, 4.0, 0.3])).tolist() == [4.0, 4.0, 0.5]
    # one block of 32 with amax 6 -> scale 1; 0.25 ties to 0 (even), 0.75 to 1.0, 2.5 to 2.0
    v = torch.zeros(1, 32)
    v[0, :4] = torch.tensor([6.0, 0.25, 0.75, 2.5])
    assert kv_qdq(v, "mxfp4", 32)[0, :4].tolist() == [6.0, 0.0, 1.0, 2.0]
