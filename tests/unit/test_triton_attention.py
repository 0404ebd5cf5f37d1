"""Triton sparse attention vs the fp64 torch reference, under TRITON_INTERPRET=1 on CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kernels import attention as attn  # noqa: E402
from kernels.kv_quant import pow2_ceil  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

pytestmark = pytest.mark.skipif(
    not attn._INTERPRET and not torch.cuda.is_available(),
    reason="kernels were imported without TRITON_INTERPRET=1",
)


def _case(seed: int, T=3, H=20, D=64, N=40, K=37):
    """Random inputs; token 0 has 5 keys, token 1 holes, the last token none (sink only)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(N, D, generator=g)
    sink = torch.randn(H, generator=g)
    idx = torch.randint(0, N, (T, K), generator=g)
    idx[0, 5:] = -1
    idx[1, ::3] = -1
    idx[-1] = -1
    angles = torch.rand(T, 8, generator=g) * 6.0
    return q, kv, idx, sink, angles


def _fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = kv.unflatten(-1, (-1, 32))
    scale = pow2_ceil(blocks.abs().amax(-1).clamp_min(1e-4) / 448.0)
    return (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2), scale


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("rope", [False, True])
def test_matches_fp64_reference(splits, rope):
    q, kv, idx, sink, angles = _case(10 * splits + rope)
    ang = angles if rope else None
    out = torch.full_like(q, float("nan"))
    attn.sparse_attention_triton(
        q, kv, idx, sink, 0.125, inv_rope_angles=ang, splits=splits, out=out
    )
    ref = attn.sparse_attention_ref(
        q.double(),
        kv.double(),
        idx,
        sink.double(),
        0.125,
        inv_rope_angles=None if ang is None else ang.double(),
    )
    assert not out.isnan().any()
    assert rel(out, ref) < 1e-5
    assert out[-1].abs().max() == 0  # no keys: the sink takes all the mass


