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
import sys
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import torch

from app.cache.block_pool import BlockPool
from app.cache.layout import FLOAT, RELEASED_V41, CacheLayout, Formats, block_multiple, row_bytes
from app.model.config import ModelConfig

Dtype = Literal["spec", "bf16", "fp32"]
_FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


@dataclass(frozen=True)
class CacheBytes:
    """Cache footprint of one model in one storage format: a report of the
    :class:`~app.cache.layout.CacheLayout` at the smallest block size the model allows."""

    arch: str
    dtype: str
    layout: CacheLayout  # blocks of block_multiple(cfg) positions, no ring headroom
    paged: tuple[CacheGroup, ...]
    window: CacheGroup  # ratio 1; ``sliding_window`` entries per request
    sliding_window: int

    @property
    def min_block_size(self) -> int:
        """A block must hold whole entries of every paged group (the layout's multiple)."""
        return self.layout.block_size

    @property
    def paged_bytes_per_token(self) -> float:
        """Bytes that grow with context (compressed KV + index keys), averaged per token."""
        return self.layout.bytes_per_token

    @property
    def window_bytes_per_request(self) -> int:
        return sum(g.nbytes for g in self.layout.slot if g.kind == "window")

    @property
    def tail_bytes_per_request(self) -> int:
        """Compressor state for windows not yet closed (fp32 (kv, gate) rows)."""
        return sum(g.nbytes for g in self.layout.slot if g.kind.startswith("tail:"))

    @property
    def fixed_bytes_per_request(self) -> int:
        """Window ring + compressor tail: what one running request holds outside the blocks."""
        return self.layout.bytes_per_slot

    def bytes_per_block(self, block_size: int) -> int:
        if block_size % self.min_block_size:
            raise ValueError(f"block_size {block_size} is not a multiple of "
                             f"{self.min_block_size} (every compression ratio)")  # fmt: skip
        return self.layout.bytes_per_block * (block_size // self.min_block_size)

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


def formats(cfg: ModelConfig, dtype: Dtype, v4_index_fp8: bool = False) -> Formats:
    """Row formats of (window, compressed, index) in storage format ``dtype``: "spec" = the
    model's specified formats (V4.1: the released ones the engine keeps with ``kv_quant``),
    bf16 / fp32 store every channel plainly."""
    if dtype in _FLOAT_DTYPES:
        return FLOAT
    if dtype != "spec":
        raise ValueError(f"unknown cache dtype {dtype!r} (spec, bf16, fp32)")
    if cfg.is_v41:
        return RELEASED_V41
    return ("fp8_rope", "fp8_rope", "fp8_s128" if v4_index_fp8 else "mxfp4")


def entry_bytes(cfg: ModelConfig, dtype: Dtype, v4_index_fp8: bool = False) -> tuple[int, int, int]:
    """``(window, compressed, index)`` bytes per entry; bf16/fp32 store every dim plainly."""
    fb = _FLOAT_DTYPES.get(dtype, torch.float32).itemsize
    (w, c, i), D = formats(cfg, dtype, v4_index_fp8), cfg.head_dim
    Di = cfg.index_head_dim
    return row_bytes(cfg, w, D, fb), row_bytes(cfg, c, D, fb), row_bytes(cfg, i, Di, fb)


def cache_bytes(cfg: ModelConfig, dtype: Dtype = "spec", v4_index_fp8: bool = False) -> CacheBytes:
    """Per-group cache footprint of ``cfg`` (backbone layers) in storage format ``dtype``,
    read off the cache layout (``app.cache.layout``)."""
    fmts = formats(cfg, dtype, v4_index_fp8)
    P = block_multiple(cfg)
    layout = CacheLayout.build(cfg, P, _FLOAT_DTYPES.get(dtype, torch.float32), formats=fmts)
    groups: dict[tuple[str, int], list[int]] = {}
    row_b: dict[tuple[str, int], int] = {}
    for kind in ("entries", "keys"):  # compressed KV groups first, then index keys
        for g in layout.paged:
            if g.kind == kind:
                key = (kind, P // g.rows)
                groups.setdefault(key, []).append(g.layer)
                row_b[key] = g.row_bytes
    names = {"entries": "compressed_kv", "keys": "index_keys"}
    paged = tuple(CacheGroup(f"{names[k]} r{r}", tuple(ids), r, row_b[k, r])
                  for (k, r), ids in groups.items())  # fmt: skip
    win = [g for g in layout.slot if g.kind == "window"]
    window = CacheGroup("window", tuple(g.layer for g in win), 1, win[0].row_bytes)
    return CacheBytes(cfg.arch, dtype, layout, paged, window, cfg.sliding_window)


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
