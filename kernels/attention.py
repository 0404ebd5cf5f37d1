"""Sparse single-latent attention with a per-head sink: the torch reference, the split
merge, and the dispatch between the two Triton kernels of the contract.

Every query token attends to its own list of key rows in a shared KV pool (K = V, one head):
the window ring and the selected compressed entries are both just rows of ``kv``.

``sparse_attention_triton`` takes the warp-specialized Hopper kernel (``kernels.attention_ws``)
where it applies and the portable kernel (``kernels.attention_tl``) elsewhere. With KV splits
each split writes (m, l) in fp32 and its unnormalized O (fp32 from the portable kernel, bf16
from the warp-specialized one: ``WS_PARTIALS``), and ``_combine_kernel`` merges them in fp32,
the output's inverse RoPE fused into its epilogue.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention_tl import LOG2E, default_splits, launch_tl
from kernels.attention_ws import HEADS, launch_ws
from kernels.dispatch import capability, op, sm_count
from kernels.kv_quant import kv_unpack
from kernels.rope import apply_rope_ref, rope_angles, rope_pairs

# The ws kernel's split partials O (m and l stay fp32): bf16 halves their write and the
# combine's read, and the kernel stores them row-contiguously through its key ring. Each
# split's O is rounded once to bf16 (relative 2^-9) before the fp32 merge, as FlashInfer
# keeps its split-KV partials in the output dtype. H200, batch 64, fp8 rows: 32.3 against
# 38.5 us with fp32 partials.
WS_PARTIALS = torch.bfloat16
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64: lets tests run the reference in float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def dequant_kv(kv: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """Stored key rows -> float: plain rows pass through (at least fp32); fp8 e4m3 rows times
    their per-32-channel scales (fp32, or e8m0 codes as uint8); nvfp4 rows (uint8, two E2M1
    codes per byte, channel 2j in the low nibble) times their e4m3 scale per 16 channels."""
    if kv_scale is None:
        return _wide(kv)
    if kv.dtype == torch.uint8:  # nvfp4
        return kv_unpack(kv, kv_scale, "nvfp4", torch.float32)
    if kv_scale.dtype == torch.uint8:  # e8m0 codes
        kv_scale = torch.ldexp(torch.ones(kv_scale.shape, device=kv.device), kv_scale.long() - 127)
    scale = _wide(kv_scale).repeat_interleave(kv.shape[-1] // kv_scale.shape[-1], dim=-1)
    return kv.to(scale.dtype) * scale


def _gather(kv: torch.Tensor, kv_scale: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` [T, K] (-1 = any row) of a key source, decoded: [T, K, D]."""
    flat = idx.clamp_min(0).reshape(-1)
    sc = kv_scale[flat] if kv_scale is not None else None
    return dequant_kv(kv[flat], sc).view(*idx.shape, -1)


