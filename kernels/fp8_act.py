"""fp8 activations as the release rounds them (Triton): per token, groups of ``group``
columns, amax floored at 1e-4, a power-of-two (e8m0) scale, e4m3 values (nearest, ties to
even). The torch references are ``kernels.quant.quantize_fp8_act`` / ``round_fp8_act``.

``act_quant``: x [..., K] -> (e4m3 [..., K], e8m0 [..., ceil(K/group)]), the fp8 GEMM's input
(``kernels.linear.fp8_act_linear``). ``act_round``: the same values dequantized in x's dtype
(exact in bf16 and fp32), for a GEMM that multiplies them in 16-bit or fp32 MMA.

One program per ``BR`` rows walks K in chunks of whole groups; a row's result depends on that
row only (the deterministic mode's requirement, ``kernels.invariant``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op
from kernels.kv_quant import _e4m3, _pow2_ceil
from kernels.quant import ACT_AMAX_FLOOR, e8m0_dtype, quantize_fp8_act, round_fp8_act

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def round_groups(g, FLOOR: tl.constexpr, HW_CVT: tl.constexpr):
    """Groups ``g`` [R, NG, G] (fp32) rounded as the release rounds them -> (e4m3 codes
    (int32), their values (fp32, unscaled), the groups' scales [R, NG] (fp32 powers of two),
    the scales' e8m0 codes (int32)): each scale from the group's amax (floored at ``FLOOR``;
    the release's ``amax * (1/448)`` rounded up to a power of two, from the bits), the values
    times the exact reciprocal, clamped to +-448 and rounded to e4m3. ``HW_CVT``: the GPU's
    e4m3 conversion (round to nearest even, as ``_e4m3`` computes from the bits under the
    interpreter, whose fp8 casts misround). Also the MoE kernels' SwiGLU epilogue
    (``kernels.moe_grouped``)."""
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), FLOOR)
    scale = _pow2_ceil(amax * (1.0 / 448.0))
    e = (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 1 / scale, exact
    v = tl.minimum(tl.maximum(g * inv[:, :, None], -448.0), 448.0)
    if HW_CVT:
        v8 = v.to(tl.float8e4nv)
        code = v8.to(tl.uint8, bitcast=True).to(tl.int32)
        val = v8.to(tl.float32)
    else:
        code, val = _e4m3(v)
    return code, val, scale, e


@triton.jit
def _act_quant_kernel(x_ptr, sx, q_ptr, sq, s_ptr, ss, M, K, FLOOR: tl.constexpr,
                      G: tl.constexpr, CH: tl.constexpr, BR: tl.constexpr,
                      ROUND: tl.constexpr, HW_CVT: tl.constexpr):  # fmt: skip
    """Rows ``[BR]`` x chunks of ``CH`` columns (CH // G groups) through
    :func:`round_groups`. ``ROUND``: the rounded values in x's dtype to ``q_ptr``, no scales;
    else the e4m3 codes as bytes and the scales' e8m0 codes."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < M
    r64 = r.to(tl.int64)
    for k0 in range(0, K, CH):
        c = k0 + tl.arange(0, CH)
        m = rm[:, None] & (c < K)[None, :]
        x = tl.load(x_ptr + r64[:, None] * sx + c[None, :], mask=m, other=0.0).to(tl.float32)
        code, val, scale, e = round_groups(tl.reshape(x, (BR, CH // G, G)), FLOOR, HW_CVT)
        if ROUND:
            out = tl.reshape(val * scale[:, :, None], (BR, CH))
            tl.store(q_ptr + r64[:, None] * sq + c[None, :], out.to(q_ptr.dtype.element_ty),
                     mask=m)  # fmt: skip
        else:
            tl.store(q_ptr + r64[:, None] * sq + c[None, :],
                     tl.reshape(code, (BR, CH)).to(tl.uint8), mask=m)  # fmt: skip
            j = k0 // G + tl.arange(0, CH // G)
            tl.store(s_ptr + r64[:, None] * ss + j[None, :], e.to(tl.uint8),
                     mask=rm[:, None] & (j * G < K)[None, :])  # fmt: skip


def _launch(x: torch.Tensor, group: int, round_: bool):
    if group < 1 or group & (group - 1):
        raise ValueError(f"activation groups are a power of two wide, got {group}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    n_groups = -(-k // group)
    ch = max(group, min(512, triton.next_power_of_2(k)))  # whole groups per chunk
    br = 4 if _INTERPRET else max(1, min(16, 4096 // ch))
    grid = (triton.cdiv(m, br),)
    common = dict(FLOOR=ACT_AMAX_FLOOR, G=group, CH=ch, BR=br, HW_CVT=not _INTERPRET)
    if round_:
        y = torch.empty(m, k, dtype=x.dtype, device=x.device)
        if m and k:
            _act_quant_kernel[grid](x2, x2.stride(0), y, y.stride(0), y, 0, m, k, ROUND=True,
                                    **common)  # fmt: skip
        return y.view(x.shape)
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, n_groups, dtype=torch.uint8, device=x.device)
    if m and k:
        _act_quant_kernel[grid](x2, x2.stride(0), q, q.stride(0), s, s.stride(0), m, k,
                                ROUND=False, **common)  # fmt: skip
    q = q.view(torch.float8_e4m3fn).view(x.shape)
    return q, s.view(e8m0_dtype()).view(*x.shape[:-1], n_groups)


def act_quant_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kernels.quant.quantize_fp8_act` (bit for bit)."""
    return _launch(x, group, round_=False)


def act_round_triton(x: torch.Tensor, group: int) -> torch.Tensor:
    """Triton :func:`~kernels.quant.round_fp8_act` (bit for bit) for bf16 / fp16 / fp32 x."""
    return _launch(x, group, round_=True)


act_quant = op(quantize_fp8_act, act_quant_triton, name="act_quant")
act_round = op(round_fp8_act, act_round_triton, name="act_round")
