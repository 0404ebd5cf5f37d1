"""One derivation of the KV cache's tensors from a model config: used to allocate the pools,
size them from a memory budget and account their bytes (``app.cache.accounting`` reports the
same numbers).

    paged (per block of P positions)        per request slot
    entries   owner layers, P/r rows each   window ring   every layer, ring rows (W + headroom)
    keys      index-key owners, P/r rows    tail ring     compressor owners, span + headroom rows

Formats: the compute dtype ("float", exact) or, for V4.1 with ``kv_quant``, the released ones:
window fp8 (528 B at D = 512), compressed nvfp4 (288 B), index keys mxfp4 (68 B at 128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from app.model.config import LayerMode, ModelConfig
from kernels.kv_quant import kv_row_bytes


@dataclass(frozen=True)
class RowGroup:
    """One cache tensor of one layer: ``rows`` rows per block (paged) or per slot."""

    layer: int
    kind: str  # "window" | "entries" | "keys" | "tail:kv" | "tail:idx"
    fmt: str  # kernels.kv_quant format, "float" = compute dtype (tails: always fp32 float)
    dim: int  # channels per row
    rows: int
    row_bytes: int
    gated: bool = False  # tails: a gate tensor beside the projections

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes * (2 if self.gated else 1)


@dataclass(frozen=True)
class CacheLayout:
    """Every cache tensor of one engine, per block and per request slot."""

    block_size: int
    ring: int
    dtype: torch.dtype
    paged: tuple[RowGroup, ...]
    slot: tuple[RowGroup, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(g.nbytes for g in self.paged)

    @property
    def bytes_per_slot(self) -> int:
        return sum(g.nbytes for g in self.slot)

    @property
    def bytes_per_token(self) -> float:
        """Paged bytes per token of context (890 for V4.1-Flash in the released formats)."""
        return self.bytes_per_block / self.block_size

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        kv_quant: bool = False,
        ring_headroom: int = 0,
        draft_stages: int = 0,
    ) -> CacheLayout:
        """The layout of ``cfg`` with blocks of ``block_size`` positions, rows in ``dtype``
        (or the released formats when ``kv_quant`` on V4.1); ``ring_headroom`` extra window
        rows per slot let verify steps of up to 1 + headroom tokens read the ring directly.

        Rings are sized so that a step of up to 1 + headroom tokens per request, run twice on
        the same inputs (CUDA-graph warm-up, capture, replay), writes the same state: the
        window ring keeps W + headroom rows, a tail ring span + headroom (a group needs the
        span - 1 positions before its last token; the next position must not overwrite
        them). ``draft_stages``: DSpark context rings per slot (one per stage, W rows in the
        window's format; only committed positions are written, so no headroom)."""
        ratios = [s.ratio for s in cfg.layers if s.owns_compressor]
        lcm = math.lcm(*ratios) if ratios else 1
        if block_size <= 0 or block_size % lcm:
            raise ValueError(f"block_size {block_size} must be a positive multiple of {lcm}")
        packed = kv_quant and cfg.is_v41
        fb = torch.empty(0, dtype=dtype).element_size()
        D, Di = cfg.head_dim, cfg.index_head_dim
        wfmt, efmt, kfmt = ("fp8", "nvfp4", "mxfp4") if packed else ("float",) * 3
        ring = cfg.sliding_window + ring_headroom
        slot = [
            RowGroup(s.layer_id, "window", wfmt, D, ring, kv_row_bytes(wfmt, D, fb))
            for s in cfg.layers
        ]
        paged = []
        for s in cfg.layers:
            if not s.owns_compressor:
                continue
            per = block_size // s.ratio
            paged.append(RowGroup(s.layer_id, "entries", efmt, D, per, kv_row_bytes(efmt, D, fb)))
            if s.owns_index_keys:
                paged.append(
                    RowGroup(s.layer_id, "keys", kfmt, Di, per, kv_row_bytes(kfmt, Di, fb))
                )
            for name, span, width in compressor_spans(cfg, s):
                if span > 1:  # (kv, gate) fp32 of the positions before a group's end
                    rows = span + ring_headroom
                    slot.append(
                        RowGroup(s.layer_id, f"tail:{name}", "float", width, rows, 4 * width,
                                 gated=True)  # fmt: skip
                    )
        W = cfg.sliding_window
        slot += [RowGroup(k, "draft", wfmt, D, W, kv_row_bytes(wfmt, D, fb)) for k in
                 range(draft_stages)]  # fmt: skip
        return cls(block_size, ring, dtype, tuple(paged), tuple(slot))


def compressor_spans(cfg: ModelConfig, spec) -> list[tuple[str, int, int]]:
    """(name, span, width) of each compressor a layer owns: "kv" (V4.1 non-overlapping:
    span = ratio, width D; V4 CSA overlapping: 2 ratio, 2D; HCA: ratio, D) and, for V4 CSA,
    the indexer's own "idx" compressor (overlapping ratio 4 at the index head dim)."""
    D, Di, r = cfg.head_dim, cfg.index_head_dim, spec.ratio
    if cfg.is_v41:
        return [("kv", r, D)]
    if spec.mode is LayerMode.CSA:
        return [("kv", 2 * r, 2 * D), ("idx", 8, 2 * Di)]
    return [("kv", r, D)]
