"""Engram (V4.1): n-gram hash rows, table gather, gated stream update (refs + Triton).

``engram_rows``: ``h_n = (c_t m_0) ^ (c_{t-1} m_1) ^ ...`` (int64, wrapping), row =
``h_n mod p + offset`` per head; once a shift is blocked (-1) it and every larger shift use
``pad_id``. ``engram_gather``: ``table[rows]`` from a device table or a pinned host table read
in-kernel over UVA (fp8 e4m3 rows with e8m0 per-32 scales dequantized on the fly).
``engram_gate``: per stream j, ``dot = sum(X_j q_j k_j key_j) rsqrt(ms(X_j)+eps)
rsqrt(ms(key_j)+eps) / sqrt(d)``; ``X_j += sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) val``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import op
from kernels.invariant import pointwise
from kernels.quant import e8m0_to_float, is_e8m0


def engram_rows_ref(
    compressed: torch.Tensor,
    mult: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    n_heads: int,
    pad_id: int,
) -> torch.Tensor:
    """``compressed`` [T, G] (-1 = blocked), ``mult`` [G], ``primes``/``offsets``
    [(G-1)*n_heads] int64 -> rows [T, (G-1)*n_heads] int64. E.g. G=3: [[7, 5, -1]] hashes
    shifts (7, 5, pad)."""
    blocked = torch.cumsum((compressed < 0).to(torch.int64), dim=1) > 0
    toks = torch.where(blocked, torch.full_like(compressed, pad_id), compressed).long()
    prod = toks * mult.long()
    rolling = prod[:, 0]
    rows = []
    for s in range(1, compressed.shape[1]):
        rolling = torch.bitwise_xor(rolling, prod[:, s])
        p = primes[(s - 1) * n_heads : s * n_heads].long()
        rows.append(torch.remainder(rolling.unsqueeze(-1), p))
    return torch.cat(rows, dim=-1) + offsets.long()


def engram_gather_ref(
    table: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``table[rows]`` [T, H*dim] in ``dtype`` (e4m3 rows times their per-32 scales)."""
    idx = rows.reshape(-1).to(table.device)
    e = table[idx].float()
    if scale is not None:
        e = e * e8m0_to_float(scale[idx]).repeat_interleave(table.shape[1] // scale.shape[1], -1)
    return e.to(dtype).reshape(rows.shape[0], -1).to(rows.device)


def engram_gate_ref(
    x: torch.Tensor,
    key: torch.Tensor,
    val: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    blocked: torch.Tensor,
) -> torch.Tensor:
    """``x``/``key`` [T, n, d], ``val`` [T, d], ``q_w``/``k_w`` [n, d], ``blocked`` [T] bool
    (gate 0) -> updated x in x.dtype (fp32 math, as ``app.model.engram``)."""
    h, key = x.float(), key.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (q_w.float() * k_w.float()) * key).sum(-1) * rstd * x.shape[-1] ** -0.5
    gate = pointwise(torch.sigmoid, torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    gate = gate.masked_fill(blocked.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * val.float().unsqueeze(1)).to(x.dtype)


# ---- Triton ---------------------------------------------------------------------------


@triton.jit
def _engram_rows(
    c_ptr, mult_ptr, p_ptr, off_ptr, rows_ptr, T, pad_id,
    G: tl.constexpr, NH: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < T
    h = tl.arange(0, NH)
    blocked = tl.zeros((BT,), tl.int1)
    rolling = tl.zeros((BT,), tl.int64)
    for s in tl.static_range(G):
        c = tl.load(c_ptr + t * G + s, mask=tmask, other=0).to(tl.int64)
        blocked = blocked | (c < 0)
        tok = tl.where(blocked, pad_id, c).to(tl.int64)
        rolling = rolling ^ (tok * tl.load(mult_ptr + s))  # int64 multiply wraps
        if s > 0:
            p = tl.load(p_ptr + (s - 1) * NH + h)
            r = rolling[:, None] % p[None, :]
            r = tl.where(r < 0, r + p[None, :], r)  # floor remainder, as torch
            r += tl.load(off_ptr + (s - 1) * NH + h)[None, :]
            dst = rows_ptr + t[:, None] * ((G - 1) * NH) + (s - 1) * NH + h[None, :]
            tl.store(dst, r, mask=tmask[:, None])


@triton.jit
def _engram_gather(
    tab_ptr, stab, s_ptr, ss, rows_ptr, out_ptr, n_rows, DIM,
    HAS_SCALE: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """``out[i, :] = table[rows[i], :]`` (x scale), BR gathered rows per program."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    imask = i < n_rows
    r = tl.load(rows_ptr + i, mask=imask, other=0).to(tl.int64)
    dd = tl.arange(0, BD)
    m = imask[:, None] & (dd[None, :] < DIM)
    v = tl.load(tab_ptr + r[:, None] * stab + dd[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_SCALE:
        sc = tl.load(s_ptr + r[:, None] * ss + dd[None, :] // 32, mask=m, other=0)
        v = v * ((sc.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
    tl.store(out_ptr + i[:, None].to(tl.int64) * DIM + dd[None, :], v, mask=m)


@triton.jit
def _engram_gate(
    x_ptr, sxt, sxj, k_ptr, skt, skj, v_ptr, svt, q_ptr, kw_ptr, b_ptr, y_ptr, syt, syj,
    D, eps, BD: tl.constexpr,
):  # fmt: skip
    """One (token, stream): reduce over d, then ``y = x + gate * val``."""
    t, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    acc = tl.zeros((BD,), tl.float32)
    xsq = tl.zeros((BD,), tl.float32)
    ksq = tl.zeros((BD,), tl.float32)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        m = dd < D
        xv = tl.load(x_ptr + t * sxt + j * sxj + dd, mask=m, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + t * skt + j * skj + dd, mask=m, other=0.0).to(tl.float32)
        qk = tl.load(q_ptr + j * D + dd, mask=m, other=0.0) * tl.load(kw_ptr + j * D + dd, mask=m)
        acc += xv * qk * kv
        xsq += xv * xv
        ksq += kv * kv
    rstd = 1.0 / tl.sqrt(tl.sum(xsq) / D + eps) / tl.sqrt(tl.sum(ksq) / D + eps)
    dot = tl.sum(acc) * rstd / tl.sqrt(D.to(tl.float32))
    mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = tl.sigmoid(tl.where(dot < 0, -mag, mag))
    gate = tl.where(tl.load(b_ptr + t) != 0, 0.0, gate)
    for d0 in range(0, D, BD):
        dd = d0 + tl.arange(0, BD)
        m = dd < D
        xv = tl.load(x_ptr + t * sxt + j * sxj + dd, mask=m, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + t * svt + dd, mask=m, other=0.0).to(tl.float32)
        y = xv + gate * vv
        tl.store(y_ptr + t * syt + j * syj + dd, y.to(y_ptr.dtype.element_ty), mask=m)


def engram_rows_triton(
    compressed: torch.Tensor,
    mult: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
    n_heads: int,
    pad_id: int,
) -> torch.Tensor:
    """Triton :func:`engram_rows_ref`; ``n_heads`` must be a power of 2 (V4.1: 8)."""
    if compressed.dim() != 2 or n_heads & (n_heads - 1):
        raise ValueError(f"compressed [T, G] and power-of-2 heads expected, got {n_heads}")
    t, g = compressed.shape
    h = (g - 1) * n_heads
    if mult.numel() != g or primes.numel() != h or offsets.numel() != h:
        raise ValueError(f"mult [{g}], primes/offsets [{h}] expected")
    rows = torch.empty(t, h, dtype=torch.int64, device=compressed.device)
    if t:
        _engram_rows[(triton.cdiv(t, 64),)](
            compressed.contiguous(), mult.long().contiguous(), primes.long().contiguous(),
            offsets.long().contiguous(), rows, t, pad_id, G=g, NH=n_heads, BT=64,
        )  # fmt: skip
    return rows


def engram_gather_triton(
    table: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``table[rows]`` -> [T, H*dim] ``dtype`` on ``rows.device``. ``table`` [R, dim] is a
    device tensor or a PINNED host tensor (read over UVA); ``scale`` [R, dim/32] e8m0."""
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"table must be [R, dim] with unit stride, got {tuple(table.shape)}")
    if not (table.is_cuda or table.is_pinned() or not rows.is_cuda):
        raise ValueError("a host table must be pinned to be read from the GPU")
    if scale is not None and (not is_e8m0(scale) or scale.shape[0] != table.shape[0]):
        raise ValueError(f"scale must be e8m0 [R, dim/32], got {scale.dtype}")
    dim = table.shape[1]
    flat = rows.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), dim, dtype=dtype, device=rows.device)
    if flat.numel():
        s = scale.view(torch.uint8) if scale is not None else flat
        _engram_gather[(triton.cdiv(flat.numel(), 8),)](
            table, table.stride(0), s, s.stride(0), flat, out, flat.numel(), dim,
            HAS_SCALE=scale is not None, BR=8, BD=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out.view(rows.shape[0], -1)


def engram_gate_triton(
    x: torch.Tensor,
    key: torch.Tensor,
    val: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    blocked: torch.Tensor,
) -> torch.Tensor:
    """Triton :func:`engram_gate_ref`: one program per (token, stream)."""
    if x.dim() != 3 or key.shape != x.shape or val.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"x/key [T, n, d], val [T, d]: {tuple(x.shape)} {tuple(val.shape)}")
    if x.stride(2) != 1 or key.stride(2) != 1 or val.stride(1) != 1:
        raise ValueError("x, key and val need unit stride in d")
    t, n, d = x.shape
    y = torch.empty_like(x)
    if t:
        _engram_gate[(t, n)](
            x, x.stride(0), x.stride(1), key, key.stride(0), key.stride(1), val, val.stride(0),
            q_w.float().contiguous(), k_w.float().contiguous(), blocked.to(torch.int8), y,
            y.stride(0), y.stride(1), d, eps, BD=min(1024, triton.next_power_of_2(d)),
        )  # fmt: skip
    return y


engram_rows = op(engram_rows_ref, engram_rows_triton)
# the rows' device decides: a host (pinned) table is read from the GPU over UVA
engram_gather = op(engram_gather_ref, engram_gather_triton, device_arg=1)
engram_gate = op(engram_gate_ref, engram_gate_triton)
