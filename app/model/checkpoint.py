"""A DeepSeek-V4/V4.1 checkpoint directory and the plan of loading it (headers only).

The **plan** matches every tensor the model expects with the checkpoint's ``weight_map``
(``model.safetensors.index.json``, or the keys of one ``model.safetensors``), checks dtypes
and shapes, pairs each quantized weight with its ``.scale`` wherever that lies (MODEL_SPEC §6
trap 7), and reports missing / unexpected tensors, so that a bad checkpoint fails before any
weight is read (``app.model.loader`` reads it). It also decides, from the headers, which MoE
layers keep their routed experts packed (one format, one block, kernel shapes) and which
dense fp8 projections stay as stored.

The plan reads through a :class:`CheckpointSource`: a checkpoint's safetensors shards
(:class:`Checkpoint`), or with ``load_format="dummy"`` random tensors of the same names,
dtypes and shapes (:func:`stored_layout` of config.json's model, ``app.model.dummy``).

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
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from safetensors import SafetensorError, safe_open

from app.model.config import ModelConfig
from app.model.moe import PackedFormat, packing_problem
from kernels.quant import FP4_GROUP, e8m0_dtype

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SKIPPED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
_MAX_REPORTED = 20

QuantKind = Literal["fp8", "fp4", "fp8_rowwise", "bf16", "fp32", "int64"]
# Where the weights come from: the checkpoint's safetensors, or random tensors of its layout.
# ``app.config.LoadFormat`` declares the same choices for the engine option (the config
# layer imports no model); tests/unit/test_dummy_load.py holds the two equal.
LOAD_FORMATS = ("auto", "dummy")

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


class LoadFormatError(CheckpointError):
    """A model directory that does not fit ``load_format`` (weights under "dummy"): the
    option is wrong, not the checkpoint (the engine reports it as a config error)."""


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
# attention's grouped output multiplies its 8 row groups with one einsum. These are also the
# projections whose input the release rounds to fp8 (its ``linear()`` runs ``act_quant`` +
# ``fp8_gemm`` for every fp8 weight; its converter dequantizes wo_a to bf16, an einsum).
_DENSE_PACKABLE = re.compile(
    _BLOCK + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
    r"|engram\.wkv)\.weight$|^mtp\.\d+\.main_proj\.weight$"
)
_ROUTER = re.compile(_BLOCK + r"ffn\.gate\.weight$")


def _official_kind(name: str) -> QuantKind:
    return next((kind for pattern, kind in _KIND_RULES if pattern.search(name)), "bf16")


def checkpoint_quant_kind(name: str, cfg: ModelConfig) -> QuantKind:
    """How an official checkpoint stores tensor ``name`` (:func:`stored_layout`: its tensors).

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


_STORED_DTYPE: dict[QuantKind, str] = {"fp8": "F8_E4M3", "fp8_rowwise": "F8_E4M3", "fp4": "I8",
                                       "bf16": "BF16", "fp32": "F32", "int64": "I64"}  # fmt: skip
_SCALE_DTYPE = "F8_E8M0" if e8m0_dtype() != torch.uint8 else "U8"


