"""Load an official (or tiny) DeepSeek-V4/V4.1 checkpoint into a :class:`DeepseekModel`.

Two phases, so that a bad checkpoint fails before any weight is read:

1. **Plan** (headers only): match every tensor the model expects with the checkpoint's
   ``weight_map`` (``model.safetensors.index.json``, or the keys of one ``model.safetensors``),
   check dtypes and shapes, pair each quantized weight with its ``.scale`` wherever that lies
   (MODEL_SPEC §6 trap 7), and report missing / unexpected tensors.
2. **Read**: shards are memory-mapped, each opened once; every tensor is read, moved to the
   device and dequantized on its own (fp8 blocks, fp4 experts, rowwise Engram tables), then the
   model's meta parameters are replaced with ``load_state_dict(assign=True)``.

Packed experts (``packed_experts``; auto = on CUDA when the experts are fp8 / fp4): each MoE
layer's routed experts skip dequantization; their bytes and scales are stacked into one
:class:`~app.model.moe.PackedExperts` (``w13`` = W1 rows then W3 rows, ``w2``), which replaces
the layer's ``ffn.experts`` ModuleList and runs the MegaMoE kernels. The plan is the same;
whether every layer can be packed (one format, one block, kernel shapes) is decided from the
headers too, before any data is read.

Storage -> model (``dtype`` is the compute dtype of dequantized weights):

    F8_E4M3 + .scale [ceil(R/br), ceil(C/bc)]   -> fp8 block dequant        -> dtype
    I8/U8 [R, C/2] + .scale [R, C/32]           -> fp4 (E2M1) dequant       -> dtype
    BF16 / F16 / F32                            -> cast (trap 6)            -> model's dtype
    I32 / I64 (tid2eid, trap 4)                 -> cast                     -> int64
    vision.*, aligner.*, image_{start,end,newline}  skipped (text-only serving, trap 8)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from app.model.config import ModelConfig
from app.model.engram_hash import compressed_token_map
from app.model.ep import ExpertShard
from app.model.layers import Fp8Linear
from app.model.model import DeepseekModel
from app.model.moe import MoE, PackedExperts, PackedFormat, packing_problem
from kernels.quant import dequantize_fp4, dequantize_fp8_block, e8m0_dtype, e8m0_to_float

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
NO_PROGRESS_ENV = "FATHOM_NO_PROGRESS"
SKIPPED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_MAX_REPORTED = 20

QuantKind = Literal["fp8", "fp4", "fp8_rowwise", "bf16", "fp32", "int64"]

_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                 "F64": torch.float64}  # fmt: skip
_INT_DTYPES = {"I32", "I64"}
_PACKED_FP4_DTYPES = {"I8", "U8"}
_SCALE_DTYPES = {"F8_E8M0", "U8", "F32"}
_E8M0_SCALE_DTYPES = {"F8_E8M0", "U8"}
# A routed expert weight: "layers.3.ffn.experts.5.w1.weight", "mtp.0.ffn.experts.2.w3.weight".
_EXPERT_WEIGHT = re.compile(
    r"^(?P<layer>(?:.+\.)?ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.weight$"
)


# Any routed expert tensor (weight or scale): what an expert-parallel rank may skip.
_EXPERT_TENSOR = re.compile(r"^(?:.+\.)?ffn\.experts\.\d+\.w[123]\.(?:weight|scale)$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names tensors and files."""


# ---- how official checkpoints store each tensor (MODEL_SPEC §5) -------------------------

_BLOCK = r"(?:^|\.)"  # start of name or of a dotted component
_KIND_RULES: tuple[tuple[re.Pattern[str], QuantKind], ...] = (
    (re.compile(_BLOCK + r"ffn\.gate\.tid2eid$"), "int64"),
    (re.compile(_BLOCK + r"engram\.embed\.weight$"), "fp8_rowwise"),
    (re.compile(_BLOCK + r"ffn\.experts\.\d+\.w[123]\.weight$"), "fp4"),
    (re.compile(_BLOCK + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                         r"|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight$"), "fp8"),
    (re.compile(r"^mtp\.\d+\.main_proj\.weight$"), "fp8"),
    (re.compile(_BLOCK + r"(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn_sink"
                         r"|ffn\.gate\.bias(?:_vl)?|compressor\.ape)$"), "fp32"),
)  # fmt: skip


