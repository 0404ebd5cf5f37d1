"""Build the tiny reference checkpoints and the golden logits (oracle env only; CI never runs this).

References: NeMo AutoModel 0.7.0 ``DeepseekV41ForCausalLM`` (V4.1) and HF transformers 5.18
``DeepseekV4ForCausalLM`` (V4), both fp32 eager on CPU. Default run (from the repo root)::

    /tmp/oracle/bin/python tests/golden/make_golden.py

builds random non-degenerate models from ``app.model.tiny_config``, exports them to the official
checkpoint layout (``tests/golden/ref_v41``, ``ref_v4``), reloads and checks the export, then writes
``golden_v41.safetensors`` / ``golden_v4.safetensors``. Any official-layout checkpoint
(fp8/fp4 too)::

    /tmp/oracle/bin/python tests/golden/make_golden.py --ckpt DIR --arch v41 --out FILE.safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.overrides import TorchFunctionMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from app.model.tiny_config import tiny_config_v4, tiny_config_v41  # noqa: E402
from app.model.tokenizer import write_tiny_tokenizer  # noqa: E402

PROMPT_TEXTS = (
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. DeepSeek serves mixture-of-experts models.",
    'def add(a, b):\n    return a + b\n\n{"name": "fathom", "value": 42, "ok": true, '
    '"items": [1, 2, 3]} Think step by step, then answer in JSON. Café naïve résumé.',
)
PROMPT_LENGTHS = (1, 7, 23, 41)
GREEDY_STEPS = 8
BOS = 0

# ----------------------------------------------------------------------------------------------
# Deterministic top-k (lower index wins ties) + tie statistics
# ----------------------------------------------------------------------------------------------


class StableTopk(TorchFunctionMode):
    """Replace every ``topk`` by a lower-index-first one and count boundary ties."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.tied_rows = 0
        self.zero_tied_rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            return self._topk(*args, **kwargs)
        return func(*args, **kwargs)

    def _topk(
        self, x: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
    ) -> torch.return_types.topk:
        xs = x.movedim(dim, -1)
        key = xs if largest else -xs
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        idx = order[..., :k]
        vals = xs.gather(-1, idx)
        self.calls += 1
        if 0 < k < xs.shape[-1]:
            kth = key.gather(-1, order[..., k - 1 : k])
            nxt = key.gather(-1, order[..., k : k + 1])
            tie = (kth == nxt) & torch.isfinite(kth)
            self.tied_rows += int(tie.sum())
            self.zero_tied_rows += int((tie & (kth == 0)).sum())
        return torch.return_types.topk((vals.movedim(-1, dim), idx.movedim(-1, dim)))


# ----------------------------------------------------------------------------------------------
# Random non-degenerate init
# ----------------------------------------------------------------------------------------------

_GAINS: tuple[tuple[str, float], ...] = (
    (r"(experts|shared_experts)\..*(gate|up|w1|w3)", 3.0),
    (r"gate_and_up_projs|gate_up_proj", 3.0),
    (r"\.gate\.weight$", 2.0),
    (r"lm_head", 3.0),
    (r"wq_b|q_b_proj", 1.5),
    (r"(wgate|gate_proj)\.weight$", 2.0),
)


def _gain(name: str) -> float:
    for pattern, gain in _GAINS:
        if re.search(pattern, name):
            return gain
    return 1.0


@torch.no_grad()
def randomize(model: nn.Module, seed: int, fan_in_dim1: Callable[[str], bool]) -> None:
    """Fill every float parameter/buffer with O(1)-activation noise (norms, sinks, biases too)."""
    g = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n not in tensors})
    for name in sorted(tensors):
        t = tensors[name]
        if "rotary" in name or "inv_freq" in name or "engram_hash" in name:
            continue
        if name.endswith("tid2eid"):
            vocab, k = t.shape
            n_exp = _n_experts(model)
            rows = [torch.randperm(n_exp, generator=g)[:k] for _ in range(vocab)]
            t.copy_(torch.stack(rows).to(t.dtype))
            continue
        if not t.is_floating_point():
            continue

        def rn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g)

        base = name.rsplit(".", 1)[-1]
        if "embed_tokens" in name or "engram.embed" in name:
            t.copy_(rn(*t.shape))
        elif _is_unit_scale(name, base, t):
            t.copy_(1 + 0.1 * rn(*t.shape))
        elif base in ("base", "hc_base"):
            t.copy_(0.1 * rn(*t.shape))
        elif base in ("fn", "hc_fn"):
            t.copy_(rn(*t.shape) / math.sqrt(t.shape[-1]))
        elif "sink" in name:
            t.copy_(rn(*t.shape))
        elif base in ("e_score_correction_bias", "bias_vl"):
            t.copy_(0.1 * rn(*t.shape))
        elif base in ("ape", "position_bias"):
            t.copy_(0.5 * rn(*t.shape))
        elif t.ndim >= 2:
            fan_in = t.shape[1] if fan_in_dim1(name) else t.shape[-1]
            t.copy_(rn(*t.shape) * (_gain(name) / math.sqrt(fan_in)))
        else:
            raise RuntimeError(f"no init rule for {name} {tuple(t.shape)}")
    _pair_indexer_heads(model)


