"""MegaGate under the Triton interpreter vs the fp64 reference.

ids must match exactly; weights ||out - ref|| / ||ref|| <= 1e-5 (fp32 path).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from kernels.gate import moe_gate_fused, moe_gate_ref, moe_gate_triton  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

T, D, E, K = 6, 64, 40, 6


pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gate_topk(dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, D, generator=g).to(dtype)
    w = (torch.randn(E, D, generator=g) / D**0.5 * 4).to(dtype)
    bias = 0.3 * torch.randn(E, generator=g) if with_bias else None
    ref_ids, ref_w = moe_gate_ref(x.double() @ w.double().t(), bias, K, 2.5)
    ids, wts = moe_gate_triton(x, w, bias, K, 2.5)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert rel(wts, ref_w) < 1e-5


def test_gate_ties_go_to_lower_id() -> None:
    x = torch.ones(2, 16)
    w = torch.zeros(E, 16)
    w[[3, 7, 9, 20, 21, 30, 31]] = 0.5  # seven equal top scores: keep the six lowest ids
    ids, wts = moe_gate_triton(x, w, None, K, 1.0)
    assert ids.tolist() == [[3, 7, 9, 20, 21, 30]] * 2
    torch.testing.assert_close(wts, torch.full((2, K), 1.0 / K))


def test_gate_hash_ids_and_fallback() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(E, D, generator=g) / D**0.5
    hash_idx = torch.randint(0, E, (T, K), generator=g)
    ref_ids, ref_w = moe_gate_ref(x.double() @ w.double().t(), None, K, 1.5, hash_idx)
    ids, wts = moe_gate_triton(x, w, None, K, 1.5, hash_idx)
    assert torch.equal(ids, ref_ids)
    assert rel(wts, ref_w) < 1e-5
    cpu_ids, _ = moe_gate_fused(x, w, None, K, 1.5, hash_idx)  # CPU tensors -> reference
    assert torch.equal(cpu_ids, ref_ids)
