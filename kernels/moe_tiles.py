"""Launch shapes of the MoE layer's grouped GEMMs: rows per tile from the expected routed
rows per local expert, N / K tiles, K splits, warps and stages (:func:`pick_tiles`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dispatch import sm_count


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
    pairs: bool = False,
    rows: bool = False,
) -> GemmTiles:
    bk = max(min_bk, next(b for b in (128, 64, 32) if k % b == 0))
    if bm >= 64:  # many rows per expert: no split (H200 sweeps, bench.kernels_moe --tiles)
        if rows and bm >= 128:  # H200 sweeps (bench.moe_prefill --sweep), 4096 tokens all
            # local: fp8 activations (one scale per row) 2.10 ms with these (2.31 with W2 128
            # wide, 3 stages; per-128-column activation scales 2.93 ms); bf16 activations
            # (fp16 MMA) 4.90 ms with W2 256 wide, 3 stages (5.24 with the 64-row tiles)
            bn = next(b for b in (128, 64, 32) if n % b == 0)
            wide = 256 if not gated and n % 256 == 0 else bn
            if act_fp8:
                return GemmTiles(wide, bk, 1, 8, 4)
            return GemmTiles(wide, bk, 1, 8, 3)
        if act_fp8:  # fp8 MMA on pre-quantized rows, narrower N tiles when gated
            bn = next(b for b in ((64, 32) if gated else (128, 64, 32)) if n % b == 0)
            return GemmTiles(bn, bk, 1, 4, 3)  # 4 warps, two CTAs per SM
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
    half: bool = True,
) -> MoeTiles:
    """Heuristic tiles: BM from the expected rows per touched local expert; at decode sizes
    small N tiles and split-K so that the weight stream fills every SM. ``pairs`` (fp4 in
    the ``moe_formats.fp4_to_pairs`` layout): a W2 tile covers two row sets, N is d/2.
    ``sb_k`` 0: the fp8 rows layout (one weight scale per row), with ``act_fp8`` its fp8
    activations (one scale per row, quantized before the GEMMs); ``half``: 16-bit MMA
    operands (fp32 ones keep the rows layout off its 128-row tiles, whose shared memory they
    would not fit)."""
    rows = sb_k == 0
    if act_fp8 and not rows:
        raise ValueError("fp8 activations go with the fp8 rows layout (sb_k 0)")
    local_slots, touched = _local_load(n_slots, n_local, n_experts)
    per_expert = local_slots / touched
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    if rows and (act_fp8 or half) and per_expert > 96:
        bm = 128
    tiles = int(touched) + int(local_slots // bm)
    min_bk = 0 if rows else min(sb_k, 128)
    return MoeTiles(
        bm,
        _gemm_tiles(bm, inter, d, tiles, sms, min_bk, True, act_fp8, pairs, rows),
        _gemm_tiles(bm, d // 2 if pairs else d, inter, tiles, sms, min_bk, pairs, act_fp8,
                    pairs, rows),  # fmt: skip
    )


def fixed_tiles(d: int, inter: int, sb_k: int, sms: int, pairs: bool = False) -> MoeTiles:
    """The deterministic mode's tiles: 64 rows (bf16 MMA, or fp16 on the fp8 rows layout as
    at every height) and no K split, whatever the rows per expert, so a routed row is
    multiplied in one order in any batch (:func:`pick_tiles` changes all of them with the
    rows). ``sb_k``, ``pairs`` as there."""
    rows = sb_k == 0
    min_bk = 0 if rows else min(sb_k, 128)
    n2 = d // 2 if pairs else d
    return MoeTiles(64, _gemm_tiles(64, inter, d, 1, sms, min_bk, True, False, pairs, rows),
                    _gemm_tiles(64, n2, inter, 1, sms, min_bk, pairs, False, pairs, rows))


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
