"""One derivation of the KV cache's tensors from a model config: used to allocate the pools,
size them from a memory budget, resolve the block size and account their bytes
(``app.cache.accounting`` reports this layout's numbers).

    paged (per block of P positions)        per request slot
    entries   owner layers, P/r rows each   window ring   every layer, ring rows (W + headroom)
    keys      index-key owners, P/r rows    tail ring     compressor owners, span + headroom rows

Formats: the compute dtype ("float", exact) or, for V4.1 with ``kv_quant``, the released ones:
window fp8 (528 B at D = 512), compressed nvfp4 (288 B), index keys mxfp4 (68 B at 128).
The accounting also reports V4's specified formats, which the engine does not allocate:
window / compressed "fp8_rope" (fp8 nope + ue8m0 per 64 + bf16 rope, padded to 8: 584 B)
and index keys mxfp4 or "fp8_s128" (fp8 + one fp32 scale per 128 channels: 132 B).

A block holds whole compressed entries of every layer: its size is a multiple of every
compression ratio (:func:`block_multiple`); auto = the smallest such multiple >= 64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from app.config import EngineConfigError
from app.model.config import LayerMode, ModelConfig
from kernels.kv_quant import kv_row_bytes

Formats = tuple[str, str, str]  # row formats of (window, entries, keys)
FLOAT: Formats = ("float", "float", "float")
RELEASED_V41: Formats = ("fp8", "nvfp4", "mxfp4")
AUTO_BLOCK_SIZE = 64  # the auto block size is the smallest allowed multiple at least this


def block_multiple(cfg: ModelConfig) -> int:
    """What a block size must be a multiple of: the lcm of every compression ratio of
    ``cfg`` (1 without compressed layers). V4.1-Flash (ratios 2, 1): 2; V4 (4, 128): 128."""
    return math.lcm(1, *(s.ratio for s in cfg.layers if s.owns_compressor))


def block_size_for(cfg: ModelConfig, block_size: int = 0) -> int:
    """The block size of an engine of ``cfg``: ``block_size`` checked against the model, or
    (0 = auto) the smallest multiple of :func:`block_multiple` that is >= 64."""
    lcm = block_multiple(cfg)
    if block_size:
        if block_size % lcm:
            raise EngineConfigError(f"block_size {block_size} must be a multiple of {lcm} "
                                    "(every compression ratio of this model)")  # fmt: skip
        return block_size
    return lcm * max(1, math.ceil(AUTO_BLOCK_SIZE / lcm))


def row_bytes(cfg: ModelConfig, fmt: str, dim: int, float_bytes: int) -> int:
    """Bytes of one stored row of ``dim`` channels in ``fmt``: the ``kernels.kv_quant``
    formats ("float": ``float_bytes`` a channel) or V4's specified "fp8_rope" / "fp8_s128"."""
    if fmt == "fp8_rope":  # 448 + 7 + 128 = 583 -> 584 at D = 512, R = 64
        nope, rope = dim - cfg.qk_rope_head_dim, cfg.qk_rope_head_dim
        return -(-(nope + -(-nope // 64) + 2 * rope) // 8) * 8
    if fmt == "fp8_s128":
        return dim + 4 * -(-dim // 128)
    return kv_row_bytes(fmt, dim, float_bytes)


@dataclass(frozen=True)
class RowGroup:
    """One cache tensor of one layer: ``rows`` rows per block (paged) or per slot."""

    layer: int
    kind: str  # "window" | "entries" | "keys" | "tail:kv" | "tail:idx"
    fmt: str  # a row format (:func:`row_bytes`), "float" = compute dtype (tails: fp32 float)
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
        formats: Formats | None = None,
    ) -> CacheLayout:
        """The layout of ``cfg`` with blocks of ``block_size`` positions, rows in ``dtype``
        (or the released formats when ``kv_quant`` on V4.1); ``ring_headroom`` extra window
        rows per slot let verify steps of up to 1 + headroom tokens read the ring directly.

        Rings are sized so that a step of up to 1 + headroom tokens per request, run twice on
        the same inputs (CUDA-graph warm-up, capture, replay), writes the same state: the
        window ring keeps W + headroom rows, a tail ring span + headroom (a group needs the
        span - 1 positions before its last token; the next position must not overwrite
        them). ``draft_stages``: DSpark context rings per slot (one per stage, W rows in the
        window's format; only committed positions are written, so no headroom).
        ``formats``: the row formats (window, entries, keys); default: :data:`RELEASED_V41`
        with ``kv_quant`` on V4.1, else :data:`FLOAT` (the engine's; the accounting also
        asks for V4's specified formats)."""
        lcm = block_multiple(cfg)
        if block_size <= 0 or block_size % lcm:
            raise ValueError(f"block_size {block_size} must be a positive multiple of {lcm}")
        if formats is None:
            formats = RELEASED_V41 if kv_quant and cfg.is_v41 else FLOAT
        fb = torch.empty(0, dtype=dtype).element_size()
        D, Di = cfg.head_dim, cfg.index_head_dim
        wfmt, efmt, kfmt = formats
        wb, eb, kb = (row_bytes(cfg, f, d, fb) for f, d in zip(formats, (D, D, Di), strict=True))
        ring = cfg.sliding_window + ring_headroom
        slot = [RowGroup(s.layer_id, "window", wfmt, D, ring, wb) for s in cfg.layers]
        paged = []
        for s in cfg.layers:
            if not s.owns_compressor:
                continue
            per = block_size // s.ratio
            paged.append(RowGroup(s.layer_id, "entries", efmt, D, per, eb))
            if s.owns_index_keys:
                paged.append(RowGroup(s.layer_id, "keys", kfmt, Di, per, kb))
            for name, span, width in compressor_spans(cfg, s):
                if span > 1:  # (kv, gate) fp32 of the positions before a group's end
                    rows = span + ring_headroom
                    slot.append(
                        RowGroup(s.layer_id, f"tail:{name}", "float", width, rows, 4 * width,
                                 gated=True)  # fmt: skip
                    )
        W = cfg.sliding_window
        slot += [RowGroup(k, "draft", wfmt, D, W, wb) for k in range(draft_stages)]
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
