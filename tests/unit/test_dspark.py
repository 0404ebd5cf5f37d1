"""DSpark drafting (app/model/dspark.py) against an independent float64 computation of
MODEL_SPEC §4 on the tiny V4.1 model, and the target features of the batched step against
the full-sequence reference."""

from __future__ import annotations

import copy
import math
import random

import torch

from app.cache.manager import CacheManager
from app.config import CacheConfig
from app.model.dspark import DSparkDrafter
from app.model.kv_store import KVRows
from bench.teacher import drive
from kernels.kv_quant import kv_storage
from tests.support.reference import reference_logits


def _rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x, pos, freqs, inverse=False):
    """Interleaved pairs of the last 2 * len(freqs) channels, rotated by pos * freqs."""
    r = 2 * freqs.numel()
    ang = pos.double().unsqueeze(-1) * freqs.double()
    if x.dim() == 3:
        ang = ang.unsqueeze(1)
    a, b = x[..., -r::2], x[..., -r + 1 :: 2]
    c, s = torch.cos(ang), (-1 if inverse else 1) * torch.sin(ang)
    out = x.clone()
    out[..., -r::2], out[..., -r + 1 :: 2] = a * c - b * s, a * s + b * c
    return out


def _mix(X, fn, base, scale, iters, hc_eps, norm_eps):
    """mHC mixing of one sublayer (MODEL_SPEC §2), fp64: -> pre [n], post [n], comb [n, n]."""
    n = X.shape[-2]
    v = X.reshape(*X.shape[:-2], -1)
    m = (v @ fn.t()) / torch.sqrt((v * v).mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    C = torch.softmax((m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n)), -1)
    C = C + hc_eps
    C = C / (C.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + hc_eps)
        C = C / (C.sum(-2, keepdim=True) + hc_eps)
    return pre, post, C


def _draft_by_definition(model, feats, a, bonus, k):
    """One block after context features ``feats`` [a+1, 3d] (positions 0..a), fp64."""
    cfg = model.cfg
    m = copy.deepcopy(model).double()
    W, B, H, D = cfg.sliding_window, cfg.dspark_block_size, cfg.num_attention_heads, cfg.head_dim
    first, last = m.mtp[0], m.mtp[-1]
    ctx_pos = torch.arange(max(0, a - W + 1), a + 1)
    main = _rms(feats.double()[ctx_pos] @ first.main_proj.weight.t(), first.main_norm.weight,
                cfg.rms_norm_eps)  # fmt: skip
    pos = a + 1 + torch.arange(B)
    ids = torch.tensor([bonus] + [cfg.dspark_noise_token_id] * (B - 1))
    X = m.embed.weight[ids].unsqueeze(1).expand(-1, cfg.hc_mult, -1).clone()
    p = torch.zeros(B, cfg.hc_mult, dtype=torch.float64)
    p[:, 0] = 1
    eps = cfg.rms_norm_eps
    for st in m.mtp:
        att = st.attn
        freqs = att.rotary.freqs
        mix = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=eps)
        pre_a, post, comb = _mix(X, st.hc_attn_fn, st.hc_attn_base, st.hc_attn_scale, **mix)
        x = _rms((p.unsqueeze(-1) * X).sum(1), st.attn_norm.weight, eps)
        q = _rope((_rms(x @ att.wq_a.weight.t(), att.q_norm.weight, eps) @ att.wq_b.weight.t())
                  .view(B, H, D), pos, freqs)  # fmt: skip
        kv_ctx = _rope(_rms(main @ att.wkv.weight.t(), att.kv_norm.weight, eps), ctx_pos, freqs)
        kv_blk = _rope(_rms(x @ att.wkv.weight.t(), att.kv_norm.weight, eps), pos, freqs)
        keys = torch.cat((kv_ctx, kv_blk))  # every block row: the window and the whole block
        logits = torch.einsum("bhd,kd->bhk", q, keys) / math.sqrt(D)
        sink = att.attn_sink.view(1, H, 1).expand(B, H, 1)
        prob = torch.softmax(torch.cat((logits, sink), -1), -1)[..., :-1]
        o = _rope(torch.einsum("bhk,kd->bhd", prob, keys), pos, freqs, inverse=True)
        g = cfg.o_groups
        o = torch.einsum("bgi,goi->bgo", o.reshape(B, g, -1),
                         att.wo_a.weight.view(g, cfg.o_lora_rank, -1)).flatten(1)  # fmt: skip
        out = o @ att.wo_b.weight.t()
        X = post.unsqueeze(-1) * out.unsqueeze(1) + torch.einsum("bjk,bjd->bkd", comb, X)
        pre_f, post, comb = _mix(X, st.hc_ffn_fn, st.hc_ffn_base, st.hc_ffn_scale, **mix)
        x = _rms((pre_a.unsqueeze(-1) * X).sum(1), st.ffn_norm.weight, eps)
        out = st.ffn(x, ids)
        X = post.unsqueeze(-1) * out.unsqueeze(1) + torch.einsum("bjk,bjd->bkd", comb, X)
        p = pre_f
    gsum = (p.unsqueeze(-1) * X).sum(1)
    base = _rms(gsum, last.norm.weight, eps) @ m.head.weight.t()
    prev, toks, zs, cs = bonus, [], [], []
    for j in range(k):
        e = last.markov_head.embed.weight[prev]
        z = base[j] + last.markov_head.head.weight @ e
        cs.append(torch.sigmoid(last.confidence_head.proj.weight @ torch.cat((gsum[j], e))))
        prev = int(z.argmax())
        toks.append(prev)
        zs.append(z)
    return torch.tensor(toks), torch.stack(zs), torch.cat(cs)


