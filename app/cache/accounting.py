"""Bytes of KV cache per token (paged) and per request (fixed) for any V4 / V4.1 config.

Paged groups grow with context and live in blocks: compressed KV (1 entry per ``ratio`` tokens
for every layer that owns a compressor: V4 CSA and HCA, V4.1 Full) and index keys (V4 CSA,
V4.1 Full). Reuse / Reindex layers own neither. Per request, outside the prefix cache: the
window ring (``sliding_window`` entries of every backbone layer; MTP/DSpark context KV is draft
state and not counted here) and the compressor tail state (always fp32).

Spec storage formats (MODEL_SPEC §3), D = head_dim = 512, R = qk_rope_head_dim = 64,
I = index_head_dim = 128:

    V4.1 window KV   fp8 x D + ue8m0 scale per 32        512 + 16        = 528 B
    V4.1 compressed  nvfp4 D/2 + e4m3 scale per 16       256 + 32        = 288 B
    index keys       mxfp4 I/2 + ue8m0 scale per 32       64 + 4         =  68 B
    V4 index (fp8)   fp8 x I + one fp32 scale per 128    128 + 4         = 132 B
    V4 window/compr. fp8 nope (D-R) + ue8m0 per 64 + bf16 rope
                     448 + 7 + 128 = 583, padded to a multiple of 8      = 584 B

Worked example, V4.1-Flash: Full layers 2, 8, 14 (ratio 2) and 20 (ratio 1) each own
compressed KV and index keys: 3 x (288 + 68) / 2 + 1 x (288 + 68) = 534 + 356 = 890 B/token.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from app.cache.block_pool import BlockPool
from app.cache.layout import compressor_spans
from app.model.config import ModelConfig

Dtype = Literal["spec", "bf16", "fp32"]
FP32 = 4  # compressor tail state is kept in fp32 in every format


@dataclass(frozen=True)
class CacheGroup:
    """One cache group: the same kind of entry at the same ratio in several layers."""

    name: str
    layer_ids: tuple[int, ...]
    ratio: int  # tokens per entry
    bytes_per_entry: int

    @property
    def entries_per_token(self) -> Fraction:
        """Entries per token per layer: ``1/ratio``."""
        return Fraction(1, self.ratio)

    @property
    def bytes_per_token(self) -> Fraction:
        return len(self.layer_ids) * self.bytes_per_entry * self.entries_per_token

    def bytes_per_block(self, block_size: int) -> int:
        if block_size % self.ratio:
            raise ValueError(f"block_size {block_size} is not a multiple of {self.name}'s ratio")
        return len(self.layer_ids) * self.bytes_per_entry * (block_size // self.ratio)


@dataclass(frozen=True)
class CacheBytes:
    """Cache footprint of one model in one storage format."""

    arch: str
    dtype: str
    paged: tuple[CacheGroup, ...]
    window: CacheGroup  # ratio 1; ``sliding_window`` entries per request
    sliding_window: int
    tail_bytes_per_request: int

    @property
    def paged_bytes_per_token(self) -> float:
        """Bytes that grow with context (compressed KV + index keys), averaged per token."""
        return float(sum(g.bytes_per_token for g in self.paged))

    @property
    def window_bytes_per_request(self) -> int:
        return self.sliding_window * self.window.bytes_per_entry * len(self.window.layer_ids)

    @property
    def fixed_bytes_per_request(self) -> int:
        """Window ring + compressor tail: what one running request holds outside the blocks."""
        return self.window_bytes_per_request + self.tail_bytes_per_request

    @property
    def min_block_size(self) -> int:
        """A block must hold whole entries of every paged group: lcm of their ratios."""
        return math.lcm(1, *(g.ratio for g in self.paged))

    def bytes_per_block(self, block_size: int) -> int:
        return sum(g.bytes_per_block(block_size) for g in self.paged)

    def blocks_for_budget(self, bytes_budget: int, block_size: int, max_requests: int = 0) -> int:
        """Blocks that fit in ``bytes_budget`` after reserving ``max_requests`` fixed slots."""
        per_block = self.bytes_per_block(block_size)
        if per_block == 0:
            raise ValueError("this model has no paged cache groups")
        rest = bytes_budget - max_requests * self.fixed_bytes_per_request
        return BlockPool.blocks_for_budget(rest, per_block)

    def table(self) -> str:
        """Human-readable summary (the CLI's output)."""
        rows = [
            f"{self.arch} cache, {self.dtype} format",
            _row("group", "layers", "1/tok", "B/entry", "B/token"),
        ]
        for g in self.paged:
            per_tok = f"{float(g.bytes_per_token):.2f}"
            ids, ept = _ids(g.layer_ids), str(g.entries_per_token)
            rows.append(_row(g.name, ids, ept, str(g.bytes_per_entry), per_tok))
        rows.append(_row("paged total", "", "", "", f"{self.paged_bytes_per_token:.2f}"))
        w = self.window
        rows += [
            f"per request: window {len(w.layer_ids)} layers x {self.sliding_window} x "
            f"{w.bytes_per_entry} B = {self.window_bytes_per_request:,} B; "
            f"compressor tail {self.tail_bytes_per_request:,} B (fp32)",
        ]
        return "\n".join(rows)


def _row(*cols: str) -> str:
    return f"{cols[0]:<20} {cols[1]:<20} {cols[2]:>6} {cols[3]:>8} {cols[4]:>10}"


def _ids(ids: tuple[int, ...]) -> str:
    """``(2, 4, 6, 8, 10, 12, 14) -> '2,4,...,14 (7)'``."""
    if len(ids) <= 5:
        return ",".join(map(str, ids))
    return f"{ids[0]},{ids[1]},...,{ids[-1]} ({len(ids)})"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def entry_bytes(cfg: ModelConfig, dtype: Dtype, v4_index_fp8: bool = False) -> tuple[int, int, int]:
    """``(window, compressed, index)`` bytes per entry; bf16/fp32 store every dim plainly."""
    D, R, I = cfg.head_dim, cfg.qk_rope_head_dim, cfg.index_head_dim
    if dtype in ("bf16", "fp32"):
        e = 2 if dtype == "bf16" else 4
        return D * e, D * e, I * e
    if dtype != "spec":
        raise ValueError(f"unknown cache dtype {dtype!r} (spec, bf16, fp32)")
    if cfg.is_v41:
        return D + _cdiv(D, 32), D // 2 + _cdiv(D, 16), I // 2 + _cdiv(I, 32)
    nope = D - R
    kv = _cdiv(nope + _cdiv(nope, 64) + 2 * R, 8) * 8
    index = I + 4 * _cdiv(I, 128) if v4_index_fp8 else I // 2 + _cdiv(I, 32)
    return kv, kv, index


def _tail_bytes(cfg: ModelConfig) -> int:
    """Compressor state for windows not yet closed, fp32, as the cache allocates it
    (``app.cache.layout``): (kv, gate) of ``span`` positions per compressor of every owner
    layer -- the span - 1 a group still needs before its last token, and one more so a step
    can run twice on the same inputs (CUDA-graph warm-up).

    V4.1 Full ratio 2: 2 x (kv, gate) x 512 x 4; ratio 1 keeps none. V4 CSA (overlapping):
    8 x (kv, gate) x 2D, plus the indexer's 8 x 2 x 2I; V4 HCA: 128 x (kv, gate) x D.
    """
    total = 0
    for s in cfg.layers:
        if not s.owns_compressor:
            continue
        for _, span, width in compressor_spans(cfg, s):
            if span > 1:
                total += span * 2 * width * FP32
    return total


def cache_bytes(cfg: ModelConfig, dtype: Dtype = "spec", v4_index_fp8: bool = False) -> CacheBytes:
    """Per-group cache footprint of ``cfg`` (backbone layers) in storage format ``dtype``."""
    window_b, comp_b, index_b = entry_bytes(cfg, dtype, v4_index_fp8)
    comp: dict[int, list[int]] = {}
    index: dict[int, list[int]] = {}
    for s in cfg.layers:
        if s.owns_compressor:
            comp.setdefault(s.ratio, []).append(s.layer_id)
        if s.owns_index_keys:
            index.setdefault(s.ratio, []).append(s.layer_id)
    paged = [CacheGroup(f"compressed_kv r{r}", tuple(ids), r, comp_b) for r, ids in comp.items()]
    paged += [CacheGroup(f"index_keys r{r}", tuple(ids), r, index_b) for r, ids in index.items()]
    window = CacheGroup("window", tuple(s.layer_id for s in cfg.layers), 1, window_b)
    return CacheBytes(
        arch=cfg.arch,
        dtype=dtype,
        paged=tuple(paged),
        window=window,
        sliding_window=cfg.sliding_window,
        tail_bytes_per_request=_tail_bytes(cfg),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="config.json or a checkpoint directory holding one")
    ap.add_argument("--dtype", choices=("spec", "bf16", "fp32"), default="spec")
    ap.add_argument("--v4-index-fp8", action="store_true", help="V4 index keys in fp8 (132 B)")
    ap.add_argument("--block-size", type=int, default=0, help="also print bytes per block")
    ap.add_argument("--budget-gib", type=float, default=0.0, help="also print blocks that fit")
    args = ap.parse_args(argv)
    cb = cache_bytes(ModelConfig.from_file(args.config), args.dtype, args.v4_index_fp8)
    print(cb.table())
    if args.block_size:
        print(f"block of {args.block_size} tokens: {cb.bytes_per_block(args.block_size):,} B")
        if args.budget_gib:
            n = cb.blocks_for_budget(int(args.budget_gib * 2**30), args.block_size)
            print(f"{args.budget_gib} GiB holds {n:,} blocks ({n * args.block_size:,} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
