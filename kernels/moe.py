"""Routed experts with the clamped SwiGLU: torch references and the Triton MegaMoE.

``y_e = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))``; ``out = sum_k w_k y_{e_k}``.

Triton path (``moe_fp8_triton`` / ``moe_fp4_triton``), no host sync (CUDA-graph safe):

1. ``_moe_align`` (one program): the T*k (token, slot) pairs grouped by local expert into
   tiles of BM rows, each tile one expert; non-local experts dropped.
2. ``_moe_gemm`` gated: ``[W1|W3] x`` for each tile, weights dequantized in registers
   (fp8 blocks or packed fp4: two values per PTX op), one MMA per scale group (32 or 128
   K columns) with its block scales applied to the fp32 partial, clamped SwiGLU in the epilogue
   -> H [rows, I]; with split-K (small batches) fp32 partials + ``_swiglu_reduce``. The MMA is
   fp16 at decode tile heights (activations stored as fp16 x 2^-4), bf16 at prefill tiles, or
   fp8 x fp8 with ``act_fp8`` (activations quantized per row and 32 columns, in the loop or,
   with ``prequant``, once by ``_quant_act_kernel``). Packed fp4 is read in the checkpoint's
   MX layout or, repacked at load time, in the *pairs* layout (:func:`fp4_to_pairs`: one byte
   = the same column of a W1 and a W3 row), whose dequantization is elementwise in the MMA
   operand's register layout (no nibble interleave): 20% faster at 64 tokens on an H200.
3. ``_moe_gemm`` plain: ``W2 h`` -> Y [split, rows, d] fp32 (pairs: rows n and n + d/2 of
   W2 per byte, two row sets per tile like the gated GEMM).
4. ``_moe_combine``: ``out[t] = sum_j w[t,j] * sum_s Y[s, row(t,j)]`` in a fixed order
   (deterministic; no atomics).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from kernels import moe_decode
from kernels.dispatch import capability, op, sm_count, split_counters
from kernels.kv_quant import e2m1_to_f32
from kernels.quant import dequantize_fp4, dequantize_fp8_block, is_e8m0


def swiglu_clamp(h1: torch.Tensor, h3: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(h1, limit)) * clamp(h3, -limit, limit)`` (limit <= 0 disables the clamp)."""
    if limit > 0:
        h1 = h1.clamp(max=limit)
        h3 = h3.clamp(-limit, limit)
    return torch.nn.functional.silu(h1) * h3


def moe_experts_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w2: list[torch.Tensor],
    w3: list[torch.Tensor],
    limit: float,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    """``x`` [T, d], ``ids``/``weights`` [T, k]; per-expert weights w1/w3 [I, d], w2 [d, I]
    -> [T, d] in ``out_dtype`` (default ``x.dtype``; the sum over experts is fp32).

    Experts absent from ``w1`` (None) are not local to this rank and contribute nothing;
    neither does id -1 (an empty slot).
    ``act_fp8``: both GEMMs' activations rounded by :func:`fake_quant_act` (h after a bf16
    round trip, as the kernels store it), per ``act_group`` columns (default ``ACT_GROUP``;
    0 = one scale per row).
    """
    group = ACT_GROUP if act_group is None else act_group
    out = torch.zeros(
        x.shape[0], w2[0].shape[0] if w2 else x.shape[1], dtype=torch.float32, device=x.device
    )
    flat_ids = ids.reshape(-1)
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    flat_w = weights.reshape(-1).float()
    for e in torch.unique(flat_ids).tolist():
        if e < 0 or w1[e] is None:  # -1: an empty slot (EP padding rows)
            continue
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        t = tok[sel]
        xe = fake_quant_act(x[t], group) if act_fp8 else x[t]
        h = swiglu_clamp(xe @ w1[e].t(), xe @ w3[e].t(), limit)
        if act_fp8:
            h = fake_quant_act(h.to(torch.bfloat16).to(h.dtype), group)
        y = (h @ w2[e].t()).float() * flat_w[sel].unsqueeze(-1)
        out.index_add_(0, t, y)
    return out.to(out_dtype or x.dtype)


moe_experts = moe_experts_ref

ACT_GROUP = 32  # fp8 activations: one scale per row and 32 columns


