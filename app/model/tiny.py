"""Write a tiny V4.1 / V4 checkpoint in the official layout (quantized, sharded, indexed).

    python -m app.model.tiny --arch v41 --out /tmp/tiny-v41 [--seed 0]

Every tensor of :class:`DeepseekModel` gets deterministic non-degenerate values from one
``torch.Generator``, is stored as an official checkpoint stores it (fp8 blocks + e8m0 scales,
packed fp4 experts, rowwise fp8 Engram tables, bf16/fp32, int64 ``tid2eid``) and written to
``model-0000K-of-0000M.safetensors`` shards. Every shard boundary falls between a quantized
weight and its ``.scale`` (MODEL_SPEC §6 trap 7). Same seed -> same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from app.model.checkpoint import INDEX_FILE, checkpoint_quant_kind, scale_name, stored_layout
from app.model.config import ModelConfig
from app.model.dummy import ONE_PLUS, SMALL, TABLE
from app.model.loader import build_empty_model
from app.model.tiny_config import tiny_config_v4, tiny_config_v41
from app.model.tokenizer import write_tiny_tokenizer
from kernels.quant import quantize_fp4, quantize_fp8_block, quantize_fp8_rowwise

N_SHARDS = 3


def _init(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """Deterministic fp32 (int64 for ``tid2eid``) value of one model tensor."""
    if name.endswith("tid2eid"):  # distinct experts per token
        vocab, k = shape
        return torch.rand(vocab, cfg.n_routed_experts, generator=g).argsort(dim=1)[:, :k]
    x = torch.randn(shape, generator=g)
    if ONE_PLUS.search(name):
        return 1 + 0.1 * x
    if SMALL.search(name):
        return 0.1 * x
    if TABLE.search(name):
        return x
    if len(shape) == 2:  # linear weights (and hc_*_fn): randn / sqrt(fan_in)
        return x / math.sqrt(shape[1])
    return 0.1 * x


def _store(name: str, value: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors of one model tensor, named as :func:`stored_layout` lists them:
    the weight, then its scale if quantized."""
    names = [n for n, _, _ in stored_layout(name, tuple(value.shape), cfg)]
    kind = checkpoint_quant_kind(name, cfg)
    if kind in ("fp8", "fp4", "fp8_rowwise"):
        if kind == "fp8":
            assert cfg.quantization is not None
            q, s = quantize_fp8_block(value, cfg.quantization.weight_block_size)
        elif kind == "fp4":
            q, s = quantize_fp4(value)
        else:
            q, s = quantize_fp8_rowwise(value)
        return list(zip(names, (q, s), strict=True))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}[kind]
    return list(zip(names, (value.to(dtype).contiguous(),), strict=True))


def _cuts(entries: list[tuple[str, torch.Tensor]], n_shards: int) -> list[int]:
    """Shard boundaries (indices into ``entries``) near equal byte sizes, each between a
    quantized weight and its scale. Example: sizes [4, 1, 4, 1], 2 shards -> [1]."""
    sizes = [t.numel() * t.element_size() for _, t in entries]
    before = [sum(sizes[:i]) for i in range(len(entries))]
    gaps = [i for i in range(1, len(entries)) if entries[i][0] == scale_name(entries[i - 1][0])]
    total = sum(sizes)
    cuts = {min(gaps, key=lambda i: abs(before[i] - total * k / n_shards))
            for k in range(1, n_shards)}  # fmt: skip
    return sorted(cuts)


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "v41",
    seed: int = 0,
    *,
    expert_dtype: str = "fp4",
    block: int | None = None,
) -> Path:
    """Write tokenizer, config.json, shards and index of a tiny ``arch`` model into ``out_dir``.

    ``expert_dtype`` ("fp4" or "fp8") stores the routed experts; ``block`` overrides the fp8
    weight block (default 32 for V4.1, 128 for V4)."""
    if arch not in ("v41", "v4"):
        raise ValueError(f"unknown tiny arch {arch!r} (v41 or v4)")
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"unknown expert dtype {expert_dtype!r} (fp4 or fp8)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = write_tiny_tokenizer(out)
    if arch == "v41":
        raw = tiny_config_v41(tok, block or 32, expert_dtype)
    else:
        raw = tiny_config_v4(block or 128, expert_dtype)
    cfg = ModelConfig.from_dict(raw)
    g = torch.Generator().manual_seed(seed)
    values = (
        (name, _init(name, tuple(t.shape), cfg, g))
        for name, t in build_empty_model(cfg).state_dict().items()
    )
    return write_checkpoint(out, raw, values)


def write_checkpoint(
    out_dir: str | Path,
    raw_config: dict,
    values: Iterable[tuple[str, torch.Tensor]],
    n_shards: int = N_SHARDS,
) -> Path:
    """Write ``config.json``, the shards and the index of a model into ``out_dir``: ``values``
    are (checkpoint name, fp32 value) pairs in state-dict order, each stored as an official
    checkpoint stores it (``checkpoint_quant_kind``: fp8 blocks + e8m0 scales, packed fp4
    experts, rowwise fp8 Engram tables, bf16/fp32). The tokenizer files are the caller's.
    Used by :func:`make_tiny_checkpoint` and by ``tools/train_tiny.py`` (trained weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    cfg = ModelConfig.from_dict(raw_config)
    entries: list[tuple[str, torch.Tensor]] = []
    for name, value in values:
        entries += _store(name, value, cfg)

    bounds = [0, *_cuts(entries, n_shards), len(entries)]
    n = len(bounds) - 1
    weight_map: dict[str, str] = {}
    for k in range(n):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        shard = dict(entries[bounds[k] : bounds[k + 1]])
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for _, t in entries)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("v41", "v4"), default="v41")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(make_tiny_checkpoint(args.out, args.arch, args.seed))


if __name__ == "__main__":
    main()
