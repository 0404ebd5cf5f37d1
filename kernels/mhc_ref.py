"""Manifold-constrained hyper-connections in torch: the references of ``kernels.mhc``.

From the flattened streams ``v`` [T, n*d]: ``m = (fn @ v) * rsqrt(mean(v^2) + eps)``;
``pre = sigmoid(m[:n]*s0 + b) + hc_eps``, ``post = 2*sigmoid(m[n:2n]*s1 + b)``,
``comb = sinkhorn(m[2n:]*s2 + b)`` ([n, n], rows = input streams, columns = outputs).
"""

from __future__ import annotations

import torch

from kernels.invariant import linear, pointwise, stream_sum
from kernels.norm import rms_norm_ref


def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column / row normalization (``iters`` column passes)."""
    x = logits.softmax(dim=-1) + eps
    x = x / (x.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(dim=-1, keepdim=True) + eps)
        x = x / (x.sum(dim=-2, keepdim=True) + eps)
    return x


def hc_mix_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` [T, n, d] -> (pre [T, n], post [T, n], comb [T, n, n]), all fp32."""
    n = x.shape[1]
    flat = x.flatten(1).float()
    m = linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    s = scale.float()
    scales = torch.cat((s[0].expand(n), s[1].expand(n), s[2].expand(n * n)))
    logits = m * scales + base.float()
    pre = pointwise(torch.sigmoid, logits[:, :n]) + hc_eps
    post = 2 * pointwise(torch.sigmoid, logits[:, n : 2 * n])
    comb = sinkhorn_ref(logits[:, 2 * n :].unflatten(-1, (n, n)), iters, hc_eps)
    return pre, post, comb


def hc_collapse_ref(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j x_j``: [T, n, d], [T, n] -> [T, d] (fp32 math, x.dtype out)."""
    return stream_sum(pre.unsqueeze(-1) * x.float()).to(x.dtype)


def hc_expand_ref(
    out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``X'_k = post_k * out + sum_j comb[j, k] X_j``: -> [T, n, d] in out.dtype."""
    upd = post.unsqueeze(-1) * out.float().unsqueeze(1)
    mixed = torch.einsum("tjk,tjd->tkd", comb, x.float())
    return (upd + mixed).to(out.dtype)


hc_collapse = hc_collapse_ref


def hc_pre_ref(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    pre_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(sum_j p_j X_j) [T, d], post, comb, pre); ``p = pre_in`` or the mix's pre."""
    pre, post, comb = hc_mix_ref(x, fn, base, scale, iters, hc_eps, norm_eps)
    collapsed = hc_collapse_ref(x, pre if pre_in is None else pre_in)
    return rms_norm_ref(collapsed, norm_w, rms_eps), post, comb, pre


def hc_post_pre_ref(
    out: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_w: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    rms_eps: float,
    pre_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``X' = hc_expand_ref(out, x, post, comb)`` then :func:`hc_pre_ref` on X'.

    -> (X', normed, post', comb', pre')."""
    x_new = hc_expand_ref(out, x, post, comb)
    return (x_new, *hc_pre_ref(x_new, fn, base, scale, norm_w, iters, hc_eps, norm_eps,
                               rms_eps, pre_in))  # fmt: skip