def sparse_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    inv_rope_angles: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    kv2: torch.Tensor | None = None,
    idx2: torch.Tensor | None = None,
    kv2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D], ``kv`` [N, D], ``idx`` [T, K] int64 rows of ``kv`` (-1 = empty),
    ``sink`` [H] fp32 logits -> out [T, H, D] in q.dtype.

    ``p_i = exp(l_i - m) / (sum_j exp(l_j - m) + exp(sink_h - m))``; fp32 softmax (fp64 for
    fp64 inputs). Optional: ``kv_scale`` dequantizes a stored ``kv`` (:func:`dequant_kv`);
    a second key source ``kv2`` [N2, D] (+ ``kv2_scale``) with its rows ``idx2`` [T, K2]
    (the compressed entries beside the window); ``inv_rope_angles`` [T, R/2] applies
    inverse RoPE to the output's last R channels.
    """
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"bad shapes q{tuple(q.shape)} kv{tuple(kv.shape)} idx{tuple(idx.shape)}")
    keys = _gather(kv, kv_scale, idx)  # [T, K, D]
    valid = idx >= 0
    if kv2 is not None:
        if idx2 is None or idx2.shape[0] != q.shape[0]:
            raise ValueError("a second key source needs idx2 [T, K2]")
        keys2 = _gather(kv2, kv2_scale, idx2)
        dt = torch.promote_types(keys.dtype, keys2.dtype)
        keys = torch.cat((keys.to(dt), keys2.to(dt)), dim=1)
        valid = torch.cat((valid, idx2 >= 0), dim=1)
    qf = _wide(q).to(keys.dtype)
    logits = torch.einsum("thd,tkd->thk", qf, keys) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.to(keys.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("thk,tkd->thd", probs, keys)
    if inv_rope_angles is not None:
        out = apply_rope_ref(out, inv_rope_angles.to(out.dtype), inverse=True)
    return out.to(q.dtype)


# ---- Triton -------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _combine_kernel(
    part_ptr, ml_ptr, ang_ptr, out_ptr, T, H, SPLITS, s_at, s_ot, s_oh,
    D: tl.constexpr, R: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out = sum_s 2^(m_s - M) O_s / sum_s 2^(m_s - M) l_s, per (token, head block)."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(ml_ptr + ((s * T + t) * H + heads) * 2, mask=hmask, other=0.0))
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for s in range(SPLITS):
        row = (s * T + t) * H + heads
        w = tl.exp2(tl.load(ml_ptr + row * 2, mask=hmask, other=0.0) - m)
        l_sum += w * tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=1.0)
        part = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=hmask[:, None], other=0.0)
        part = part.to(tl.float32)
        acc += w[:, None] * part
    o = acc / l_sum[:, None]
    if ROPE:
        o = rope_pairs(o, rope_angles(ang_ptr + t * s_at, D, R), INVERSE=True)
    optrs = out_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _source(kv: torch.Tensor, kv_scale: torch.Tensor | None, q: torch.Tensor, D: int, which: str):
    """(format code, scale is e8m0) of one key source, after checking its shapes and dtypes."""
    if kv.dim() != 2 or kv.stride(-1) != 1:
        raise ValueError(f"{which} must be [N, D] with a contiguous last dim: {tuple(kv.shape)}")
    if kv.dtype == torch.uint8:  # nvfp4
        if kv.shape[1] != D // 2 or kv_scale is None or kv_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"nvfp4 {which} needs [N, D/2] bytes and e4m3 scales per 16")
        if kv_scale.shape != (kv.shape[0], D // 16) or kv_scale.stride(-1) != 1:
            raise ValueError(f"{which} scale must be [N, D/16], got {tuple(kv_scale.shape)}")
        return 2, False
    if kv.shape[1] != D:
        raise ValueError(f"{which} rows have {kv.shape[1]} channels, q has {D}")
    if kv.dtype == torch.float8_e4m3fn:
        if kv_scale is None or kv_scale.shape != (kv.shape[0], D // 32):
            raise ValueError(f"fp8 {which} needs a scale [N, D/32]")
        if kv_scale.dtype not in (torch.float32, torch.uint8) or kv_scale.stride(-1) != 1:
            raise ValueError(f"{which} scale must be fp32 or e8m0 (uint8), contiguous")
        return 1, kv_scale.dtype == torch.uint8
    if kv_scale is not None:
        raise ValueError(f"a scale is given for plain {which} rows ({kv.dtype})")
    if kv.dtype != q.dtype:
        raise TypeError(f"{which} dtype {kv.dtype} must match q dtype {q.dtype}")
    return 0, False


_KERNELS = ("auto", "ws", "tl")


def ws_applies(q: torch.Tensor) -> bool:
    """Whether the warp-specialized kernel takes queries ``q`` [T, H, D] (sm_90, bf16,
    D = 512, heads in blocks of 64); it reads every key format."""
    T, H, D = q.shape
    return (
        q.is_cuda
        and not _INTERPRET
        and q.dtype == torch.bfloat16
        and D == 512
        and H % HEADS == 0
        and capability(q.device) == (9, 0)
    )


def ws_splits(T: int, H: int, K: int, device: torch.device) -> int:
    """KV splits of the warp-specialized kernel (one ~190 KB CTA per SM): as many as keep
    (token, 64-head) programs within one wave, with >= 128 keys each."""
    programs = T * triton.cdiv(H, HEADS)
    return max(1, min(sm_count(device) // programs, K // 128))


def sparse_attention_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    *,
    inv_rope_angles: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    kv2: torch.Tensor | None = None,
    idx2: torch.Tensor | None = None,
    kv2_scale: torch.Tensor | None = None,
    splits: int | None = None,
    out: torch.Tensor | None = None,
    launch: dict[str, int] | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Triton ``sparse_attention_ref`` (same arguments). Key sources: rows in q.dtype, fp8
    e4m3 with ``kv_scale`` [N, D/32] (fp32 or e8m0 codes), or (second source) nvfp4 bytes
    [N, D/2] with e4m3 scales [N, D/16]; ``splits`` overrides the KV split count
    (``default_splits``); ``out`` [T, H, D] (contiguous last dim) receives the result;
    ``launch`` (BLOCK_H, BLOCK_N, num_warps, num_stages) bypasses the autotuner.

    ``kernel``: "auto" (the dispatch) takes the warp-specialized Hopper kernel
    (``kernels.attention_ws``) wherever it applies (sm_90, bf16 q, D = 512, heads in blocks of
    64, key pools under 2^31 rows) except for plain bf16 rows at under 8 (token, 64-head)
    programs, and the portable kernel elsewhere: at those small plain-row calls it was the
    faster of the two on the H200. "ws" / "tl" name one of the two (benchmarks and tests
    compare them at one shape; "ws" is an error where it cannot run). With "ws", ``launch``
    holds its (block_n, stages, p_regs, c_regs) instead."""
    T, H, D = q.shape
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"bad shapes q{tuple(q.shape)} kv{tuple(kv.shape)} idx{tuple(idx.shape)}")
    if D < 32 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 32")
    if q.dtype not in _Q_DTYPES:
        raise TypeError(f"unsupported q dtype {q.dtype}")
    fmt, e8 = _source(kv, kv_scale, q, D, "kv")
    if fmt == 2:
        raise ValueError("nvfp4 rows are taken as the second key source only")
    if (kv2 is None) != (idx2 is None):
        raise ValueError("kv2 and idx2 go together")
    if kv2 is None:
        kv2, idx2, fmt2, e82 = kv, idx[:, :0], fmt, e8
        kv2_scale = kv_scale
    else:
        fmt2, e82 = _source(kv2, kv2_scale, q, D, "kv2")
        if idx2.dim() != 2 or idx2.shape[0] != T:
            raise ValueError(f"idx2 must be [T, K2], got {tuple(idx2.shape)}")
    for i in (idx, idx2):
        if i.dtype not in (torch.int64, torch.int32) or (i.numel() and i.stride(-1) != 1):
            raise ValueError("idx / idx2 must be int32/int64 with a contiguous last dim")
    if sink.shape != (H,):
        raise ValueError(f"sink must be [H], got {tuple(sink.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dim")
    R = 0
    if inv_rope_angles is not None:
        R = 2 * inv_rope_angles.shape[-1]
        if inv_rope_angles.shape != (T, R // 2) or R > D or inv_rope_angles.stride(-1) != 1:
            raise ValueError(f"inv_rope_angles must be [T, <=D/2], got {inv_rope_angles.shape}")
        inv_rope_angles = inv_rope_angles.float()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, H, D] with a contiguous last dim: {tuple(out.shape)}")
    K, K2 = idx.shape[1], idx2.shape[1]
    if T == 0:
        return out
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
    # (the ws kernel takes row ids as int32)
    ws = ws_applies(q) and max(kv.shape[0], kv2.shape[0]) < 2**31
    if kernel == "ws" and not ws:
        raise ValueError("the warp-specialized kernel needs sm_90, bf16 q, D = 512, "
                         "H % 64 == 0 and key pools under 2^31 rows")  # fmt: skip
    if kernel == "auto":
        ws = ws and not (fmt == 0 and fmt2 == 0 and T * (H // HEADS) < 8)
    else:
        ws = kernel == "ws"
    S = splits or (ws_splits if ws else default_splits)(T, H, K + K2, q.device)
    sink = sink.float().contiguous()
    ang = inv_rope_angles if R else sink  # dummy pointer when unused
    sc = kv_scale if fmt else sink
    sc2 = kv2_scale if fmt2 else sink
    part = ml = out
    if S > 1:
        part = torch.empty((S, T, H, D), device=q.device,
                           dtype=WS_PARTIALS if ws else torch.float32)  # fmt: skip
        ml = torch.empty((S, T, H, 2), device=q.device, dtype=torch.float32)

    if ws:
        strides = (q.stride(0), q.stride(1), kv.stride(0), sc.stride(0), idx.stride(0),
                   kv2.stride(0), sc2.stride(0), max(idx2.stride(0), 1), ang.stride(0),
                   out.stride(0), out.stride(1))  # fmt: skip
        launch_ws(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
                  scale * LOG2E, strides, D=D, R=R, fmt=fmt, e8=e8, fmt2=fmt2, e82=e82,
                  **(launch or {}))  # fmt: skip
    else:
        launch_tl(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
                   scale, D, R, fmt, e8, fmt2, e82, launch)  # fmt: skip
    if S > 1:
        bh = 16
        _combine_kernel[(T, triton.cdiv(H, bh))](
            part, ml, ang, out, T, H, S, ang.stride(0), out.stride(0), out.stride(1),
            D=D, R=R, ROPE=R > 0, BLOCK_H=bh, num_warps=4,
        )  # fmt: skip
    return out


def invariant_launch(H: int) -> dict[str, int]:
    """The portable kernel's one launch shape in the deterministic mode (by head count only;
    two of the autotuner's configs)."""
    if _INTERPRET:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4}
    if H >= 64:
        return {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


def sparse_attention_invariant(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor,
                               sink: torch.Tensor, scale: float, **kw) -> torch.Tensor:  # fmt: skip
    """:func:`sparse_attention_triton` in the deterministic mode: the portable kernel at one
    launch shape (:func:`invariant_launch`) and one KV split, so a token's online softmax
    takes its keys in the same blocks whatever the batch: its key lists are fixed by its
    own positions (window, top-k), and the padding of a wider step (V4's all-visible
    entries) adds blocks of masked keys, which change nothing. (Splits by key count would
    fill the GPU better at small batches; here they would move a token's keys between
    splits as a step's widest list changes.)"""
    return sparse_attention_triton(q, kv, idx, sink, scale, splits=1, kernel="tl",
                                   launch=invariant_launch(q.shape[1]), **kw)  # fmt: skip


sparse_attention = op(sparse_attention_ref, sparse_attention_triton,
                      invariant=sparse_attention_invariant)  # fmt: skip
