"""RMSNorm and fused RMSNorm + RoPE: torch references and one Triton kernel.

``rms_norm``: ``w * x * rsqrt(mean(x^2) + eps)`` in fp32. ``norm_rope``: optional RMSNorm of
each row (weightless when ``weight`` is None), then RoPE on the last ``R = 2 cos.shape[-1]``
channels of each row with precomputed ``cos`` / ``sin`` [T, R/2] (rows [T, D], or heads
[T, H, D] sharing their token's angles); interleaved pairs (2i, 2i+1). One launch, where the
references take six to fifteen small ones. ``norm_rope_pair``: the two column ranges of a
stacked projection's output (attention's wq_a | wkv), each normed with its weight and the
second rotated, in one launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.dispatch import op


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalize the last dim in fp32; ``weight`` None means weightless. Returns x.dtype."""
    v = x.float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        v = weight.float() * v
    return v.to(x.dtype)


def rope_cs_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with precomputed ``cos`` / ``sin`` [T, R/2] on the last R channels of ``x``."""
    rd = 2 * cos.shape[-1]
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    if x.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rot.to(x.dtype)), dim=-1)


def norm_rope_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm (skipped when ``eps`` is None) then RoPE (when ``cos`` is given)."""
    if eps is not None:
        x = rms_norm_ref(x, weight, eps)
    if cos is not None:
        x = rope_cs_ref(x, cos, sin)
    return x


