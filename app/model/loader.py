"""Load an official (or tiny) DeepSeek-V4/V4.1 checkpoint into a :class:`DeepseekModel`.

Two phases, so that a bad checkpoint fails before any weight is read:

1. **Plan** (headers only, ``app.model.checkpoint``): every tensor the model expects matched
   with the checkpoint's, dtypes, shapes and scales checked, problems reported at once.
2. **Read**: shards are memory-mapped, each opened once; every tensor is read, moved to the
   device and dequantized on its own (fp8 blocks, fp4 experts, rowwise Engram tables), then the
   model's meta parameters are replaced with ``load_state_dict(assign=True)``.

Packed experts (``packed_experts``; auto = on CUDA when the experts are fp8 / fp4): each MoE
layer's routed experts skip dequantization; their bytes and scales are stacked into one
:class:`~app.model.moe.PackedExperts` (``w13`` = W1 rows then W3 rows, ``w2``), which replaces
the layer's ``ffn.experts`` ModuleList and runs the MegaMoE kernels. Whether every layer can
be packed (one format, one block, kernel shapes) is decided in the plan, before any data is
read.

Both phases read through a :class:`~app.model.checkpoint.CheckpointSource`: the safetensors
shards, or with ``load_format="dummy"`` random tensors of the same names, dtypes and shapes
drawn on the device (:mod:`app.model.dummy`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from tqdm import tqdm

from app.model.checkpoint import (
    LOAD_FORMATS,
    Checkpoint,
    CheckpointError,
    CheckpointSource,
    ExpertPacking,
    TensorLoad,
    TensorSpec,
    checkpoint_names,
    plan_act_groups,
    plan_dense,
    plan_loads,
    plan_packing,
    scale_name,
)
from app.model.config import ModelConfig
from app.model.dummy import random_source, refuse_weights
from app.model.engram_hash import compressed_token_map
from app.model.ep import ExpertShard
from app.model.layers import Fp8Linear
from app.model.model import DeepseekModel
from app.model.moe import MoE, PackedExperts
from kernels.quant import dequantize_fp4, dequantize_fp8_block, e8m0_dtype, e8m0_to_float

logger = logging.getLogger(__name__)

NO_PROGRESS_ENV = "FATHOM_NO_PROGRESS"


def _read(ckpt: CheckpointSource, load: TensorLoad, device: torch.device) -> torch.Tensor:
    raw = ckpt.read(load.name).to(device)
    if load.how == "plain":
        return raw.to(load.dtype)
    scale = ckpt.read(scale_name(load.name)).to(device)
    if load.how == "fp8":
        return dequantize_fp8_block(raw, scale, load.block, load.dtype)
    return dequantize_fp4(raw, scale, load.dtype)


def _read_packed(
    ckpt: CheckpointSource, p: ExpertPacking, device: torch.device
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
    act_groups: dict[str, int] = field(default_factory=dict)  # plan_act_groups


def load_state(
    path: str | Path,
    expected: Mapping[str, TensorSpec],
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    packed_experts: bool | None = None,
    packed_dense: bool = False,
    partial_experts: bool = False,
    load_format: str = "auto",
    seed: int = 0,
) -> LoadedState:
    """Validate the checkpoint at ``path`` against ``expected`` and read it.

    Quantized weights come back dequantized in ``dtype``, other tensors in their expected
    dtype, except routed experts kept packed (see :func:`plan_packing` for
    ``packed_experts``) and, with ``packed_dense``, the dense fp8 projections the kernels
    take (their e4m3 bytes and e8m0 scales, under the weight's and scale's names). Raises
    :class:`CheckpointError` naming the offending tensors and files. A progress bar goes to
    stderr when it is a terminal and ``FATHOM_NO_PROGRESS`` is
    unset (or ``0``). ``load_format="dummy"``: no file is read; the tensors come from
    :func:`~app.model.dummy.random_source` (``seed``), through the same plan and packing.
    """
    root, dev = Path(path), torch.device(device)
    with contextlib.ExitStack() as stack:
        if load_format == "dummy":
            ckpt: CheckpointSource = random_source(root, expected, cfg, dev, seed)
        else:
            ckpt = Checkpoint(root, stack)
        loads = plan_loads(ckpt, expected, cfg, dtype, partial_experts)
        packed = plan_packing(ckpt, loads, packed_experts, dev)
        in_packed = {n for p in packed.values() for e in p.experts for n in p.names(e)}
        dense = plan_dense(ckpt, loads) if packed_dense else {}
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
        return LoadedState(out, packed, dense, plan_act_groups(loads))


def _install_dense(model: nn.Module, state: LoadedState) -> None:
    """Swap each packed projection's :class:`Linear` for an :class:`Fp8Linear` holding the
    checkpoint's bytes (the state's weight and scale tensors are assigned by name after)."""
    for name, block in state.dense.items():
        path = name.removesuffix(".weight")
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        w, s = state.tensors[name], state.tensors[scale_name(name)]
        setattr(owner, child, Fp8Linear(w, s, block))


def _round_activations(model: nn.Module, state: LoadedState) -> int:
    """``dense_act="fp8"``: each of the release's fp8 projections (plain or packed) rounds its
    input to fp8 in groups of its weight block's columns -> how many do."""
    for name, group in state.act_groups.items():
        model.get_submodule(name.removesuffix(".weight")).act_group = group
    return len(state.act_groups)


