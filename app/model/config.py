"""Model configuration: parse official ``config.json`` for DeepSeek-V4 and V4.1.

V4 keeps text fields at the top level; V4.1 nests them under ``text_config``. Both are
flattened into one frozen :class:`ModelConfig`, and the per-layer attention mode is derived
once into :class:`LayerSpec` objects the model reads.

Layer modes (MODEL_SPEC §1):

    V4    ratio 0 -> SWA, ratio 4 -> CSA (overlapping compressor + indexer), other -> HCA
    V4.1  ratio 0 -> SWA; layers in kv_source_layer_ids -> FULL (own compressor + index keys);
          other index sources -> REINDEX (own queries, keys of the last FULL layer);
          remaining compressed layers -> REUSE (compressed KV of the last FULL layer,
          indices of the most recent FULL/REINDEX layer)
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

V4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration")


class ConfigError(ValueError):
    """A config.json that Fathom cannot serve, with the reason."""


class LayerMode(enum.Enum):
    """Attention mode of one layer."""

    SWA = "swa"  # sliding window only (both archs)
    CSA = "csa"  # V4: overlapping ratio-4 compressor + lightning indexer
    HCA = "hca"  # V4: heavily compressed, every visible entry attended
    FULL = "full"  # V4.1: owns compressor and index keys, computes top-k
    REINDEX = "reindex"  # V4.1: recomputes top-k with its own queries
    REUSE = "reuse"  # V4.1: reuses KV and top-k of earlier layers


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer owns and reads.

    ``kv_source``/``index_source`` are layer ids (the layer itself when it owns them);
    -1 when the layer has no compressed KV / no top-k selection.
    """

    layer_id: int
    mode: LayerMode
    ratio: int
    kv_source: int = -1
    index_source: int = -1
    is_candidate_source: bool = False
    uses_candidates: bool = False
    engram: bool = False
    hash_moe: bool = False

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def owns_compressor(self) -> bool:
        return self.mode in (LayerMode.CSA, LayerMode.HCA, LayerMode.FULL)

    @property
    def owns_index_keys(self) -> bool:
        return self.mode in (LayerMode.CSA, LayerMode.FULL)

    @property
    def computes_topk(self) -> bool:
        return self.mode in (LayerMode.CSA, LayerMode.FULL, LayerMode.REINDEX)