_QUANTIZED: frozenset[QuantKind] = frozenset(("fp8", "fp4", "fp8_rowwise"))
# Dense fp8 projections ``packed_dense`` keeps as stored (Fp8Linear). wo_a is left out: the
# attention's grouped output multiplies its 8 row groups with one einsum.
_DENSE_PACKABLE = re.compile(
    _BLOCK + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
    r"|engram\.wkv)\.weight$|^mtp\.\d+\.main_proj\.weight$"
)
_ROUTER = re.compile(_BLOCK + r"ffn\.gate\.weight$")


def _official_kind(name: str) -> QuantKind:
    return next((kind for pattern, kind in _KIND_RULES if pattern.search(name)), "bf16")


def checkpoint_quant_kind(name: str, cfg: ModelConfig) -> QuantKind:
    """How an official checkpoint stores tensor ``name`` (used by the tiny writer).

    Everything not matched (embed, head, norms, router weight, compressor wkv/wgate, indexer
    weights_proj/wk, Engram q/k weights, DSpark heads, V4 MTP e_proj/h_proj) is bf16.
    Without a ``quantization_config`` nothing is quantized; experts follow its ``expert_dtype``.
    """
    kind = _official_kind(name)
    if kind in _QUANTIZED and cfg.quantization is None:
        return "bf16"
    if kind == "fp4" and cfg.quantization is not None and cfg.quantization.expert_dtype != "fp4":
        return "fp8"
    return kind


# ---- checkpoint files -------------------------------------------------------------------


