"""Checkpoint number formats: e8m0 scales, fp8 e4m3 blocks, packed fp4 (E2M1) experts.

The one quantization library of the project (the loader, the tiny-checkpoint writer and the
kernels' torch references all use it). Pure torch. Layouts (MODEL_SPEC §5); a leading batch
dimension (stacked experts [E, R, C]) is accepted by the dequantizers:

    fp8 block     weight [R, C] float8_e4m3fn, scale [ceil(R/br), ceil(C/bc)] e8m0
    fp8 rowwise   weight [R, C] float8_e4m3fn, scale [R, C/32] e8m0   (= block (1, 32))
    fp4           weight [R, C/2] int8, two codes per byte, EVEN column in the LOW nibble,
                  scale [R, C/32] e8m0
    fp8 act       x [..., K] float8_e4m3fn, scale [..., ceil(K/g)] e8m0   (= block (1, g))

Every scale is a power of two: the smallest one with ``amax / scale <= qmax``.

fp8 activations are what the release's inference (``inference/model.py``: ``linear()`` calls
``act_quant(x, block, "ue8m0", ...)`` before ``fp8_gemm`` / ``fp4_gemm``) multiplies its
quantized weights by: per token, groups of ``g`` columns (the checkpoint's weight block
columns: 32 on V4.1, 128 on V4), each group's amax floored at :data:`ACT_AMAX_FLOOR`, a
power-of-two scale, values rounded to e4m3 (nearest, ties to even).
Dequantization fills a preallocated output a few rows at a time, so no full-size fp32
temporary of a huge tensor (an Engram table) is ever built.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
FP4_MAX = 6.0
FP4_GROUP = 32
E8M0_BIAS = 127
ACT_AMAX_FLOOR = 1e-4  # the release's act_quant floors each group's amax here
# E2M1 code -> value (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_VALUES + tuple(-v for v in FP4_VALUES)
# Midpoints between successive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")
# Elements dequantized per chunk (bounds the fp32 temporaries to ~64 MiB).
_CHUNK_ELEMS = 1 << 24


def e8m0_dtype() -> torch.dtype:
    """The dtype scales are stored in: float8_e8m0fnu when torch has it, else uint8."""
    return torch.float8_e8m0fnu if _HAS_E8M0 else torch.uint8


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Decode e8m0 scales (float8_e8m0fnu, or uint8 exponents with bias 127) to fp32.

    Float scales (some checkpoints store fp32 powers of two) pass through as fp32.
    """
    if is_e8m0(scale):
        code = scale.view(torch.uint8).to(torch.int32) - E8M0_BIAS
        return torch.ldexp(torch.ones_like(code, dtype=torch.float32), code)
    if not scale.is_floating_point():
        raise TypeError(f"not an e8m0 or float scale dtype: {scale.dtype}")
    return scale.float()


def is_e8m0(scale: torch.Tensor) -> bool:
    """True for raw e8m0 scales (uint8 exponents or torch's float8_e8m0fnu)."""
    return scale.dtype == torch.uint8 or str(scale.dtype) == "torch.float8_e8m0fnu"


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Encode fp32 powers of two (2^-127 .. 2^127) as e8m0 (see :func:`e8m0_dtype`)."""
    mant, exp = torch.frexp(scale.float())  # scale = mant * 2^exp, mant in [0.5, 1)
    if not bool(((mant == 0.5) & (exp - 1 >= -E8M0_BIAS) & (exp - 1 <= E8M0_BIAS)).all()):
        raise ValueError("e8m0 encodes only powers of two in [2^-127, 2^127]")
    code = (exp - 1 + E8M0_BIAS).to(torch.uint8)
    return code.view(e8m0_dtype()) if _HAS_E8M0 else code


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two ``s`` with ``amax / s <= qmax`` (fp32; zero amax -> 2^-127)."""
    ratio = (amax.float() / qmax).clamp(min=2.0**-127)
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp).clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.ldexp(torch.ones_like(ratio), exp)


# ---- fp8 e4m3 blocks ------------------------------------------------------------------


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    br, bc = block
    r, c = w.shape
    rb, cb = -(-r // br), -(-c // bc)
    padded = torch.zeros(rb * br, cb * bc, dtype=torch.float32, device=w.device)
    padded[:r, :c] = w.float().abs()
    return padded.view(rb, br, cb, bc).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Scale [rb, cb] -> per-element [R, C] (blocks at the edges cropped)."""
    br, bc = block
    full = scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int], amax_floor: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight -> (float8_e4m3fn weight, e8m0 scale [ceil(R/br), ceil(C/bc)]); each block's
    amax taken at least ``amax_floor``."""
    if w.dim() != 2:
        raise ValueError(f"fp8 block quantization needs a 2-D tensor, got shape {tuple(w.shape)}")
    scale = pow2_scale(_block_amax(w, block).clamp_min(amax_floor), E4M3_MAX)
    q = (w.float() / _expand(scale, block, tuple(w.shape))).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), float_to_e8m0(scale)


