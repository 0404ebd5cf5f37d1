"""The step's compressor groups in one Triton launch (interpreted) = the torch reference."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels.compressor import compressor_groups_ref, compressor_groups_triton  # noqa: E402


def _step(seed: int, decode: bool):
    """A step of B sequences: chunk start a, chunk length n (1 when decoding), cached tokens
    (a multiple of 16 up to the chunk start), cache slots and block tables of 64-token blocks."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 6, (1,), generator=g))
    start = torch.randint(0, 300, (B,), generator=g)
    n = torch.ones(B, dtype=torch.int64) if decode else torch.randint(1, 40, (B,), generator=g)
    cached = (torch.rand(B, generator=g) * start).long() // 16 * 16
    slots = torch.randperm(B + 3, generator=g)[:B]
    seq = torch.arange(B).repeat_interleave(n)
    pos = torch.cat([torch.arange(int(s), int(s + k)) for s, k in zip(start, n, strict=True)])
    table = torch.randperm(200, generator=g)[: B * 8].view(B, 8)
    return pos, seq, start[seq], n[seq], slots[seq], cached, table


@pytest.mark.parametrize("ratio,span,rows", [(2, 2, 0), (2, 2, 2), (1, 1, 0), (4, 8, 8),
                                             (128, 128, 128), (4, 4, 3)])  # fmt: skip
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compressor_groups_equal_reference(ratio, span, rows, decode, seed):
    args = (*_step(seed, decode), ratio, span, rows, 64, 199, 7)
    want = compressor_groups_ref(*args)
    got = compressor_groups_triton(*args)
    names = ("token", "valid", "entry", "dest", "first", "from_new", "new_idx", "tail_idx",
             "tail_write")  # fmt: skip
    for name, x, y in zip(names, got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), (name, x, y)
    if 1 < ratio <= 4 and not decode:
        assert want[1].any()  # some group ends in the step: the compaction is exercised


def test_compressor_groups_empty_step():
    args = (*(torch.zeros(0, dtype=torch.int64),) * 5, torch.zeros(2, dtype=torch.int64),
            torch.zeros(2, 4, dtype=torch.int64), 2, 2, 2, 64, 9, 3)  # fmt: skip
    for x, y in zip(compressor_groups_triton(*args), compressor_groups_ref(*args), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
