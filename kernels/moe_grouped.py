"""The MegaMoE grouped GEMM (Triton): ``_moe_gemm`` and its in-register dequantization.

One program per (tile of BM routed rows of one expert, N block, K split): ``acc = A[tile
rows] @ W_e^T``, the weights dequantized in registers (fp8 blocks or packed fp4: two values
per PTX op), one MMA per scale group (32 or 128 K columns) with its block scales applied to
the fp32 partial. The MMA is fp16 at decode tile heights (activations stored as fp16 x
2^-4), bf16 at prefill tiles, or fp8 x fp8 for the fp8 rows layout's fp8 activations
(quantized once per launch, one scale per row on each side, both after the K loop) and for
the release's fp8 activations against fp8 block weights (a scale per token per group of
``SA_K`` columns: each group's fp8 partial is promoted to fp32 with both scales). Gated
(W1|W3) with the clamped SwiGLU in the epilogue, or plain (W2). ``kernels.moe`` launches it
for the MoE layer, ``kernels.linear`` with one group for the fp8 dense projections.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import moe_decode
from kernels.fp8_act import round_groups
from kernels.kv_quant import e2m1_to_f32
from kernels.quant import ACT_AMAX_FLOOR, is_e8m0

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
def _as_gemm_input(h, dt: tl.constexpr, F16: tl.constexpr, USE_ASM: tl.constexpr,
                   RG: tl.constexpr = 0):  # fmt: skip
    """SwiGLU output ``h`` (fp32, [rows, N]) as the W2 GEMM reads it: fp16 x 2^-4 on the F16
    path. ``RG`` > 0: first rounded as the release rounds W2's input (``kernels.fp8_act``,
    groups of ``RG`` columns, which the tile's columns hold whole); exact in bf16 / fp32."""
    if RG > 0:
        r: tl.constexpr = h.shape[0]
        c: tl.constexpr = h.shape[1]
        _, v, sc, _ = round_groups(tl.reshape(h, (r, c // RG, RG)), ACT_AMAX_FLOOR, USE_ASM)
        h = tl.reshape(v * sc[:, :, None], (r, c))
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
               NB: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    """The packed fp4 bytes [BN, NB] of rows ``n`` from byte column ``kb``: their low-nibble
    and high-nibble values [BN, NB] each. With ``F16`` the codes become e4m3 x 2^-6, then
    fp16 (e4m3 -> fp16 is exact, one ``cvt`` per two values on sm_90), else CDT. Which
    weights the nibbles hold is the layout's business (:func:`_w_group`, :func:`_group_dot`,
    :func:`_pair_dot`)."""
    kh = kb + tl.arange(0, NB)
    q = tl.load(w_base + n[:, None] * swn + kh[None, :])  # [BN, NB] packed bytes
    if F16:
        if USE_ASM:
            lo, hi = tl.inline_asm_elementwise(
                _FP4_E4M3_ASM, "=r,=r,r", [q], dtype=(tl.float8e4nv, tl.float8e4nv),
                is_pure=True, pack=4,
            )  # fmt: skip
        else:  # fp32 holding the e4m3 values (the interpreter's fp8 casts misround)
            b = q.to(tl.int32) & 0xFF
            lo = e2m1_to_f32(b & 0xF) * 0.015625
            hi = e2m1_to_f32(b >> 4) * 0.015625
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
    e4m3 when ``A_FP8`` (fp8 weights as stored), fp16 when ``F16`` (e4m3 -> fp16 is exact and
    one ``cvt`` per two values on sm_90; fp4 codes go through an exact e4m3 x 2^-6
    re-encoding first), else CDT. Packed fp4 in the MX layout (even column in the low
    nibble) is interleaved back (the pairs layout needs no interleave: :func:`_pair_dot`)."""
    if FP4:
        lo, hi = _fp4_split(w_base, n, kg // 2, swn, USE_ASM, CDT, GK // 2, F16)
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
def _group_dot(a_base, rmask, kg, w_base, n, swn, s, acc, FP4: tl.constexpr,
               USE_ASM: tl.constexpr, CDT: tl.constexpr,
               GK: tl.constexpr, SCALE_ON_W: tl.constexpr, A_FP8: tl.constexpr,
               F16: tl.constexpr):  # fmt: skip
    """``acc + A[:, kg:kg+GK] @ W[n, kg:kg+GK]^T`` for one scale group (GK = 32 or 128), with
    the group's row scales ``s`` [BN] (fp32; see :func:`_moe_gemm` for their factors).

    A_FP8 (fp8 rows layout): e4m3 activations quantized with one scale per row
    (``moe_align._quant_rows``) times the e4m3 weights on the fp8 tensor cores, both row
    scales after the K loop, so the MMAs accumulate in place. F16 (bf16 activations, scales
    on the partial): fp16 MMA on activations stored as fp16 times 2^-4 (converted by the
    align launch, ``moe_align._align``; the 2^4 goes back in the scale), so the weights'
    dequantization is one ``cvt`` per two values instead of integer bit surgery. Else bf16
    MMA: scales on the weight tile when many rows share it (BM >= 64: fewer multiplies, no
    second accumulator), else on the partial."""
    w = _w_group(w_base, n, kg, swn, FP4, USE_ASM, CDT, GK, A_FP8, F16)
    a = _a_group(a_base, rmask, kg, GK)
    return _w_dot(a, w, s, acc, USE_ASM, CDT, SCALE_ON_W, A_FP8, F16)


@triton.jit
def _a_group(a_base, rmask, kg, GK: tl.constexpr):
    """The activation group [BM, GK] at column ``kg`` as the MMA takes it."""
    return tl.load(a_base + (kg + tl.arange(0, GK))[None, :], mask=rmask[:, None], other=0.0)


@triton.jit
def _w_dot(a, w, s, acc, USE_ASM: tl.constexpr, CDT: tl.constexpr,
           SCALE_ON_W: tl.constexpr, A_FP8: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    """``acc + (a @ w^T)`` with the weight group's row scales ``s`` [BN] (see
    :func:`_group_dot`; A_FP8: the row scales of both sides come after the loop)."""
    if A_FP8:
        # the interpreter holds e4m3 values in fp32. On sm_90 Triton accumulates fp8 MMAs in
        # the tensor cores' fast (reduced-precision) mode across the whole K loop
        wt = tl.trans(w) if USE_ASM else tl.trans(w.to(tl.float32))
        return tl.dot(a, wt, acc)
    elif F16:
        return acc + tl.dot(a, tl.trans(w)) * s[None, :]
    elif SCALE_ON_W:
        return _dot(a.to(CDT), tl.trans((w.to(tl.float32) * s[:, None]).to(CDT)), acc, CDT)
    else:
        zero = tl.zeros(acc.shape, tl.float32)
        return acc + _dot(a.to(CDT), tl.trans(w.to(CDT)), zero, CDT) * s[None, :]


@triton.jit
def _act_group_dot(a_base, rmask, kg, w_base, n, swn, sa, s, acc, USE_ASM: tl.constexpr,
                   GK: tl.constexpr):  # fmt: skip
    """``acc + (A @ W^T) * sa[:, None] * s[None, :]`` for one group of fp8 activations
    (scales ``sa`` [BM]) and fp8 weights (scales ``s`` [BN]): the fp8 MMA's partial of the
    group starts at zero and is promoted to fp32 with both scales, as the release's fp8
    GEMM does per K block (the tensor cores' fast accumulation stays within the group).
    The interpreter multiplies the e4m3 values in fp32."""
    w = tl.load(w_base + n[:, None] * swn + (kg + tl.arange(0, GK))[None, :])
    a = _a_group(a_base, rmask, kg, GK)
    if USE_ASM:
        p = tl.dot(a, tl.trans(w))
    else:
        p = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + p * (sa[:, None] * s[None, :])


@triton.jit
def _act_scale(sa_base, rmask, kg, SA_K: tl.constexpr):
    """The activations' e8m0 scales [BM] of the group holding column ``kg`` as fp32."""
    raw = tl.load(sa_base + kg // SA_K, mask=rmask, other=127)
    return ((raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pair_dot(a_base, rmask, kg, w_base, n, swn, s1, s3, acc1, acc3,
              USE_ASM: tl.constexpr, CDT: tl.constexpr, GK: tl.constexpr,
              SCALE_ON_W: tl.constexpr, F16: tl.constexpr):  # fmt: skip
    """One scale group of fp4 experts in the *pairs* layout (``moe_formats.fp4_to_pairs``): byte
    (n, k) holds W[n, k] in its low nibble and W[n + P, k] in its high one, so one byte tile
    [BN, GK] gives both row sets' tiles with the same (row, column) per element — the
    conversion is elementwise where the MMA operand lives, no interleave or shuffle."""
    lo, hi = _fp4_split(w_base, n, kg, swn, USE_ASM, CDT, GK, F16)
    a = _a_group(a_base, rmask, kg, GK)
    acc1 = _w_dot(a, lo, s1, acc1, USE_ASM, CDT, SCALE_ON_W, False, F16)
    acc3 = _w_dot(a, hi, s3, acc3, USE_ASM, CDT, SCALE_ON_W, False, F16)
    return acc1, acc3


@triton.jit
def _moe_gemm(
    a_ptr, sam, sa_ptr, ssa, rows_ptr, tile_e_ptr,
    w_ptr, swe, swn, s_ptr, sse, ssn, ssk,
    out_ptr, sos, som,
    n_slots, topk, N, K, k_per_split, limit, rw_ptr,
    A_GATHER: tl.constexpr, GATED: tl.constexpr, FUSE_SWIGLU: tl.constexpr,
    FP4: tl.constexpr, PAIRS: tl.constexpr, USE_ASM: tl.constexpr,
    SCALE_E8M0: tl.constexpr, SCALE_WORDS: tl.constexpr, SB_N: tl.constexpr,
    SB_K: tl.constexpr, HAS_LIMIT: tl.constexpr, CDT: tl.constexpr, A_FP8: tl.constexpr,
    F16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GK: tl.constexpr,
    SA_K: tl.constexpr = 0, RG: tl.constexpr = 0,
):  # fmt: skip
    """One (tile, N block, K split): ``acc = A[tile rows] @ W_e[n, k-range]^T``; with
    ``GATED`` also the W3 rows ``n + N`` (W1|W3 stacked). ``GK``: K columns per MMA group
    (one weight scale group).

    ``SB_K == 0``: one weight scale per row (the fp8 rows layout,
    ``moe_formats.fp4_to_fp8_rows``), applied to the accumulators once, after the K loop, so
    the MMAs accumulate in place. ``A_FP8`` (with ``SB_K == 0``): A is e4m3 with one scale
    per row over all of K at ``sa_ptr`` (row stride ``ssa``), applied with the weights'
    after the loop: no promotion. ``A_FP8`` with ``SA_K`` > 0 (fp8 weights in blocks, ``SB_K``
    > 0): A is e4m3 with an e8m0 scale per row and ``SA_K`` columns at ``sa_ptr`` (row stride
    ``ssa``, groups contiguous); ``GK`` divides ``SA_K`` and ``SB_K``; each group's partial
    is promoted (:func:`_act_group_dot`). ``RG`` (with ``FUSE_SWIGLU``): H times its slot's
    routing weight (``rw_ptr``, fp32 [slots]; the release weights H before W2, and rounds
    the product) rounded in groups of ``RG`` columns as it is stored (:func:`_as_gemm_input`).

    Scales: the re-encoding's 2^6 (fp4 codes as e4m3) and, under ``F16``, the 2^4 of the
    activations' fp16 x 2^-4 are folded into the scales' exponents (no multiply).
    ``SCALE_WORDS`` (e8m0 per 32 columns, BK a multiple of 128): ``s_ptr`` is the scales read
    as int32, ``ssn`` / ``sse`` in words, one load per row for four groups."""
    tl.static_assert(SA_K == 0 or (A_FP8 and SB_K > 0 and not FP4 and not PAIRS),
                     "activation groups go with fp8 block weights")
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
    L2: tl.constexpr = (6 if FP4 and F16 else 0) + (4 if F16 else 0)
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
            if A_FP8 and SA_K > 0:
                sa = _act_scale(sa_base, rmask, kg, SA_K)
                acc1 = _act_group_dot(a_base, rmask, kg, w_base, n, swn, sa, s1, acc1, USE_ASM,
                                      GK)  # fmt: skip
                if GATED:
                    acc3 = _act_group_dot(a_base, rmask, kg, w_base, n + N, swn, sa, s3, acc3,
                                          USE_ASM, GK)  # fmt: skip
            elif PAIRS:
                acc1, acc3 = _pair_dot(a_base, rmask, kg, w_base, n, swn, s1, s3, acc1, acc3,
                                       USE_ASM, CDT, GK, BM >= 64, F16)  # fmt: skip
            else:
                acc1 = _group_dot(a_base, rmask, kg, w_base, n, swn, s1, acc1, FP4, USE_ASM,
                                  CDT, GK, BM >= 64, A_FP8, F16)  # fmt: skip
                if GATED:
                    acc3 = _group_dot(a_base, rmask, kg, w_base, n + N, swn, s3, acc3, FP4,
                                      USE_ASM, CDT, GK, BM >= 64, A_FP8, F16)  # fmt: skip
    if SB_K == 0:
        acc1 = acc1 * _scale(s_row1, SCALE_E8M0, L2)[None, :]
        if GATED:
            acc3 = acc3 * _scale(s_row3, SCALE_E8M0, L2)[None, :]
    if A_FP8 and SA_K == 0:
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
        if RG > 0:
            h = h * tl.load(rw_ptr + slot, mask=rmask, other=0.0)[:, None]
        tl.store(o_ptrs, _as_gemm_input(h, out_ptr.dtype.element_ty, F16, USE_ASM, RG))
    else:
        tl.store(o_ptrs, acc1)
        if GATED:
            tl.store(o_ptrs + N, acc3)


def _dot_dtype(x: torch.Tensor) -> tl.dtype:
    """MMA operands: bf16 (fp32 accumulation) for bf16/fp16 activations; fp32 (exact
    products) for fp32 activations and under the interpreter (it computes bf16 dots wrongly)."""
    return tl.float32 if _INTERPRET or x.dtype == torch.float32 else tl.bfloat16


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if is_e8m0(s):
        return s.view(torch.uint8).contiguous(), True
    if s.dtype != torch.float32:
        raise ValueError(f"scales must be e8m0 or fp32, got {s.dtype}")
    return s.contiguous(), False


def _scale_launch(s: torch.Tensor, e8: bool, sb_k: int, bk: int) -> tuple[tuple, dict]:
    """The scale arguments of one ``_moe_gemm`` launch: e8m0 codes per 32 columns with BK a
    multiple of 128 go as int32 words (four groups per load, ``SCALE_WORDS``); ``sb_k`` 0 =
    one scale per row ([E, N] scales). The MMA group ``GK``: the weight scale group, at most
    BK (one group per K tile for row scales)."""
    gk = bk if sb_k == 0 or sb_k >= bk else sb_k
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