@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_dequantized_in_kernel(qdtype):
    q, kv, idx, sink, angles = _case(3, D=64)
    k8, scale = _fp8(kv * 3.0)
    q = q.to(qdtype)
    out = attn.sparse_attention_triton(
        q, k8, idx, sink, 0.1, kv_scale=scale, inv_rope_angles=angles, splits=2
    )
    ref = attn.sparse_attention_ref(
        q.double(),
        k8,
        idx,
        sink.double(),
        0.1,
        kv_scale=scale.double(),
        inv_rope_angles=angles.double(),
    )
    assert out.dtype == qdtype
    assert rel(out, ref) < (1e-5 if qdtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_kv(dtype):
    q, kv, idx, sink, _ = _case(4, T=2, H=16, D=32, N=24, K=20)
    q, kv = q.to(dtype), kv.to(dtype)
    out = attn.sparse_attention_triton(q, kv, idx, sink, 0.2)
    ref = attn.sparse_attention_ref(q.double(), kv.double(), idx, sink.double(), 0.2)
    assert out.dtype == dtype and rel(out, ref) < 1e-2


def test_strided_q_and_int32_idx():
    q, kv, idx, sink, _ = _case(5, T=2, H=16, D=32, N=24, K=20)
    wide = torch.randn(2, 16, 64)
    wide[..., :32] = q
    out = attn.sparse_attention_triton(wide[..., :32], kv, idx.int(), sink, 0.3)
    ref = attn.sparse_attention_ref(q.double(), kv.double(), idx, sink.double(), 0.3)
    assert rel(out, ref) < 1e-5


def test_wrapper_rejects_bad_inputs():
    q, kv, idx, sink, angles = _case(6, T=2, H=16, D=32, N=24, K=20)
    with pytest.raises(TypeError):
        attn.sparse_attention_triton(q, kv.half(), idx, sink, 1.0)
    with pytest.raises(ValueError):
        attn.sparse_attention_triton(q, kv.to(torch.float8_e4m3fn), idx, sink, 1.0)
    with pytest.raises(ValueError):
        attn.sparse_attention_triton(q, kv, idx[:1], sink, 1.0)
    with pytest.raises(ValueError):
        attn.sparse_attention_triton(q, kv, idx, sink, 1.0, inv_rope_angles=angles[:1])


def test_kernel_is_validated():
    """``kernel`` names a kernel or fails: "ws" where the warp-specialized kernel cannot run
    (here: no sm_90 GPU, 16 heads, D 32) is an error, not a silent fallback; the portable
    kernel named outright gives the reference's result, as does the dispatch ("auto")."""
    q, kv, idx, sink, _ = _case(7, T=2, H=16, D=32, N=24, K=20)
    ref = attn.sparse_attention_ref(q.double(), kv.double(), idx, sink.double(), 0.3)
    with pytest.raises(ValueError, match="warp-specialized"):
        attn.sparse_attention_triton(q, kv, idx, sink, 0.3, kernel="ws")
    with pytest.raises(ValueError, match="kernel must be"):
        attn.sparse_attention_triton(q, kv, idx, sink, 0.3, kernel="fast")
    assert rel(attn.sparse_attention_triton(q, kv, idx, sink, 0.3, kernel="tl"), ref) < 1e-5
    assert rel(attn.sparse_attention_triton(q, kv, idx, sink, 0.3), ref) < 1e-5


def test_combine_reads_bf16_partials():
    """The split merge on bf16 partials (the ws kernel's, ``WS_PARTIALS``) = the merge on the
    same values in fp32, bit for bit (the kernel widens them before any arithmetic), and =
    the merge formula sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s in torch."""
    import triton

    g = torch.Generator().manual_seed(3)
    S, T, H, D = 3, 2, 20, 64
    part = (torch.randn(S, T, H, D, generator=g) * 3).bfloat16()
    m = torch.randn(S, T, H, generator=g) * 4
    ml = torch.stack((m, torch.rand(S, T, H, generator=g) + 0.5), -1)
    outs = []
    for p in (part, part.float()):
        out = torch.empty(T, H, D)
        attn._combine_kernel[(T, triton.cdiv(H, 16))](
            p, ml, ml, out, T, H, S, 0, out.stride(0), out.stride(1),
            D=D, R=0, ROPE=False, BLOCK_H=16, num_warps=4,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    w = torch.exp2(m - m.amax(0))
    ref = (w[..., None] * part.double()).sum(0) / (w * ml[..., 1]).sum(0)[..., None]
    assert rel(outs[0], ref) < 1e-6


def test_ws_block_fit_keeps_a_ring_for_the_epilogue():
    """The ws launch's key block: halved until the CTA fits in shared memory, and refused
    when the key ring (stages x block) holds fewer than 64 rows, since the epilogue stages
    two [64, D/2] bf16 output tiles in it. Plain bf16 rows at 3 stages would halve the
    32-row default to 16 (48 rows): refused, where fp8 rows at 3 stages keep 32."""
    from kernels.attention_ws import SMEM_LIMIT, fit_block_n, smem_bytes

    assert fit_block_n(32, 2, plain=False, scaled=True) == 32
    assert fit_block_n(32, 2, plain=True, scaled=False) == 32
    assert fit_block_n(32, 3, plain=False, scaled=True) == 32
    assert fit_block_n(16, 4, plain=True, scaled=True) == 16
    assert smem_bytes(32, 3, plain=True, scaled=False) > SMEM_LIMIT
    with pytest.raises(ValueError, match="at least 64 rows"):
        fit_block_n(32, 3, plain=True, scaled=False)
    with pytest.raises(ValueError, match="at least 64 rows"):
        fit_block_n(16, 2, plain=False, scaled=True)
    with pytest.raises(ValueError, match="exceeds shared memory"):
        fit_block_n(32, 8, plain=True, scaled=True)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("splits", [1, 2])
def test_two_key_sources(packed, splits):
    """Window rows from one pool and compressed entries from another, as the batched step
    reads the cache in place; packed: fp8 window (e8m0 scales) + nvfp4 entries (e4m3 scales),
    the released V4.1 formats, dequantized in the kernel."""
    from kernels.kv_quant import kv_pack

    q, kv, idx, sink, angles = _case(8 + splits, T=3, H=16, D=64, N=30, K=9)
    g = torch.Generator().manual_seed(30 + splits)
    kv2 = torch.randn(50, 64, generator=g) * 2.0
    idx2 = torch.randint(0, 50, (3, 21), generator=g)
    idx2[0, ::2] = -1
    idx2[-1] = -1
    kw: dict = {}
    if packed:
        (kv, s1), (kv2, s2) = kv_pack(kv, "fp8"), kv_pack(kv2, "nvfp4")
        kw = dict(kv_scale=s1, kv2_scale=s2)
    out = attn.sparse_attention_triton(
        q, kv, idx, sink, 0.15, kv2=kv2, idx2=idx2, inv_rope_angles=angles, splits=splits, **kw
    )
    ref = attn.sparse_attention_ref(
        q.double(), kv if packed else kv.double(), idx, sink.double(), 0.15,
        kv2=kv2 if packed else kv2.double(), idx2=idx2, inv_rope_angles=angles.double(), **kw,
    )  # fmt: skip
    assert rel(out, ref) < 1e-5
    if packed:  # the reference decodes e8m0 fp8 rows like kv_qdq rounds them
        from kernels.kv_quant import kv_unpack

        assert torch.equal(attn.dequant_kv(kv, s1), kv_unpack(kv, s1, "fp8"))