@torch.no_grad()
def _pair_indexer_heads(model: nn.Module) -> None:
    """Indexer query head 1 := -head 0, so ``w0*ReLU(d) + w1*ReLU(-d)`` is never an exact 0 tie.

    With independent heads, ReLU zeroes every head for ~1/16 of (query, entry) pairs and top-k then
    breaks ties among exact zeros arbitrarily (MODEL_SPEC trap 1). Heads 2.. stay independent.
    """
    cfg = getattr(model.config, "text_config", model.config)
    di = int(cfg.index_head_dim)
    for name, p in model.named_parameters():
        if re.search(r"indexer\.(wq_b|q_b_proj)\.weight$", name):
            p[di : 2 * di].copy_(-p[:di])


def _is_unit_scale(name: str, base: str, t: torch.Tensor) -> bool:
    """Norm weights, Engram q/k weights and mHC scales: initialised around 1."""
    if base in ("scale", "hc_scale"):
        return True
    return bool(re.search(r"(norm|q_weight|k_weight)", name)) and t.ndim <= 2 and "fn" not in base


def _n_experts(model: nn.Module) -> int:
    cfg = model.config
    cfg = getattr(cfg, "text_config", cfg)
    return int(cfg.n_routed_experts)


# ----------------------------------------------------------------------------------------------
# Checkpoint IO (official layout) and dequantization
# ----------------------------------------------------------------------------------------------


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], n_shards: int = 2) -> None:
    """Write ``model-0000N-of-0000M.safetensors`` shards + index (contiguous, fp32 as given)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    names = sorted(tensors)
    per = math.ceil(len(names) / n_shards)
    weight_map: dict[str, str] = {}
    total = 0
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {
            n: tensors[n].detach().contiguous().clone() for n in names[s * per : (s + 1) * per]
        }
        save_file(chunk, str(out / fname), metadata={"format": "pt"})
        for n, t in chunk.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    """Read every tensor named in ``model.safetensors.index.json`` (or a lone model.safetensors)."""
    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(ckpt / f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_tensor(k)
    return out


_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


def dequant_v4(sd: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """V4: fp8 e4m3 with e8m0 ``block``x``block`` scales, packed fp4 experts (scale per row/32)."""
    out: dict[str, torch.Tensor] = {}
    for k, w in sd.items():
        if k.endswith(".scale") and k[: -len(".scale")] + ".weight" in sd:
            continue
        sk = k[: -len(".weight")] + ".scale" if k.endswith(".weight") else None
        if sk is None or sk not in sd:
            out[k] = w.float() if w.is_floating_point() else w
            continue
        s = sd[sk].float()
        if w.dtype == torch.int8:
            raw = w.view(torch.uint8)
            dec = torch.empty(w.shape[0], w.shape[1] * 2)
            dec[:, 0::2] = _E2M1[(raw & 15).long()]
            dec[:, 1::2] = _E2M1[(raw >> 4).long()]
            out[k] = dec * s.repeat_interleave(32, 1)[:, : dec.shape[1]]
        else:
            full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
            out[k] = w.float() * full[: w.shape[0], : w.shape[1]]
    return out


# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------


def make_prompts(tokenizer_json: Path) -> list[torch.Tensor]:
    """BOS + the first L-1 tokens of fixed strings (lengths 1, 7, 23, 41)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    prompts = []
    for text, length in zip(PROMPT_TEXTS, PROMPT_LENGTHS, strict=True):
        ids = [BOS] + tok.encode(text, add_special_tokens=False).ids
        if len(ids) < length:
            raise RuntimeError(f"prompt {text!r} too short: {len(ids)} < {length}")
        prompts.append(torch.tensor(ids[:length], dtype=torch.long))
    return prompts


