"""Layouts of stacked experts beside the checkpoint's: fp4 *pairs* (the Triton MoE's fast
layout: one byte = the same column of two rows) and *fp8 rows* (the prefill layout: e4m3 with
one power-of-two scale per row). Converted at load time, one expert at a time."""

from __future__ import annotations

import torch

from kernels.quant import dequantize_fp4


def fp4_to_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [..., R, C/2] from the MX layout to the *pairs* layout [..., R/2, C] of the
    Triton MoE: byte (r, c) holds W[r, c] in its low nibble and W[r + R/2, c] in its high one
    (W13: W1 and W3 rows share bytes; W2: the first and second half of d). Same bytes, same
    scales (still [..., R, C/32]); R % 2 == 0."""
    if packed.dim() < 2 or packed.shape[-2] % 2:
        raise ValueError(f"the pairs layout needs an even row count, got {tuple(packed.shape)}")
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # [..., R, C] in column order
    half = codes.shape[-2] // 2
    return (codes[..., :half, :] | (codes[..., half:, :] << 4)).view(packed.dtype)


def fp4_from_pairs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp4_to_pairs`."""
    b = packed.view(torch.uint8)
    codes = torch.cat((b & 0xF, b >> 4), dim=-2)  # [..., R, C]
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(packed.dtype)


def fp4_to_fp8_rows(
    packed: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed fp4 [..., R, C/2] (MX layout, e8m0 ``scales`` [..., R, C/32]) -> the *fp8 rows*
    layout: (e4m3 [..., R, C], one fp32 power-of-two scale per row [..., R], exact [..., R]).

    A row's scale is the least power of two that keeps its largest magnitude within e4m3's
    448, so a row is exact whenever its 32-column scales span at most 14 binades (the
    smallest nonzero code, 0.5, then stays at or above e4m3's 2^-9; sufficient, not
    necessary: ``exact`` checks each row's round trip); an inexact row is rounded to nearest
    even. The kernels apply the row scale once, after the K loop (with fp8 activations on the
    fp8 tensor cores, the activations' row scale too)."""
    w = dequantize_fp4(packed, scales, torch.float32)
    amax = w.abs().amax(-1)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax, 448.0) / 448.0))
    scale = torch.exp2(e)
    q = (w / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    exact = (q.float() * scale.unsqueeze(-1) == w).all(-1)
    return q, scale, exact
