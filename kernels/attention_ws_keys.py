"""The key rows of the warp-specialized attention (``kernels.attention_ws``): what its producer
partition copies and decodes. cp.async of a key block's stored rows (bf16; fp8 e4m3 with
fp32 or e8m0 scales per 32 channels; nvfp4 bytes with e4m3 scales per 16) and their scale
rows into a byte ring slot, then the landed slot decoded to a bf16 K tile, 16 rows at a time.
Rows with id -1 are masked copies (zero-filled bytes).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.runtime.jit import constexpr_function


@constexpr_function
def _raw_layout(FMT):
    """Register layout of one stored key tile: bf16 [N, D]; fp8 [N, D/32 groups, 32];
    nvfp4 bytes [N, D/16 groups, 8]. Each thread owns 16 (nvfp4: 8) contiguous bytes."""
    if FMT == 2:
        return gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    if FMT == 1:
        return gl.BlockedLayout([1, 1, 16], [1, 16, 2], [4, 1, 1], [2, 1, 0])
    return gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])


@gluon.jit
def _raw_view(raw_buf, kv_ptr, D: gl.constexpr, FMT: gl.constexpr, BLOCK_N: gl.constexpr):
    """One slot of the byte ring viewed as a stored key tile of format FMT."""
    if FMT == 2:
        return raw_buf._reinterpret(gl.uint8, [BLOCK_N, D // 16, 8],
                                    gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # fmt: skip
    elif FMT == 1:
        return raw_buf._reinterpret(kv_ptr.dtype.element_ty, [BLOCK_N, D // 32, 32],
                                    gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # fmt: skip
    else:
        return raw_buf._reinterpret(kv_ptr.dtype.element_ty, [BLOCK_N, D],
                                    gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # fmt: skip


@gluon.jit
def _row_ids(idx_row, n0, hi, BLOCK_N: gl.constexpr):
    """Key row ids of columns [n0, n0 + BLOCK_N) (-1 past ``hi``) as int32 (pool rows stay
    under 2^31; the byte offsets are formed in int64 from them), spread over the
    partition's 128 threads (replicated when BLOCK_N < 128)."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([1], [32], [4], [0]))
    return gl.load(idx_row + n, mask=n < hi, other=-1).to(gl.int32)


@constexpr_function
def _scale_layout(G, esize):
    """Register layout of a scale tile [N, G] whose rows are copied 16 bytes per thread."""
    v = min(G, 16 // esize)
    tpr = G // v
    return gl.BlockedLayout([1, v], [32 // tpr, tpr], [4, 1], [1, 0])


@gluon.jit
def _scale_view(sc_buf, sc_ptr, D: gl.constexpr, FMT: gl.constexpr, BLOCK_N: gl.constexpr):
    """One slot of the scale ring viewed as [BLOCK_N, groups] of the source's scale dtype."""
    G: gl.constexpr = D // 16 if FMT == 2 else D // 32
    return sc_buf._reinterpret(sc_ptr.dtype.element_ty, [BLOCK_N, G],
                               gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # fmt: skip


@gluon.jit
def _issue_rows(raw_buf, sc_buf, kv_ptr, sc_ptr, ids, s_kv, s_sc, D: gl.constexpr,
                FMT: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """cp.async the stored rows ``ids`` and their scale rows into one ring slot, then commit
    the group. Rows with id -1 are masked copies, which zero-fill their bytes."""
    bl: gl.constexpr = _raw_layout(FMT)
    dst = _raw_view(raw_buf, kv_ptr, D, FMT, BLOCK_N)
    if FMT == 0:
        d = gl.arange(0, D, layout=gl.SliceLayout(0, bl))
        r2 = gl.expand_dims(gl.convert_layout(ids, gl.SliceLayout(1, bl)), 1)
        async_copy.async_copy_global_to_shared(
            dst, kv_ptr + gl.maximum(r2, 0).to(gl.int64) * s_kv + gl.expand_dims(d, 0), mask=r2 >= 0
        )
    else:
        G: gl.constexpr = D // 16 if FMT == 2 else D // 32
        W: gl.constexpr = 8 if FMT == 2 else 32
        g = gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(2, bl)))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, bl)))
        r2 = gl.expand_dims(gl.convert_layout(ids, gl.SliceLayout(1, gl.SliceLayout(2, bl))), 1)
        row = gl.maximum(r2, 0).to(gl.int64) * s_kv
        off = gl.expand_dims(row + gl.expand_dims(g, 0) * W, 2) + gl.expand_dims(
            gl.expand_dims(c, 0), 1
        )
        async_copy.async_copy_global_to_shared(dst, kv_ptr + off, mask=gl.expand_dims(r2 >= 0, 2))
        sl: gl.constexpr = _scale_layout(G, sc_ptr.dtype.element_ty.primitive_bitwidth // 8)
        gs = gl.arange(0, G, layout=gl.SliceLayout(0, sl))
        rs = gl.expand_dims(gl.convert_layout(ids, gl.SliceLayout(1, sl)), 1)
        async_copy.async_copy_global_to_shared(
            _scale_view(sc_buf, sc_ptr, D, FMT, BLOCK_N),
            sc_ptr + gl.maximum(rs, 0).to(gl.int64) * s_sc + gl.expand_dims(gs, 0),
            mask=rs >= 0,
        )
    async_copy.commit_group()


@gluon.jit
def _e4m3_bits_bf16(raw):
    """e4m3 codes -> bf16 of the value x 2^-120, exact (subnormals too), with no conversion
    instruction: per 4 bytes, PRMT spreads each byte with its sign replicated above it, a
    shift puts the exponent and mantissa bits at bf16's (the 4 exponent bits become the
    low ones of bf16's 8), an AND keeps them and the sign. (The conversion path,
    e4m3 -> f16 -> f32 x scale -> bf16, spends two conversion instructions per pair on
    the SM's quarter-rate conversion pipe, which bounds the producer.) NaN codes are not
    kept (the KV quantizer never writes them)."""
    return gl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1;\n"
        "prmt.b32 t0, $2, 0, 0x9180;\n"
        "prmt.b32 t1, $2, 0, 0xB3A2;\n"
        "shl.b32 t0, t0, 4;\n"
        "shl.b32 t1, t1, 4;\n"
        "and.b32 $0, t0, 0x87F087F0;\n"
        "and.b32 $1, t1, 0x87F087F0; }",
        "=r,=r,r", [raw.to(gl.uint8, bitcast=True)], dtype=gl.bfloat16, is_pure=True, pack=4,
    )  # fmt: skip


