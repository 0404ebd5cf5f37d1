"""Quantize-dequantize of KV-cache formats (torch reference), as the released V4.1 stores them.

- fp8:   e4m3 values, one power-of-two (ue8m0) scale per ``block`` channels, scale >= amax/448
- mxfp4: e2m1 values, one power-of-two scale per ``block`` channels, scale >= amax/6
- nvfp4: e2m1 values, one e4m3 scale (amax/6 rounded to e4m3) per ``block`` channels
E2M1 rounding is to nearest with ties to the even code. Output has the input's dtype.
"""

from __future__ import annotations

import torch

_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x for positive normal fp32 x (exact, via the exponent bits)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    bump = ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exp + bump) << 23).view(torch.float32)


def _round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round |v| <= 6 to the E2M1 grid, ties to the even code (codes 0..7)."""
    mag = v.abs()
    mids = mag.new_tensor(_E2M1_MIDS)
    levels = mag.new_tensor(_E2M1_LEVELS)
    code = torch.bucketize(mag, mids)  # ties fall to the lower code
    tie = mag == mids[code.clamp_max(6)]
    code = code + (tie & (code % 2 == 1)).to(code.dtype)
    return torch.copysign(levels[code], v)


def kv_qdq(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Quantize then dequantize the last dim of ``x`` in groups of ``block`` channels."""
    c = x.shape[-1]
    g = torch.nn.functional.pad(x.float(), (0, -c % block)).unflatten(-1, (-1, block))
    amax = g.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = pow2_ceil(amax.clamp_min(1e-4) / 448.0)
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif fmt == "mxfp4":
        scale = pow2_ceil(amax.clamp_min(6 * 2.0**-126) / 6.0)
        q = _round_e2m1((g / scale).clamp(-6, 6))
    elif fmt == "nvfp4":
        scale = (amax.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
        q = _round_e2m1((g / scale).clamp(-6, 6))
    else:
        raise ValueError(f"unknown KV format {fmt!r} (fp8, mxfp4, nvfp4)")
    return (q * scale).flatten(-2)[..., :c].to(x.dtype)
