"""Routed experts with the clamped SwiGLU on the GPU: the MegaMoE ops and their dispatch.

``y_e = W2(silu(min(W1 x, L)) * clamp(W3 x, -L, L))``; ``out = sum_k w_k y_{e_k}``
(references: ``kernels.moe_ref``; expert layouts: ``kernels.moe_formats``).

Triton path (``moe_fp8_triton`` / ``moe_fp4_triton`` / ``moe_fp8_rows_triton``), no host
sync (CUDA-graph safe), launch shapes from ``kernels.moe_tiles.pick_tiles``:

1. ``_align`` (``kernels.moe_align``, one program): the T*k (token, slot) pairs grouped by
   local expert into tiles of BM rows, each tile one expert; non-local experts dropped.
2. ``_moe_gemm`` gated (``kernels.moe_grouped``): ``[W1|W3] x`` for each tile, weights
   dequantized in registers, clamped SwiGLU in the epilogue -> H [rows, I]; with split-K
   (small batches) fp32 partials + ``_reduce_swiglu``. Packed fp4 is read in the
   checkpoint's MX layout or, repacked at load time, in the *pairs* layout
   (``moe_formats.fp4_to_pairs``: one byte = the same column of a W1 and a W3 row), whose
   dequantization is elementwise in the MMA operand's register layout (no nibble
   interleave): 20% faster at 64 tokens on an H200.
3. ``_moe_gemm`` plain: ``W2 h`` -> Y [split, rows, d] fp32 (pairs: rows n and n + d/2 of
   W2 per byte, two row sets per tile like the gated GEMM).
4. ``_combine``: ``out[t] = sum_j w[t,j] * sum_s Y[s, row(t,j)]`` in a fixed order
   (deterministic; no atomics).

Decode batches of fp4 pairs experts with exact row references (:func:`_decode_fits`) take
``kernels.moe_decode``'s Gluon GEMMs instead: up to :data:`FUSED_SLOTS` token slots two
launches (:func:`_moe_run_fused`), else the four above with those GEMMs.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
import triton.language as tl

from kernels import moe_decode
from kernels.dispatch import capability, op, split_counters
from kernels.fp8_act import act_round_triton
from kernels.moe_align import _align, _combine, _quant_rows, _reduce_swiglu, _y_buffer
from kernels.moe_grouped import _INTERPRET, _dot_dtype, _moe_gemm, _scale_arg, _scale_launch
from kernels.moe_ref import moe_fp4_ref, moe_fp8_ref, moe_fp8_rows_ref
from kernels.moe_tiles import (
    MoeTiles,
    _local_load,
    _num_sms,
    fixed_tiles,
    pick_tiles,
    rows_per_expert,
)
from kernels.quant import is_e8m0


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
    act_fp8: bool = False,
    pairs: bool = False,
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    row_refs: tuple[torch.Tensor, torch.Tensor] | None = None,
    fixed: bool = False,
    act_group: int = 0,
) -> torch.Tensor:
    """The MoE layer's launches. ``act_fp8`` (the fp8 rows layout only, ``block[1]`` 0): x and
    H quantized to e4m3 with one scale per row, once each, and multiplied on the fp8 tensor
    cores. ``fixed`` (the deterministic mode): :func:`~kernels.moe_tiles.fixed_tiles` and no
    decode kernels, whatever the rows. ``act_group``: x and H rounded as the release rounds
    them (``kernels.fp8_act``, groups of that many columns; x in one launch, H as the SwiGLU
    epilogue stores it) and multiplied in bf16 / fp32 MMA, where their products are exact:
    no fp16 path and no decode kernels (whose fp16 operands would not hold every rounded
    value)."""
    if act_fp8 and block[1] != 0:
        raise ValueError("fp8 activations (one scale per row) need the fp8 rows layout")
    if act_group and (act_fp8 or fp16_mma):
        raise ValueError("the release's activation rounding takes bf16 / fp32 MMA")
    if fp16_mma and (act_fp8 or not 0 < limit <= 1024):
        raise ValueError("fp16_mma needs bf16 activations and a SwiGLU clamp in (0, 1024]")
    t, d = x.shape
    topk = ids.shape[1]
    n_local, n_slots = w13.shape[0], t * topk
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if n_slots == 0:
        return out
    if (tiles, block_m, split_k) != (None, None, None) or fixed or act_group:
        row_refs = None  # the launch overrides shape ``_moe_gemm``'s launches
    rg = min(act_group, inter)  # H's groups (one narrower group: the row)
    if act_group and inter % rg:
        raise ValueError(f"H rounds in groups of {act_group}: I = {inter} is not a multiple")
    if act_group:
        x = act_round_triton(x, act_group)
    if fixed and tiles is None:
        tiles = fixed_tiles(d, inter, block[1], _num_sms(x.device), pairs)
    if tiles is None:
        tiles = pick_tiles(n_slots, n_local, n_experts or n_local, d, inter, block[1],
                           _num_sms(x.device), act_fp8, pairs,
                           _dot_dtype(x) != tl.float32)  # fmt: skip
    tiles = _override(tiles, block_m, split_k)
    if rg and tiles.gate_up.bn % rg:  # the SwiGLU epilogue holds H's groups whole
        tiles = replace(tiles, gate_up=replace(tiles.gate_up, bn=rg))
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
    f16 = (cdt == tl.bfloat16 and not act_fp8 and not act_group and (bm < 64 or rows_layout)
           and 0 < limit <= 1024 and not _INTERPRET)  # fmt: skip
    if fp16_mma is not None:  # forced (the interpreter tests run the path too)
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
                  SB_K=block[1], BM=bm, USE_ASM=not _INTERPRET, A_FP8=act_fp8,
                  F16=f16)  # fmt: skip
    round_h = {"RG": rg} if rg else {}
    # the release weights H before W2 (and rounds the product): the combine then adds as is
    rw = weights.reshape(-1).float().contiguous() if rg else None
    h_dtype = torch.float16 if f16 else torch.float32 if cdt == tl.float32 else torch.bfloat16
    h = torch.empty(n_rows, inter, dtype=h_dtype, device=x.device)
    k1 = -(-(d // g1.bk) // g1.split) * g1.bk
    scale_args, scale_kw = _scale_launch(s13, e8_13, block[1], g1.bk)
    xs = x  # the activations' row scales (A_FP8)
    if xa is None:  # F16: converted by the align launch
        xa = x
        if act_fp8:
            xa, xs = _quant_rows(x)
    gate_args = (xa, xa.stride(0), xs, xs.stride(0), rows, tile_e, w13, w13.stride(0),
                 w13.stride(1))  # fmt: skip
    gate_args += scale_args
    grid1 = (n_tiles, inter // g1.bn, g1.split)
    launch1 = dict(BN=g1.bn, BK=g1.bk, num_warps=g1.warps, num_stages=g1.stages, **scale_kw)
    if g1.split == 1:
        _moe_gemm[grid1](*gate_args, h, 0, h.stride(0), n_slots, topk, inter, d, k1, limit, rw,
                         A_GATHER=True, GATED=True, FUSE_SWIGLU=True, **launch1, **round_h,
                         **common)  # fmt: skip
    else:
        part = torch.empty(g1.split, n_rows, 2 * inter, dtype=torch.float32, device=x.device)
        _moe_gemm[grid1](*gate_args, part, part.stride(0), part.stride(1), n_slots, topk, inter,
                         d, k1, limit, None, A_GATHER=True, GATED=True, FUSE_SWIGLU=False,
                         **launch1, **common)  # fmt: skip
        _reduce_swiglu(part, h, tile_e, inter, limit, bm, f16, rg, rows, rw)
    y = _y_buffer(x, g2.split, n_rows)
    k2 = -(-(inter // g2.bk) // g2.split) * g2.bk
    scale_args, scale_kw = _scale_launch(s2, e8_2, block[1], g2.bk)
    ha, hs = _quant_rows(h) if act_fp8 else (h, h)
    _moe_gemm[(n_tiles, n2 // g2.bn, g2.split)](
        ha, ha.stride(0), hs, hs.stride(0), rows, tile_e, w2, w2.stride(0), w2.stride(1),
        *scale_args, y, y.stride(0), y.stride(1),
        n_slots, topk, n2, inter, k2, limit, None, A_GATHER=False, GATED=pairs,
        FUSE_SWIGLU=False,
        BN=g2.bn, BK=g2.bk, num_warps=g2.warps, num_stages=g2.stages, **scale_kw, **common,
    )  # fmt: skip
    return _combine(y, inv, torch.ones_like(weights) if rg else weights, out)


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
    """The launch overrides of tests and sweeps: BM and/or the K splits of both GEMMs."""
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
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    fixed: bool = False,
    act_group: int = 0,
) -> torch.Tensor:
    """MegaMoE over fp8 e4m3 block-scaled experts: ``w13`` [E, 2I, d] (W1 rows then W3 rows),
    ``s13`` [E, 2I/b0, d/b1], ``w2`` [E, d, I], ``s2`` [E, d/b0, I/b1] (e8m0 or fp32).

    ``x`` [T, d] bf16/fp32, ``ids``/``weights`` [T, k]; returns [T, d] in ``out_dtype``
    (default x.dtype; fp32 keeps the combine's fp32 sums, what an EP rank sends back).
    ``n_experts`` (all experts, local or not) sizes the tiles; ``tiles`` overrides them,
    as ``block_m`` / ``split_k`` override BM and the K splits (tests and sweeps).
    ``fp16_mma`` (None = the dispatch's choice: at decode tile heights for bf16 activations
    under a clamp, on the GPU) forces the fp16-MMA path on or off, so that the CPU
    interpreter tests cover it. ``fixed``: the deterministic mode's launches (``_moe_run``).
    ``act_group``: the release's activation rounding (``_moe_run``).
    """
    _check_experts(x, ids, weights, w13, w2)
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
                    local_expert_offset, n_experts, tiles, block_m, split_k,
                    fp16_mma=fp16_mma, out_dtype=out_dtype, fixed=fixed,
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
    *,
    n_experts: int | None = None,
    tiles: MoeTiles | None = None,
    block_m: int | None = None,
    split_k: int | None = None,
    fp16_mma: bool | None = None,
    fixed: bool = False,
    act_group: int = 0,
) -> torch.Tensor:
    """MegaMoE over experts in the *fp8 rows* layout (``moe_formats.fp4_to_fp8_rows``): e4m3
    ``w13`` [E, 2I, d] and ``w2`` [E, d, I] with one fp32 scale per row, ``s13`` [E, 2I],
    ``s2`` [E, d]. The row scale goes on the accumulators after the K loop, so the MMAs
    accumulate in place. ``act_fp8``: x and H quantized to e4m3 with one scale per row
    (``moe_ref.fake_quant_act``'s rounding), once each in their own launch, and multiplied
    on the fp8 tensor cores, which accumulate in their fast mode over all of K (both row
    scales after the loop). Same routing arguments, result and ``act_group`` as
    :func:`moe_fp8_triton`."""
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
    return _moe_run(x, ids, weights, w13, s13, w2, s2, inter, False, (1, 0), limit,
                    local_expert_offset, n_experts, tiles, block_m, split_k, act_fp8,
                    fp16_mma=fp16_mma, out_dtype=out_dtype, fixed=fixed,
                    act_group=act_group)  # fmt: skip


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
    pairs: bool = False,
    fp16_mma: bool | None = None,
    out_dtype: torch.dtype | None = None,
    row_refs: tuple[torch.Tensor, torch.Tensor] | None = None,
    fixed: bool = False,
    act_group: int = 0,
) -> torch.Tensor:
    """MegaMoE over packed fp4 experts, dequantized in-kernel: ``w13`` int8 [E, 2I, d/2]
    (W1 rows then W3 rows, even column in the low nibble), ``s13`` e8m0 [E, 2I, d/32],
    ``w2`` int8 [E, d, I/2], ``s2`` [E, d, I/32]. Split-K fills the GPU at 1-64 tokens.
    ``pairs``: ``w13`` [E, I, d] and ``w2`` [E, d/2, I] in the layout of
    ``moe_formats.fp4_to_pairs`` (one byte = the same column of two rows; the conversion is
    elementwise in the MMA operand's layout, for every path); d a multiple of 64.
    ``fp16_mma`` and ``out_dtype`` as in :func:`moe_fp8_triton`.
    ``row_refs`` (r13, r2) of ``moe_decode.row_refs`` for these scales, when
    exact: decode batches in the pairs layout then run :mod:`kernels.moe_decode`'s GEMMs
    where they apply (:func:`_decode_fits`); without them ``_moe_gemm`` runs every call.
    ``act_group`` as in :func:`moe_fp8_triton`."""
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
                    local_expert_offset, n_experts, tiles, block_m, split_k, pairs=pairs,
                    fp16_mma=fp16_mma, out_dtype=out_dtype, row_refs=row_refs,
                    fixed=fixed, act_group=act_group)  # fmt: skip


def _unused_n_experts(ref):
    """A reference with the kernels' ``n_experts`` and ``row_refs`` keywords (they only
    choose and size the kernels' launches)."""

    def run(*args: Any, n_experts: int | None = None, row_refs: Any = None,
            **kwargs: Any) -> torch.Tensor:  # fmt: skip
        return ref(*args, **kwargs)

    run.__doc__, run.__name__ = ref.__doc__, ref.__name__
    return run


# the deterministic mode: the fixed launches (``_moe_run``'s ``fixed``)
moe_fp8 = op(_unused_n_experts(moe_fp8_ref), moe_fp8_triton,
             invariant=functools.partial(moe_fp8_triton, fixed=True))
moe_fp4 = op(_unused_n_experts(moe_fp4_ref), moe_fp4_triton,
             invariant=functools.partial(moe_fp4_triton, fixed=True))
moe_fp8_rows = op(_unused_n_experts(moe_fp8_rows_ref), moe_fp8_rows_triton,
                  invariant=functools.partial(moe_fp8_rows_triton, fixed=True))  # fmt: skip