def _prefill_with_features(model, toks):
    """Prefill ``toks`` through the batched step; the target features of every row."""
    cfg = CacheConfig(block_size=8, enable_prefix_caching=False, bounded_replay="off")
    mgr = CacheManager(model, cfg, num_blocks=16, max_slots=2)
    feats: list[torch.Tensor] = []
    orig = model.forward

    def capture(batch):
        return orig(batch, feats)

    model.forward = capture
    try:
        drive(model, mgr, {"r": toks}, random.Random(0), max_chunk=1000)
    finally:
        del model.forward
    return feats[0]


def test_target_features_equal_the_reference(tiny_model):
    model = tiny_model("v41")
    toks = torch.randint(3, 500, (23,), generator=torch.Generator().manual_seed(4))
    got = _prefill_with_features(model, toks)
    ref: list[torch.Tensor] = []
    reference_logits(model, toks, ref)
    assert got.shape == (23, 3 * model.cfg.hidden_size)
    torch.testing.assert_close(got, ref[0], rtol=0, atol=1e-5 * ref[0].abs().max().item())


def test_draft_block_equals_the_definition(tiny_model):
    model = tiny_model("v41")
    cfg = model.cfg
    toks = torch.randint(3, 500, (14,), generator=torch.Generator().manual_seed(5))
    feats: list[torch.Tensor] = []
    reference_logits(model, toks, feats)
    F = feats[0]
    a, bonus, k = toks.numel() - 1, 77, cfg.dspark_block_size
    drafter = DSparkDrafter(model)
    rings = [KVRows(*kv_storage("float", 3 * cfg.sliding_window, cfg.head_dim, torch.float32,
                                "cpu"), "float", cfg.head_dim) for _ in model.mtp]  # fmt: skip
    slot = 1
    pos = torch.arange(a + 1)
    drafter.write_context(rings, torch.full_like(pos, slot), F, pos)
    with torch.no_grad():
        blk = drafter.draft(rings, torch.tensor([slot]), torch.tensor([a]),
                            torch.tensor([bonus]), k)  # fmt: skip
        want_ids, want_z, want_c = _draft_by_definition(model, F, a, bonus, k)
    assert blk.ids[0].tolist() == want_ids.tolist()
    z = blk.logits[0].double()
    assert ((z - want_z).abs().max() / want_z.abs().max()).item() < 1e-5
    torch.testing.assert_close(blk.confidence[0].double(), want_c, rtol=1e-5, atol=1e-6)