def run_prompts(
    forward: Callable[[torch.Tensor], torch.Tensor], prompts: list[torch.Tensor], suffix: str
) -> tuple[dict[str, torch.Tensor], StableTopk]:
    """Full-sequence logits per prompt and an 8-token greedy continuation (full re-forward)."""
    out: dict[str, torch.Tensor] = {}
    mode = StableTopk()
    with torch.no_grad(), mode:
        for i, ids in enumerate(prompts):
            logits = forward(ids)
            out[f"p{i}.logits{suffix}"] = logits.float().contiguous()
            seq = ids.clone()
            greedy = []
            for _ in range(GREEDY_STEPS):
                nxt = int(forward(seq)[-1].argmax())
                greedy.append(nxt)
                seq = torch.cat([seq, torch.tensor([nxt])])
            out[f"p{i}.greedy{suffix}"] = torch.tensor(greedy, dtype=torch.long)
    return out, mode


# ----------------------------------------------------------------------------------------------
# V4.1 (NeMo AutoModel)
# ----------------------------------------------------------------------------------------------


def _nemo_backend() -> Any:
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(
        attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch"
    )


def build_v41(cfg_dict: dict[str, Any], tokenizer_json: Path) -> nn.Module:
    """Construct NeMo's DeepseekV41ForCausalLM in fp32 (weights uninitialised/random)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from transformers import PreTrainedTokenizerFast

    d = json.loads(json.dumps(cfg_dict))
    d.pop("quantization_config", None)
    d["text_config"]["dtype"] = "float32"
    d["text_config"].pop("torch_dtype", None)
    d.pop("torch_dtype", None)
    d["dtype"] = "float32"
    cfg = DeepseekV41Config(**d)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    model = DeepseekV41ForCausalLM(cfg, backend=_nemo_backend(), tokenizer=tok)
    return model.float().eval()


def _nemo_fan_in_dim1(name: str) -> bool:
    return name.endswith(("gate_and_up_projs", "down_projs"))


def export_v41(model: nn.Module) -> dict[str, torch.Tensor]:
    """Released names via NeMo's own adapter (``to_hf``); drops non-persistent hash buffers."""
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("model.engram_hash.")}
    out = model.state_dict_adapter.to_hf(sd)
    return {k: v.detach().float() if v.is_floating_point() else v for k, v in out.items()}


def load_v41(model: nn.Module, released: dict[str, torch.Tensor]) -> None:
    """Load released-name tensors (fp8/fp4 dequantized by NeMo's adapter) into ``model``."""
    released = {k: v for k, v in released.items() if not k.startswith(("vision.", "aligner."))}
    native = model.state_dict_adapter.from_hf(dict(released))
    own = model.state_dict()
    missing = [k for k in own if k not in native and not k.startswith("model.engram_hash.")]
    for k in missing:
        if k not in model.state_dict_adapter.view_loaded_native_keys:
            raise RuntimeError(f"checkpoint lacks {k}")
    with torch.no_grad():
        for k, v in native.items():
            if k not in own:
                raise RuntimeError(f"unexpected tensor {k}")
            own[k].copy_(v.to(own[k].dtype))