def dequantize_fp8_block(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block`, computed in fp32 and returned as ``dtype``;
    ``q`` [R, C] or stacked [E, R, C] with ``scale`` [(E,) ceil(R/br), ceil(C/bc)]."""
    if q.dim() == 3:
        pairs = zip(q, scale, strict=True)
        return torch.stack([dequantize_fp8_block(qe, se, block, dtype) for qe, se in pairs])
    r, c = q.shape
    br, bc = block
    if tuple(scale.shape) != (-(-r // br), -(-c // bc)):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not fit weight {(r, c)} with block {block}"
        )
    s = e8m0_to_float(scale)
    out = torch.empty(r, c, dtype=dtype, device=q.device)
    step = max(br, (_CHUNK_ELEMS // max(c, 1)) // br * br)  # whole row blocks per chunk
    for r0 in range(0, r, step):
        r1 = min(r, r0 + step)
        sc = _expand(s[r0 // br : -(-r1 // br)], block, (r1 - r0, c))
        out[r0:r1] = (q[r0:r1].float() * sc).to(dtype)
    return out


def quantize_fp8_rowwise(
    w: torch.Tensor, group: int = FP4_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table [rows, dim] -> (e4m3 [rows, dim], e8m0 [rows, dim/group])."""
    return quantize_fp8_block(w, (1, group))


def dequantize_fp8_rowwise(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_rowwise`; the group is ``dim / scale.shape[1]``."""
    group = q.shape[1] // scale.shape[1]
    return dequantize_fp8_block(q, scale, (1, group), dtype)


def quantize_fp8_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x`` [..., K] -> (float8_e4m3fn [..., K], e8m0 scale [..., ceil(K/group)]),
    the release's ``act_quant`` (module doc); a last group narrower than ``group`` is one
    group of the columns left."""
    k = x.shape[-1]
    q, s = quantize_fp8_block(x.reshape(-1, k), (1, group), ACT_AMAX_FLOOR)
    return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])


def dequantize_fp8_act(
    q: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_act`: ``q`` [..., K], ``scale`` [..., ceil(K/group)]."""
    k = q.shape[-1]
    out = dequantize_fp8_block(q.reshape(-1, k), scale.reshape(-1, scale.shape[-1]),
                               (1, group), dtype)  # fmt: skip
    return out.view(q.shape)


def round_fp8_act(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` rounded as the release rounds a quantized GEMM's activations (quantized, then
    dequantized in fp32) in x's dtype: every value is an e4m3 value times a power of two,
    exact in bf16 / fp32."""
    return dequantize_fp8_act(*quantize_fp8_act(x, group), group, x.dtype)


# ---- fp4 E2M1 -------------------------------------------------------------------------


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Values (already divided by their scale) -> E2M1 codes (uint8, 0..15).

    Round to nearest; a tie goes to the even code (1.25 -> 1.0, 1.75 -> 2.0); |x| > 6
    saturates to 6. Negative values get sign bit 8. (Comparisons with Python constants: no
    host-to-device copy, so the KV cache's packing may run inside a CUDA graph.)
    """
    mag = x.float().abs()
    lo = torch.zeros_like(mag, dtype=torch.uint8)  # a tie picks the smaller magnitude
    hi = torch.zeros_like(lo)  # a tie picks the larger magnitude
    for m in _FP4_MIDPOINTS:
        lo += mag > m
        hi += mag >= m
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)
    return code + 8 * (x < 0).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0..15, any integer dtype) -> fp32 values."""
    c = codes.to(torch.int32)
    m = c & 7
    mag = torch.where(m < 2, 0.5 * m, (1 + 0.5 * (m & 1)) * torch.exp2(((m >> 1) - 1).float()))
    return torch.where(c >= 8, -mag, mag).float()


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [R, C] (C even) -> int8 [R, C/2]; column 2k in the low nibble, 2k+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [R, C/2] -> codes uint8 [R, C] (inverse of :func:`pack_fp4`)."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D weight [R, C] -> (packed int8 [R, C/2], e8m0 scale [R, C/group])."""
    r, c = w.shape
    if c % group:
        raise ValueError(f"fp4 quantization needs columns divisible by {group}, got {c}")
    g = w.float().view(r, c // group, group)
    scale = pow2_scale(g.abs().amax(dim=-1), FP4_MAX)
    codes = fp4_encode(g / scale.unsqueeze(-1)).view(r, c)
    return pack_fp4(codes), float_to_e8m0(scale)


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: packed [R, C/2] and scale [R, C/g] -> [R, C]
    (stacked [E, R, C/2] and [E, R, C/g] -> [E, R, C])."""
    if packed.dim() == 3:
        pairs = zip(packed, scale, strict=True)
        return torch.stack([dequantize_fp4(p, s, dtype) for p, s in pairs])
    r, half = packed.shape
    c = half * 2
    if scale.dim() != 2 or scale.shape[0] != r or c % scale.shape[1]:
        raise ValueError(f"fp4 scale shape {tuple(scale.shape)} does not fit weight {(r, c)}")
    group = c // scale.shape[1]
    s = e8m0_to_float(scale)
    out = torch.empty(r, c, dtype=dtype, device=packed.device)
    step = max(1, _CHUNK_ELEMS // max(c, 1))
    for r0 in range(0, r, step):
        r1 = min(r, r0 + step)
        vals = fp4_decode(unpack_fp4(packed[r0:r1])).view(r1 - r0, c // group, group)
        out[r0:r1] = (vals * s[r0:r1].unsqueeze(-1)).view(r1 - r0, c).to(dtype)
    return out