@gluon.jit
def _decode_rows(raw_buf, sc_buf, kv_ptr, sc_ptr, r0, D: gl.constexpr, FMT: gl.constexpr,
                 SC_E8: gl.constexpr, BLOCK_N: gl.constexpr, SUB: gl.constexpr):  # fmt: skip
    """Rows [r0, r0 + SUB) of a landed ring slot -> bf16 [SUB, D] (masked rows: zeros).
    fp8 with e8m0 codes c (``SC_E8``): integer ops and x 2^(c - 127) as two exact bf16x2
    multiplies, 2^(min(c, 134) - 7) then 2^(max(c, 134) - 134) (each factor finite; the
    first product is the value x 2^(min(c, 134) - 127), rounded only where it is subnormal,
    where the second factor is 1): the values of e4m3 -> fp32 x 2^(c - 127) -> bf16, with
    no instruction on the conversion pipe (:func:`_e4m3_bits_bf16`)."""
    bl: gl.constexpr = _raw_layout(FMT)
    raw = _raw_view(raw_buf, kv_ptr, D, FMT, BLOCK_N).slice(r0, SUB, dim=0).load(bl)
    if FMT == 1 and SC_E8:
        sv = _scale_view(sc_buf, sc_ptr, D, FMT, BLOCK_N).slice(r0, SUB, dim=0)
        c = sv.load(gl.SliceLayout(2, bl)).to(gl.int32)
        m1 = ((gl.minimum(c, 134) + 120) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
        m2 = ((gl.maximum(c, 134) - 7) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
        k = _e4m3_bits_bf16(raw) * gl.expand_dims(m1, 2) * gl.expand_dims(m2, 2)
        return gl.reshape(k, [SUB, D])
    elif FMT == 0:
        return raw.to(gl.bfloat16)
    elif FMT == 2:  # e2m1 pairs -> bf16 (channel 2j low nibble); x e4m3 is exact in bf16
        k = gl.fp4_to_fp(raw, gl.bfloat16, 2)
        sv = _scale_view(sc_buf, sc_ptr, D, FMT, BLOCK_N).slice(r0, SUB, dim=0)
        sc = sv.load(gl.SliceLayout(2, k.type.layout)).to(gl.bfloat16)
        return gl.reshape(k * gl.expand_dims(sc, 2), [SUB, D])
    else:  # fp8 with fp32 scales
        sv = _scale_view(sc_buf, sc_ptr, D, FMT, BLOCK_N).slice(r0, SUB, dim=0)
        sc = sv.load(gl.SliceLayout(2, bl)).to(gl.float32)
        return gl.reshape((raw.to(gl.float32) * gl.expand_dims(sc, 2)).to(gl.bfloat16), [SUB, D])


@gluon.jit
def _decode_block(k_buf, raw_buf, sc_buf, kv_ptr, sc_ptr, D: gl.constexpr, FMT: gl.constexpr,
                  SC_E8: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """A landed ring slot -> its bf16 K tile, 16 rows at a time (fewer live registers)."""
    SUB: gl.constexpr = 16
    for r0 in gl.static_range(0, BLOCK_N, SUB):
        k = _decode_rows(raw_buf, sc_buf, kv_ptr, sc_ptr, r0, D, FMT, SC_E8, BLOCK_N, SUB)
        k_buf.slice(r0, SUB, dim=0).store(k)


@gluon.jit
def _block_ids(idx1, lo, hi, nb1, idx2, lo2, hi2, b, BLOCK_N: gl.constexpr):
    """Row ids of key block ``b`` of the token's sequence: source 1's blocks, then source
    2's (all -1 past the last block)."""
    if b < nb1:
        ids = _row_ids(idx1, lo + b * BLOCK_N, hi, BLOCK_N)
    else:
        ids = _row_ids(idx2, lo2 + (b - nb1) * BLOCK_N, hi2, BLOCK_N)
    return ids


@gluon.jit
def _issue_block(raw_buf, sc_buf, kv_ptr, sc_ptr, kv2_ptr, sc2_ptr, ids, s_kv, s_sc, s_kv2,
                 s_sc2, first: gl.constexpr, D: gl.constexpr, FMT: gl.constexpr,
                 FMT2: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    if first:
        _issue_rows(raw_buf, sc_buf, kv_ptr, sc_ptr, ids, s_kv, s_sc, D, FMT, BLOCK_N)
    else:
        _issue_rows(raw_buf, sc_buf, kv2_ptr, sc2_ptr, ids, s_kv2, s_sc2, D, FMT2, BLOCK_N)
