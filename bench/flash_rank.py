"""A scaled DeepSeek-V4.1-Flash rank built in memory (../shared/docs/PERFORMANCE.md).

Every per-layer shape of V4.1-Flash (hidden 5120, 64 x 512 heads, q_lora 1280, o 8 x 1024,
window 128, top-512, indexer 32 x 128, experts 2304 wide, top-6), all 40 layers and the
3 DSpark stages; the expert share of one rank of an EP8 deployment (48 of 384 routed experts
per layer, 16 of 128 in the DSpark stages) as fp4 in the pairs layout; small Engram tables of
the real row width; random weights (dense bf16 — the checkpoint's fp8 dense weights are not
kept packed yet — norms, mHC, router in fp32).

EP assumption: with every rank of an EP8 group at batch B, the local experts see the group's
8B tokens (``GroupLoad``: this rank's tokens plus 7B fixed random hidden states through the
same router, their outputs dropped); the dispatch / combine all-to-all is not part of a
one-GPU step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from app.model.config import ModelConfig
from app.model.engram_hash import engram_hash_spec
from app.model.layers import Linear
from app.model.loader import build_empty_model
from app.model.model import DeepseekModel
from app.model.moe import Gate, MoE, PackedExperts

EP = 8
ENGRAM_VOCAB = 4099  # real Engram rows come from a 16M-entry vocabulary; this keeps 50 MB


def flash_config() -> ModelConfig:
    """V4.1-Flash's config (MODEL_SPEC §1) with small Engram tables."""
    spec = engram_hash_spec((1, 14), 4, 8, ENGRAM_VOCAB, 99092)
    text = {
        "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2304, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 3,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "engram_layer_ids": [1, 14],
        "engram_num_embeddings": list(spec.table_rows()), "engram_max_ngram_size": 4,
        "engram_vocab_size": ENGRAM_VOCAB, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "pad_token_id": 2,
    }  # fmt: skip
    return ModelConfig.from_dict({
        "architectures": ["DeepseekV41ForCausalLM"], "text_config": text,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [32, 32], "expert_dtype": "fp4"},
    })  # fmt: skip


