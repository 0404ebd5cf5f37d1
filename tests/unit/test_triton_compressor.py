"""Compressor pooling: reference vs the model's compressors, Triton vs the fp64 reference."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from app.model.compressor import Compressor41, CompressorV4  # noqa: E402
from kernels import compressor as cp  # noqa: E402

pytestmark = pytest.mark.skipif(
    not cp._INTERPRET and not torch.cuda.is_available(),
    reason="kernels were imported without TRITON_INTERPRET=1",
)

MODES = [(False, 1), (False, 2), (False, 4), (True, 2)]  # (overlap, ratio)


def _inputs(seed: int, overlap: bool, ratio: int, E=5, dim=32):
    g = torch.Generator().manual_seed(seed)
    span, width = (2 * ratio, 2 * dim) if overlap else (ratio, dim)
    kv = torch.randn(E, span, width, generator=g)
    gate = 2 * torch.randn(E, span, width, generator=g)
    first = torch.arange(E) % 2 == 0
    norm_w = 1 + 0.1 * torch.randn(dim, generator=g)
    angles = 6 * torch.rand(E, 4, generator=g)
    return kv, gate, first, norm_w, angles


def _pool_by_definition(kv, gate, first, norm_w, overlap, ratio, eps):
    """MODEL_SPEC 2, one entry at a time in fp64: per channel a softmax over the group's
    slots (V4 CSA: window w-1's Ca half and window w's Cb half, window -1 dead for w = 0),
    then RMSNorm."""
    dim = norm_w.shape[0]
    out = []
    for e in range(kv.shape[0]):
        if overlap:
            v = torch.cat((kv[e, :ratio, :dim], kv[e, ratio:, dim:])).double()
            g = torch.cat((gate[e, :ratio, :dim], gate[e, ratio:, dim:])).double()
            if first[e]:
                v, g = v[ratio:], g[ratio:]
        else:
            v, g = kv[e].double(), gate[e].double()
        w = torch.exp(g - g.max(0).values) if v.shape[0] > 1 else torch.ones_like(g)
        pooled = (w * v).sum(0) / w.sum(0)
        rms = math.sqrt(float((pooled**2).mean()) + eps)
        out.append(norm_w.double() * pooled / rms)
    return torch.stack(out)


@pytest.mark.parametrize(("overlap", "ratio"), MODES)
def test_model_pool_matches_the_definition(overlap, ratio):
    kv, gate, first, norm_w, _ = _inputs(ratio, overlap, ratio)
    dim = norm_w.shape[0]
    if overlap or ratio == 4:
        mod = CompressorV4(8, dim, ratio, overlap, 1e-6)
    else:
        mod = Compressor41(8, dim, ratio, 1e-6)
    with torch.no_grad():
        mod.norm.weight.copy_(norm_w)
    want = _pool_by_definition(kv, gate, first, norm_w, overlap, ratio, 1e-6)
    torch.testing.assert_close(mod.pool(kv, gate, first).double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("overlap", "ratio"), MODES)
@pytest.mark.parametrize("rope", [False, True])
def test_triton_matches_fp64_reference(overlap, ratio, rope):
    kv, gate, first, norm_w, angles = _inputs(10 + ratio + rope, overlap, ratio)
    gate = None if ratio == 1 else gate
    ang = angles if rope else None
    dim = norm_w.shape[0]
    kw = {"overlap": overlap, "ratio": ratio, "dim": dim}
    out = torch.full((kv.shape[0], dim), float("nan"))
    cp.compress_pool_triton(kv, gate, first, norm_w, 1e-6, angles=ang, out=out, **kw)
    ref = cp.compress_pool_ref(
        kv.double(),
        None if gate is None else gate.double(),
        first,
        norm_w.double(),
        1e-6,
        angles=None if ang is None else ang.double(),
        **kw,
    )
    assert not out.isnan().any()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_scatter_into_paged_pool_bf16():
    kv, gate, first, norm_w, angles = _inputs(3, False, 2)
    pool = torch.full((4 * 5, 32), float("nan"), dtype=torch.bfloat16)  # 4 blocks x 5 rows
    rows = torch.tensor([7, 2, -1, 19, 10])
    kw = {"overlap": False, "ratio": 2, "dim": 32, "angles": angles}
    cp.compress_pool_triton(kv, gate, first, norm_w, 1e-20, out=pool, out_rows=rows, **kw)
    ref = cp.compress_pool_ref(kv.double(), gate.double(), first, norm_w.double(), 1e-20, **kw)
    keep = rows >= 0
    written = torch.zeros(20, dtype=torch.bool)
    written[rows[keep]] = True
    assert pool[~written].isnan().all() and not pool[written].isnan().any()
    err = (pool[rows[keep]].double() - ref[keep]).norm() / ref[keep].norm()
    assert float(err) < 1e-2


def test_wrapper_rejects_bad_inputs():
    kv, gate, first, norm_w, _ = _inputs(4, True, 2)
    with pytest.raises(ValueError):
        cp.compress_pool_triton(kv, gate, first, norm_w, 1e-6, overlap=False, ratio=2, dim=32)
    with pytest.raises(ValueError):
        cp.compress_pool_triton(kv, None, first, norm_w, 1e-6, overlap=True, ratio=2, dim=32)