def _round_expert_activations(model: nn.Module, cfg: ModelConfig) -> int:
    """``expert_act="fp8"``: every MoE layer's routed experts round x and H as the release
    does, in groups of the checkpoint's weight block columns (its ``fp8_block_size``, which
    its ``fp4_gemm`` takes for the activations of fp4 experts too) -> how many layers do."""
    if cfg.quantization is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.act_group = cfg.quantization.weight_block_size[1]
    return len(layers)


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
    load_format: str = "auto",
    seed: int = 0,
    dense_act: str = "bf16",
    expert_act: str = "bf16",
) -> DeepseekModel:
    """Build :class:`DeepseekModel` from ``path/config.json`` and load its weights.

    Parameters start on the meta device and are replaced by the loaded tensors, so the weights
    exist once in memory. ``dtype`` is the compute dtype of dequantized weights; ``kv_quant``
    rounds V4.1 KV like the released cache formats (see ``kernels.kv_quant``).
    ``packed_experts``: keep fp8 / fp4 routed experts packed per layer
    (:class:`~app.model.moe.PackedExperts`, MegaMoE kernels) — True requires it of every MoE
    layer (else :class:`CheckpointError`), None (auto) packs on CUDA when every layer can be
    packed and dequantizes otherwise, False always dequantizes. ``packed_dense``: keep the
    dense fp8 projections as stored (:class:`~app.model.layers.Fp8Linear`; see
    ``app.model.checkpoint._DENSE_PACKABLE``). ``shard``: expert parallelism: the decoder
    layers read only this rank's routed experts (``app.model.ep``; a redundant slot reads its
    expert again). ``expert_layout``: "auto" (fp4 experts in the pairs layout on CUDA) or
    "fp8_rows" (the prefill layout, :func:`_fp8_rows_layout`), with ``prefill_act_fp8`` (fp8
    activations at prefill-sized steps). ``load_format``: "auto" reads the checkpoint's
    safetensors; "dummy" reads none (a directory holding weights is refused with a
    :class:`~app.model.checkpoint.LoadFormatError`): every tensor of config.json's shapes is
    drawn at random (``seed``) on ``device`` in the checkpoint's formats, then planned,
    packed and installed as read ones are. ``dense_act``: "fp8" rounds the inputs of the
    release's fp8 dense projections as the release does (:func:`_round_activations`;
    ``packed_dense`` keeps their fp8 weights for the fp8 GEMM), "bf16" leaves them as is;
    ``expert_act`` the same for the routed experts (:func:`_round_expert_activations`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    for name, act in (("dense_act", dense_act), ("expert_act", expert_act)):
        if act not in ("bf16", "fp8"):
            raise ValueError(f"{name} must be 'bf16' or 'fp8', got {act!r}")
    cfg = ModelConfig.from_file(path)
    if shard is not None and shard.placement.n_experts != cfg.n_routed_experts:
        raise CheckpointError(f"{path}: {cfg.n_routed_experts} routed experts, the placement "
                              f"has {shard.placement.n_experts}")  # fmt: skip
    if load_format == "dummy":  # every tensor of the model is drawn, mtp.* included
        refuse_weights(path)
        model = build_empty_model(cfg, kv_quant, shard)
    else:
        model = _empty_model(path, cfg, kv_quant, shard)
    state = load_state(path, tensor_specs(model), cfg, device, dtype, packed_experts,
                       packed_dense, partial_experts=shard is not None,
                       load_format=load_format, seed=seed)  # fmt: skip
    _install_packed(model, state)
    _install_dense(model, state)
    model.load_state_dict(state.tensors, assign=True, strict=True)
    if dense_act == "fp8" and not _round_activations(model, state):
        logger.warning("dense_act fp8: %s stores no fp8 dense projection, nothing to round",
                       path)  # fmt: skip
    if expert_act == "fp8" and not _round_expert_activations(model, cfg):
        logger.warning("expert_act fp8: %s stores no quantized experts, nothing to round",
                       path)  # fmt: skip
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