def fake_quant_act(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Round ``x`` [..., K] like the kernels' fp8 activations: per row and ``group`` columns
    (0: the whole row), scale = amax / 448 (fp32), values rounded to e4m3; returns
    dequantized values."""
    xf = x.float().unflatten(-1, (-1, group or x.shape[-1]))
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0
    q = (xf / scale).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2).to(x.dtype)


def _stacked_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    offset: int,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    n_exp = max(int(ids.max()) + 1, offset + w13.shape[0])
    inter = w13.shape[1] // 2
    w1: list = [None] * n_exp
    w3: list = [None] * n_exp
    w2s: list = [None] * n_exp
    for i in range(w13.shape[0]):
        w1[offset + i], w3[offset + i] = w13[i, :inter], w13[i, inter:]
        w2s[offset + i] = w2[i]
    w2s = [w if w is not None else w2[0] for w in w2s]  # only shapes are read for non-local
    return moe_experts_ref(x, ids, weights, w1, w2s, w3, limit, act_fp8, out_dtype, act_group)


def moe_fp8_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    block: tuple[int, int],
    limit: float,
    local_expert_offset: int = 0,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    """Dequantize stacked fp8 experts (``w13`` [E, 2I, d] = W1|W3, ``w2`` [E, d, I]) to
    ``x.dtype`` and run :func:`moe_experts_ref`; expert ``offset + i`` is ``w13[i]``."""
    w13f = dequantize_fp8_block(w13, s13, block, x.dtype)
    w2f = dequantize_fp8_block(w2, s2, block, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset, act_fp8,
                        out_dtype, act_group)


def moe_fp8_rows_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 128,
) -> torch.Tensor:
    """Experts in the *fp8 rows* layout (:func:`fp4_to_fp8_rows`): e4m3 ``w13`` [E, 2I, d]
    and ``w2`` [E, d, I], one fp32 scale per row (``s13`` [E, 2I], ``s2`` [E, d]), dequantized
    to ``x.dtype``; ``act_fp8`` rounds the activations per ``act_group`` columns."""
    w13f = (w13.float() * s13.float().unsqueeze(-1)).to(x.dtype)
    w2f = (w2.float() * s2.float().unsqueeze(-1)).to(x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset, act_fp8,
                        out_dtype, act_group)


def moe_fp4_ref(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    act_fp8: bool = False,
    pairs: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Packed fp4 experts (``w13`` [E, 2I, d/2] int8 + [E, 2I, d/32] scales, ``w2``
    [E, d, I/2] + [E, d, I/32]) dequantized to ``x.dtype``, then :func:`moe_experts_ref`.
    ``pairs``: the weights are in the :func:`fp4_to_pairs` layout (unpacked here first)."""
    if pairs:
        w13, w2 = fp4_from_pairs(w13), fp4_from_pairs(w2)
    w13f = dequantize_fp4(w13, s13, x.dtype)
    w2f = dequantize_fp4(w2, s2, x.dtype)
    return _stacked_ref(x, ids, weights, w13f, w2f, limit, local_expert_offset, act_fp8,
                        out_dtype)


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
    even. The prefill kernels multiply it on the fp8 tensor cores with one
    promotion per activation group and the row scale applied once, in the epilogue."""
    w = dequantize_fp4(packed, scales, torch.float32)
    amax = w.abs().amax(-1)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax, 448.0) / 448.0))
    scale = torch.exp2(e)
    q = (w / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    exact = (q.float() * scale.unsqueeze(-1) == w).all(-1)
    return q, scale, exact


# ---- Triton ---------------------------------------------------------------------------

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Packed dequantization in PTX (GPU only; the interpreter runs the plain-Triton twin below).
# Two bytes are spread into the two 16-bit halves of a register (prmt), their bits moved to
# bf16 positions (shift/and/or), and one bf16x2 multiply re-biases the exponent:
# e4m3 s.eeee.mmm -> bf16 bits (s<<15 | eeeemmm<<4) * 2^120; e2m1 s.ee.m -> bf16 bits
# (s<<15 | eem<<6) * 2^126. Subnormal codes (e = 0) become bf16 subnormals that the multiply
# makes exact. Two values per op, no lookup tables; block scales go on the accumulator.
_FP8_ASM = tl.constexpr("""{
.reg .b32 t0, t1, a0, a1, u0, u1, c, z;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shl.b32 a0, t0, 4;  and.b32 a0, a0, 0x07F007F0;
shl.b32 u0, t0, 8;  and.b32 u0, u0, 0x80008000;  or.b32 a0, a0, u0;
shl.b32 a1, t1, 4;  and.b32 a1, a1, 0x07F007F0;
shl.b32 u1, t1, 8;  and.b32 u1, u1, 0x80008000;  or.b32 a1, a1, u1;
mov.b32 c, 0x7B807B80;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, a0, c, z;
fma.rn.bf16x2 $1, a1, c, z;
}""")

_FP4_ASM = tl.constexpr("""{
.reg .b32 t0, t1, a, u, c, z;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
shl.b32 a, t0, 6;  and.b32 a, a, 0x01C001C0;
shl.b32 u, t0, 12; and.b32 u, u, 0x80008000;  or.b32 a, a, u;  fma.rn.bf16x2 $0, a, c, z;
shl.b32 a, t1, 6;  and.b32 a, a, 0x01C001C0;
shl.b32 u, t1, 12; and.b32 u, u, 0x80008000;  or.b32 a, a, u;  fma.rn.bf16x2 $1, a, c, z;
shl.b32 a, t0, 2;  and.b32 a, a, 0x01C001C0;
shl.b32 u, t0, 8;  and.b32 u, u, 0x80008000;  or.b32 a, a, u;  fma.rn.bf16x2 $2, a, c, z;
shl.b32 a, t1, 2;  and.b32 a, a, 0x01C001C0;
shl.b32 u, t1, 8;  and.b32 u, u, 0x80008000;  or.b32 a, a, u;  fma.rn.bf16x2 $3, a, c, z;
}""")


# fp4 -> e4m3 x 2^-6 for the fp8 tensor cores and the fp16 path (kernels.moe_decode's PTX).
_FP4_E4M3_ASM = tl.constexpr(moe_decode.FP4_TO_E4M3_PTX)


# fp32 -> fp16 as an inline cvt after the fp32 multiply: the compiler otherwise may convert
# first and scale in fp16, which overflows for |x| > 65504.
_F16_ASM = tl.constexpr("cvt.rn.f16.f32 $0, $1;")


@triton.jit
def _f16_sixteenth(v, USE_ASM: tl.constexpr):
    """fp16(v * 2^-4) of fp32 ``v``: the input convention of the F16 GEMM path. The scale
    is exact; it keeps |v| up to 2^20 finite and bf16's 8 significant bits down to 2^-12.
    (The interpreter multiplies and converts in that order anyway.)"""
    if USE_ASM:
        return tl.inline_asm_elementwise(_F16_ASM, "=h,r", [v * 0.0625], dtype=tl.float16,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        return (v * 0.0625).to(tl.float16)


@triton.jit
def _as_gemm_input(h, dt: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr):
    """SwiGLU output ``h`` (fp32) as the W2 GEMM reads it: fp16 x 2^-4 on the F16 path."""
    if F16:
        return _f16_sixteenth(h, USE_ASM)
    else:
        return h.to(dt)


@triton.jit
def _dot(a, b, acc, CDT: tl.constexpr):
    """``acc + a @ b``; fp32 operands multiply exactly (not tf32)."""
    if tl.float32 == CDT:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _e4m3_rne(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32:
    3 mantissa bits for normals (|v| >= 2^-6), steps of 2^-9 below."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 of 23 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting rounds to an integer, ties to even
    sub = ((v * 512.0 + magic) - magic) * 0.001953125
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _e4m3_rows(x, USE_ASM: tl.constexpr):
    """fp32 rows ``x`` as :func:`fake_quant_act` rounds them: (e4m3(x / scale) with ties to
    even, scale = max(row amax, 1e-30) / 448 in fp32). The interpreter returns the e4m3 values
    in fp32 (its fp8 casts misround)."""
    sc = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / 448.0
    v = x / sc[:, None]
    return (v.to(tl.float8e4nv) if USE_ASM else _e4m3_rne(v)), sc


@triton.jit
def _scale(s_ptrs, SCALE_E8M0: tl.constexpr, LOG2_MUL: tl.constexpr):
    """Scales as fp32, times ``2^LOG2_MUL`` (the power-of-two factors of the F16 and e4m3
    re-encodings): e8m0 code c -> bits ``(c + LOG2_MUL) << 23`` = 2^(c - 127 + LOG2_MUL), the
    factor folded into the exponent for free (code 0, 2^-127, reads as 0 without a factor;
    codes above 254 - LOG2_MUL, scales of 2^118 and more, would overflow the exponent)."""
    raw = tl.load(s_ptrs)
    if SCALE_E8M0:
        return (((raw.to(tl.int32) & 0xFF) + LOG2_MUL) << 23).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32) * (2.0**LOG2_MUL)


@triton.jit
def _word_scale(word, J: tl.constexpr, LOG2_MUL: tl.constexpr):
    """:func:`_scale` of code ``J`` of four e8m0 codes read as one int32 (byte j = the scale
    of the j-th of four consecutive groups): the byte is shifted straight onto the fp32
    exponent and masked, one shift and one ``and`` per scale instead of a byte load."""
    bits = ((word >> 1) if J == 3 else (word << (23 - 8 * J))) & 0x7F800000
    return (bits + (LOG2_MUL << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_split(w_base, n, kb, swn, USE_ASM: tl.constexpr, CDT: tl.constexpr,
               NB: tl.constexpr, A_FP8: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    """The packed fp4 bytes [BN, NB] of rows ``n`` from byte column ``kb``: their low-nibble
    and high-nibble values [BN, NB] each. Codes become e4m3 x 2^-6 when ``A_FP8`` or ``F16``
    (then fp16: e4m3 -> fp16 is exact, one ``cvt`` per two values on sm_90), else CDT. Which
    weights the nibbles hold is the layout's business (:func:`_w_group`, :func:`_group_dot`,
    :func:`_pair_dot`)."""
    kh = kb + tl.arange(0, NB)
    q = tl.load(w_base + n[:, None] * swn + kh[None, :])  # [BN, NB] packed bytes
    if A_FP8 or F16:
        if USE_ASM:
            lo, hi = tl.inline_asm_elementwise(
                _FP4_E4M3_ASM, "=r,=r,r", [q], dtype=(tl.float8e4nv, tl.float8e4nv),
                is_pure=True, pack=4,
            )  # fmt: skip
        else:  # fp32 holding the e4m3 values (the interpreter's fp8 casts misround)
            b = q.to(tl.int32) & 0xFF
            lo = e2m1_to_f32(b & 0xF) * 0.015625
            hi = e2m1_to_f32(b >> 4) * 0.015625
        if F16:
            lo = lo.to(tl.float16)
            hi = hi.to(tl.float16)
    elif USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            _FP4_ASM, "=r,=r,=r,=r,r", [q], dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True, pack=4,
        )  # fmt: skip
    else:
        b = q.to(tl.int32) & 0xFF
        lo = e2m1_to_f32(b & 0xF).to(CDT)
        hi = e2m1_to_f32(b >> 4).to(CDT)
    return lo, hi


@triton.jit
def _w_group(w_base, n, kg, swn, FP4: tl.constexpr, USE_ASM: tl.constexpr,
             CDT: tl.constexpr, GK: tl.constexpr, A_FP8: tl.constexpr,
             F16: tl.constexpr):  # fmt: skip
    """One scale group of weight rows ``n``, columns ``[kg, kg+GK)``: the unscaled tile
    [BN, GK] (W = tile * scale[:, None], the scales from :func:`_moe_gemm`). The tile is
    e4m3 when ``A_FP8`` (fp8 weights as stored; fp4 codes re-encoded exactly as e4m3 * 2^-6),
    fp16 when ``F16`` (e4m3 -> fp16 is exact and one ``cvt`` per two values on sm_90; fp4 goes
    through the same e4m3 re-encoding first), else CDT. Packed fp4 in the MX layout (even
    column in the low nibble) is interleaved back (the pairs layout needs no interleave:
    :func:`_pair_dot`)."""
    if FP4:
        lo, hi = _fp4_split(w_base, n, kg // 2, swn, USE_ASM, CDT, GK // 2, A_FP8, F16)
        w = tl.reshape(tl.join(lo, hi), (n.shape[0], GK))  # even column = low nibble
    else:
        q = tl.load(w_base + n[:, None] * swn + (kg + tl.arange(0, GK))[None, :])
        if A_FP8:
            w = q
        elif F16:
            w = q.to(tl.float16)
        elif USE_ASM:
            w = tl.inline_asm_elementwise(
                _FP8_ASM, "=r,=r,r", [q.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                is_pure=True, pack=4,
            )  # fmt: skip
        else:
            w = q.to(tl.float32).to(CDT)
    return w


@triton.jit
def _group_dot(a_base, sa_base, rmask, kg, w_base, n, swn, s, acc, FP4: tl.constexpr,
               USE_ASM: tl.constexpr, CDT: tl.constexpr,
               GK: tl.constexpr, SCALE_ON_W: tl.constexpr, A_FP8: tl.constexpr,
               A_Q: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    """``acc + A[:, kg:kg+GK] @ W[n, kg:kg+GK]^T`` for one scale group (GK = 32 or 128), with
    the group's row scales ``s`` [BN] (fp32; see :func:`_moe_gemm` for their factors).

    A_FP8: the activation group is quantized in registers (row amax / 448 -> e4m3, the
    rounding of :func:`fake_quant_act`) and multiplied on the fp8 tensor cores; both scales
    go on the fp32 partial. A_Q (with A_FP8): the activations come quantized already
    (:func:`_quant_act_kernel`: e4m3 values, one fp32 scale per row and group at
    ``sa_base``), so the loop is loads, the fp8 MMA and the promotion of its partial.
    F16 (bf16 activations, scales on the partial): fp16 MMA on activations stored as fp16
    times 2^-4 (converted by the align launch, :func:`_align`; the 2^4 goes back in the
    scale), so the weights' dequantization is one ``cvt`` per two values instead of
    integer bit surgery. Else bf16 MMA: scales on the weight tile when many rows share it
    (BM >= 64: fewer multiplies, no second accumulator), else on the partial."""
    w = _w_group(w_base, n, kg, swn, FP4, USE_ASM, CDT, GK, A_FP8, F16)
    a, sa = _a_group(a_base, sa_base, rmask, kg, USE_ASM, GK, A_FP8, A_Q)
    return _w_dot(a, sa, w, s, acc, USE_ASM, CDT, SCALE_ON_W, A_FP8, F16, A_Q)


@triton.jit
def _a_group(a_base, sa_base, rmask, kg, USE_ASM: tl.constexpr, GK: tl.constexpr,
             A_FP8: tl.constexpr, A_Q: tl.constexpr):  # fmt: skip
    """The activation group [BM, GK] at column ``kg`` as the MMA takes it, with its per-row
    scales under ``A_FP8`` (quantized here, or loaded when ``A_Q``; else a placeholder 1)."""
    a = tl.load(a_base + (kg + tl.arange(0, GK))[None, :], mask=rmask[:, None], other=0.0)
    sa = 1.0
    if A_FP8:
        if A_Q >= 2:  # one scale per row over all of K: applied after the loop
            pass
        elif A_Q:  # one scale per row and GK columns (the host quantizes with the same group)
            sa = tl.load(sa_base + kg // GK, mask=rmask, other=0.0)
        else:
            a, sa = _e4m3_rows(a.to(tl.float32), USE_ASM)
    return a, sa


@triton.jit
def _w_dot(a, sa, w, s, acc, USE_ASM: tl.constexpr, CDT: tl.constexpr,
           SCALE_ON_W: tl.constexpr, A_FP8: tl.constexpr, F16: tl.constexpr,
           A_Q: tl.constexpr = 0):  # fmt: skip
    """``acc + (a @ w^T)`` with the activation scales ``sa`` [BM] (A_FP8) and the weight
    group's row scales ``s`` [BN] (see :func:`_group_dot`). ``A_Q == 2`` (row scales on
    both sides, applied after the loop): the fp8 MMAs accumulate in place."""
    if A_FP8 and A_Q >= 2:
        # the interpreter holds e4m3 values in fp32. On sm_90 Triton accumulates fp8 MMAs in
        # the tensor cores' fast (reduced-precision) mode across the whole K loop (A_Q 2), or
        # promotes to fp32 every 128 columns (A_Q 3, as CUTLASS without fast accumulation)
        wt = tl.trans(w) if USE_ASM else tl.trans(w.to(tl.float32))
        if A_Q == 3:
            return tl.dot(a, wt, acc, max_num_imprecise_acc=128)
        return tl.dot(a, wt, acc)
    elif A_FP8:
        # the interpreter holds e4m3 values in fp32
        part = tl.dot(a, tl.trans(w)) if USE_ASM else tl.dot(a, tl.trans(w.to(tl.float32)))
        return acc + part * sa[:, None] * s[None, :]
    elif F16:
        return acc + tl.dot(a, tl.trans(w)) * s[None, :]
    elif SCALE_ON_W:
        return _dot(a.to(CDT), tl.trans((w.to(tl.float32) * s[:, None]).to(CDT)), acc, CDT)
    else:
        zero = tl.zeros(acc.shape, tl.float32)
        return acc + _dot(a.to(CDT), tl.trans(w.to(CDT)), zero, CDT) * s[None, :]


@triton.jit
def _pair_dot(a_base, sa_base, rmask, kg, w_base, n, swn, s1, s3, acc1, acc3,
              USE_ASM: tl.constexpr, CDT: tl.constexpr, GK: tl.constexpr,
              SCALE_ON_W: tl.constexpr, A_FP8: tl.constexpr, A_Q: tl.constexpr,
              F16: tl.constexpr):  # fmt: skip
    """One scale group of fp4 experts in the *pairs* layout (:func:`fp4_to_pairs`): byte
    (n, k) holds W[n, k] in its low nibble and W[n + P, k] in its high one, so one byte tile
    [BN, GK] gives both row sets' tiles with the same (row, column) per element — the
    conversion is elementwise where the MMA operand lives, no interleave or shuffle."""
    lo, hi = _fp4_split(w_base, n, kg, swn, USE_ASM, CDT, GK, A_FP8, F16)
    a, sa = _a_group(a_base, sa_base, rmask, kg, USE_ASM, GK, A_FP8, A_Q)
    acc1 = _w_dot(a, sa, lo, s1, acc1, USE_ASM, CDT, SCALE_ON_W, A_FP8, F16)
    acc3 = _w_dot(a, sa, hi, s3, acc3, USE_ASM, CDT, SCALE_ON_W, A_FP8, F16)
    return acc1, acc3


@triton.jit
def _moe_gemm(
    a_ptr, sam, sa_ptr, ssa, rows_ptr, tile_e_ptr,
    w_ptr, swe, swn, s_ptr, sse, ssn, ssk,
    out_ptr, sos, som,
    n_slots, topk, N, K, k_per_split, limit,
    A_GATHER: tl.constexpr, GATED: tl.constexpr, FUSE_SWIGLU: tl.constexpr,
    FP4: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
    SCALE_E8M0: tl.constexpr, SCALE_WORDS: tl.constexpr, SB_N: tl.constexpr,
    SB_K: tl.constexpr, HAS_LIMIT: tl.constexpr, CDT: tl.constexpr, A_FP8: tl.constexpr,
    A_Q: tl.constexpr, F16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GK: tl.constexpr,
):  # fmt: skip
    """One (tile, N block, K split): ``acc = A[tile rows] @ W_e[n, k-range]^T``; with
    ``GATED`` also the W3 rows ``n + N`` (W1|W3 stacked). ``A_Q``: A is e4m3 with one scale
    per row and group at ``sa_ptr`` (row stride ``ssa``). ``GK``: K columns per MMA group
    (one weight scale group, and with fp8 activations one activation scale group).

    ``SB_K == 0``: one weight scale per row (the fp8 rows layout, :func:`fp4_to_fp8_rows`),
    applied to the accumulators once, after the K loop; the loop promotes only by the
    activation scales (fp8) or not at all (bf16 / fp16: the MMAs accumulate in place).
    ``A_Q`` 2 / 3 (with ``SB_K == 0``): fp8 activations with one scale per row over all of K
    (``ssa``-strided [rows, 1]), applied with the weights' after the loop: no promotion
    (3: fp32 promotion of the MMA accumulator every 128 columns).

    Scales: the re-encoding's 2^6 (fp4 codes as e4m3) and, under ``F16``, the 2^4 of the
    activations' fp16 x 2^-4 are folded into the scales' exponents (no multiply).
    ``SCALE_WORDS`` (e8m0 per 32 columns, BK a multiple of 128): ``s_ptr`` is the scales read
    as int32, ``ssn`` / ``sse`` in words, one load per row for four groups."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(tile_e_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pos = pid_m * BM + tl.arange(0, BM)
    slot = tl.load(rows_ptr + pos)
    rmask = slot < n_slots
    arow = slot // topk if A_GATHER else pos
    a_base = a_ptr + arow.to(tl.int64)[:, None] * sam
    sa_base = sa_ptr + arow.to(tl.int64) * ssa
    n = pid_n * BN + tl.arange(0, BN)
    w_base, s_base = w_ptr + e * swe, s_ptr + e * sse
    acc1 = tl.zeros((BM, BN), tl.float32)
    acc3 = tl.zeros((BM, BN), tl.float32)
    L2: tl.constexpr = (6 if FP4 and (A_FP8 or F16) else 0) + (4 if F16 else 0)
    s_row1 = s_base + (n // SB_N) * ssn
    s_row3 = s_base + ((n + N) // SB_N) * ssn
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        for g in tl.static_range(BK // GK):
            kg = k0 + g * GK
            if SB_K == 0:  # row scales: after the loop
                s1 = tl.full((BN,), 1.0, tl.float32)
                s3 = s1
            elif SCALE_WORDS:
                if g % 4 == 0:
                    sw1 = tl.load(s_row1 + kg // 128)
                    sw3 = tl.load(s_row3 + kg // 128) if GATED else sw1
                s1 = _word_scale(sw1, g % 4, L2)
                s3 = _word_scale(sw3, g % 4, L2)
            else:
                s1 = _scale(s_row1 + (kg // SB_K) * ssk, SCALE_E8M0, L2)
                s3 = _scale(s_row3 + (kg // SB_K) * ssk, SCALE_E8M0, L2) if GATED else s1
            if PAIRS:
                acc1, acc3 = _pair_dot(a_base, sa_base, rmask, kg, w_base, n, swn, s1, s3, acc1,
                                       acc3, USE_ASM, CDT, GK, BM >= 64, A_FP8, A_Q,
                                       F16)  # fmt: skip
            else:
                acc1 = _group_dot(a_base, sa_base, rmask, kg, w_base, n, swn, s1, acc1, FP4,
                                  USE_ASM, CDT, GK, BM >= 64, A_FP8, A_Q, F16)  # fmt: skip
                if GATED:
                    acc3 = _group_dot(a_base, sa_base, rmask, kg, w_base, n + N, swn, s3, acc3,
                                      FP4, USE_ASM, CDT, GK, BM >= 64, A_FP8, A_Q,
                                      F16)  # fmt: skip
    if SB_K == 0:
        acc1 = acc1 * _scale(s_row1, SCALE_E8M0, L2)[None, :]
        if GATED:
            acc3 = acc3 * _scale(s_row3, SCALE_E8M0, L2)[None, :]
    if A_Q >= 2:
        tl.static_assert(SB_K == 0, "row activation scales go with row weight scales")
        sa_row = tl.load(sa_base, mask=rmask, other=0.0)[:, None]
        acc1 = acc1 * sa_row
        acc3 = acc3 * sa_row
    o_ptrs = out_ptr + pid_k * sos + pos.to(tl.int64)[:, None] * som + n[None, :]
    if FUSE_SWIGLU:
        if HAS_LIMIT:
            acc1 = tl.minimum(acc1, limit)
            acc3 = tl.minimum(tl.maximum(acc3, -limit), limit)
        h = acc1 * tl.sigmoid(acc1) * acc3
        tl.store(o_ptrs, _as_gemm_input(h, out_ptr.dtype.element_ty, F16, USE_ASM))
    else:
        tl.store(o_ptrs, acc1)
        if GATED:
            tl.store(o_ptrs + N, acc3)


@triton.jit
def _swiglu_reduce(
    p_ptr, sps, spm, h_ptr, shm, tile_e_ptr, N, limit,
    SPLIT: tl.constexpr, HAS_LIMIT: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """H = swiglu(sum_s P[s, :, :N], sum_s P[s, :, N:]) for one tile and column block
    (F16: times 2^-4, the fp16 input convention of the next GEMM)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if tl.load(tile_e_ptr + pid_m) < 0:
        return
    pos = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    cmask = n[None, :] < N
    ptrs = p_ptr + pos[:, None] * spm + n[None, :]
    h1 = tl.zeros((BM, BN), tl.float32)
    h3 = tl.zeros((BM, BN), tl.float32)
    for s in tl.static_range(SPLIT):
        h1 += tl.load(ptrs + s * sps, mask=cmask, other=0.0)
        h3 += tl.load(ptrs + s * sps + N, mask=cmask, other=0.0)
    if HAS_LIMIT:
        h1 = tl.minimum(h1, limit)
        h3 = tl.minimum(tl.maximum(h3, -limit), limit)
    h = h1 * tl.sigmoid(h1) * h3
    tl.store(h_ptr + pos[:, None] * shm + n[None, :],
             _as_gemm_input(h, h_ptr.dtype.element_ty, F16, USE_ASM), mask=cmask)  # fmt: skip


@triton.jit
def _moe_combine(
    y_ptr, sys, sym, inv_ptr, w_ptr, out_ptr, som, D, topk,
    SPLIT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """``out[t, cols] = sum_j w[t, j] * sum_s Y[s, inv[t*k+j], cols]`` (fixed order)."""
    t, pid_d = tl.program_id(0), tl.program_id(1)
    cols = pid_d * BD + tl.arange(0, BD)
    cmask = cols < D
    acc = tl.zeros((BD,), tl.float32)
    for j in range(topk):
        slot = t * topk + j
        p = tl.load(inv_ptr + slot).to(tl.int64)
        w = tl.load(w_ptr + slot)
        m = cmask & (p >= 0)
        part = tl.zeros((BD,), tl.float32)
        for s in tl.static_range(SPLIT):
            part += tl.load(y_ptr + s * sys + p * sym + cols, mask=m, other=0.0).to(tl.float32)
        acc += w * part
    tl.store(out_ptr + t * som + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _moe_align(
    ids_ptr, n_slots, offset, n_local, rows_ptr, inv_ptr, tile_e_ptr, cursor_ptr,
    n_tiles, n_rows, x_ptr, xa_ptr, n_x, BM: tl.constexpr, NB: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, CONVERT: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    """Program 0: count slots per local expert (histogram), lay out BM-row tiles per expert
    (prefix sum), write each tile's expert, pad rows, then place every slot with an atomic
    cursor per expert. Row order inside an expert varies between runs; results do not (rows
    of a matrix product are independent, and the combine reads in slot order).
    ``CONVERT``: programs 1.. also write ``xa = fp16(x * 2^-4)`` (the F16 GEMMs' input),
    BLOCK values each, in the same launch."""
    if CONVERT:
        pid = tl.program_id(0)
        if pid > 0:
            i = (pid - 1) * BLOCK + tl.arange(0, BLOCK)
            v = tl.load(x_ptr + i, mask=i < n_x, other=0.0).to(tl.float32)
            tl.store(xa_ptr + i, _f16_sixteenth(v, USE_ASM), mask=i < n_x)
            return
    bins = tl.arange(0, NB)
    counts = tl.zeros((NB,), tl.int32)
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - offset
        local = (s < n_slots) & (e >= 0) & (e < n_local)
        counts += tl.histogram(tl.where(local, e, 0), NB, mask=local)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    first_row = (tile_end - tiles) * BM
    for t0 in range(0, n_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ex = tl.sum((tile_end[None, :] <= t[:, None]).to(tl.int32), axis=1)
        tl.store(tile_e_ptr + t, tl.where(ex < n_local, ex, -1), mask=t < n_tiles)
    for r0 in range(0, n_rows, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        tl.store(rows_ptr + r, tl.full((BLOCK,), 0, tl.int32) + n_slots, mask=r < n_rows)
    tl.store(cursor_ptr + bins, first_row)
    tl.debug_barrier()
    for s0 in range(0, n_slots, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        e = tl.load(ids_ptr + s, mask=s < n_slots, other=0).to(tl.int32) - offset
        local = (s < n_slots) & (e >= 0) & (e < n_local)
        p = tl.atomic_add(cursor_ptr + tl.where(local, e, 0), 1, mask=local)
        tl.store(rows_ptr + p, s, mask=local)
        tl.store(inv_ptr + s, tl.where(local, p, -1), mask=s < n_slots)


@triton.jit
def _quant_act_kernel(x_ptr, sx, q_ptr, sq, sc_ptr, ssc, n_rows, USE_ASM: tl.constexpr,
                      G: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """One group of ``G`` columns for ``BR`` rows quantized by :func:`_e4m3_rows`, as the
    in-loop A_FP8 path does (the interpreter stores the e4m3 values in fp32)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    g = tl.program_id(1)
    rmask = r < n_rows
    c = g * G + tl.arange(0, G)
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + c[None, :], mask=rmask[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    q, sc = _e4m3_rows(x, USE_ASM)
    tl.store(q_ptr + r.to(tl.int64)[:, None] * sq + c[None, :], q, mask=rmask[:, None])
    tl.store(sc_ptr + r.to(tl.int64) * ssc + g, sc, mask=rmask)


@triton.jit
def _quant_rows_kernel(x_ptr, sx, q_ptr, sq, sc_ptr, K, USE_ASM: tl.constexpr,
                       BK: tl.constexpr):  # fmt: skip
    """One row quantized with one scale over all of it (amax / 448, as :func:`_e4m3_rows`):
    a pass for the amax, a pass to round."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BK,), tl.float32)
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + r * sx + c, mask=c < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    sc = tl.maximum(tl.max(amax, axis=0), 1e-30) / 448.0
    for k0 in range(0, K, BK):
        c = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + r * sx + c, mask=c < K, other=0.0).to(tl.float32) / sc
        tl.store(q_ptr + r * sq + c, v.to(tl.float8e4nv) if USE_ASM else _e4m3_rne(v),
                 mask=c < K)  # fmt: skip
    tl.store(sc_ptr + r, sc)


def _quant_act(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [R, K] -> (e4m3 values [R, K], fp32 scales [R, K / group]); ``group`` 0: one
    scale per row ([R, 1]). fp32 values under the interpreter."""
    r, k = x.shape
    q = torch.empty(r, k, device=x.device,
                    dtype=torch.float32 if _INTERPRET else torch.float8_e4m3fn)  # fmt: skip
    if group == 0:
        sc = torch.empty(r, 1, device=x.device, dtype=torch.float32)
        if r:
            _quant_rows_kernel[(r,)](x, x.stride(0), q, q.stride(0), sc, k,
                                     USE_ASM=not _INTERPRET, BK=1024)  # fmt: skip
        return q, sc
    sc = torch.empty(r, k // group, device=x.device, dtype=torch.float32)
    if r:
        _quant_act_kernel[(triton.cdiv(r, 32), k // group)](
            x, x.stride(0), q, q.stride(0), sc, sc.stride(0), r, USE_ASM=not _INTERPRET,
            G=group, BR=32,
        )  # fmt: skip
    return q, sc


def _dot_dtype(x: torch.Tensor) -> tl.dtype:
    """MMA operands: bf16 (fp32 accumulation) for bf16/fp16 activations; fp32 (exact
    products) for fp32 activations and under the interpreter (it computes bf16 dots wrongly)."""
    return tl.float32 if _INTERPRET or x.dtype == torch.float32 else tl.bfloat16


def _align(
    ids: torch.Tensor,
    n_local: int,
    offset: int,
    bm: int,
    x: torch.Tensor | None = None,
    xa: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots by tile row [tiles*BM] int32 (pad = T*k), row of each slot [T*k] int32
    (-1 = not local), tile experts [tiles] int32 (-1 = idle)); one launch, no host sync.
    With ``x`` and ``xa`` the same launch writes ``xa = fp16(x * 2^-4)`` (the F16 path's
    activations; one launch fewer per layer).

    e.g. BM=2, slot experts [1,0,1] -> rows [1,-,0,2] (``-`` = pad; 0 and 2 in either
    order), tile experts [0,1]."""
    n_slots = ids.numel()
    n_tiles = moe_decode.tile_count(n_slots, n_local, bm)
    n_rows = n_tiles * bm
    dev = ids.device
    rows = torch.empty(n_rows, dtype=torch.int32, device=dev)
    inv = torch.empty(n_slots, dtype=torch.int32, device=dev)
    tile_e = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    nb = triton.next_power_of_2(n_local + 1)
    cursor = torch.empty(nb, dtype=torch.int32, device=dev)
    convert = x is not None and xa is not None
    n_x = x.numel() if convert else 0
    _moe_align[(1 + triton.cdiv(n_x, 1024),)](
        ids.reshape(-1), n_slots, offset, n_local, rows, inv, tile_e, cursor, n_tiles, n_rows,
        x if convert else ids, xa if convert else ids, n_x, BM=bm, NB=nb, BLOCK=1024,
        BLOCK_T=max(16, 8192 // nb), CONVERT=convert, USE_ASM=not _INTERPRET, num_warps=8,
    )  # fmt: skip
    return rows, inv, tile_e


def _num_sms(dev: torch.device) -> int:
    if dev.type == "cuda":
        return sm_count(dev)
    return 4


@dataclass(frozen=True)
class GemmTiles:
    """Launch shape of one grouped GEMM: N/K tile, K splits, warps, pipeline stages."""

    bn: int
    bk: int
    split: int = 1
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class MoeTiles:
    """Rows per tile (BM) and the two GEMMs' shapes; :func:`pick_tiles` chooses them."""

    bm: int
    gate_up: GemmTiles
    down: GemmTiles


def _gemm_tiles(
    bm: int,
    n: int,
    k: int,
    tiles: int,
    sms: int,
    min_bk: int,
    gated: bool,
    act_fp8: bool,
    prequant: bool = False,
    pairs: bool = False,
    rows: bool = False,
    row_act: bool = False,
) -> GemmTiles:
    bk = max(min_bk, next(b for b in (128, 64, 32) if k % b == 0))
    if bm >= 64:  # many rows per expert: no split (H200 sweeps, bench.kernels_moe --tiles)
        if rows and bm >= 128:  # H200 sweeps (bench.moe_prefill --sweep), 4096 tokens all
            # local: row activation scales 2.10 ms with these (2.31 with W2 128 wide, 3
            # stages); 128-column groups 2.93 ms; bf16 activations (fp16 MMA) 4.90 ms with W2
            # 256 wide, 3 stages (5.24 with the 64-row tiles)
            bn = next(b for b in (128, 64, 32) if n % b == 0)
            wide = 256 if not gated and n % 256 == 0 else bn
            if act_fp8 and row_act:
                return GemmTiles(wide, bk, 1, 8, 4)
            return GemmTiles(bn if act_fp8 else wide, bk, 1, 8, 3)
        if act_fp8:  # fp8 MMA, scales on fp32 partials: gated keeps three accumulators
            bn = next(b for b in ((64, 32) if gated else (128, 64, 32)) if n % b == 0)
            # pre-quantized: 4 warps, two CTAs per SM (one's MMAs under the other's scaling;
            # 4096 tokens all local: 6.8 ms vs 7.9 ms with the in-loop tile below)
            return GemmTiles(bn, bk, 1, 4, 3) if prequant else GemmTiles(bn, bk, 1, 8, 3)
        bn = next(b for b in (128, 64, 32) if n % b == 0)
        if pairs:  # fp4 pairs, bf16 MMA: 7.8 ms vs 10.6 ms with the fp8 tile (4096, all local)
            return GemmTiles(bn, bk, 1, 4, 3)
        return GemmTiles(bn, min(bk, 64), 1, 4, 4)
    bn = next(b for b in (64, 32) if n % b == 0)
    stages = 4
    if k % 256 == 0 and not act_fp8:  # H200 decode sweep: 2-6% faster than 128 at 1 and 64 tokens
        bk, stages = 256, 3  # (bench.kernels_moe --tiles decode)
    blocks = max(1, tiles) * (n // bn)
    split = max(1, min(k // bk // 2, -(-2 * sms // blocks)))
    return GemmTiles(bn, bk, split, 4, stages)


def pick_tiles(
    n_slots: int,
    n_local: int,
    n_experts: int,
    d: int,
    inter: int,
    sb_k: int,
    sms: int,
    act_fp8: bool = False,
    pairs: bool = False,
    prequant: bool = False,
    row_act: bool = False,
    half: bool = True,
) -> MoeTiles:
    """Heuristic tiles: BM from the expected rows per touched local expert; at decode sizes
    small N tiles and split-K so that the weight stream fills every SM. ``pairs`` (fp4 in
    the :func:`fp4_to_pairs` layout): a W2 tile covers two row sets, N is d/2. ``prequant``:
    fp8 activations quantized before the GEMMs (``act_fp8``). ``sb_k`` 0: the fp8 rows
    layout (one weight scale per row); ``row_act``: with one activation scale per row;
    ``half``: 16-bit MMA operands (fp32 ones keep the rows layout off its 128-row tiles, whose
    shared memory they would not fit)."""
    rows = sb_k == 0
    local_slots, touched = _local_load(n_slots, n_local, n_experts)
    per_expert = local_slots / touched
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if ((rows and (act_fp8 or half)) or (act_fp8 and not prequant)) and per_expert > 96:
        bm = 128
    tiles = int(touched) + int(local_slots // bm)
    min_bk = 0 if rows else min(sb_k, 128)
    return MoeTiles(
        bm,
        _gemm_tiles(bm, inter, d, tiles, sms, min_bk, True, act_fp8, prequant, pairs, rows,
                    row_act),  # fmt: skip
        _gemm_tiles(
            bm,
            d // 2 if pairs else d,
            inter,
            tiles,
            sms,
            min_bk,
            pairs,
            act_fp8,
            prequant,
            pairs,
            rows,
            row_act,
        ),
    )


def rows_per_expert(n_slots: int, n_local: int, n_experts: int) -> float:
    """Expected routed rows per touched local expert when ``n_slots`` (token, slot) pairs
    spread uniformly over ``n_experts`` of which ``n_local`` are here: what sizes the tiles
    (above 96: prefill tiles of 128 rows)."""
    local_slots, touched = _local_load(n_slots, n_local, n_experts)
    return local_slots / touched


def _local_load(n_slots: int, n_local: int, n_experts: int) -> tuple[float, float]:
    """(expected slots on the local experts, expected local experts touched)."""
    local_slots = max(1.0, n_slots * n_local / max(n_local, n_experts))
    return local_slots, min(float(n_local), local_slots)


def _check_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be contiguous [T, d], got {tuple(x.shape)}")
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"ids/weights must be [T, k]: {tuple(ids.shape)} {tuple(weights.shape)}")
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"stacked experts expected: {tuple(w13.shape)} {tuple(w2.shape)}")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("expert weights must be contiguous")


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if is_e8m0(s):
        return s.view(torch.uint8).contiguous(), True
    if s.dtype != torch.float32:
        raise ValueError(f"scales must be e8m0 or fp32, got {s.dtype}")
    return s.contiguous(), False


def _scale_launch(
    s: torch.Tensor, e8: bool, sb_k: int, bk: int, act_group: int | None = None
) -> tuple[tuple, dict]:
    """The scale arguments of one ``_moe_gemm`` launch: e8m0 codes per 32 columns with BK a
    multiple of 128 go as int32 words (four groups per load, ``SCALE_WORDS``); ``sb_k`` 0 =
    one scale per row ([E, N] scales). The MMA group ``GK``: the weight scale group (at most
    BK), or ``act_group`` (fixed fp8 activation groups), which must divide it."""
    gk = bk if sb_k == 0 or sb_k >= bk else sb_k
    if act_group:  # 0: one activation scale per row (rows layout), no MMA groups
        if gk % act_group:
            raise ValueError(f"activation groups of {act_group} columns do not divide the "
                             f"weight group / K tile ({gk})")  # fmt: skip
        gk = act_group
    if sb_k == 0:
        s = s.unsqueeze(-1)  # [E, N, 1]: the kernel's (expert, row, group) strides
    words = (
        e8
        and sb_k == 32
        and bk % 128 == 0
        and s.shape[-1] % 4 == 0
        and s.storage_offset() % 4 == 0
        and all(st % 4 == 0 for st in s.stride()[:-1])
    )  # else the int32 view fails
    if words:
        s = s.view(torch.int32)
    args = (s, s.stride(0), s.stride(1), s.stride(-1))
    return args, {"SCALE_E8M0": e8, "SCALE_WORDS": words, "GK": gk}


def _reduce_swiglu(part: torch.Tensor, h: torch.Tensor, tile_e: torch.Tensor, inter: int,
                   limit: float, bm: int, f16: bool) -> None:  # fmt: skip
    """H = SwiGLU(sum of the W13 GEMM's K-split partials ``part`` [split, rows, 2I])."""
    _swiglu_reduce[(tile_e.numel(), triton.cdiv(inter, 64))](
        part, part.stride(0), part.stride(1), h, h.stride(0), tile_e, inter, limit,
        SPLIT=part.shape[0], HAS_LIMIT=limit > 0, F16=f16, USE_ASM=not _INTERPRET, BM=bm, BN=64,
    )  # fmt: skip


def _y_buffer(x: torch.Tensor, split: int, n_rows: int) -> torch.Tensor:
    """The W2 GEMM's output: bf16 when one K split writes it whole (each expert's output
    rounded once, as the reference's bf16 ``h @ W2^T`` is; the combine still sums in fp32; at
    4096 tokens its fp32 write and read back were ~0.5 GB of traffic), else fp32 partials."""
    dt = torch.bfloat16 if split == 1 and x.dtype == torch.bfloat16 else torch.float32
    return torch.empty(split, n_rows, x.shape[1], dtype=dt, device=x.device)


def _combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor,
             out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out[t] = sum_j w[t, j] * sum_s Y[s, row(t, j)] (fixed order)."""
    t, d = out.shape
    topk = weights.shape[1]
    w = weights.reshape(-1).float().contiguous()
    bd = min(1024, triton.next_power_of_2(d))
    _moe_combine[(t, triton.cdiv(d, bd))](
        y, y.stride(0), y.stride(1), inv, w, out, out.stride(0), d, topk, SPLIT=y.shape[0], BD=bd
    )
    return out


def _moe_run(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    inter: int,
    fp4: bool,
    block: tuple[int, int],
    limit: float,
    offset: int,
    n_experts: int | None,
    tiles: MoeTiles | None,
    block_m: int | None,
    split_k: int | None,
    act_fp8: bool,
    pairs: bool = False,
    prequant: bool = False,
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    act_group: int | None = None,
    precise_acc: bool = False,
    row_refs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    if prequant and (not act_fp8 or (act_group is None and block[1] != ACT_GROUP)):
        raise ValueError(f"prequant needs act_fp8 and {ACT_GROUP}-column scale groups "
                         "(or an explicit act_group)")  # fmt: skip
    if act_group is not None and not act_fp8:
        act_group = None  # bf16 / fp16 activations have no groups
    if act_group == 0 and (block[1] != 0 or not prequant):
        raise ValueError("row activation scales (act_group 0) need row weight scales and "
                         "prequant")  # fmt: skip
    a_q = (3 if precise_acc else 2) if act_group == 0 else int(prequant)
    if fp16_mma and (act_fp8 or not 0 < limit <= 1024):
        raise ValueError("fp16_mma needs bf16 activations and a SwiGLU clamp in (0, 1024]")
    t, d = x.shape
    topk = ids.shape[1]
    n_local, n_slots = w13.shape[0], t * topk
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if n_slots == 0:
        return out
    if (tiles, block_m, split_k) != (None, None, None):
        row_refs = None  # the launch overrides shape ``_moe_gemm``'s launches
    if tiles is None:
        tiles = pick_tiles(n_slots, n_local, n_experts or n_local, d, inter, block[1],
                           _num_sms(x.device), act_fp8, pairs, prequant, a_q >= 2,
                           _dot_dtype(x) != tl.float32)  # fmt: skip
    tiles = _override(tiles, block_m, split_k)
    bm, g1, g2 = tiles.bm, tiles.gate_up, tiles.down
    n2 = d // 2 if pairs else d  # pairs: each W2 tile computes columns n and n + d/2
    if inter % g1.bn or n2 % g2.bn:  # the grids tile N exactly (no column masks)
        raise ValueError(f"tiles {tiles} do not divide I={inter} and the W2 N={n2}")
    # fp16 MMA for bf16 activations at decode tile heights (see _group_dot); BM >= 64 keeps
    # bf16 with the scales on the weight tile (fp16 could not hold every scaled weight). The
    # SwiGLU clamp bounds H by limit^2 (V4/V4.1: 10 -> 100), inside fp16 * 2^4's 2^20; no
    # clamp, no bound: bf16. The fp8 rows layout (sb_k 0) has no weight-tile scales, so it
    # takes fp16 MMA at every tile height (e4m3 -> fp16 is one cvt per two values).
    cdt = _dot_dtype(x)
    rows_layout = block[1] == 0
    f16 = (cdt == tl.bfloat16 and not act_fp8 and (bm < 64 or rows_layout)
           and 0 < limit <= 1024 and not _INTERPRET)  # fmt: skip
    if fp16_mma is not None:  # test hook (the interpreter runs the path too)
        f16 = fp16_mma
    if row_refs is not None and _decode_fits(x, s13, s2, d, inter, bm, pairs and f16):
        return _moe_run_decode(x, ids, weights, w13, s13, w2, s2, inter, limit, offset,
                               n_experts or n_local, row_refs, out)  # fmt: skip
    xa = torch.empty(x.shape, dtype=torch.float16, device=x.device) if f16 else None
    rows, inv, tile_e = _align(ids, n_local, offset, bm, x, xa)  # + x -> xa on the F16 path
    n_tiles, n_rows = tile_e.numel(), rows.numel()
    s13, e8_13 = _scale_arg(s13)
    s2, e8_2 = _scale_arg(s2)
    common = dict(HAS_LIMIT=limit > 0, CDT=cdt, FP4=fp4, PAIRS=pairs, SB_N=block[0],
                  SB_K=block[1], BM=bm, USE_ASM=not _INTERPRET, A_FP8=act_fp8, A_Q=a_q,
                  F16=f16)  # fmt: skip
    h_dtype = torch.float16 if f16 else torch.float32 if cdt == tl.float32 else torch.bfloat16
    h = torch.empty(n_rows, inter, dtype=h_dtype, device=x.device)
    k1 = -(-(d // g1.bk) // g1.split) * g1.bk
    scale_args, scale_kw = _scale_launch(s13, e8_13, block[1], g1.bk, act_group)
    xs = x  # the scales of the activations (A_Q)
    if xa is None:  # F16: converted by the align launch
        xa = x
        if prequant:
            xa, xs = _quant_act(x, 0 if a_q >= 2 else scale_kw["GK"])
    gate_args = (xa, xa.stride(0), xs, xs.stride(0), rows, tile_e, w13, w13.stride(0),
                 w13.stride(1))  # fmt: skip
    gate_args += scale_args
    grid1 = (n_tiles, inter // g1.bn, g1.split)
    launch1 = dict(BN=g1.bn, BK=g1.bk, num_warps=g1.warps, num_stages=g1.stages, **scale_kw)
    if g1.split == 1:
        _moe_gemm[grid1](*gate_args, h, 0, h.stride(0), n_slots, topk, inter, d, k1, limit,
                         A_GATHER=True, GATED=True, FUSE_SWIGLU=True, **launch1,
                         **common)  # fmt: skip
    else:
        part = torch.empty(g1.split, n_rows, 2 * inter, dtype=torch.float32, device=x.device)
        _moe_gemm[grid1](*gate_args, part, part.stride(0), part.stride(1), n_slots, topk, inter,
                         d, k1, limit, A_GATHER=True, GATED=True, FUSE_SWIGLU=False, **launch1,
                         **common)  # fmt: skip
        _reduce_swiglu(part, h, tile_e, inter, limit, bm, f16)
    y = _y_buffer(x, g2.split, n_rows)
    k2 = -(-(inter // g2.bk) // g2.split) * g2.bk
    scale_args, scale_kw = _scale_launch(s2, e8_2, block[1], g2.bk, act_group)
    ha, hs = _quant_act(h, 0 if a_q >= 2 else scale_kw["GK"]) if prequant else (h, h)
    _moe_gemm[(n_tiles, n2 // g2.bn, g2.split)](
        ha, ha.stride(0), hs, hs.stride(0), rows, tile_e, w2, w2.stride(0), w2.stride(1),
        *scale_args, y, y.stride(0), y.stride(1),
        n_slots, topk, n2, inter, k2, limit, A_GATHER=False, GATED=pairs, FUSE_SWIGLU=False,
        BN=g2.bn, BK=g2.bk, num_warps=g2.warps, num_stages=g2.stages, **scale_kw, **common,
    )  # fmt: skip
    return _combine(y, inv, weights, out)


# token slots (tokens x top-k) up to which the decode layer is two launches. H200,
# V4.1-Flash rank at top-6 (bench.moe_decode): 18.1 / 25.7 / 38.1 / 48.1 us at 1 / 2 / 4 / 8
# tokens against 21.8 / 28.2 / 39.2 / 49.6 for the four launches, 59.0 against 56.6 at 10
# tokens (60 slots, 16-row tiles)
FUSED_SLOTS = 48


def _decode_fits(x: torch.Tensor, s13: torch.Tensor, s2: torch.Tensor, d: int, inter: int,
                 bm: int, f16_pairs: bool) -> bool:  # fmt: skip
    """Whether :mod:`kernels.moe_decode`'s GEMMs take a call whose experts carry exact row
    references: fp4 pairs on the fp16 path at decode tile heights (BM <= 32), e8m0 scales,
    d and I multiples of 128, CUDA sm_89+ (the e4m3 -> fp16 cvt). Elsewhere ``_moe_gemm``."""
    return (
        f16_pairs and bm <= 32 and x.is_cuda and is_e8m0(s13) and is_e8m0(s2)
        and d % moe_decode.KB == 0 and inter % moe_decode.KB == 0
        and inter % moe_decode.BR == 0 and (d // 2) % moe_decode.BR == 0
        and capability(x.device) >= (8, 9)
    )  # fmt: skip


def _moe_run_decode(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    inter: int,
    limit: float,
    offset: int,
    n_all: int,
    refs: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
) -> torch.Tensor:
    """The MoE layer with :mod:`kernels.moe_decode`'s GEMMs (fp4 pairs, decode batches). Up
    to :data:`FUSED_SLOTS` token slots, when W13 splits K: the two GEMM launches alone
    (:func:`_moe_run_fused`); else four launches: align + x -> fp16 x 2^-4, W13 (+ SwiGLU;
    K splits summed by the last CTA of each tile's row block), W2, combine."""
    t, d = x.shape
    topk = ids.shape[1]
    n_local, n_slots = w13.shape[0], t * topk
    per = rows_per_expert(n_slots, n_local, n_all)
    bt = 8 if per <= 4 else 16 if per <= 12 else 32
    _, touched = _local_load(n_slots, n_local, n_all)
    tiles = touched + n_slots * n_local / max(n_local, n_all) / bt  # active tiles, expected
    sms = _num_sms(x.device)
    split1 = moe_decode.pick_split(tiles, inter, d, sms)
    split2 = moe_decode.pick_split(tiles, d // 2, inter, sms)
    q13, q2 = s13.view(torch.uint8), s2.view(torch.uint8)
    st = moe_decode.pick_stages(bt, tiles)
    if n_slots <= FUSED_SLOTS and split1 > 1:
        return _moe_run_fused(x, ids, weights, w13, q13, w2, q2, inter, limit, offset, refs,
                              out, bt, split1, split2, st)  # fmt: skip
    xa = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    rows, inv, tile_e = _align(ids, n_local, offset, bt, x, xa)  # and x -> fp16 x 2^-4
    n_rows = rows.numel()
    h = torch.empty(n_rows, inter, dtype=torch.float16, device=x.device)
    if split1 == 1:
        moe_decode.launch(xa, rows, tile_e, w13, q13, refs[0], h, n_slots, topk, inter, d, 1,
                          limit, True, True, bt, stages=st)  # fmt: skip
    else:
        part = torch.empty(split1, n_rows, 2 * inter, dtype=torch.float32, device=x.device)
        cnt = split_counters(tile_e.numel() * (inter // moe_decode.BR), x.device)
        moe_decode.launch(xa, rows, tile_e, w13, q13, refs[0], part, n_slots, topk, inter, d,
                          split1, limit, True, False, bt, stages=st, fin=h,
                          counters=cnt)  # fmt: skip
    y = _y_buffer(x, split2, n_rows)
    moe_decode.launch(h, rows, tile_e, w2, q2, refs[1], y, n_slots, topk, d // 2, inter, split2,
                      limit, False, False, bt, stages=st)  # fmt: skip
    return _combine(y, inv, weights, out)


def _moe_run_fused(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   w13: torch.Tensor, q13: torch.Tensor, w2: torch.Tensor, q2: torch.Tensor,
                   inter: int, limit: float, offset: int,
                   refs: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor, bt: int,
                   split1: int, split2: int, stages: int) -> torch.Tensor:  # fmt: skip
    """The decode layer in two launches (a few token slots): W13 lays out its own tiles
    from ``ids`` (the align launch's tiles, rows in slot order), converts x, sums its K
    splits and writes H; W2 writes fp32 partials and the last CTA of each row block
    combines them into ``out`` (the combine launch's order). The four launches' values, bit
    for bit."""
    t, d = x.shape
    topk = ids.shape[1]
    n_local, n_slots = w13.shape[0], t * topk
    n_tiles = moe_decode.tile_count(n_slots, n_local, bt)
    dev = x.device
    rows = torch.empty(n_tiles * bt, dtype=torch.int32, device=dev)
    inv = torch.empty(n_slots, dtype=torch.int32, device=dev)
    tile_e = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    h = torch.empty(n_tiles * bt, inter, dtype=torch.float16, device=dev)
    part = torch.empty(split1, n_tiles * bt, 2 * inter, dtype=torch.float32, device=dev)
    y = torch.empty(split2, n_tiles * bt, d, dtype=torch.float32, device=dev)
    cnt = split_counters(max(n_tiles * (inter // moe_decode.BR),
                                        d // 2 // moe_decode.BR), dev)  # fmt: skip
    moe_decode.launch(x.contiguous(), rows, tile_e, w13, q13, refs[0], part, n_slots, topk,
                      inter, d, split1, limit, True, False, bt, stages=stages, fin=h,
                      counters=cnt, route=(ids.reshape(-1), offset, n_local, inv))  # fmt: skip
    moe_decode.launch(h, rows, tile_e, w2, q2, refs[1], y, n_slots, topk, d // 2, inter, split2,
                      limit, False, False, bt, stages=stages, counters=cnt,
                      combine=(inv, weights.reshape(-1).float().contiguous(), out))  # fmt: skip
    return out


def _override(tiles: MoeTiles, block_m: int | None, split_k: int | None) -> MoeTiles:
    """Test hooks: force BM and/or the K splits of both GEMMs."""
    if split_k is not None:
        tiles = replace(tiles, gate_up=replace(tiles.gate_up, split=split_k),
                        down=replace(tiles.down, split=split_k))  # fmt: skip
    return replace(tiles, bm=block_m) if block_m is not None else tiles


def moe_fp8_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    block: tuple[int, int],
    limit: float,
    local_expert_offset: int = 0,
    block_m: int | None = None,
    split_k: int | None = None,
    *,
    n_experts: int | None = None,
    tiles: MoeTiles | None = None,
    act_fp8: bool = False,
    prequant: bool = False,
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    act_group: int | None = None,
) -> torch.Tensor:
    """MegaMoE over fp8 e4m3 block-scaled experts: ``w13`` [E, 2I, d] (W1 rows then W3 rows),
    ``s13`` [E, 2I/b0, d/b1], ``w2`` [E, d, I], ``s2`` [E, d/b0, I/b1] (e8m0 or fp32).

    ``x`` [T, d] bf16/fp32, ``ids``/``weights`` [T, k]; returns [T, d] in ``out_dtype``
    (default x.dtype; fp32 keeps the combine's fp32 sums, what an EP rank sends back).
    ``n_experts`` (all experts, local or not) sizes the tiles; ``tiles`` overrides them.
    ``act_fp8``: activations rounded to e4m3 per row and 32 columns (:func:`fake_quant_act`)
    and multiplied on the fp8 tensor cores, as DeepSeek's own inference does; else bf16.
    (With 128-column weight blocks (V4) the kernel's activation groups follow the weight
    group, min(128, BK) columns, not the reference's 32: only V4.1 blocks and fp4 experts
    match :func:`moe_fp8_ref` there.)
    ``prequant`` (with ``act_fp8``, 32-column scale groups): x and H are quantized once, in
    their own launches, instead of in every GEMM tile's loop (same rounding; meant for
    prefill tiles, where the loop should be loads, fp8 MMAs and promotion only).
    ``fp16_mma`` (test hook; None = auto): force the fp16-MMA path on or off (auto takes it at
    decode tile heights for bf16 activations under a clamp, on the GPU).
    ``act_group`` (with ``act_fp8``): fp8 activation groups of 32, 64 or 128 columns (must
    divide the weight group; V4's reference rounds activations per 128), also with
    ``prequant``.
    """
    _check_experts(x, ids, weights, w13, w2)
    if act_group is not None and act_group not in (32, 64, 128):
        raise ValueError(f"act_group must be 32, 64 or 128, got {act_group}")
    inter = w13.shape[1] // 2
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 e4m3 experts expected, got {w13.dtype} / {w2.dtype}")
    if w13.shape[2] != x.shape[1] or tuple(w2.shape[1:]) != (x.shape[1], inter):
        raise ValueError(f"expert shapes {tuple(w13.shape)} {tuple(w2.shape)} vs d={x.shape[1]}")
    if inter % block[0] or x.shape[1] % 32 or inter % 32:
        raise ValueError(f"I={inter} must divide by block {block} and d, I by 32")
    b0, b1 = block
    want13 = (w13.shape[0], -(-2 * inter // b0), -(-x.shape[1] // b1))
    want2 = (w2.shape[0], -(-x.shape[1] // b0), -(-inter // b1))
    if tuple(s13.shape) != want13 or tuple(s2.shape) != want2:
        raise ValueError(f"scales {tuple(s13.shape)} {tuple(s2.shape)}, want {want13} {want2}")
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, False, block, limit,
                    local_expert_offset, n_experts, tiles, block_m, split_k, act_fp8,
                    prequant=prequant, fp16_mma=fp16_mma, out_dtype=out_dtype,
                    act_group=act_group)  # fmt: skip


def moe_fp8_rows_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    act_fp8: bool = False,
    out_dtype: torch.dtype | None = None,
    act_group: int = 128,
    *,
    n_experts: int | None = None,
    tiles: MoeTiles | None = None,
    block_m: int | None = None,
    split_k: int | None = None,
    prequant: bool | None = None,
    fp16_mma: bool | None = None,
    precise_acc: bool = False,
) -> torch.Tensor:
    """MegaMoE over experts in the *fp8 rows* layout (:func:`fp4_to_fp8_rows`): e4m3 ``w13``
    [E, 2I, d] and ``w2`` [E, d, I] with one fp32 scale per row, ``s13`` [E, 2I], ``s2``
    [E, d]. The row scale goes on the accumulators after the K loop, so with ``act_fp8`` the
    loop's only promotion is the activations' scale, once per ``act_group`` columns (128:
    four fp8 MMAs per promotion; 0: one scale per row of x and of H, applied after the loop
    too, and the fp8 MMAs accumulate in place), and with bf16 activations the MMAs
    accumulate in place.
    ``prequant`` (default: with ``act_fp8``) quantizes x and H once, in their own launches.
    With one activation scale per row the fp8 MMAs accumulate in the tensor cores' fast
    mode over all of K; ``precise_acc`` promotes to fp32 every 128 columns instead.
    Same routing arguments and result as :func:`moe_fp8_triton`."""
    _check_experts(x, ids, weights, w13, w2)
    d, inter = x.shape[1], w13.shape[1] // 2
    if w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 e4m3 experts expected, got {w13.dtype} / {w2.dtype}")
    if w13.shape[2] != d or tuple(w2.shape[1:]) != (d, inter) or d % 32 or inter % 32:
        raise ValueError(f"expert shapes {tuple(w13.shape)} {tuple(w2.shape)} vs d={d} "
                         "(d and I multiples of 32)")  # fmt: skip
    if tuple(s13.shape) != tuple(w13.shape[:2]) or tuple(s2.shape) != tuple(w2.shape[:2]):
        raise ValueError(f"row scales {tuple(s13.shape)} {tuple(s2.shape)} do not fit the "
                         f"experts {tuple(w13.shape)} {tuple(w2.shape)}")  # fmt: skip
    if act_fp8 and act_group not in (0, 32, 64, 128):
        raise ValueError(f"act_group must be 0 (one scale per row), 32, 64 or 128, got {act_group}")
    prequant = act_fp8 if prequant is None else prequant
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, False, (1, 0), limit,
                    local_expert_offset, n_experts, tiles, block_m, split_k, act_fp8,
                    prequant=prequant, fp16_mma=fp16_mma, out_dtype=out_dtype,
                    act_group=act_group, precise_acc=precise_acc)  # fmt: skip


def moe_fp4_triton(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    s13: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    limit: float,
    local_expert_offset: int = 0,
    block_m: int | None = None,
    split_k: int | None = None,
    *,
    n_experts: int | None = None,
    tiles: MoeTiles | None = None,
    act_fp8: bool = False,
    pairs: bool = False,
    prequant: bool = False,
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    row_refs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """MegaMoE over packed fp4 experts, dequantized in-kernel: ``w13`` int8 [E, 2I, d/2]
    (W1 rows then W3 rows, even column in the low nibble), ``s13`` e8m0 [E, 2I, d/32],
    ``w2`` int8 [E, d, I/2], ``s2`` [E, d, I/32]. Split-K fills the GPU at 1-64 tokens.
    ``act_fp8`` as in :func:`moe_fp8_triton` (fp4 codes re-encoded as e4m3 in-kernel).
    ``pairs``: ``w13`` [E, I, d] and ``w2`` [E, d/2, I] in the layout of :func:`fp4_to_pairs`
    (one byte = the same column of two rows; the conversion is elementwise in the MMA
    operand's layout, for every path); d a multiple of 64.
    ``prequant``, ``fp16_mma`` and ``out_dtype`` as in :func:`moe_fp8_triton`.
    ``row_refs`` (r13, r2) of :func:`kernels.moe_decode.row_refs` for these scales, when
    exact: decode batches in the pairs layout then run :mod:`kernels.moe_decode`'s GEMMs
    where they apply (:func:`_decode_fits`); without them ``_moe_gemm`` runs every call."""
    _check_experts(x, ids, weights, w13, w2)
    d = x.shape[1]
    inter = w13.shape[1] if pairs else w13.shape[1] // 2
    if w13.dtype != torch.int8 or w2.dtype != torch.int8:
        raise ValueError(f"packed fp4 (int8) experts expected, got {w13.dtype} / {w2.dtype}")
    shapes = (d, (d // 2, inter)) if pairs else (d // 2, (d, inter // 2))
    if w13.shape[2] != shapes[0] or tuple(w2.shape[1:]) != shapes[1]:
        layout = "pairs" if pairs else "packed"
        raise ValueError(f"{layout} expert shapes {tuple(w13.shape)} {tuple(w2.shape)} vs d={d}")
    if d % (64 if pairs else 32) or inter % 32:
        raise ValueError(f"d={d} and I={inter} must divide by {64 if pairs else 32} and 32")
    if tuple(s13.shape) != (w13.shape[0], 2 * inter, d // 32) or tuple(s2.shape) != (
        w2.shape[0],
        d,
        inter // 32,
    ):
        raise ValueError(f"fp4 scales {tuple(s13.shape)} {tuple(s2.shape)} do not fit")
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, True, (1, 32), limit,
                    local_expert_offset, n_experts, tiles, block_m, split_k, act_fp8,
                    pairs, prequant, fp16_mma, out_dtype, row_refs=row_refs)  # fmt: skip


def _unused_n_experts(ref):
    """A reference with the kernels' ``n_experts`` and ``row_refs`` keywords (they only
    choose and size the kernels' launches)."""

    def run(*args: Any, n_experts: int | None = None, row_refs: Any = None,
            **kwargs: Any) -> torch.Tensor:  # fmt: skip
        return ref(*args, **kwargs)

    run.__doc__, run.__name__ = ref.__doc__, ref.__name__
    return run


moe_fp8 = op(_unused_n_experts(moe_fp8_ref), moe_fp8_triton)
moe_fp4 = op(_unused_n_experts(moe_fp4_ref), moe_fp4_triton)
moe_fp8_rows = op(_unused_n_experts(moe_fp8_rows_ref), moe_fp8_rows_triton)