def forward_v41(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(ids.unsqueeze(0)).logits[0]


@contextlib.contextmanager
def no_cache_quant() -> Iterator[None]:
    """Monkeypatch NeMo's quantize_cache to identity wherever it is imported by name."""
    import nemo_automodel.components.models.deepseek_v41.attention as attn
    import nemo_automodel.components.models.deepseek_v41.quantization as q

    mods = [attn, q]
    mods += [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("nemo_automodel") and m not in mods and "quantize_cache" in vars(m)
    ]
    saved = [(m, m.quantize_cache) for m in mods]
    try:
        for m, _ in saved:
            m.quantize_cache = lambda values, **_: values
        yield
    finally:
        for m, f in saved:
            m.quantize_cache = f


def export_dspark_v41(cfg_dict: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random DSpark draft (``mtp.*``) exported through DeepseekV41DSparkStateDictAdapter."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    text = dict(cfg_dict["text_config"])
    text["dtype"] = "float32"
    tcfg = DeepseekV41TextConfig(**text)
    draft = DeepseekV41DSparkModel(
        tcfg, _nemo_backend(), num_anchors=1, enable_confidence_head=True
    ).float()
    randomize(draft, seed, _nemo_fan_in_dim1)
    adapter = getattr(draft, "state_dict_adapter", None)
    if adapter is None:
        from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (
            DeepseekV41DSparkStateDictAdapter,
        )

        adapter = DeepseekV41DSparkStateDictAdapter(
            tcfg, draft.moe_config, _nemo_backend(), dtype=torch.float32
        )
    out = adapter.to_hf(draft.state_dict())
    # The draft holds its own copies of embed/head (shared with the target on disk): keep mtp.*.
    return {
        k: v.detach().float() if v.is_floating_point() else v
        for k, v in out.items()
        if k.startswith("mtp.")
    }


# ----------------------------------------------------------------------------------------------
# V4 (HF transformers)
# ----------------------------------------------------------------------------------------------

_LAYER_TYPE = {4: "compressed_sparse_attention"}


def hf_v4_config(cfg_dict: dict[str, Any]) -> Any:
    """Map an official V4 config.json to HF's DeepseekV4Config (explicit layer types/rates)."""
    from transformers import DeepseekV4Config

    n = cfg_dict["num_hidden_layers"]
    ratios = cfg_dict["compress_ratios"][:n]
    hca = sorted({r for r in ratios if r and r != 4})
    if len(hca) > 1:
        raise ValueError(f"HF V4 supports one HCA ratio, got {hca}")
    types = [
        "sliding_attention"
        if r == 0
        else "compressed_sparse_attention"
        if r == 4
        else "heavily_compressed_attention"
        for r in ratios
    ]
    n_hash = cfg_dict.get("num_hash_layers", 0)
    rs = dict(cfg_dict.get("rope_scaling") or {})
    rs["rope_type"] = rs.pop("type", rs.get("rope_type", "yarn"))
    cfg = DeepseekV4Config(
        vocab_size=cfg_dict["vocab_size"],
        hidden_size=cfg_dict["hidden_size"],
        moe_intermediate_size=cfg_dict["moe_intermediate_size"],
        num_hidden_layers=n,
        num_attention_heads=cfg_dict["num_attention_heads"],
        num_key_value_heads=cfg_dict.get("num_key_value_heads", 1),
        head_dim=cfg_dict["head_dim"],
        q_lora_rank=cfg_dict["q_lora_rank"],
        num_experts_per_tok=cfg_dict["num_experts_per_tok"],
        n_routed_experts=cfg_dict["n_routed_experts"],
        n_shared_experts=cfg_dict.get("n_shared_experts", 1),
        scoring_func=cfg_dict.get("scoring_func", "sqrtsoftplus"),
        norm_topk_prob=cfg_dict.get("norm_topk_prob", True),
        routed_scaling_factor=cfg_dict["routed_scaling_factor"],
        max_position_embeddings=cfg_dict["max_position_embeddings"],
        rope_theta=cfg_dict["rope_theta"],
        compress_rope_theta=cfg_dict["compress_rope_theta"],
        layer_types=types,
        compress_rates={
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": hca[0] if hca else 128,
        },
        hc_mult=cfg_dict["hc_mult"],
        hc_sinkhorn_iters=cfg_dict["hc_sinkhorn_iters"],
        hc_eps=cfg_dict["hc_eps"],
        mlp_layer_types=["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash),
        swiglu_limit=cfg_dict["swiglu_limit"],
        sliding_window=cfg_dict["sliding_window"],
        o_groups=cfg_dict["o_groups"],
        o_lora_rank=cfg_dict["o_lora_rank"],
        index_n_heads=cfg_dict["index_n_heads"],
        index_head_dim=cfg_dict["index_head_dim"],
        index_topk=cfg_dict["index_topk"],
        rms_norm_eps=cfg_dict["rms_norm_eps"],
        rope_parameters=rs,
        partial_rotary_factor=cfg_dict["qk_rope_head_dim"] / cfg_dict["head_dim"],
        bos_token_id=cfg_dict.get("bos_token_id", 0),
        eos_token_id=cfg_dict.get("eos_token_id", 1),
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    return cfg


def build_v4(cfg_dict: dict[str, Any]) -> nn.Module:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf_v4_config(cfg_dict))
    return model.float().eval()


_V4_TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
_V4_LAYER: tuple[tuple[str, str], ...] = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.kv_norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
)


def export_v4(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF V4 state dict -> official names (inverse of transformers' conversion_mapping)."""
    out: dict[str, torch.Tensor] = {}
    layer_map = dict(_V4_LAYER)
    for k, v in model.state_dict().items():
        if "rotary_emb" in k:
            continue
        if k in _V4_TOP:
            out[_V4_TOP[k]] = v
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", k)
        if not m:
            raise KeyError(k)
        i, rest = m[1], m[2]
        if rest == "mlp.experts.gate_up_proj":
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = v[e, :half]
                out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = v[e, half:]
        elif rest == "mlp.experts.down_proj":
            for e in range(v.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = v[e]
        else:
            out[f"layers.{i}.{layer_map[rest]}"] = v
    return {k: v.detach().float() if v.is_floating_point() else v for k, v in out.items()}


def load_v4(model: nn.Module, official: dict[str, torch.Tensor]) -> None:
    """Load fp32 official-name tensors into the HF model (explicit inverse of ``export_v4``)."""
    inv_top = {v: k for k, v in _V4_TOP.items()}
    inv_layer = {v: k for k, v in _V4_LAYER}
    own = model.state_dict()
    seen: set[str] = set()
    experts: dict[tuple[str, int, int], torch.Tensor] = {}
    for k, v in official.items():
        if (
            k.startswith("mtp.")
            or k.endswith(".scale")
            and not k.endswith("hc_head_scale")
            and (not re.search(r"hc_(attn|ffn)_scale$", k))
        ):
            continue
        if k in inv_top:
            tgt = inv_top[k]
        else:
            m = re.fullmatch(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.w([123])\.weight", k)
            if m:
                experts[(m[1], int(m[2]), int(m[3]))] = v
                continue
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", k)
            if not m or m[2] not in inv_layer:
                raise KeyError(f"unknown V4 tensor {k}")
            tgt = f"model.layers.{m[1]}.{inv_layer[m[2]]}"
        own[tgt].copy_(v.to(own[tgt].dtype))
        seen.add(tgt)
    for (i, e, w), v in experts.items():
        if w == 2:
            tgt = f"model.layers.{i}.mlp.experts.down_proj"
            own[tgt][e].copy_(v)
        else:
            tgt = f"model.layers.{i}.mlp.experts.gate_up_proj"
            half = own[tgt].shape[1] // 2
            own[tgt][e, (0 if w == 1 else half) : (half if w == 1 else 2 * half)].copy_(v)
        seen.add(tgt)
    missing = [k for k in own if k not in seen and "rotary_emb" not in k]
    if missing:
        raise RuntimeError(f"checkpoint lacks {missing[:5]}")


def forward_v4(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(ids.unsqueeze(0), use_cache=False).logits[0]


# ----------------------------------------------------------------------------------------------
# Drivers
# ----------------------------------------------------------------------------------------------


def _maxrel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _save_golden(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def _write_config(out: Path, cfg: dict[str, Any]) -> None:
    cfg = dict(cfg)
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def make_v41(seed: int, out_dir: Path, golden: Path) -> dict[str, Any]:
    """Build, export, reload-check and run the V4.1 reference; returns a findings dict."""
    write_tiny_tokenizer(out_dir)
    tok_json = out_dir / "tokenizer.json"
    from tokenizers import Tokenizer

    cfg = tiny_config_v41(Tokenizer.from_file(str(tok_json)))
    model = build_v41(cfg, tok_json)
    randomize(model, seed, _nemo_fan_in_dim1)
    released = export_v41(model)
    try:
        mtp = export_dspark_v41(cfg, seed + 1)
    except Exception as exc:  # noqa: BLE001 - report and continue without mtp
        print(f"[v41] DSpark draft not exported: {exc!r}")
        mtp = {}
    write_checkpoint(out_dir, {**released, **mtp})
    _write_config(out_dir, cfg)
    return run_v41_ckpt(out_dir, golden, reference=model, extra={"n_mtp_tensors": len(mtp)})


def run_v41_ckpt(
    ckpt: Path,
    golden: Path,
    reference: nn.Module | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    cfg = json.loads((ckpt / "config.json").read_text())
    model = build_v41(cfg, ckpt / "tokenizer.json")
    load_v41(model, read_checkpoint(ckpt))
    prompts = make_prompts(ckpt / "tokenizer.json")
    info: dict[str, Any] = dict(extra or {})
    if reference is not None:
        with torch.no_grad():
            for ids in prompts:
                a = forward_v41(model)(ids)
                b = forward_v41(reference)(ids)
                if not torch.equal(a, b):
                    raise RuntimeError(f"V4.1 reload mismatch {_maxrel(a, b):.3e}")
        info["reload"] = "bit-identical"
    tensors: dict[str, torch.Tensor] = {}
    for i, ids in enumerate(prompts):
        tensors[f"p{i}.input_ids"] = ids
    res, mode_q = run_prompts(forward_v41(model), prompts, "")
    tensors.update(res)
    with no_cache_quant():
        res, mode_n = run_prompts(forward_v41(model), prompts, "_noquant")
    tensors.update(res)
    info["ties_quant"] = (mode_q.calls, mode_q.tied_rows, mode_q.zero_tied_rows)
    info["ties_noquant"] = (mode_n.calls, mode_n.tied_rows, mode_n.zero_tied_rows)
    # Same without the stable top-k override: does the reference's own topk agree?
    with torch.no_grad(), no_cache_quant():
        diffs = [
            _maxrel(forward_v41(model)(ids), tensors[f"p{i}.logits_noquant"])
            for i, ids in enumerate(prompts)
        ]
    info["native_topk_vs_stable_maxrel"] = max(diffs)
    info["quant_vs_noquant_maxrel"] = max(
        _maxrel(tensors[f"p{i}.logits"], tensors[f"p{i}.logits_noquant"])
        for i in range(len(prompts))
    )
    _save_golden(golden, tensors, {"arch": "v41", "ckpt": str(ckpt.name)})
    return info


def make_v4(seed: int, out_dir: Path, golden: Path) -> dict[str, Any]:
    write_tiny_tokenizer(out_dir)
    cfg = tiny_config_v4()
    model = build_v4(cfg)
    randomize(model, seed, lambda _n: False)
    official = export_v4(model)
    write_checkpoint(out_dir, official)
    _write_config(out_dir, cfg)
    info: dict[str, Any] = {}
    # Reload through HF's own path (conversion_mapping) as an independent export check.
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(out_dir), config=hf_v4_config(cfg))
    hf = hf.float().eval()
    prompts = make_prompts(out_dir / "tokenizer.json")
    with torch.no_grad():
        worst = max(_maxrel(forward_v4(hf)(ids), forward_v4(model)(ids)) for ids in prompts)
    if worst > 1e-5:
        raise RuntimeError(f"V4 HF from_pretrained reload mismatch {worst:.3e}")
    info["reload_hf_from_pretrained_maxrel"] = worst
    info.update(run_v4_ckpt(out_dir, golden, reference=model))
    return info


def run_v4_ckpt(ckpt: Path, golden: Path, reference: nn.Module | None = None) -> dict[str, Any]:
    cfg = json.loads((ckpt / "config.json").read_text())
    block = (cfg.get("quantization_config") or {}).get("weight_block_size", [128, 128])[0]
    model = build_v4(cfg)
    load_v4(model, dequant_v4(read_checkpoint(ckpt), block))
    prompts = make_prompts(ckpt / "tokenizer.json")
    info: dict[str, Any] = {}
    if reference is not None:
        with torch.no_grad():
            for ids in prompts:
                a, b = forward_v4(model)(ids), forward_v4(reference)(ids)
                if not torch.equal(a, b):
                    raise RuntimeError(f"V4 reload mismatch {_maxrel(a, b):.3e}")
        info["reload_explicit"] = "bit-identical"
    tensors: dict[str, torch.Tensor] = {f"p{i}.input_ids": ids for i, ids in enumerate(prompts)}
    res, mode = run_prompts(forward_v4(model), prompts, "")
    tensors.update(res)
    info["ties"] = (mode.calls, mode.tied_rows, mode.zero_tied_rows)
    with torch.no_grad():
        diffs = [
            _maxrel(forward_v4(model)(ids), tensors[f"p{i}.logits"])
            for i, ids in enumerate(prompts)
        ]
    info["native_topk_vs_stable_maxrel"] = max(diffs)
    _save_golden(golden, tensors, {"arch": "v4", "ckpt": str(ckpt.name)})
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("v41", "v4", "all"), default="all")
    ap.add_argument(
        "--ckpt", type=Path, help="run the reference on this official-layout checkpoint"
    )
    ap.add_argument("--out", type=Path, help="golden output file (with --ckpt)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.ckpt is not None:
        if args.arch == "all" or args.out is None:
            ap.error("--ckpt needs --arch v41|v4 and --out")
        run = run_v41_ckpt if args.arch == "v41" else run_v4_ckpt
        print(json.dumps(run(args.ckpt, args.out), indent=1))
        return
    if args.arch in ("v41", "all"):
        info = make_v41(args.seed, HERE / "ref_v41", HERE / "golden_v41.safetensors")
        print("v41", json.dumps(info))
    if args.arch in ("v4", "all"):
        info = make_v4(args.seed, HERE / "ref_v4", HERE / "golden_v4.safetensors")
        print("v4", json.dumps(info))


if __name__ == "__main__":
    main()