def _fill(shape, dtype, device, std: float, g: torch.Generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    return t.normal_(0.0, std, generator=g).to(dtype)


def _packed(n: int, d: int, inter: int, device, g: torch.Generator) -> PackedExperts:
    """``n`` random fp4 experts (codes uniform, e8m0 scales giving weights ~ 1/sqrt(fan_in))."""

    def codes(*shape):
        return torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=g)

    def scales(shape, code: int):
        return torch.full(shape, code, dtype=torch.uint8, device=device).view(
            torch.float8_e8m0fnu
        )

    pe = PackedExperts(
        codes(n, 2 * inter, d // 2), scales((n, 2 * inter, d // 32), 127 - 8),
        codes(n, d, inter // 2), scales((n, d, inter // 32), 127 - 7),
        "fp4", (1, 32), 10.0,
    )  # fmt: skip
    pe.repack("pairs")
    return pe


def build_flash_rank(
    device: str = "cuda", ep: int = EP, seed: int = 0, dense: str = "bf16"
) -> DeepseekModel:
    """The scaled rank on ``device`` (~50 GB on a GPU): see the module doc."""
    return build_rank(flash_config(), device, ep, seed, dense)


def build_rank(
    cfg: ModelConfig, device: str, ep: int = EP, seed: int = 0, dense: str = "bf16"
) -> DeepseekModel:
    """Random weights for ``cfg`` with ``1/ep`` of each MoE layer's experts local (fp4,
    pairs layout), packed V4.1 cache formats; ``dense="fp8"``: the projections the loader's
    ``packed_dense`` keeps fp8 are e4m3 with 32 x 32 e8m0 blocks (``Fp8Linear``)."""
    model = build_empty_model(cfg, kv_quant=True)
    g = torch.Generator(device=device).manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, MoE):
            n_all = mod.gate.weight.shape[0]
            mod.experts = _packed(n_all // ep, cfg.hidden_size, cfg.moe_intermediate_size,
                                  device, g)  # fmt: skip
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if isinstance(mod, Linear | Gate) and p.dim() == 2:  # the router: bf16 as stored
                new = _fill(p.shape, torch.bfloat16, device, 1 / math.sqrt(p.shape[-1]), g)
            elif p.dim() >= 2:  # mHC maps, Engram tables
                new = _fill(p.shape, p.dtype, device, 1 / math.sqrt(p.shape[-1]), g)
            elif name.endswith("scale") or "norm" in type(mod).__name__.lower() or "weight" in name:
                new = torch.ones(p.shape, dtype=p.dtype, device=device)
            else:
                new = torch.zeros(p.shape, dtype=p.dtype, device=device)
            mod._parameters[name] = nn.Parameter(new, requires_grad=False)
    model.embed.weight = nn.Parameter(
        _fill(model.embed.weight.shape, torch.bfloat16, device, 1.0, g), requires_grad=False
    )
    for layer in model.layers:
        if hasattr(layer, "engram"):
            w = layer.engram.embed.weight
            layer.engram.embed.weight = nn.Parameter(w.to(torch.bfloat16), requires_grad=False)
    if dense == "fp8":
        _fp8_dense(model)
    model = model.to(device).eval()
    model.set_engram_token_map([i % cfg.engram_compressed_vocab_size
                                for i in range(cfg.vocab_size)])  # fmt: skip
    return model


def _fp8_dense(model: DeepseekModel) -> None:
    """The loader's ``packed_dense`` set of projections as Fp8Linear (quantized weights)."""
    from app.model.checkpoint import _DENSE_PACKABLE
    from app.model.layers import Fp8Linear
    from kernels.quant import quantize_fp8_block

    for name, mod in list(model.named_modules()):
        if isinstance(mod, Linear) and _DENSE_PACKABLE.search(f"{name}.weight"):
            parent, _, child = name.rpartition(".")
            q, s = quantize_fp8_block(mod.weight.float(), (32, 32))
            setattr(model.get_submodule(parent), child, Fp8Linear(q, s, (32, 32)))


class GroupLoad:
    """The local experts of every MoE layer see ``ep`` x this rank's tokens: its own and
    ``(ep - 1)`` x as many fixed random hidden states (what the other ranks of the group send
    through the all-to-all), routed by the same gate; only the own rows are kept."""

    def __init__(self, model: DeepseekModel, ep: int, max_tokens: int) -> None:
        self.ep = ep
        d, dev = model.cfg.hidden_size, model.embed.weight.device
        g = torch.Generator(device=dev).manual_seed(1234)
        self.remote = _fill(((ep - 1) * max_tokens, d), torch.bfloat16, dev, 1.0, g)
        if ep > 1:
            for mod in model.modules():
                if isinstance(mod, MoE):
                    mod.forward = self._wrap(mod)

    def _wrap(self, moe: MoE):
        def forward(x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
            T = x.shape[0]
            xg = torch.cat((x, self.remote[: (self.ep - 1) * T].to(x.dtype)))
            tg = token_ids.repeat(self.ep)
            ids, w = moe.gate(xg, tg)
            routed = moe.experts(xg, ids, w, moe.gate.weight.shape[0])[:T]
            return routed + moe.shared_experts(x)

        return forward


# ---- floors ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step must read (each weight once, each KV row once)."""

    dense: float  # attention, shared expert, router, mHC, Engram, head of every layer
    experts: float  # local routed experts touched
    kv: float  # window + selected compressed entries + every visible index key

    @property
    def total(self) -> float:
        return self.dense + self.experts + self.kv


def expected_experts(n_local: int, n_all: int, k: int, tokens: int) -> float:
    """Distinct local experts ``tokens`` uniformly routed tokens touch: E_l [1 - (1-k/E)^t]."""
    return n_local * (1 - (1 - k / n_all) ** tokens)


def decode_bytes(
    model: DeepseekModel, batch: int, ctx: int, q: int = 1, ep: int = EP, dense_fp8: bool = False
) -> StepBytes:
    """The floor's bytes for a decode step of ``batch`` requests x ``q`` tokens at context
    ``ctx``: the model's own storage (bf16 dense), or the checkpoint's fp8 dense weights
    (``dense_fp8``: 1 B per value + e8m0 per 32 x 32 block; the bf16 head stays)."""
    cfg = model.cfg
    dense = 0.0
    expert_bytes, n_local = 0.0, 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("mtp.") or ".experts." in name:
            continue
        per = t.element_size()
        if dense_fp8 and t.dim() == 2 and t.dtype == torch.bfloat16 and not name.startswith(
            ("head.", "embed.")
        ) and "engram.embed" not in name:
            per = 1 + 1 / 1024
        if name.startswith("embed.") or "engram.embed" in name:
            continue  # gathered rows, not read whole
        dense += t.numel() * per
    layer_pe = model.layers[0].ffn.experts
    n_local = layer_pe.n_local
    for b in (layer_pe.w13, layer_pe.s13, layer_pe.w2, layer_pe.s2):
        expert_bytes += b.numel() * b.element_size()
    per_expert = expert_bytes / n_local
    touched = expected_experts(n_local, cfg.n_routed_experts, cfg.num_experts_per_tok,
                               batch * q * ep)  # fmt: skip
    experts = cfg.num_hidden_layers * touched * per_expert
    tokens = batch * q
    kv_tok = 0.0
    for s in cfg.layers:
        kv_tok += cfg.sliding_window * 528  # fp8 window rows
        if s.compressed:
            kv_tok += min(cfg.index_topk, ctx // s.ratio) * 288  # nvfp4 entries
        if s.computes_topk:
            kv_tok += (ctx // s.ratio) * 68  # the indexer scores every visible mxfp4 key
    return StepBytes(dense, experts, tokens * kv_tok)


def prefill_flops(model: DeepseekModel, tokens: int, ctx: int, ep: int = EP,
                  decoder_rows: int | None = None) -> float:  # fmt: skip
    """Matrix FLOPs of a prefill step of ``tokens`` new tokens at context ``ctx`` (average
    position ctx): dense projections, routed experts of the group's tokens routed here,
    attention over window + top-k, indexer scores; ``decoder_rows`` = rows that run the
    decoder layers (decoder replay), else all."""
    cfg = model.cfg
    per_layer_dense = {}
    for i, layer in enumerate(model.layers):
        n = 0
        for name, t in layer.named_parameters():
            if ".experts." not in f".{name}" and t.dim() == 2 and "engram.embed" not in name:
                n += t.numel()
        per_layer_dense[i] = n
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    # the group's tokens routed to this rank's experts: ep x (k x local/all) slots per own
    # token = k slots (ep = all / local), 3 GEMMs of d x inter each
    routed = cfg.num_experts_per_tok * 3 * d * inter
    flops = 0.0
    for i, s in enumerate(cfg.layers):
        rows = tokens if decoder_rows is None or i < model.decoder_start else decoder_rows
        keys = cfg.sliding_window + (cfg.index_topk if s.compressed else 0)
        attn = keys * cfg.head_dim * cfg.num_attention_heads * 4
        idx = 0
        if s.computes_topk:
            idx = (ctx // s.ratio) * cfg.index_n_heads * cfg.index_head_dim * 2
        flops += rows * (2 * per_layer_dense[i] + 2 * routed + attn + idx)
    return flops
