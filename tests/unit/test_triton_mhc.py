"""Mega-mHC under the Triton interpreter vs the fp64 reference.

fp32 streams: ||out - ref|| / ||ref|| <= 1e-5; bf16 streams: <= 1e-2 (the reference rounds the
collapsed input to bf16 before its norm, the fused kernel does not).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from kernels import dispatch, mhc, mhc_ref  # noqa: E402
from tests.support.forms import mhc_finish_form  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

T, N, D, ITERS, HC_EPS, NORM_EPS, RMS_EPS = 5, 4, 96, 20, 1e-6, 1e-6, 1e-6


pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN


def _params(g: torch.Generator, d: int = D) -> tuple[torch.Tensor, ...]:
    fn = torch.randn(N * (N + 2), N * d, generator=g) / (N * d) ** 0.5
    base = 0.5 * torch.randn(N * (N + 2), generator=g)
    scale = 1 + 0.2 * torch.randn(3, generator=g)
    norm_w = 1 + 0.1 * torch.randn(d, generator=g)
    return fn, base, scale, norm_w


def _f64(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.double() for t in ts)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("v41", [False, True])
def test_hc_pre(dtype: torch.dtype, tol: float, v41: bool) -> None:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(T, N, D, generator=g).to(dtype)
    params = _params(g)
    pre_in = torch.rand(T, N, generator=g) + 0.1 if v41 else None
    eps = (ITERS, HC_EPS, NORM_EPS, RMS_EPS)
    ref = mhc_ref.hc_pre_ref(x.double(), *_f64(params), *eps, pre_in)
    out = mhc.hc_pre_triton(x, *params, *eps, pre_in)
    assert out[0].dtype == dtype and out[0].shape == (T, D)
    for o, r in zip(out[1:], ref[1:], strict=True):  # post, comb, pre: fp32 math
        assert rel(o, r) < 1e-5
    assert rel(out[0], ref[0]) < tol


def test_hc_post() -> None:
    g = torch.Generator().manual_seed(12)
    x = torch.randn(T, N, D, generator=g)
    out = torch.randn(T, D, generator=g)
    post, comb = torch.rand(T, N, generator=g), torch.rand(T, N, N, generator=g)
    ref = mhc_ref.hc_expand_ref(out.double(), x.double(), post, comb)  # refs mix in fp32
    assert rel(mhc.hc_post_triton(out, x, post, comb), ref) < 1e-6


@pytest.mark.parametrize("v41", [False, True])
def test_hc_post_pre(v41: bool) -> None:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(T, N, D, generator=g)
    out = torch.randn(T, D, generator=g)
    post, comb = 2 * torch.rand(T, N, generator=g), torch.rand(T, N, N, generator=g)
    params = _params(g)
    pre_in = torch.rand(T, N, generator=g) + 0.1 if v41 else None
    eps = (ITERS, HC_EPS, NORM_EPS, RMS_EPS)
    ref = mhc_ref.hc_post_pre_ref(out.double(), x.double(), post, comb, *_f64(params), *eps, pre_in)
    res = mhc.hc_post_pre_triton(out, x, post, comb, *params, *eps, pre_in)
    for o, r in zip(res, ref, strict=True):
        assert rel(o, r) < 1e-5


@pytest.mark.parametrize("form", ["auto", "fused", "tile", "loop"])
@pytest.mark.parametrize("d", [96, 192])  # 2 and 3 d-splits of the mix (96: a masked split)
@pytest.mark.parametrize("t", [1, 3])  # one launch: 1 token over 2-3 programs, 3 over 1 each
@pytest.mark.parametrize("v41", [False, True])
def test_finish_forms_match_reference(v41: bool, t: int, d: int, form: str) -> None:
    """Every form on a decode wave (1 or 3 tokens, within the interpreter's 4 "SMs"), for hc_pre
    and hc_post_pre: the fp64 reference's outputs, and the form really taken ("auto": one
    launch, the token's last program finishing, at up to FUSED_MAX_TOKENS tokens; "tile":
    two launches, the finish loading the streams once; 5 tokens, more than a wave, take the
    loop whatever is forced but "loop"; "loop" forced: the two-pass form everywhere). The
    one-launch form leaves its token counters at zero for the next launch."""
    forms: list[str] = []
    g = torch.Generator().manual_seed(14)
    x = torch.randn(t, N, d, generator=g)
    out = torch.randn(t, d, generator=g)
    post, comb = 2 * torch.rand(t, N, generator=g), torch.rand(t, N, N, generator=g)
    params = _params(g, d)
    pre_in = torch.rand(t, N, generator=g) + 0.1 if v41 else None
    eps = (ITERS, HC_EPS, NORM_EPS, RMS_EPS)
    ref_pre = mhc_ref.hc_pre_ref(x.double(), *_f64(params), *eps, pre_in)
    ref_pp = mhc_ref.hc_post_pre_ref(out.double(), x.double(), post, comb, *_f64(params), *eps,
                                 pre_in)  # fmt: skip
    with mhc_finish_form(form, forms):
        got_pre = mhc.hc_pre_triton(x, *params, *eps, pre_in)
        got_pp = mhc.hc_post_pre_triton(out, x, post, comb, *params, *eps, pre_in)
        mhc.hc_pre_triton(torch.randn(5, N, d, generator=g), *params, *eps)
    first = {"auto": "fused", "fused": "fused", "tile": "tile", "loop": "loop"}[form]
    assert forms == [first, first, "loop"]
    for o, r in zip((*got_pre, *got_pp), (*ref_pre, *ref_pp), strict=True):
        assert rel(o, r) < 1e-5
    assert not any(bool(c.any()) for kept in dispatch._COUNTERS.values() for c in kept)
