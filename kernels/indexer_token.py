"""The indexer's paged scores, one token per program row: the decode kernel.

``score(t, c) = sum_h w[t, h] * relu(q[t, h] . k[c])`` over the entries ``c < visible[t]`` of
token t's own sequence, read in place from the paged key pool (``kernels.indexer`` has the
reference and the token-blocks kernel that prefill chunks take).

Grid (token, key chunk): program (t, j) keeps token t's queries [D, H] and head weights in
registers and streams chunk j of the sequence's entries once, BLOCK_C at a time: a tile's
pool rows through the block table, its mxfp4 bytes + e8m0 scales (68 B an entry at D = 128)
dequantized in registers, then ``k [BLOCK_C, D] @ q^T [D, H]`` (the keys on the M side of one
dot, heads padded to 16), ReLU, head weights and the head sum: [BLOCK_C] fp32 scores, written
once. Tiles past ``visible`` are written -inf without a read. Nothing is summed across tiles,
so a score's bits depend on the tile config alone, never on the split or the batch.

The split (chunks per token) fills the GPU whatever the batch: at 128-entry tiles B = 1 at
32K spreads its 256 tiles over 256 programs, B = 256 gives each program ~50 tiles (key bytes
stream while the previous tile's dot runs: ``num_stages``). A fixed launch (the
deterministic mode's) splits by the key count alone.

Dequantization (``dequant``): "bits" decodes E2M1 in registers (the nibble's sign and
exponent-mantissa bits placed in an fp16, which is the value times 2^-14, subnormal 0.5
included, then one fp32 multiply by 2^14 * 2^(e - 127)); "dot_scaled" hands the bytes and
scales to ``tl.dot_scaled`` (sm_90: the compiler's own fp4 upcast; not in the interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import sm_count

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEQUANT = "bits"  # the default dequantization of mxfp4 keys ("bits" | "dot_scaled")
FIXED_TILES = 8  # tiles per program of a fixed launch's split (by the key count alone)
FILL = 8  # a free launch wants about FILL programs per SM


def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_C": 16}, num_warps=4)]
    return [
        triton.Config({"BLOCK_C": bc}, num_warps=w, num_stages=s)
        for bc, w, s in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (256, 8, 3))
    ]


# The deterministic mode's one launch shape (one of the autotuner's)
FIXED_LAUNCH = ({"BLOCK_C": 16, "num_warps": 4} if _INTERPRET
                else {"BLOCK_C": 64, "num_warps": 4, "num_stages": 3})  # fmt: skip


@triton.jit
def _e2m1_f16(code):
    """E2M1 codes (int32, low 4 bits; sign bit 3) -> fp16 equal to the value times 2^-14: the
    exponent-mantissa bits go to fp16 bits 9..11 (exponent 0 is fp16's subnormal, so the code
    0.5 needs no case), the sign to bit 15."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _mxfp4_tile(b, sc, BLOCK_C: tl.constexpr, DP: tl.constexpr):
    """mxfp4 rows: bytes [BLOCK_C, DP/2] (channel 2j: byte j's low nibble) and e8m0 codes
    [BLOCK_C, DP/32] -> fp32 [BLOCK_C, DP] (a code e is 2^(e-127); codes 1..254, what the
    packers write; 2^14 * 2^(e-127) overflows above 240, i.e. keys past 6e34)."""
    b = b.to(tl.int32)
    v = tl.join(_e2m1_f16(b), _e2m1_f16(b >> 4))  # [BLOCK_C, DP/2, 2]
    v = tl.reshape(v, (BLOCK_C, DP // 32, 32)).to(tl.float32)
    s = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0
    return tl.reshape(v * s[:, :, None], (BLOCK_C, DP))


@triton.autotune(configs=_configs(),
                 key=["C_BUCKET", "T_CLASS", "HP", "DP", "MXFP4", "DOT_SCALED"])  # fmt: skip
@triton.jit(do_not_specialize=["C", "C_BUCKET", "T_CLASS"])
def _token_scores_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, vis_ptr, seq_ptr, bt_ptr, out_ptr, C, HI, DI, C_BUCKET,
    T_CLASS, s_qt, s_qh, s_k, s_ks, s_wt, s_bt, s_ot,
    RATIO: tl.constexpr, P: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    MXFP4: tl.constexpr, F32_DOT: tl.constexpr, DOT_SCALED: tl.constexpr,
    Q_FMT: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Program (t, j): token t's scores over tiles [i0, i1) of its entries, the j-th of
    ``num_programs(1)`` equal chunks."""
    t = tl.program_id(0)
    n_tiles = tl.cdiv(C, BLOCK_C)
    per = tl.cdiv(n_tiles, tl.num_programs(1))
    i0 = tl.program_id(1) * per
    i1 = tl.minimum(i0 + per, n_tiles)
    vis = tl.load(vis_ptr + t).to(tl.int32)
    iv = tl.maximum(i0, tl.minimum(i1, tl.cdiv(vis, BLOCK_C)))  # tiles [i0, iv) see entries
    orow = out_ptr + t.to(tl.int64) * s_ot
    cc = tl.arange(0, BLOCK_C)
    if iv > i0:
        dot_t: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
        prec: tl.constexpr = "ieee" if F32_DOT else "tf32"
        seq = tl.load(seq_ptr + t).to(tl.int64)
        hh = tl.arange(0, HP)
        dd = tl.arange(0, DP)
        qp = q_ptr + t.to(tl.int64) * s_qt + hh[None, :] * s_qh + dd[:, None]
        qt = tl.load(qp, mask=(hh[None, :] < HI) & (dd[:, None] < DI), other=0.0).to(dot_t)
        wv = tl.load(w_ptr + t.to(tl.int64) * s_wt + hh, mask=hh < HI, other=0.0).to(tl.float32)
        for i in tl.range(i0, iv):
            c = i * BLOCK_C + cc
            seen = c < vis
            blk = tl.load(bt_ptr + seq * s_bt + (c * RATIO) // P, mask=seen, other=0)
            rows = blk.to(tl.int64) * (P // RATIO) + ((c * RATIO) % P) // RATIO
            if MXFP4:
                jj = tl.arange(0, DP // 2)
                b = tl.load(k_ptr + rows[:, None] * s_k + jj[None, :],
                            mask=seen[:, None] & (jj[None, :] < DI // 2), other=0)  # fmt: skip
                g = tl.arange(0, DP // 32)
                sc = tl.load(ks_ptr + rows[:, None] * s_ks + g[None, :],
                             mask=seen[:, None] & (g[None, :] < DI // 32), other=127)  # fmt: skip
                if DOT_SCALED:
                    s = tl.dot_scaled(b, sc, "e2m1", qt, None, Q_FMT)
                else:
                    k = _mxfp4_tile(b, sc, BLOCK_C, DP).to(dot_t)
                    s = tl.dot(k, qt, input_precision=prec)
            else:
                kp = k_ptr + rows[:, None] * s_k + dd[None, :]
                k = tl.load(kp, mask=seen[:, None] & (dd[None, :] < DI), other=0.0).to(dot_t)
                s = tl.dot(k, qt, input_precision=prec)
            s = tl.sum(tl.maximum(s, 0.0) * wv[None, :], axis=1)
            tl.store(orow + c, tl.where(seen, s, float("-inf")), mask=c < C)
    for i in range(iv, i1):
        c = i * BLOCK_C + cc
        tl.store(orow + c, tl.full([BLOCK_C], float("-inf"), tl.float32), mask=c < C)


def t_class(T: int) -> int:
    """The autotuner's token classes (tokens in octaves of 8: 1-7, 8-63, 64 and more): a
    graph bucket of its own per batch size would tune at every capture."""
    return min(2, (T.bit_length() - 1) // 3)


def splits(T: int, n_tiles: int, sms: int, fixed: bool) -> int:
    """Key chunks per token: about ``FILL`` programs per SM over the T tokens (at most one
    tile a program); a fixed launch: ``FIXED_TILES`` tiles a chunk, by the key count alone."""
    if fixed:
        return triton.cdiv(n_tiles, FIXED_TILES)
    return max(1, min(n_tiles, triton.cdiv(FILL * sms, T)))


def token_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_scale: torch.Tensor | None,
    w: torch.Tensor,
    visible: torch.Tensor,
    token_seq: torch.Tensor,
    block_table: torch.Tensor,
    ratio: int,
    block_size: int,
    out: torch.Tensor,
    *,
    launch: dict[str, int] | None = None,
    dequant: str | None = None,
) -> torch.Tensor:
    """``out`` [T, C] fp32 <- the scores of every token (``kernels.indexer``'s
    ``indexer_scores_paged_ref`` contract; shapes checked by its Triton entry). ``launch``
    (BLOCK_C, num_warps, num_stages) fixes the launch: the tile, and a split by the key count
    alone; ``dequant``: "bits" or "dot_scaled" (default :data:`DEQUANT`; the interpreter and
    fp32 queries: "bits")."""
    T, HI, DI = q.shape
    C = out.shape[1]
    mx = key_scale is not None
    dequant = dequant or DEQUANT
    if dequant not in ("bits", "dot_scaled"):
        raise ValueError(f"dequant must be 'bits' or 'dot_scaled', got {dequant!r}")
    f32 = q.dtype == torch.float32 or not q.is_cuda
    scaled = mx and dequant == "dot_scaled" and not f32 and not _INTERPRET
    HP, DP = max(16, triton.next_power_of_2(HI)), max(32, triton.next_power_of_2(DI))
    table = block_table.contiguous()
    ks = key_scale if mx else keys
    sms = sm_count(q.device) if q.is_cuda else 1

    def grid(meta):
        n_tiles = triton.cdiv(C, meta["BLOCK_C"])
        return (T, splits(T, n_tiles, sms, fixed=launch is not None))

    kernel = _token_scores_kernel if launch is None else _token_scores_kernel.fn
    kernel[grid](
        q, keys, ks, w, visible.contiguous(), token_seq.contiguous(), table, out, C, HI, DI,
        triton.next_power_of_2(C), t_class(T), q.stride(0), q.stride(1),
        keys.stride(0), ks.stride(0), w.stride(0), table.stride(0), out.stride(0),
        RATIO=ratio, P=block_size, HP=HP, DP=DP, MXFP4=mx, F32_DOT=f32, DOT_SCALED=scaled,
        Q_FMT="fp16" if q.dtype == torch.float16 else "bf16", **(launch or {}),
    )  # fmt: skip
    return out