@triton.jit
def _norm_rope_rows(x_ptr, sx, y_ptr, sy, w_ptr, c_ptr, s_ptr, sc, r, N, H, D, eps,
                    BD: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
                    ROPE: tl.constexpr, BR: tl.constexpr):  # fmt: skip
    """Rows ``r`` [BR] of x [N, D] (row stride ``sx``) -> y: RMSNorm, then RoPE on the last R
    channels with the angles of token ``r // H``."""
    rm = r < N
    d = tl.arange(0, BD)
    dm = d < D
    m = rm[:, None] & dm[None, :]
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * sx + d[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    if NORM:
        ms = tl.sum(x * x, axis=1) / D
        x = x * tl.rsqrt(ms + eps)[:, None]
        if HAS_W:
            x = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :] * x
    if ROPE:
        t = r // H
        a, b = tl.split(tl.reshape(x, (BR, BD // 2, 2)))
        j = tl.arange(0, BD // 2)
        k = j - (D // 2 - R // 2)
        on = (k >= 0) & (j < D // 2)
        cm = rm[:, None] & on[None, :]
        off = t[:, None].to(tl.int64) * sc + k[None, :]
        c = tl.load(c_ptr + off, mask=cm, other=1.0)
        s = tl.load(s_ptr + off, mask=cm, other=0.0)
        x = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BR, BD))
    tl.store(y_ptr + r[:, None].to(tl.int64) * sy + d[None, :], x.to(y_ptr.dtype.element_ty),
             mask=m)  # fmt: skip


@triton.jit
def _norm_rope_kernel(
    x_ptr, sx, y_ptr, sy, w_ptr, c_ptr, s_ptr, sc, N, H, D, eps,
    BD: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
    ROPE: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    _norm_rope_rows(x_ptr, sx, y_ptr, sy, w_ptr, c_ptr, s_ptr, sc, r, N, H, D, eps, BD, R, NORM,
                    HAS_W, ROPE, BR)  # fmt: skip


@triton.jit
def _norm_rope_pair_kernel(
    x_ptr, sx, y1_ptr, sy1, y2_ptr, sy2, w1_ptr, w2_ptr, c_ptr, s_ptr, sc, N, D1, D2, eps1,
    eps2, BD1: tl.constexpr, BD2: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    _norm_rope_rows(x_ptr, sx, y1_ptr, sy1, w1_ptr, c_ptr, s_ptr, sc, r, N, 1, D1, eps1, BD1, 0,
                    True, True, False, BR)  # fmt: skip
    _norm_rope_rows(x_ptr + D1, sx, y2_ptr, sy2, w2_ptr, c_ptr, s_ptr, sc, r, N, 1, D2, eps2,
                    BD2, R, True, True, R > 0, BR)  # fmt: skip


def norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float | None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton :func:`norm_rope_ref` (x [T, D] or [T, H, D] with a contiguous last dim)."""
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    D = x.shape[-1]
    H = x.shape[1] if x.dim() == 3 else 1
    x2 = x.reshape(-1, D)
    N = x2.shape[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    R = 0
    if cos is not None:
        R = 2 * cos.shape[-1]
        if cos.shape != (N // H, R // 2) or sin.shape != cos.shape or R > D or D % 2:
            raise ValueError(f"cos/sin must be [T, <=D/2], got {tuple(cos.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if weight is not None and weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    BD = triton.next_power_of_2(D)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    BR = max(1, min(16, 4096 // BD)) if not interp else min(4, triton.next_power_of_2(N))
    w = weight.float().contiguous() if weight is not None else x2
    c = cos if cos is not None else x2
    s = sin if sin is not None else x2
    y2 = out.view(-1, D)
    _norm_rope_kernel[(triton.cdiv(N, BR),)](
        x2, x2.stride(0), y2, y2.stride(0), w, c, s, c.stride(0) if cos is not None else 0,
        N, H, D, float(eps or 0.0), BD=BD, R=R, NORM=eps is not None, HAS_W=weight is not None,
        ROPE=cos is not None, BR=BR, num_warps=4 if BD <= 1024 else 8,
    )  # fmt: skip
    return out


def _rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return norm_rope_triton(x, weight, eps)


norm_rope = op(norm_rope_ref, norm_rope_triton, when=lambda x, *a, **k: x.stride(-1) == 1)
rms_norm = op(rms_norm_ref, _rms_norm_triton, when=lambda x, *a, **k: x.stride(-1) == 1)


def norm_rope_pair_ref(
    x: torch.Tensor,
    split: int,
    w1: torch.Tensor,
    eps1: float,
    w2: torch.Tensor,
    eps2: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two column ranges of ``x`` [T, D1 + D2] (a stacked projection's output, ``split``
    = D1) each RMSNormed with its weight, RoPE on the second's last channels:
    (``norm_rope(x[:, :D1], w1, eps1)``, ``norm_rope(x[:, D1:], w2, eps2, cos, sin)``)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, D], got {tuple(x.shape)}")
    return norm_rope_ref(x[:, :split], w1, eps1), norm_rope_ref(x[:, split:], w2, eps2, cos, sin)


def norm_rope_pair_triton(
    x: torch.Tensor,
    split: int,
    w1: torch.Tensor,
    eps1: float,
    w2: torch.Tensor,
    eps2: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`norm_rope_pair_ref`: both ranges in one launch (x [T, D] with a
    contiguous last dim)."""
    if x.dim() != 2 or x.stride(-1) != 1 or not 0 < split < x.shape[1]:
        raise ValueError(f"x must be [T, D] with contiguous rows and 0 < split < D: "
                         f"{tuple(x.shape)}, split {split}")  # fmt: skip
    N, D = x.shape
    D1, D2 = split, D - split
    if w1.shape != (D1,) or w2.shape != (D2,):
        raise ValueError(f"weights must be [{D1}] and [{D2}]")
    R = 0
    if cos is not None:
        R = 2 * cos.shape[-1]
        if cos.shape != (N, R // 2) or sin.shape != cos.shape or R > D2 or D2 % 2:
            raise ValueError(f"cos/sin must be [T, <=D2/2], got {tuple(cos.shape)}")
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    y1 = torch.empty((N, D1), dtype=x.dtype, device=x.device)
    y2 = torch.empty((N, D2), dtype=x.dtype, device=x.device)
    if N == 0:
        return y1, y2
    BD1, BD2 = triton.next_power_of_2(D1), triton.next_power_of_2(D2)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    BR = max(1, min(16, 4096 // max(BD1, BD2))) if not interp else min(4, triton.next_power_of_2(N))
    c = cos if cos is not None else x
    s = sin if sin is not None else x
    _norm_rope_pair_kernel[(triton.cdiv(N, BR),)](
        x, x.stride(0), y1, y1.stride(0), y2, y2.stride(0), w1.float().contiguous(),
        w2.float().contiguous(), c, s, c.stride(0) if cos is not None else 0, N, D1, D2,
        float(eps1), float(eps2), BD1=BD1, BD2=BD2, R=R, BR=BR,
        num_warps=4 if max(BD1, BD2) <= 1024 else 8,
    )  # fmt: skip
    return y1, y2


norm_rope_pair = op(norm_rope_pair_ref, norm_rope_pair_triton,
                    when=lambda x, *a, **k: x.dim() == 2 and x.stride(-1) == 1)  # fmt: skip
