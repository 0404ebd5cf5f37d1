"""The Gluon decode GEMMs' arithmetic in torch (``kernels.moe_decode``, ``kernels.dense_wgmma``):
the K permutation of their weight fragments, the fp16 / bf16 scale re-basing, and the routing
that the MoE decode layer's W13 launch does in registers. The kernels do not run under the
interpreter; the CPU tests hold these emulations to the references."""

from __future__ import annotations

import torch

from kernels.moe_decode import tile_count


def k_perm(kb: int) -> torch.Tensor:
    """The stored column of each logical MMA column k in a KB-column block
    (``kernels.moe_decode``'s docstring: logical k = 16 s + 8 h + 2 t + b is stored column
    (KB/4) t + 4 s + 2 h + b): ``stored[k]``."""
    k = torch.arange(kb)
    s, h, t, b = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    return (kb // 4) * t + 4 * s + 2 * h + b


def rebased_weights(codes: torch.Tensor, c: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The MoE decode kernel's fp16 weights: e2m1 ``codes`` [R, K] (fp32 values) x 2^-6 in fp16 (the
    e4m3 re-encoding's ``cvt``), times the fp16 2^(6 + c - R) of their group (``c`` [R, K/32]
    e8m0 codes, ``ref`` [R]): code x 2^(c - R), i.e. W x 2^(127 - R) when exact."""
    g = torch.arange(codes.shape[1]) // 32
    mult = torch.exp2((6 + c[:, g] - ref[:, None]).double()).to(torch.float16)
    return (codes * 2.0**-6).to(torch.float16) * mult  # one fp16 rounding, as HMUL2


def emulate(x16: torch.Tensor, codes: torch.Tensor, c: torch.Tensor, ref: torch.Tensor,
            kb: int) -> torch.Tensor:  # fmt: skip
    """What the MoE decode kernel computes for one row set, in torch: ``x16`` [T, K] fp16
    activations (x 2^-4), ``codes`` [R, K] e2m1 values (fp32), ``c`` [R, K/32] e8m0 codes,
    ``ref`` [R] reference exponents. The weights are scaled in fp16 as the kernel does, the
    columns permuted per KB block as the kernel's fragments take them, the products summed in
    fp64 (the MMA's fp32 accumulation order is not modelled), and the row factor applied.
    Returns [T, R] fp32 (= x @ W^T when the scales are exact)."""
    k = codes.shape[1]
    w16 = rebased_weights(codes, c, ref)
    perm = (torch.arange(k) // kb) * kb + k_perm(kb).repeat(k // kb)
    acc = x16[:, perm].double() @ w16[:, perm].double().T
    return (acc * torch.exp2((ref - 127 + 4).double())[None, :]).float()


def emulate_route(ids: torch.Tensor, offset: int, n_local: int, bt: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """What ``kernels.moe_decode._route_tile`` computes for every tile, in torch and the same
    formulation (counts per expert, their running tile sum, a running count of the tile's expert's
    slots): (rows [tiles * bt] slot per tile row, pad = the slot count; inv per slot, the
    tile row, -1 = not local; tile_e [tiles], -1 = idle) over the graph-static tile count
    of ``kernels.moe_align._align`` (whose tiles these are, rows in slot order)."""
    e = ids.reshape(-1).long() - offset
    n = e.numel()
    s = torch.arange(n)
    loc = (e >= 0) & (e < n_local)
    cnt = torch.bincount(e[loc], minlength=n_local)
    tiles = (cnt + bt - 1) // bt
    end = torch.cumsum(tiles, 0)
    n_tiles = tile_count(n, n_local, bt)
    rows = torch.full((n_tiles * bt,), n, dtype=torch.int32)
    inv = torch.full((n,), -1, dtype=torch.int32)
    tile_e = torch.full((n_tiles,), -1, dtype=torch.int32)
    for m in range(n_tiles):
        em = int((end <= m).sum())
        if em >= n_local:
            continue
        j0 = (m - int(end[em] - tiles[em])) * bt
        match = (loc & (e == em)).long()
        rank = torch.cumsum(match, 0) - match
        mine = (match > 0) & (rank >= j0) & (rank < j0 + bt)
        tile_e[m] = em
        rows[m * bt + rank[mine] - j0] = s[mine].int()
        inv[mine] = (m * bt + rank[mine] - j0).int()
    return rows, inv, tile_e


def rebased_fp8_weights(w: torch.Tensor, codes: torch.Tensor, refs: torch.Tensor,
                        b0: int) -> torch.Tensor:  # fmt: skip
    """The dense fp8 decode kernel's fp16 weights: e4m3 ``w`` [N, K] (``cvt``, exact) times the fp16
    2^(c - R) of its 32-column group (``codes`` uint8 [ceil(N / b0), K / 32] e8m0, ``refs``
    [N] from ``moe_decode.fp8_refs``), one fp16 rounding as HMUL2: W x 2^(127 - R) when exact."""
    n, k = w.shape
    c = codes.to(torch.int32).repeat_interleave(b0, dim=0)[:n].repeat_interleave(32, dim=1)
    mult = torch.exp2((c - refs[:, None]).double()).to(torch.float16)
    return w.to(torch.float16) * mult


def rebased_bf16_weights(w: torch.Tensor, codes: torch.Tensor, refs: torch.Tensor,
                         b0: int) -> torch.Tensor:  # fmt: skip
    """The wgmma kernel's bf16 weights: e4m3 ``w`` [N, K] converted, times the bf16 2^(c - R) of its
    32-column group (``codes`` uint8 [ceil(N / b0), K / 32], ``refs`` [N]), rounded once to
    bf16 as the kernel's multiply: W x 2^(127 - R), exact where the plan holds."""
    n, k = w.shape
    c = codes.to(torch.int32).repeat_interleave(b0, dim=0)[:n].repeat_interleave(32, dim=1)
    mult = torch.exp2((c - refs[:, None]).double()).to(torch.bfloat16)
    return (w.to(torch.bfloat16) * mult).to(torch.bfloat16)
