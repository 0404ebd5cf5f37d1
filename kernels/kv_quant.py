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
    """Round |v| <= 6 to the E2M1 grid, ties to the even code (codes 0..7). Comparisons with
    Python constants only: no host-to-device copy (safe inside a CUDA graph capture)."""
    mag = v.abs()
    code = torch.zeros_like(mag, dtype=torch.int64)
    for m in _E2M1_MIDS:  # ties fall to the lower code
        code += (mag > m).to(torch.int64)
    odd = code % 2 == 1
    tie = torch.zeros_like(mag, dtype=torch.bool)
    for i, m in enumerate(_E2M1_MIDS):
        tie |= (mag == m) & (code == i)
    code = code + (tie & odd).to(torch.int64)
    level = torch.zeros_like(mag)
    for i, lv in enumerate(_E2M1_LEVELS[1:], start=1):
        level = torch.where(code == i, lv, level)
    return torch.copysign(level, v)


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


# ---- packed storage (the KV cache's real bytes) --------------------------------------------
#
#   fp8    codes float8_e4m3fn [N, D]      scale uint8 e8m0 [N, D/32]     (528 B at D = 512)
#   nvfp4  codes uint8 [N, D/2]            scale float8_e4m3fn [N, D/16]  (288 B)
#   mxfp4  codes uint8 [N, D/2]            scale uint8 e8m0 [N, D/32]     ( 68 B at D = 128)
# fp4 bytes hold channel 2j in the low nibble and 2j+1 in the high one (the checkpoint's order).
# ``kv_unpack(*kv_pack(x, f), f)`` equals ``kv_qdq(x, f, KV_BLOCKS[f])`` bit for bit.

KV_BLOCKS = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}
KV_FORMATS = ("float", *KV_BLOCKS)


def kv_row_bytes(fmt: str, dim: int, float_bytes: int = 4) -> int:
    """Bytes of one stored row of ``dim`` channels in ``fmt`` ("float": ``float_bytes`` each)."""
    if fmt == "float":
        return dim * float_bytes
    b = KV_BLOCKS[fmt]
    return (dim if fmt == "fp8" else dim // 2) + dim // b


def kv_storage(fmt: str, rows: int, dim: int, dtype: torch.dtype, device) -> tuple:
    """Zeroed (codes, scale) tensors of ``rows`` rows; "float" gives (``dtype`` [rows, dim],
    None)."""
    if fmt == "float":
        return torch.zeros(rows, dim, dtype=dtype, device=device), None
    b = KV_BLOCKS[fmt]
    if dim % b:
        raise ValueError(f"{fmt} rows need a multiple of {b} channels, got {dim}")
    if fmt == "fp8":
        codes = torch.zeros(rows, dim, dtype=torch.float8_e4m3fn, device=device)
    else:
        codes = torch.zeros(rows, dim // 2, dtype=torch.uint8, device=device)
    sdt = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    return codes, torch.zeros(rows, dim // b, dtype=sdt, device=device)


def _pow2_code(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 code (biased exponent) of fp32 powers of two."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def kv_pack(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` [N, D] -> (codes, scale) in ``fmt`` (fp8, nvfp4, mxfp4; see above)."""
    from kernels.quant import fp4_encode, pack_fp4

    b = KV_BLOCKS[fmt]
    n, d = x.shape
    g = x.float().reshape(n, d // b, b)
    amax = g.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = pow2_ceil(amax.clamp_min(1e-4) / 448.0)
        codes = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, d)
        return codes, _pow2_code(scale).reshape(n, d // b)
    if fmt == "mxfp4":
        scale = pow2_ceil(amax.clamp_min(6 * 2.0**-126) / 6.0)
        sc = _pow2_code(scale).reshape(n, d // b)
    elif fmt == "nvfp4":
        s8 = (amax.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn)
        scale, sc = s8.float(), s8.reshape(n, d // b)
    else:
        raise ValueError(f"unknown KV format {fmt!r} ({', '.join(KV_BLOCKS)})")
    codes = fp4_encode((g / scale).clamp(-6, 6)).reshape(n, d)
    return pack_fp4(codes).view(torch.uint8), sc


def kv_unpack(
    codes: torch.Tensor, scale: torch.Tensor | None, fmt: str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`kv_pack` -> ``dtype`` [N, D] ("float" rows pass through)."""
    from kernels.quant import fp4_decode, unpack_fp4

    if fmt == "float":
        return codes.to(dtype)
    vals = codes.float() if fmt == "fp8" else fp4_decode(unpack_fp4(codes))
    n, d = vals.shape
    b = KV_BLOCKS[fmt]
    if fmt == "nvfp4":
        s = scale.float()
    else:
        s = torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.long() - 127)
    return (vals.reshape(n, d // b, b) * s.unsqueeze(-1)).reshape(n, d).to(dtype)
