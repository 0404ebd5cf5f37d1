"""App-independent dequantization for kernel references (MODEL_SPEC §5 layouts).

``fp8 block``: weight [..., R, C] e4m3, scale [..., ceil(R/br), ceil(C/bc)];
``fp4``: packed int8 [..., R, C/2] (even column in the LOW nibble), e8m0 scale [..., R, C/32].
Scales are e8m0 (uint8 / float8_e8m0fnu exponents, bias 127) or fp32 powers of two.
"""

from __future__ import annotations

import torch

FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def is_e8m0(scale: torch.Tensor) -> bool:
    """True for raw e8m0 scales (uint8 exponents or torch's float8_e8m0fnu)."""
    return scale.dtype == torch.uint8 or str(scale.dtype) == "torch.float8_e8m0fnu"


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 exponents -> fp32 ``2^(code-127)``; float scales pass through as fp32."""
    if is_e8m0(scale):
        code = scale.view(torch.uint8).to(torch.int32) - 127
        return torch.ldexp(torch.ones_like(code, dtype=torch.float32), code)
    return scale.float()


def dequant_fp8_blocks(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 [..., R, C] with block scales -> ``dtype`` [..., R, C] (math in fp32)."""
    br, bc = block
    r, c = w.shape[-2:]
    s = scale_to_float(scale).repeat_interleave(br, -2).repeat_interleave(bc, -1)
    return (w.float() * s[..., :r, :c]).to(dtype)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 [..., R, C/2] + per-32 scales [..., R, C/32] -> ``dtype`` [..., R, C]."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # [lo0, hi0, lo1, ...]
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    vals = table[codes.long()]
    group = vals.shape[-1] // scale.shape[-1]
    s = scale_to_float(scale).repeat_interleave(group, -1)
    return (vals * s).to(dtype)