@dataclass(frozen=True)
class QuantConfig:
    """``quantization_config`` of an official checkpoint."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> QuantConfig | None:
        if not d:
            return None
        block = tuple(int(x) for x in d.get("weight_block_size", (128, 128)))
        if len(block) != 2 or min(block) <= 0:
            raise ConfigError(
                f"quantization_config.weight_block_size must be two positive ints: {block}"
            )
        return cls(
            quant_method=str(d.get("quant_method", "fp8")),
            fmt=str(d.get("fmt", "e4m3")),
            scale_fmt=str(d.get("scale_fmt", "ue8m0")),
            weight_block_size=block,  # type: ignore[arg-type]
            expert_dtype=str(d.get("expert_dtype", "fp4")),
        )


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (frequency-only; no mscale)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Flattened, validated text config of a V4 or V4.1 checkpoint."""

    arch: str  # "v4" | "v41"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    swiglu_limit: float
    max_position_embeddings: int
    num_nextn_predict_layers: int
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    num_hash_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = None
    image_token_id: int | None = None
    # V4.1 only
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    quantization: QuantConfig | None = None
    layers: tuple[LayerSpec, ...] = field(default=(), compare=False)

    # ---- derived ----------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.arch == "v41"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def mtp_ratio(self, k: int) -> int:
        """Compress ratio slot of MTP/DSpark block ``k`` (after the backbone layers)."""
        idx = self.num_hidden_layers + k
        return self.compress_ratios[idx] if idx < len(self.compress_ratios) else 0

    def draft_problem(self, method: str, num_drafts: int = 1) -> str | None:
        """Why this config cannot draft ``num_drafts`` tokens with ``method`` ("dspark": the
        V4.1 DSpark stages, "mtp": V4's MTP block), or None."""
        if method == "dspark":
            if not self.is_v41:
                return "DSpark drafts with DeepSeek-V4.1 checkpoints (V4 uses MTP)"
            if not self.dspark_target_layer_ids or self.dspark_block_size < 1:
                return "config.json has no dspark_target_layer_ids / dspark_block_size"
            if num_drafts > self.dspark_block_size:
                return (f"num_draft_tokens {num_drafts} exceeds the checkpoint's DSpark block "
                        f"of {self.dspark_block_size} drafts")  # fmt: skip
            return None
        if self.is_v41:
            return "MTP drafts with DeepSeek-V4 checkpoints (V4.1 uses DSpark)"
        if self.num_nextn_predict_layers < 1:
            return "config.json has no MTP layer (num_nextn_predict_layers = 0)"
        if self.mtp_ratio(0) != 0:
            return f"the MTP block's compress ratio is {self.mtp_ratio(0)} (only SWA is supported)"
        return None

    # ---- parsing ----------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Parse ``config.json`` (a file, or a checkpoint directory holding one)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json at {p}")
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: invalid JSON: {e}") from e
        return cls.from_dict(raw, source=str(p))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Flatten and validate an official config dict."""
        archs = tuple(raw.get("architectures") or ())
        if any(a in V41_ARCHITECTURES for a in archs) or raw.get("model_type") == "deepseek_v41":
            arch = "v41"
        elif any(a in V4_ARCHITECTURES for a in archs) or raw.get("model_type") == "deepseek_v4":
            arch = "v4"
        else:
            raise ConfigError(
                f"{source}: unsupported architectures {list(archs) or None}; Fathom serves "
                f"{', '.join(V4_ARCHITECTURES + V41_ARCHITECTURES)}"
            )
        text = dict(raw.get("text_config") or {}) if arch == "v41" else dict(raw)
        if arch == "v41" and not text:
            raise ConfigError(f"{source}: DeepSeek-V4.1 config needs a 'text_config' object")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
            if key not in text and key in raw:
                text[key] = raw[key]
        qraw = raw.get("quantization_config") or text.get("quantization_config")
        return _build(arch, text, QuantConfig.from_dict(qraw), source)

    def to_dict(self) -> dict[str, Any]:
        """The official config.json form of this config (V4.1 nests ``text_config``)."""
        keys = _V4_KEYS if self.arch == "v4" else _V41_KEYS
        text: dict[str, Any] = {}
        for k in keys:
            v = getattr(self, k)
            text[k] = list(v) if isinstance(v, tuple) else v
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            text["rope_scaling"] = {
                "type": "yarn",
                "factor": rs.factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings,
                "beta_fast": rs.beta_fast,
                "beta_slow": rs.beta_slow,
            }
        q = None
        if self.quantization is not None:
            q = {
                "quant_method": self.quantization.quant_method,
                "fmt": self.quantization.fmt,
                "scale_fmt": self.quantization.scale_fmt,
                "weight_block_size": list(self.quantization.weight_block_size),
                "expert_dtype": self.quantization.expert_dtype,
            }
        if self.arch == "v4":
            out = {"architectures": list(V4_ARCHITECTURES), "model_type": "deepseek_v4", **text}
            out["scoring_func"] = self.scoring_func
            out["topk_method"] = "noaux_tc"
        else:
            out = {
                "architectures": ["DeepseekV41ForCausalLM"],
                "model_type": "deepseek_v41",
                "text_config": {"model_type": "deepseek_v41_text", **text},
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id,
                "image_token_id": self.image_token_id,
            }
        if q is not None:
            out["quantization_config"] = q
        return out


_COMMON_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
    "compress_ratios", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
    "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta",
    "swiglu_limit", "max_position_embeddings", "num_nextn_predict_layers", "scoring_func",
    "norm_topk_prob", "bos_token_id", "eos_token_id",
)  # fmt: skip
_V4_KEYS = _COMMON_KEYS + ("num_hash_layers",)
_V41_KEYS = _COMMON_KEYS + (
    "pad_token_id", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
    "candidate_topk_blocks", "candidate_block_size", "engram_layer_ids", "engram_num_embeddings",
    "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
    "engram_pad_token_id", "engram_compressed_vocab_size", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)  # fmt: skip

_INT_FIELDS = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
    "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok",
    "n_shared_experts", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
    "max_position_embeddings",
}  # fmt: skip


def _get(text: dict[str, Any], key: str, default: Any, source: str) -> Any:
    if key in text and text[key] is not None:
        return text[key]
    if default is _REQUIRED:
        raise ConfigError(f"{source}: missing required field '{key}'")
    return default


_REQUIRED = object()


def _build(arch: str, t: dict[str, Any], quant: QuantConfig | None, source: str) -> ModelConfig:
    v41 = arch == "v41"
    g = lambda k, d=_REQUIRED: _get(t, k, d, source)  # noqa: E731
    n_layers = int(g("num_hidden_layers"))
    n_mtp = int(g("num_nextn_predict_layers", 3 if v41 else 1))
    ratios = g("compress_ratios", None)
    if ratios is None:
        raise ConfigError(f"{source}: missing required field 'compress_ratios'")
    ratios = tuple(int(r) for r in ratios)
    if len(ratios) < n_layers:
        raise ConfigError(
            f"{source}: compress_ratios has {len(ratios)} entries for {n_layers} layers"
        )
    rs = t.get("rope_scaling")
    rope_scaling = None
    if rs:
        rope_scaling = RopeScaling(
            factor=float(rs.get("factor", 16)),
            original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 65536)),
            beta_fast=float(rs.get("beta_fast", 32)),
            beta_slow=float(rs.get("beta_slow", 1)),
        )
    kw: dict[str, Any] = dict(
        arch=arch,
        vocab_size=g("vocab_size"),
        hidden_size=g("hidden_size"),
        num_hidden_layers=n_layers,
        num_attention_heads=g("num_attention_heads"),
        head_dim=g("head_dim", 512),
        qk_rope_head_dim=g("qk_rope_head_dim", 64),
        q_lora_rank=g("q_lora_rank"),
        o_groups=g("o_groups"),
        o_lora_rank=g("o_lora_rank"),
        sliding_window=g("sliding_window", 128),
        compress_ratios=ratios,
        index_n_heads=g("index_n_heads"),
        index_head_dim=g("index_head_dim"),
        index_topk=g("index_topk"),
        n_routed_experts=g("n_routed_experts"),
        num_experts_per_tok=g("num_experts_per_tok"),
        n_shared_experts=g("n_shared_experts", 1),
        moe_intermediate_size=g("moe_intermediate_size"),
        routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
        hc_mult=g("hc_mult", 4),
        hc_sinkhorn_iters=g("hc_sinkhorn_iters", 20),
        hc_eps=float(g("hc_eps", 1e-6)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-20 if v41 else 1e-6)),
        rope_theta=float(g("rope_theta", 10000.0)),
        compress_rope_theta=float(g("compress_rope_theta", 160000.0)),
        rope_scaling=rope_scaling,
        swiglu_limit=float(g("swiglu_limit", 10.0)),
        max_position_embeddings=g("max_position_embeddings", 1048576),
        num_nextn_predict_layers=n_mtp,
        scoring_func=str(g("scoring_func", "sqrtsoftplus")),
        norm_topk_prob=bool(g("norm_topk_prob", True)),
        num_hash_layers=int(g("num_hash_layers", 0)) if not v41 else 0,
        bos_token_id=int(g("bos_token_id", 0)),
        eos_token_id=_first(g("eos_token_id", 1)),
        pad_token_id=t.get("pad_token_id", 2 if v41 else None),
        image_token_id=t.get("image_token_id"),
        quantization=quant,
    )
    if v41:
        kw.update(
            kv_source_layer_ids=tuple(g("kv_source_layer_ids")),
            index_source_layer_ids=tuple(g("index_source_layer_ids")),
            candidate_source_layer_id=int(g("candidate_source_layer_id", -1)),
            candidate_topk_blocks=int(g("candidate_topk_blocks", 0)),
            candidate_block_size=int(g("candidate_block_size", 0)),
            engram_layer_ids=tuple(g("engram_layer_ids", ())),
            engram_num_embeddings=tuple(int(x) for x in g("engram_num_embeddings", ())),
            engram_max_ngram_size=int(g("engram_max_ngram_size", 0)),
            engram_vocab_size=int(g("engram_vocab_size", 0)),
            engram_n_heads=int(g("engram_n_heads", 0)),
            engram_head_dim=int(g("engram_head_dim", 0)),
            engram_pad_token_id=int(g("engram_pad_token_id", 2)),
            engram_compressed_vocab_size=int(g("engram_compressed_vocab_size", 0)),
            dspark_block_size=int(g("dspark_block_size", 0)),
            dspark_noise_token_id=int(g("dspark_noise_token_id", 0)),
            dspark_target_layer_ids=tuple(g("dspark_target_layer_ids", ())),
            dspark_markov_rank=int(g("dspark_markov_rank", 0)),
            dspark_n_routed_experts=int(g("dspark_n_routed_experts", 0)),
            dspark_num_experts_per_tok=int(g("dspark_num_experts_per_tok", 0)),
        )
    for k in _INT_FIELDS:
        v = kw[k]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{source}: '{k}' must be a positive integer, got {v!r}")
    cfg = ModelConfig(**kw)
    _validate(cfg, source)
    return ModelConfig(**{**kw, "layers": derive_layers(cfg)})


def _first(v: Any) -> int:
    return int(v[0]) if isinstance(v, list | tuple) else int(v)


def _validate(c: ModelConfig, source: str) -> None:
    def err(msg: str) -> ConfigError:
        return ConfigError(f"{source}: {msg}")

    if c.num_attention_heads % c.o_groups:
        raise err("num_attention_heads must be divisible by o_groups")
    if c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= min(c.head_dim, c.index_head_dim):
        raise err("qk_rope_head_dim must be even and no larger than head_dim and index_head_dim")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise err("num_experts_per_tok must not exceed n_routed_experts")
    if c.n_shared_experts != 1:
        raise err("exactly one shared expert is supported (n_shared_experts=1)")
    if c.scoring_func != "sqrtsoftplus":
        raise err(f"scoring_func '{c.scoring_func}' is not supported (sqrtsoftplus)")
    for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta"):
        v = getattr(c, name)
        if not math.isfinite(v) or v <= 0:
            raise err(f"'{name}' must be finite and positive, got {v!r}")
    if any(r < 0 for r in c.compress_ratios):
        raise err("compress_ratios must be non-negative")
    if c.is_v41:
        n = c.num_hidden_layers
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            ids = list(getattr(c, name))
            if ids != sorted(set(ids)) or any(i < 0 for i in ids):
                raise err(f"'{name}' must be strictly increasing non-negative layer ids")
        if not set(c.kv_source_layer_ids) <= set(c.index_source_layer_ids):
            raise err("every kv_source_layer_id must also be an index_source_layer_id")
        owner_ratio = None
        for i, r in enumerate(c.compress_ratios[:n]):
            if r == 0:
                if i in c.index_source_layer_ids:
                    raise err(f"SWA-only layer {i} cannot be a KV or index source")
                continue
            if i in c.kv_source_layer_ids:
                owner_ratio = r
            if owner_ratio != r:
                raise err(f"compressed layer {i} needs a preceding KV source with ratio {r}")
        cand = c.candidate_source_layer_id
        if cand >= 0:
            if cand not in c.kv_source_layer_ids:
                raise err("candidate_source_layer_id must be a kv_source layer")
            if c.candidate_block_size <= 0 or c.candidate_topk_blocks <= 0:
                raise err("candidate_block_size and candidate_topk_blocks must be positive")
        if len(c.engram_layer_ids) != len(c.engram_num_embeddings):
            raise err("engram_num_embeddings needs one row count per engram layer")
        if c.engram_layer_ids and (
            c.engram_max_ngram_size < 2 or c.engram_n_heads <= 0 or c.engram_head_dim <= 0
            or c.engram_compressed_vocab_size <= 0 or c.engram_vocab_size < 2
        ):  # fmt: skip
            raise err("Engram needs max_ngram_size >= 2 and positive heads, dims and vocab sizes")
    elif c.num_hash_layers > c.num_hidden_layers:
        raise err("num_hash_layers exceeds num_hidden_layers")


def derive_layers(c: ModelConfig) -> tuple[LayerSpec, ...]:
    """Per-layer attention mode and sources (see module docstring)."""
    out: list[LayerSpec] = []
    last_kv = last_index = -1
    for i in range(c.num_hidden_layers):
        r = c.compress_ratios[i]
        if not c.is_v41:
            mode = LayerMode.SWA if r == 0 else LayerMode.CSA if r == 4 else LayerMode.HCA
            out.append(
                LayerSpec(
                    layer_id=i,
                    mode=mode,
                    ratio=r,
                    kv_source=i if r else -1,
                    index_source=i if mode is LayerMode.CSA else -1,
                    hash_moe=i < c.num_hash_layers,
                )
            )
            continue
        if r == 0:
            mode = LayerMode.SWA
        elif i in c.kv_source_layer_ids:
            mode, last_kv, last_index = LayerMode.FULL, i, i
        elif i in c.index_source_layer_ids:
            mode, last_index = LayerMode.REINDEX, i
        else:
            mode = LayerMode.REUSE
        cand = c.candidate_source_layer_id
        out.append(
            LayerSpec(
                layer_id=i,
                mode=mode,
                ratio=r,
                kv_source=last_kv if r else -1,
                index_source=last_index if r else -1,
                is_candidate_source=i == cand,
                uses_candidates=mode in (LayerMode.FULL, LayerMode.REINDEX) and 0 <= cand < i,
                engram=i in c.engram_layer_ids,
            )
        )
    return tuple(out)
