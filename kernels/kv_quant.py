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


def kv_qdq_ref(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
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
# ``kv_unpack(*kv_pack(x, f), f)`` equals ``kv_qdq(x, f, KV_BLOCKS[f])`` bit for bit (and the
# Triton kernels below the torch references, in every format).

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


def kv_pack_ref(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
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


# ---- Triton: one launch per pack / round-trip ----------------------------------------------
import os  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.dispatch import op  # noqa: E402

_FMT_CODE = {"fp8": 0, "mxfp4": 1, "nvfp4": 2}


@triton.jit
def _pow2_ceil(x):
    """Smallest power of two >= x for positive normal fp32 x, from the exponent bits."""
    bits = x.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v):
    """fp32 |v| <= 448 -> (e4m3fn code as int32, its value as fp32), round to nearest even,
    from the bits (the same rounding as a hardware cvt.rn, in the interpreter too)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    E = ((abits >> 23) & 0xFF) - 127
    m = abits & 0x7FFFFF
    keep = m >> 20
    rem = m & 0xFFFFF
    up = (rem > 0x80000) | ((rem == 0x80000) & ((keep & 1) == 1))
    keep = keep + up.to(tl.int32)
    E = E + (keep >> 3)
    keep = keep & 7
    normal = ((E + 7) << 3) | keep
    # subnormals (|v| < 2^-6): multiples of 2^-9, rounded half to even; 8 is the first normal
    t = a * 512.0
    q = tl.floor(t)
    frac = t - q
    qi = q.to(tl.int32)
    qi = qi + ((frac > 0.5) | ((frac == 0.5) & ((qi & 1) == 1))).to(tl.int32)
    code = tl.where(a < 2.0**-6, qi, normal)
    mag = tl.where(a < 2.0**-6, qi.to(tl.float32) * 2.0**-9,
                   ((E + 127) << 23 | (keep << 20)).to(tl.float32, bitcast=True))  # fmt: skip
    code = tl.where(a == 0.0, 0, code)
    mag = tl.where(a == 0.0, 0.0, mag)
    return code | sign, tl.where(sign != 0, -mag, mag)


@triton.jit
def _e2m1_code(v):
    """|v| <= 6 -> E2M1 code 0..15 (round to nearest, ties to the even code)."""
    m = tl.abs(v)
    c = ((m > 0.25).to(tl.int32) + (m > 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m > 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m > 3.5).to(tl.int32)
         + (m > 5.0).to(tl.int32))  # fmt: skip
    tie = ((m == 0.25) | (m == 0.75) | (m == 1.25) | (m == 1.75) | (m == 2.5) | (m == 3.5)
           | (m == 5.0))  # fmt: skip
    c = c + (tie & (c % 2 == 1)).to(tl.int32)
    return c + 8 * (v < 0).to(tl.int32)


@triton.jit
def e2m1_to_f32(code):
    """E2M1 code (int32 0..15, sign bit 3) -> fp32 from bits: e = (c>>1)&3, m = c&1; e = 0:
    m * 0.5, else 2^(e-1) (1 + m/2) (exponent e + 126, mantissa bit m). Shared by the
    kernels that read fp4 (attention's nvfp4 entries, the indexer's mxfp4 keys, MoE)."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _kv_pack_kernel(
    x_ptr, sx, c_ptr, sc, s_ptr, ss, y_ptr, sy, dst_ptr, N,
    D: tl.constexpr, B: tl.constexpr, FMT: tl.constexpr, QDQ: tl.constexpr,
    HAS_DST: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """Rows [BR, D] -> groups of B channels: scale from the group's amax, codes (packed two
    fp4 per byte, channel 2j low), or with QDQ the decoded values in x's dtype. HAS_DST:
    row i's codes and scales go to row ``dst[i]`` of the code and scale tensors (a cache
    write in the same launch)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < N
    d = tl.arange(0, D)
    w = tl.load(dst_ptr + r, mask=rm, other=0).to(tl.int64) if HAS_DST else r.to(tl.int64)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * sx + d[None, :], mask=rm[:, None], other=0.0)
    g = tl.reshape(x.to(tl.float32), (BR, D // B, B))
    amax = tl.max(tl.abs(g), axis=2)
    if FMT == 0:
        scale = _pow2_ceil(tl.maximum(amax, 1e-4) / 448.0)
    elif FMT == 1:
        scale = _pow2_ceil(tl.maximum(amax, 6 * 2.0**-126) / 6.0)
    else:
        # e4m3 saturates at 448 (as torch's cast): amax / 6 above it keeps the top scale
        s8, scale = _e4m3(tl.minimum(tl.math.div_rn(tl.maximum(amax, 6 * 2.0**-9), 6.0), 448.0))
    v = tl.math.div_rn(g, scale[:, :, None])
    gs = tl.arange(0, D // B)
    if FMT == 0:
        q, qv = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
        if QDQ:
            out = qv * scale[:, :, None]
        else:
            tl.store(c_ptr + w[:, None] * sc + d[None, :],
                     tl.reshape(q, (BR, D)).to(tl.uint8), mask=rm[:, None])  # fmt: skip
    else:
        code = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0))
        if QDQ:
            out = e2m1_to_f32(code) * scale[:, :, None]
        else:
            lo, hi = tl.split(tl.reshape(code, (BR, D // 2, 2)))
            j = tl.arange(0, D // 2)
            tl.store(c_ptr + w[:, None] * sc + j[None, :],
                     (lo | (hi << 4)).to(tl.uint8), mask=rm[:, None])  # fmt: skip
    if QDQ:
        tl.store(y_ptr + r[:, None].to(tl.int64) * sy + d[None, :],
                 tl.reshape(out, (BR, D)).to(y_ptr.dtype.element_ty), mask=rm[:, None])
    else:
        sp = s_ptr + w[:, None] * ss + gs[None, :]
        if FMT == 2:
            tl.store(sp, s8.to(tl.uint8), mask=rm[:, None])
        else:  # e8m0: the biased exponent
            e = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
            tl.store(sp, e.to(tl.uint8), mask=rm[:, None])


def _rows_per_program(d: int) -> int:
    """Rows per program: about 2048 values (16 per thread at 4 warps). 16 rows of 512
    channels took 255 registers and spilled (sm_90), and at decode sizes most of them were
    masked."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 4
    return max(1, min(16, 2048 // d))


def _check(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int, int, int]:
    if fmt not in _FMT_CODE:
        raise ValueError(f"unknown KV format {fmt!r} ({', '.join(_FMT_CODE)})")
    b = KV_BLOCKS[fmt]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n, d = x2.shape
    if d % b or d & (d - 1):
        raise ValueError(f"{fmt} rows need a power-of-two multiple of {b} channels, got {d}")
    return x2, n, d, b


def _launch(x: torch.Tensor, fmt: str, qdq: bool):
    x2, n, d, b = _check(x, fmt)
    br = _rows_per_program(d)
    grid = (triton.cdiv(n, br),)
    if qdq:
        y = torch.empty_like(x2)
        if n:
            _kv_pack_kernel[grid](x2, x2.stride(0), y, 0, y, 0, y, y.stride(0), y, n, D=d, B=b,
                                  FMT=_FMT_CODE[fmt], QDQ=True, HAS_DST=False, BR=br)  # fmt: skip
        return y.view(x.shape)
    codes, scale = kv_storage(fmt, n, d, x.dtype, x.device)
    cu, su = codes.view(torch.uint8), scale.view(torch.uint8)  # codes written as bytes
    if n:
        _kv_pack_kernel[grid](x2, x2.stride(0), cu, cu.stride(0), su, su.stride(0),
                              codes, 0, cu, n, D=d, B=b, FMT=_FMT_CODE[fmt], QDQ=False,
                              HAS_DST=False, BR=br)  # fmt: skip
    return codes, scale


def kv_pack_triton(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`kv_pack` (same results, bit for bit): rows [N, D] -> (codes, scale)."""
    return _launch(x, fmt, qdq=False)


def kv_pack_into_ref(
    x: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: str
) -> None:
    """:func:`kv_pack` of ``x`` [N, D] stored at rows ``rows`` [N] (int64) of the cache
    tensors ``codes`` / ``scale`` (a repeated row, the trash row, keeps one of its writes)."""
    c, s = kv_pack_ref(x, fmt)
    codes.view(torch.uint8).index_copy_(0, rows, c.view(torch.uint8))
    scale.view(torch.uint8).index_copy_(0, rows, s.view(torch.uint8))


def kv_pack_into_triton(
    x: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, fmt: str
) -> None:
    """Triton :func:`kv_pack_into`: pack and store in one launch (no packed temporaries, no
    scatter launches)."""
    x2, n, d, b = _check(x, fmt)
    cu, su = codes.view(torch.uint8), scale.view(torch.uint8)
    if rows.shape != (n,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be integer [{n}], got {rows.dtype} {tuple(rows.shape)}")
    if cu.stride(1) != 1 or su.stride(1) != 1 or su.shape[1] != d // b:
        raise ValueError(f"{fmt} cache tensors of {d} channels with unit stride expected")
    if n:
        br = _rows_per_program(d)
        _kv_pack_kernel[(triton.cdiv(n, br),)](
            x2, x2.stride(0), cu, cu.stride(0), su, su.stride(0), cu, 0, rows.contiguous(), n,
            D=d, B=b, FMT=_FMT_CODE[fmt], QDQ=False, HAS_DST=True, BR=br,
        )  # fmt: skip


def kv_qdq_triton(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Triton :func:`kv_qdq` with the format's block (the last dim of any shape)."""
    return _launch(x, fmt, qdq=True)



def _qdq_triton(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    return kv_qdq_triton(x, fmt)


kv_pack = op(kv_pack_ref, kv_pack_triton)
kv_pack_into = op(kv_pack_into_ref, kv_pack_into_triton)
# the Triton kernel rounds with the format's own block (the one the model uses)
kv_qdq = op(kv_qdq_ref, _qdq_triton, when=lambda x, fmt, block: block == KV_BLOCKS.get(fmt))