def stored_layout(
    name: str, shape: tuple[int, ...], cfg: ModelConfig
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(checkpoint name, safetensors dtype, shape) of each tensor that stores the model's
    tensor ``name`` of ``shape``: the tensor itself, or a quantized weight and its e8m0
    ``.scale`` (fp8 [R, C] + [ceil(R/br), ceil(C/bc)]; fp4 [R, C/2] + [R, C/32]; rowwise fp8
    [R, C] + [R, C/32]). The tiny writer stores this layout; ``load_format="dummy"`` serves it."""
    kind = checkpoint_quant_kind(name, cfg)
    if kind not in _QUANTIZED:
        return [(name, _STORED_DTYPE[kind], shape)]
    r, c = shape
    if kind == "fp8":
        assert cfg.quantization is not None
        br, bc = cfg.quantization.weight_block_size
        weight, scale = (r, c), (-(-r // br), -(-c // bc))
    elif kind == "fp4":
        weight, scale = (r, c // 2), (r, c // FP4_GROUP)
    else:
        weight, scale = (r, c), (r, -(-c // FP4_GROUP))
    return [(name, _STORED_DTYPE[kind], weight), (scale_name(name), _SCALE_DTYPE, scale)]


# ---- checkpoint files -------------------------------------------------------------------


class CheckpointSource(Protocol):
    """What the plan and the loader read: every tensor name (``weight_map``: name -> the
    file that holds it), its stored dtype and shape (``header``) and its data (``read``).
    Implemented by a checkpoint's safetensors shards (:class:`Checkpoint`) and by random
    weights in the same layout (``app.model.dummy.RandomCheckpoint``, ``load_format="dummy"``)."""

    root: Path
    source: str  # what lists the names, for messages
    weight_map: Mapping[str, str]

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype string, shape) without reading data."""
        ...

    def read(self, name: str) -> torch.Tensor:
        """The stored tensor ``name``."""
        ...

    def where(self, name: str) -> str:
        """Where ``name`` lies, for messages."""
        ...


class Checkpoint:
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
            raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found (for "
                                  "random weights of config.json's shapes, set load_format: "
                                  "dummy)")  # fmt: skip
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


# ---- the plan ----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What the model holds for one name: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorLoad:
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
    ckpt: CheckpointSource,
    name: str,
    want: TensorSpec,
    dtype: torch.dtype,
    block: tuple[int, int] | None,
) -> TensorLoad:
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
        return TensorLoad(name, "plain", want.dtype)
    if st in _FLOAT_DTYPES:
        check_shape(shape, expect)
        if scale_info is not None:
            raise CheckpointError(f"'{scale}' in {ckpt.where(scale)}: scale of unquantized {where}")
        return TensorLoad(name, "plain", dtype)
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
        return TensorLoad(name, "fp8", dtype, blk)
    if len(expect) != 2 or expect[1] % 2:
        raise CheckpointError(f"{where}: packed fp4 {st}, but the model expects {list(expect)}")
    check_shape(shape, (expect[0], expect[1] // 2))
    if len(sshape) != 2 or sshape[0] != expect[0] or sshape[1] <= 0 or expect[1] % sshape[1]:
        raise CheckpointError(f"{swhere}: fp4 scale shape {list(sshape)} does not fit "
                              f"weight {list(expect)}")  # fmt: skip
    return TensorLoad(name, "fp4", dtype)


def plan_loads(
    ckpt: CheckpointSource,
    expected: Mapping[str, TensorSpec],
    cfg: ModelConfig,
    dtype: torch.dtype,
    partial_experts: bool = False,
) -> list[TensorLoad]:
    """Check every expected tensor and every checkpoint name; report all problems at once.
    ``partial_experts`` (expert parallelism): the routed experts the model does not hold are
    skipped, not unexpected."""
    block = cfg.quantization.weight_block_size if cfg.quantization else None
    problems: list[str] = []
    loads: list[TensorLoad] = []
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


def _expert_groups(loads: list[TensorLoad]) -> dict[str, dict[int, dict[str, TensorLoad]]]:
    """Routed expert weights by layer, expert id and ``w1`` / ``w2`` / ``w3``."""
    groups: dict[str, dict[int, dict[str, TensorLoad]]] = {}
    for ld in loads:
        m = _EXPERT_WEIGHT.match(ld.name)
        if m:
            groups.setdefault(m["layer"], {}).setdefault(int(m["e"]), {})[m["w"]] = ld
    return groups


def _pack_layer(
    ckpt: CheckpointSource, layer: str, experts: dict[int, dict[str, TensorLoad]]
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


def plan_packing(
    ckpt: CheckpointSource,
    loads: list[TensorLoad],
    packed_experts: bool | None,
    device: torch.device,
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


def plan_dense(ckpt: CheckpointSource, loads: list[TensorLoad]) -> dict[str, tuple[int, int]]:
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


def plan_act_groups(loads: list[TensorLoad]) -> dict[str, int]:
    """The release's fp8 dense projections -> the columns of their activation groups: every
    fp8 weight of :data:`_DENSE_PACKABLE`, whose input the release's ``linear()`` rounds to
    fp8 in per-token groups of its weight block's columns (``fp8_block_size``: 32 on V4.1,
    128 on V4) before ``fp8_gemm``. Empty for a checkpoint stored unquantized."""
    return {ld.name: ld.block[1] for ld in loads
            if ld.how == "fp8" and _DENSE_PACKABLE.search(ld.name)}  # fmt: skip


def checkpoint_names(path: str | Path) -> set[str]:
    """Tensor names of the checkpoint at ``path`` (from the index or the single file)."""
    with contextlib.ExitStack() as stack:
        return set(Checkpoint(Path(path), stack).weight_map)