class _Checkpoint:
    """The ``weight_map`` of a checkpoint directory and its shards, each opened once."""

    def __init__(self, root: Path, stack: contextlib.ExitStack) -> None:
        self.root = root
        index = root / INDEX_FILE
        if index.is_file():
            self.source = index.name
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e!r})") from e
            self.weight_map: dict[str, str] = {str(k): str(v) for k, v in wm.items()}
        elif (root / SINGLE_FILE).is_file():
            self.source = SINGLE_FILE
            self.weight_map = {}
        else:
            raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        files = sorted(set(self.weight_map.values())) or [SINGLE_FILE]
        for f in files:
            if not (root / f).is_file():
                first = next((n for n, v in self.weight_map.items() if v == f), "?")
                raise CheckpointError(
                    f"shard {root / f} is missing (listed in {INDEX_FILE} for '{first}')"
                )
        self._handles: dict[str, Any] = {}
        for f in files:
            try:
                self._handles[f] = stack.enter_context(safe_open(str(root / f), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"shard {root / f} is unreadable or truncated: {e}") from e
        if not self.weight_map:
            self.weight_map = dict.fromkeys(self._handles[SINGLE_FILE].keys(), SINGLE_FILE)
        self._paths = {f: str(root / f) for f in files}
        keys = {f: set(h.keys()) for f, h in self._handles.items()}
        for n, f in self.weight_map.items():
            if n not in keys[f]:
                raise CheckpointError(f"'{n}': {self.source} points to {root / f}, which lacks it")

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) without reading data."""
        s = self._handles[self.weight_map[name]].get_slice(name)
        return s.get_dtype(), tuple(s.get_shape())

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self.weight_map[name]].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"'{name}': cannot read from {self.where(name)}: {e}") from e

    def where(self, name: str) -> str:
        """The path of the shard holding ``name``."""
        return self._paths[self.weight_map[name]]


# ---- phase 1: plan ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What the model holds for one name: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Load:
    """How to produce one model tensor from the checkpoint."""

    name: str
    how: Literal["fp8", "fp4", "plain"]
    dtype: torch.dtype
    block: tuple[int, int] = (0, 0)


def scale_name(name: str) -> str:
    """``X.weight`` -> ``X.scale`` (the e8m0 companion of a quantized weight)."""
    return name.removesuffix(".weight") + ".scale"


def _fp8_block(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], preferred: tuple[int, int] | None
) -> tuple[int, int] | None:
    """Block (br, bc) with scale = [ceil(R/br), ceil(C/bc)]: the config's if it fits, else
    the one the scale's shape implies when that is a pair of powers of two (Engram: (1, 32))."""
    if len(shape) != 2 or len(scale_shape) != 2 or min(scale_shape) <= 0:
        return None
    (r, c), (sr, sc) = shape, scale_shape
    fits = lambda br, bc: -(-r // br) == sr and -(-c // bc) == sc  # noqa: E731
    if preferred is not None and fits(*preferred):
        return preferred
    br, bc = 1 << (-(-r // sr) - 1).bit_length(), 1 << (-(-c // sc) - 1).bit_length()
    return (br, bc) if fits(br, bc) else None


def _plan_one(
    ckpt: _Checkpoint,
    name: str,
    want: TensorSpec,
    dtype: torch.dtype,
    block: tuple[int, int] | None,
) -> _Load:
    """How to load ``name`` into ``dtype``; raises :class:`CheckpointError` if it cannot."""
    where = f"'{name}' in {ckpt.where(name)}"
    st, shape = ckpt.header(name)
    expect = tuple(want.shape)
    scale = scale_name(name)
    has_scale = name.endswith(".weight") and scale in ckpt.weight_map
    scale_info = ckpt.header(scale) if has_scale else None

    def check_shape(found: tuple[int, ...], wanted: tuple[int, ...]) -> None:
        if found != wanted:
            raise CheckpointError(f"{where}: shape {list(found)}, expected {list(wanted)}")

    if not want.dtype.is_floating_point:
        if st not in _INT_DTYPES:
            raise CheckpointError(f"{where}: dtype {st}, expected an integer tensor")
        check_shape(shape, expect)
        return _Load(name, "plain", want.dtype)
    if st in _FLOAT_DTYPES:
        check_shape(shape, expect)
        if scale_info is not None:
            raise CheckpointError(f"'{scale}' in {ckpt.where(scale)}: scale of unquantized {where}")
        return _Load(name, "plain", dtype)
    if st != "F8_E4M3" and st not in _PACKED_FP4_DTYPES:
        raise CheckpointError(f"{where}: dtype {st}, expected a float tensor")
    if scale_info is None:
        raise CheckpointError(f"{where}: dtype {st} needs '{scale}', which the checkpoint lacks")
    (sdt, sshape), swhere = scale_info, f"'{scale}' in {ckpt.where(scale)}"
    if sdt not in _SCALE_DTYPES:
        raise CheckpointError(f"{swhere}: scale dtype {sdt}, expected F8_E8M0")
    if st == "F8_E4M3":
        check_shape(shape, expect)
        blk = _fp8_block(shape, sshape, block)
        if blk is None:
            raise CheckpointError(f"{swhere}: scale shape {list(sshape)} fits no block of "
                                  f"weight {list(shape)} (config block {block})")  # fmt: skip
        return _Load(name, "fp8", dtype, blk)
    if len(expect) != 2 or expect[1] % 2:
        raise CheckpointError(f"{where}: packed fp4 {st}, but the model expects {list(expect)}")
    check_shape(shape, (expect[0], expect[1] // 2))
    if len(sshape) != 2 or sshape[0] != expect[0] or sshape[1] <= 0 or expect[1] % sshape[1]:
        raise CheckpointError(f"{swhere}: fp4 scale shape {list(sshape)} does not fit "
                              f"weight {list(expect)}")  # fmt: skip
    return _Load(name, "fp4", dtype)


def _plan(
    ckpt: _Checkpoint,
    expected: Mapping[str, TensorSpec],
    cfg: ModelConfig,
    dtype: torch.dtype,
    partial_experts: bool = False,
) -> list[_Load]:
    """Check every expected tensor and every checkpoint name; report all problems at once.
    ``partial_experts`` (expert parallelism): the routed experts the model does not hold are
    skipped, not unexpected."""
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    problems: list[str] = []
    loads: list[_Load] = []
    for name, want in expected.items():
        if name not in ckpt.weight_map:
            problems.append(f"'{name}' {list(want.shape)}: expected by the model, missing from "
                            f"{ckpt.root / ckpt.source}")  # fmt: skip
            continue
        target = dtype if _official_kind(name) in _QUANTIZED else want.dtype
        if dtype == torch.bfloat16 and _ROUTER.search(name):
            # stored bf16: kept so the MegaGate multiplies on tensor cores (bf16 x bf16
            # products are exact in its fp32 accumulation, as in the reference's fp32 GEMM)
            target = torch.bfloat16
        try:
            loads.append(_plan_one(ckpt, name, want, target, block))
        except CheckpointError as e:
            problems.append(str(e))
    skipped = [n for n in ckpt.weight_map if n.startswith(SKIPPED_PREFIXES)]
    if skipped:
        logger.info("skipping %d vision/aligner tensors (text-only serving)", len(skipped))
    known = set(expected) | {scale_name(n) for n in expected if n.endswith(".weight")}
    known |= set(skipped)
    if partial_experts:
        known |= {n for n in ckpt.weight_map if _EXPERT_TENSOR.match(n)}
    problems += [f"'{n}' in {ckpt.where(n)}: unexpected tensor (the model has no such name)"
                 for n in ckpt.weight_map if n not in known]  # fmt: skip
    if problems:
        shown = "\n  ".join(problems[:_MAX_REPORTED])
        more = len(problems) - _MAX_REPORTED
        raise CheckpointError(
            f"checkpoint {ckpt.root} does not fit the model ({len(problems)} problems):\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    return loads


@dataclass(frozen=True)
class ExpertPacking:
    """How one MoE layer's routed experts are kept packed (decided from the headers).

    ``layer``: the module path of the experts (``layers.3.ffn.experts``); ``block``: the fp8
    weight block, or (1, 32) for fp4; ``experts``: the global expert ids held, stacked in this
    order (all of them, or an expert-parallel rank's slots: ``app.model.ep``).
    """

    layer: str
    fmt: PackedFormat
    block: tuple[int, int]
    experts: tuple[int, ...]
    scale_dtype: torch.dtype

    def names(self, e: int) -> tuple[str, str, str]:
        """Checkpoint names of expert ``e``'s W1, W3, W2 weights."""
        base = f"{self.layer}.{e}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"


class _Unpackable(Exception):
    """A layer whose experts cannot be packed; ``quantized`` False = stored unquantized."""

    def __init__(self, why: str, quantized: bool = True) -> None:
        super().__init__(why)
        self.quantized = quantized


def _expert_groups(loads: list[_Load]) -> dict[str, dict[int, dict[str, _Load]]]:
    """Routed expert weights by layer, expert id and ``w1`` / ``w2`` / ``w3``."""
    groups: dict[str, dict[int, dict[str, _Load]]] = {}
    for ld in loads:
        m = _EXPERT_WEIGHT.match(ld.name)
        if m:
            groups.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["w"]] = ld
    return groups


def _pack_layer(
    ckpt: _Checkpoint, layer: str, experts: dict[int, dict[str, _Load]]
) -> ExpertPacking:
    """How ``layer``'s experts are stacked for the MegaMoE kernels; :class:`_Unpackable` if
    they cannot be (unquantized, mixed formats or blocks, shapes the kernels cannot take)."""
    loads = [ld for e in experts for ld in experts[e].values()]
    plain = next((ld for ld in loads if ld.how == "plain"), None)
    if plain is not None:
        st = ckpt.header(plain.name)[0]
        raise _Unpackable(f"'{plain.name}' is stored unquantized ({st}); packing needs fp8 "
                          "or fp4 experts", quantized=False)  # fmt: skip
    fmts = {ld.how for ld in loads}
    if len(fmts) != 1:
        raise _Unpackable(f"experts mix formats {sorted(fmts)}; packing needs one")
    fmt: PackedFormat = "fp8" if fmts == {"fp8"} else "fp4"
    inter, cols = ckpt.header(experts[min(experts)]["w1"].name)[1]
    d = cols * 2 if fmt == "fp4" else cols
    if fmt == "fp8":
        blocks = {ld.block for ld in loads}
    else:  # (1, columns per scale) of every fp4 weight
        blocks = {(1, 2 * ckpt.header(ld.name)[1][1] // ckpt.header(scale_name(ld.name))[1][1])
                  for ld in loads}  # fmt: skip
    if len(blocks) != 1:
        raise _Unpackable(f"experts use scale blocks {sorted(blocks)}; the kernels take one")
    (block,) = blocks
    problem = packing_problem(fmt, d, inter, block)
    if problem is not None:
        raise _Unpackable(problem)
    sdts = {ckpt.header(scale_name(ld.name))[0] for ld in loads}
    sdt = e8m0_dtype() if sdts <= _E8M0_SCALE_DTYPES else torch.float32  # fp32 if any is
    return ExpertPacking(layer, fmt, block, tuple(experts), sdt)  # the model's slot order


def _plan_packing(
    ckpt: _Checkpoint, loads: list[_Load], packed_experts: bool | None, device: torch.device
) -> dict[str, ExpertPacking]:
    """Which MoE layers keep their experts packed. ``packed_experts`` True: every layer (a
    :class:`CheckpointError` names each one that cannot); None (auto): every layer when on
    CUDA and all can be packed, else none; False: none."""
    if packed_experts is False or (packed_experts is None and device.type != "cuda"):
        return {}
    packings: dict[str, ExpertPacking] = {}
    problems: dict[str, _Unpackable] = {}
    for layer, experts in _expert_groups(loads).items():
        try:
            packings[layer] = _pack_layer(ckpt, layer, experts)
        except _Unpackable as e:
            problems[layer] = e
    if not problems:
        return packings
    lines = [f"{layer}: {why}" for layer, why in problems.items()]
    if packed_experts:
        shown = "\n  ".join(lines[:_MAX_REPORTED])
        more = len(lines) - _MAX_REPORTED
        raise CheckpointError(
            f"checkpoint {ckpt.root}: packed_experts is on, but {len(lines)} MoE layers cannot "
            f"keep their routed experts packed for the MegaMoE kernels:\n  {shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\n(turn packed_experts off to load them dequantized)"
        )
    log = logger.warning if any(e.quantized for e in problems.values()) else logger.info
    log("routed experts stay dequantized (%d layers cannot be packed; first: %s)",
        len(lines), lines[0])  # fmt: skip
    return {}


# ---- phase 2: read ----------------------------------------------------------------------


def _read(ckpt: _Checkpoint, load: _Load, device: torch.device) -> torch.Tensor:
    raw = ckpt.read(load.name).to(device)
    if load.how == "plain":
        return raw.to(load.dtype)
    scale = ckpt.read(scale_name(load.name)).to(device)
    if load.how == "fp8":
        return dequantize_fp8_block(raw, scale, load.block, load.dtype)
    return dequantize_fp4(raw, scale, load.dtype)


def _read_packed(
    ckpt: _Checkpoint, p: ExpertPacking, device: torch.device
) -> dict[str, torch.Tensor]:
    """``{layer}.w13 / .s13 / .w2 / .s2``: the experts' raw bytes and scales stacked on
    ``device``, copied one expert at a time (no full-size temporary, nothing dequantized)."""
    w1, _, w2 = p.names(p.experts[0])
    wdt = torch.int8 if p.fmt == "fp4" else torch.float8_e4m3fn
    (_, w1s), (_, s1s) = ckpt.header(w1), ckpt.header(scale_name(w1))
    (_, w2s), (_, s2s) = ckpt.header(w2), ckpt.header(scale_name(w2))
    n = len(p.experts)
    out = {
        "w13": torch.empty(n, 2 * w1s[0], w1s[1], dtype=wdt, device=device),
        "s13": torch.empty(n, 2 * s1s[0], s1s[1], dtype=p.scale_dtype, device=device),
        "w2": torch.empty(n, *w2s, dtype=wdt, device=device),
        "s2": torch.empty(n, *s2s, dtype=p.scale_dtype, device=device),
    }

    def weight(name: str) -> torch.Tensor:
        t = ckpt.read(name)
        return t.view(torch.int8) if p.fmt == "fp4" else t  # fp4 bytes may be stored as U8

    def scale(name: str) -> torch.Tensor:
        s = ckpt.read(scale_name(name))
        if p.scale_dtype == torch.float32:
            return e8m0_to_float(s)
        return s.view(p.scale_dtype)  # U8 codes are e8m0 exponents

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:  # bytes as bytes (no fp8 casts)
        if dst.element_size() == 1:
            dst, src = dst.view(torch.uint8), src.view(torch.uint8)
        dst.copy_(src)

    for i, e in enumerate(p.experts):
        n1, n3, n2 = p.names(e)
        put(out["w13"][i, : w1s[0]], weight(n1))
        put(out["w13"][i, w1s[0] :], weight(n3))
        put(out["s13"][i, : s1s[0]], scale(n1))
        put(out["s13"][i, s1s[0] :], scale(n3))
        put(out["w2"][i], weight(n2))
        put(out["s2"][i], scale(n2))
    return {f"{p.layer}.{k}": t for k, t in out.items()}


def _progress_disabled() -> bool:
    return os.environ.get(NO_PROGRESS_ENV, "") not in ("", "0") or not sys.stderr.isatty()


@dataclass(frozen=True)
class LoadedState:
    """The read phase's result: ``tensors`` by state-dict name (checkpoint names; a packed
    layer's experts as ``{layer}.w13 / .s13 / .w2 / .s2``) and the packed layers."""

    tensors: dict[str, torch.Tensor]
    packed: dict[str, ExpertPacking]
    dense: dict[str, tuple[int, int]] = field(default_factory=dict)  # packed fp8: block


def load_state(
    path: str | Path,
    expected: Mapping[str, TensorSpec],
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    packed_experts: bool | None = None,
    packed_dense: bool = False,
    partial_experts: bool = False,
) -> LoadedState:
    """Validate the checkpoint at ``path`` against ``expected`` and read it.

    Quantized weights come back dequantized in ``dtype``, other tensors in their expected
    dtype, except routed experts kept packed (see :func:`_plan_packing` for
    ``packed_experts``) and, with ``packed_dense``, the dense fp8 projections the kernels
    take (their e4m3 bytes and e8m0 scales, under the weight's and scale's names). Raises
    :class:`CheckpointError` naming the offending tensors and files. A progress bar goes to
    stderr when it is a terminal and ``FATHOM_NO_PROGRESS`` is
    unset (or ``0``).
    """
    root, dev = Path(path), torch.device(device)
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(root, stack)
        loads = _plan(ckpt, expected, cfg, dtype, partial_experts)
        packed = _plan_packing(ckpt, loads, packed_experts, dev)
        in_packed = {n for p in packed.values() for e in p.experts for n in p.names(e)}
        dense = _plan_dense(ckpt, loads) if packed_dense else {}
        # Shard by shard keeps reads sequential within each memory map.
        rest = sorted((ld for ld in loads if ld.name not in in_packed),
                      key=lambda ld: (ckpt.weight_map[ld.name], ld.name))  # fmt: skip
        out: dict[str, torch.Tensor] = {}
        with tqdm(total=len(loads), desc="loading weights", unit="tensor", file=sys.stderr,
                  disable=_progress_disabled()) as bar:  # fmt: skip
            for load in rest:
                if load.name in dense:
                    out[load.name] = ckpt.read(load.name).to(dev)
                    sc = ckpt.read(scale_name(load.name)).to(dev)
                    out[scale_name(load.name)] = sc.view(e8m0_dtype()) if sc.dtype == (
                        torch.uint8) else sc  # fmt: skip
                else:
                    out[load.name] = _read(ckpt, load, dev)
                bar.update()
            for p in packed.values():
                out.update(_read_packed(ckpt, p, dev))
                bar.update(3 * len(p.experts))
        return LoadedState(out, packed, dense)


def _plan_dense(ckpt: _Checkpoint, loads: list[_Load]) -> dict[str, tuple[int, int]]:
    """fp8 dense projections to keep packed: name -> weight block. Shapes the kernel cannot
    take (dims not multiples of 32, scale blocks narrower than 32 columns) stay dequantized."""
    out = {}
    for ld in loads:
        if ld.how != "fp8" or not _DENSE_PACKABLE.search(ld.name):
            continue
        n, k = ckpt.header(ld.name)[1]
        if n % 32 == 0 and k % 32 == 0 and ld.block[1] % 32 == 0:
            out[ld.name] = ld.block
    return out


def _install_dense(model: nn.Module, state: LoadedState) -> None:
    """Swap each packed projection's :class:`Linear` for an :class:`Fp8Linear` holding the
    checkpoint's bytes (the state's weight and scale tensors are assigned by name after)."""
    for name, block in state.dense.items():
        path = name.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        w, s = state.tensors[name], state.tensors[scale_name(name)]
        setattr(owner, child, Fp8Linear(w, s, block))


def checkpoint_names(path: str | Path) -> set[str]:
    """Tensor names of the checkpoint at ``path`` (from the index or the single file)."""
    with contextlib.ExitStack() as stack:
        return set(_Checkpoint(Path(path), stack).weight_map)


def build_empty_model(
    cfg: ModelConfig, kv_quant: bool = False, shard: ExpertShard | None = None
) -> DeepseekModel:
    """``DeepseekModel(cfg)`` with parameters and persistent buffers on the meta device
    (no memory, no init); the model creates its derived tensors (RoPE frequencies, the
    Engram token map) on the CPU explicitly. ``shard``: only this rank's routed experts."""
    with torch.device("meta"):
        return DeepseekModel(cfg, kv_quant=kv_quant, shard=shard)


def tensor_specs(model: nn.Module) -> dict[str, TensorSpec]:
    """Name -> shape/dtype of every tensor in ``model.state_dict()`` (checkpoint names)."""
    return {n: TensorSpec(tuple(t.shape), t.dtype) for n, t in model.state_dict().items()}


def _empty_model(
    path: str | Path, cfg: ModelConfig, kv_quant: bool, shard: ExpertShard | None = None
) -> DeepseekModel:
    """:func:`build_empty_model`, without ``mtp`` when the checkpoint has no ``mtp.*``."""
    model = build_empty_model(cfg, kv_quant, shard)
    if len(model.mtp) and not any(n.startswith("mtp.") for n in checkpoint_names(path)):
        # e.g. checkpoints exported by Hugging Face transformers, which drops mtp.*
        logger.warning("%s has no mtp.* weights: speculative decoding will be unavailable", path)
        model.mtp = nn.ModuleList()
    return model


def _install_packed(model: DeepseekModel, state: LoadedState) -> None:
    """Swap each packed layer's ``ffn.experts`` ModuleList for its :class:`PackedExperts`."""
    for layer, p in state.packed.items():
        moe = model.get_submodule(layer.removesuffix(".experts"))
        assert isinstance(moe, MoE), layer
        t = {k: state.tensors[f"{layer}.{k}"] for k in ("w13", "s13", "w2", "s2")}
        try:
            moe.experts = PackedExperts(**t, fmt=p.fmt, block=p.block, limit=moe.limit,
                                        local_expert_offset=moe.slot_offset)  # fmt: skip
        except ValueError as e:
            raise CheckpointError(f"{layer}: cannot keep the experts packed: {e}") from e


def _repack_fp4_for_cuda(model: nn.Module) -> None:
    """Packed fp4 experts go to the pairs layout, which the CUDA MegaMoE dequantizes without
    shuffles (H200: 20% faster than the checkpoint's layout at 64 tokens, docs/performance.md),
    where the hidden size allows it."""
    for m in model.modules():
        if isinstance(m, PackedExperts) and m.can_pair:
            m.repack("pairs")


def _fp8_rows_layout(model: nn.Module, prefill_act_fp8: bool, cuda: bool) -> None:
    """``expert_layout="fp8_rows"``: every packed fp4 layer re-encoded exactly as e4m3 rows
    (the prefill layout; H200, 4096 tokens on 48 local experts: 4.9 ms with bf16 activations,
    2.2 ms with fp8 ones, against 7.8 ms in the pairs layout, docs/performance.md). A layer
    with a row that is not exact keeps its fp4 layout, with a warning naming it."""
    kept, done = [], 0
    for name, m in model.named_modules():
        if isinstance(m, PackedExperts) and m.fmt == "fp4":
            try:
                m.repack("fp8_rows")
            except ValueError as e:
                kept.append(f"{name}: {e}")
                if cuda and m.can_pair:
                    m.repack("pairs")
                continue
            m.prefill_act_fp8 = prefill_act_fp8
            done += 1
    if kept:
        logger.warning("expert_layout fp8_rows: %d layer(s) keep fp4: %s", len(kept),
                       "; ".join(kept))  # fmt: skip
    if not done and not kept:
        logger.warning("expert_layout fp8_rows: no packed fp4 expert layers to re-encode "
                       "(fp8 or dequantized experts keep their layout)")  # fmt: skip
    if cuda:  # the fp4 buffers' blocks back to the device, where the KV budget can see them
        torch.cuda.empty_cache()


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    kv_quant: bool = False,
    packed_experts: bool | None = None,
    packed_dense: bool = False,
    shard: ExpertShard | None = None,
    expert_layout: str = "auto",
    prefill_act_fp8: bool = False,
) -> DeepseekModel:
    """Build :class:`DeepseekModel` from ``path/config.json`` and load its weights.

    Parameters start on the meta device and are replaced by the loaded tensors, so the
    weights exist once in memory. ``dtype`` is the compute dtype of dequantized weights;
    ``kv_quant`` rounds V4.1 KV like the released cache formats (see ``kernels.kv_quant``).
    ``packed_experts``: keep fp8 / fp4 routed experts packed per layer
    (:class:`~app.model.moe.PackedExperts`, MegaMoE kernels) — True requires it of every MoE
    layer (else :class:`CheckpointError`), None (auto) packs on CUDA when every layer can be
    packed and dequantizes otherwise, False always dequantizes. ``packed_dense``: keep the
    dense fp8 projections as stored (:class:`~app.model.layers.Fp8Linear`; see
    ``_DENSE_PACKABLE``). ``shard``: expert parallelism: the decoder layers read only this
    rank's routed experts (``app.model.ep``; a redundant slot reads its expert again).
    ``expert_layout``: "auto" (fp4 experts in the pairs layout on CUDA) or "fp8_rows" (the
    prefill layout, :func:`_fp8_rows_layout`), with ``prefill_act_fp8`` (fp8 activations at
    prefill-sized steps).
    """
    cfg = ModelConfig.from_file(path)
    if shard is not None and shard.placement.n_experts != cfg.n_routed_experts:
        raise CheckpointError(f"{path}: {cfg.n_routed_experts} routed experts, the placement "
                              f"has {shard.placement.n_experts}")  # fmt: skip
    model = _empty_model(path, cfg, kv_quant, shard)
    state = load_state(path, tensor_specs(model), cfg, device, dtype, packed_experts,
                       packed_dense, partial_experts=shard is not None)  # fmt: skip
    _install_packed(model, state)
    _install_dense(model, state)
    model.load_state_dict(state.tensors, assign=True, strict=True)
    cuda = torch.device(device).type == "cuda"
    if expert_layout == "fp8_rows":
        _fp8_rows_layout(model, prefill_act_fp8, cuda)
    elif expert_layout != "auto":
        raise ValueError(f"expert_layout must be 'auto' or 'fp8_rows', got {expert_layout!r}")
    elif cuda:
        _repack_fp4_for_cuda(model)
    if model.hash_spec is not None:
        model.set_engram_token_map(engram_token_map(path, cfg))
    return model.to(device).eval()


def engram_token_map(path: str | Path, cfg: ModelConfig) -> list[int]:
    """Compressed token map from the checkpoint's ``tokenizer.json`` (V4.1 Engram)."""
    tok_file = Path(path) / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"{tok_file}: V4.1 Engram needs the checkpoint's tokenizer.json")
    tmap, n = compressed_token_map(Tokenizer.from_file(str(tok_file)))
    if n != cfg.engram_compressed_vocab_size:
        raise CheckpointError(
            f"{tok_file}: the tokenizer normalizes to {n} Engram keys but config.json says "
            f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}; the hash "
            "multipliers depend on it, so this tokenizer does not belong to these weights"
        )
    return tmap
