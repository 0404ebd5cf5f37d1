"""Engram kernels under the Triton interpreter vs the references (rows: exact; gate: fp32
||out - ref|| / ||ref|| <= 1e-5 vs fp64; gather: exact)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton")
if isinstance(triton.language.zeros, triton.runtime.JITFunction):  # imported before the env
    pytest.skip("run with TRITON_INTERPRET=1 (make test sets it)", allow_module_level=True)

from app.model.engram_hash import engram_hash_spec  # noqa: E402
from kernels import engram  # noqa: E402
from kernels.quant import quantize_fp8_rowwise  # noqa: E402
from tests.unit.test_engram_hash import python_rows  # noqa: E402
from tests.unit.triton_util import rel  # noqa: E402

T, N, D = 7, 4, 48


pytestmark = pytest.mark.usefixtures("poison_outputs")  # unwritten outputs stay NaN


def test_rows_match_python_hash() -> None:
    spec = engram_hash_spec((1, 14), 4, 8, 1000, 1 << 20)
    g = torch.Generator().manual_seed(21)
    comp = torch.randint(0, 1 << 20, (T, 4), generator=g)
    comp[1, 2:] = -1
    comp[3, 1] = -1  # blocks shifts 1.. even though shift 2 is valid
    comp[5, 0] = -1
    layer = 1
    args = [
        torch.tensor(v) for v in (spec.multipliers[layer], spec.primes[layer], spec.offsets[layer])
    ]
    ref = python_rows(comp, spec.multipliers[layer], spec.primes[layer], spec.offsets[layer], 8, 3)
    assert torch.equal(engram.engram_rows_ref(comp, *args, 8, 3), ref)
    assert torch.equal(engram.engram_rows_triton(comp, *args, 8, 3), ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_gather(fp8: bool) -> None:
    g = torch.Generator().manual_seed(22)
    table = torch.randn(50, 64, generator=g)
    scale = None
    if fp8:
        table, scale = quantize_fp8_rowwise(table)
    rows = torch.randint(0, 50, (T, 3), generator=g)
    ref = engram.engram_gather_ref(table, rows, scale, torch.float32)
    out = engram.engram_gather_triton(table, rows, scale, torch.float32)
    assert out.shape == (T, 3 * 64) and torch.equal(out, ref)


def test_gate() -> None:
    g = torch.Generator().manual_seed(23)
    x, key = torch.randn(T, N, D, generator=g), torch.randn(T, N, D, generator=g)
    val = torch.randn(T, D, generator=g)
    q_w, k_w = 1 + 0.3 * torch.randn(N, D, generator=g), 1 + 0.3 * torch.randn(N, D, generator=g)
    blocked = torch.zeros(T, dtype=torch.bool)
    blocked[2] = True
    ref = engram.engram_gate_ref(*(v.double() for v in (x, key, val, q_w, k_w)), 1e-6, blocked)
    out = engram.engram_gate_triton(x, key, val, q_w, k_w, 1e-6, blocked)
    assert rel(out, ref) < 1e-5
    assert torch.equal(out[2], x[2])
