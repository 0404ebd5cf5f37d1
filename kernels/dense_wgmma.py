"""fp8 dense projections at 17-256 token rows on Hopper (Gluon, sm_90): the weights as the
register A operand of a ``wgmma`` in the activations' dtype, all the tokens of a call as its
N.

The ``mma.sync`` decode kernel (``kernels.moe_decode``, ``FP8``) takes the tokens in 8-64-row
tiles and converts the activations to fp16 in every warp: at 64-row tiles that is most of
its 905 SASS instructions per block, and it loses to cuBLAS bf16 there (H200,
docs/performance.md).
Here one CTA takes BM = 16 x warps weight rows (one or two warpgroups) and BT (16 / 32 / 64
/ 128) token rows, so up to 128 rows each stored byte is read and converted once per call
(twice at 129-256 rows: two token tiles):

- a ring of STAGES shared-memory slots takes, by cp.async, the weight bytes [BM, KB], the
  rows' scale words (four e8m0 codes per 128 columns, one per 32) and the activations
  [BT, KB] -- bf16 as the model holds them, the B operand of the wgmma as they land;
- each thread loads its weight fragments from the slot (two 16-byte loads per row and
  block: the K permutation of ``kernels.moe_decode``, so the activation columns are copied
  in that same permuted order), converts them e4m3 -> the activations' dtype and multiplies
  each 32-column group by 2^(c - R) (exact in bf16 and fp16: the plan bounds c - R to
  [-15, 6]);
- ``wgmma`` m64nBTk16 per warpgroup, A from registers, B from the slot, fp32 accumulation
  over all of K; the row factor 2^(R - 127) once after the loop. Each wgmma is retired
  before the next block's conversion: ptxas reuses the registers of an in-flight wgmma's A
  operand (seen in the sm_90 SASS; NaNs on the H200 with a 3-slot ring).

Measured (H200, docs/performance.md): faster than the mma.sync kernel from
32 rows, but not than cuBLAS on the same weights in bf16 at 64 and 128 rows -- about 30% of
the copy rate: one or two warpgroups per CTA convert every byte (e4m3 -> f16 -> bf16, scale)
on the path between the copy and the MMA, and do not hide that latency.

The plan (``kernels.linear.fp8_decode_plan``: scale words, per-row R) is the decode
kernel's, so a planned projection takes either kernel. Output as ``launch_dense`` writes it:
[split, rows, N], x's dtype for one K split, else fp32 partials summed by the caller.

Gluon does not run under the interpreter: ``tests/gpu/test_dense_kernels.py`` checks this
kernel against the fp64 reference and the other paths at every V4.1-Flash dense shape; the
CPU tests check that the activation columns are copied in the weight fragments' order
(:func:`_stored_cols` against the fragments' permutation) and the re-basing in bf16
(``tests.support.decode_gemm``: the kernel's arithmetic in torch).
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.moe_decode import _fragments, _quarters_layout, _tile_layout

KB = 128  # K columns per ring slot; a thread's quarter of a row is one 32-column scale group
WARPS = 4  # one warpgroup, 64 weight rows per CTA (pick_launch: two at 128-token tiles)
TOKEN_TILES = (16, 32, 64, 128)  # BT: the wgmma N


@gluon.jit
def _stored_cols(kk, KB: gl.constexpr):
    """The stored column of each logical MMA column ``kk`` of a KB-column block: what the
    weight fragments hold there (``kernels.moe_decode``'s K permutation), so the activation
    tile is copied in the same order. Pairs of columns stay adjacent (4-byte copies). Plain
    integer arithmetic: the CPU tests call it on torch tensors (``_stored_cols.fn``)."""
    return (KB // 4) * ((kk // 2) % 4) + 4 * (kk // 16) + 2 * ((kk // 8) % 2) + kk % 2


@gluon.jit
def _issue(w_slot, x_slot, s_slot, w_ptrs, x_ptrs, x_mask, s_ptrs, k, k_hi, KB: gl.constexpr):
    """cp.async the K block at ``k`` into one ring slot, unless it lies at or past ``k_hi``
    (the group is committed either way, so the waits count blocks): the weight bytes
    [BM, KB], the activations [BT, KB] (``x_ptrs`` maps logical column k of the slot to
    the block's stored column :func:`_stored_cols` (k): column pairs stay adjacent, 4-byte
    copies) and the rows' scale words."""
    if k < k_hi:
        async_copy.async_copy_global_to_shared(w_slot, w_ptrs + k)
        async_copy.async_copy_global_to_shared(x_slot, x_ptrs + k, mask=x_mask)
        async_copy.async_copy_global_to_shared(s_slot, s_ptrs + k // KB)
    async_copy.commit_group()


@gluon.jit
def _dense_wg_kernel(
    x_ptr, sxm, w_ptr, swn, s_ptr, ssn, r_ptr, out_ptr, sos, som, M, N, K, k_per_split,
    BM: gl.constexpr, BT: gl.constexpr, KB: gl.constexpr, STAGES: gl.constexpr,
    SB_N: gl.constexpr, WARPS: gl.constexpr,
):  # fmt: skip
    """One (BM weight rows, K split, BT token rows): out[split, t, n] = sum over the split's
    K of x[t, k] W[n, k] (see the module docstring)."""
    pid_n, pid_k, pid_t = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BT, 16])  # fmt: skip
    dot_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    wl: gl.constexpr = _tile_layout(BM, KB, "w", WARPS)  # after _fragments: the A fragments
    wq: gl.constexpr = _quarters_layout(BM, KB, "w", WARPS)
    ql: gl.constexpr = gl.SliceLayout(2, wq)  # [BM, 4]: one scale group per thread and row
    rl: gl.constexpr = gl.SliceLayout(1, ql)

    n0 = pid_n * BM
    # the copies' addresses at k = 0 (loop invariant; each block adds its k)
    cw_l: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // KB, KB // 16], [WARPS, 1], [1, 0])
    rw = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, cw_l))
    cw = gl.arange(0, KB, layout=gl.SliceLayout(0, cw_l))
    w_ptrs = w_ptr + rw.to(gl.int64)[:, None] * swn + cw[None, :]
    cx_l: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [WARPS, 1], [1, 0])
    tok = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, cx_l))
    col = _stored_cols(gl.arange(0, KB, layout=gl.SliceLayout(0, cx_l)), KB)
    x_ptrs = x_ptr + tok.to(gl.int64)[:, None] * sxm + col[None, :]
    x_mask = (tok < M)[:, None] & (col < KB)[None, :]
    cs_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    s_ptrs = s_ptr + ((n0 + gl.arange(0, BM, layout=cs_l)) // SB_N).to(gl.int64) * ssn
    ref = gl.load(r_ptr + n0 + gl.arange(0, BM, layout=rl))

    w_bufs = gl.allocate_shared_memory(
        gl.uint8, [STAGES, BM, KB], gl.SwizzledSharedLayout(16, 1, KB // 16, [1, 0]))
    x_bufs = gl.allocate_shared_memory(
        x_ptr.dtype.element_ty, [STAGES, BT, KB],
        gl.NVMMASharedLayout.get_default_for([BT, KB], x_ptr.dtype.element_ty))
    s_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BM],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))  # fmt: skip

    k_lo = pid_k * k_per_split
    k_hi = gl.minimum(k_lo + k_per_split, K)
    n_it = gl.cdiv(k_hi - k_lo, KB)
    AHEAD: gl.constexpr = STAGES - 1  # blocks in flight while block i is multiplied
    for j in gl.static_range(AHEAD):
        _issue(w_bufs.index(j), x_bufs.index(j), s_bufs.index(j), w_ptrs, x_ptrs, x_mask, s_ptrs,
               k_lo + j * KB, k_hi, KB)  # fmt: skip
    acc = gl.zeros([BM, BT], gl.float32, mma)
    t4 = gl.arange(0, 4, layout=gl.SliceLayout(0, ql))
    for i in range(n_it):
        async_copy.wait_group(AHEAD - 1)  # block i has landed (this thread's copies) ...
        fence_async_shared()  # ... and is visible to the wgmma's reads
        gl.thread_barrier()  # ... everyone's; block i - 1 (its slot is refilled next) is done
        nxt = (i + AHEAD) % STAGES
        _issue(w_bufs.index(nxt), x_bufs.index(nxt), s_bufs.index(nxt), w_ptrs, x_ptrs, x_mask,
               s_ptrs, k_lo + (i + AHEAD) * KB, k_hi, KB)  # fmt: skip
        cur = i % STAGES
        q = gl.convert_layout(gl.reshape(w_bufs.index(cur).load(wl), [BM, 4, KB // 4]), wq,
                              assert_trivial=True)  # fmt: skip
        words = s_bufs.index(cur).load(rl)
        c = (words[:, None] >> (8 * t4)[None, :]) & 0xFF
        dt: gl.constexpr = x_ptr.dtype.element_ty  # the MMA's type: the activations' own
        mult = ((c + 127 - ref[:, None]) << 23).to(gl.float32, bitcast=True).to(dt)
        w = q.to(gl.float8e4nv, bitcast=True).to(dt) * gl.expand_dims(mult, 2)
        a = gl.convert_layout(_fragments(gl.reshape(w, [BM, KB]), BM, KB), dot_a, True)
        # retired before the next block's conversion: an async wgmma reads its register A
        # operand while it runs, and ptxas reused those registers for the next block's
        # values (sm_90 SASS; NaNs on the H200 with a 3-slot ring)
        acc = warpgroup_mma(a, x_bufs.index(cur).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    # rows x tokens -> out[split, token, row]; the row factor 2^(R - 127) as 2^(R - 63) 2^-64
    rm = n0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    f = ((gl.load(r_ptr + rm) + 64) << 23).to(gl.float32, bitcast=True)
    acc = acc * f[:, None] * 5.421010862427522e-20
    tp = pid_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, mma))
    o_ptrs = out_ptr + pid_k * sos + tp.to(gl.int64)[None, :] * som + rm[:, None]
    gl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(tp < M)[None, :])


def token_tile(m: int) -> int:
    """BT for ``m`` token rows: the smallest of :data:`TOKEN_TILES` that holds them."""
    return next((bt for bt in TOKEN_TILES if m <= bt), TOKEN_TILES[-1])


def pick_split(n: int, k: int, sms: int, bm: int = 16 * WARPS) -> int:
    """K splits: about two CTAs per SM over the row tiles with one warpgroup per CTA, one with
    two (H200 sweep: twice that lost 10-40% at 128 tokens), at most half the K blocks (after
    rounding the last split may hold one block, trailing ones none: they store zeros). The
    fp32 partials stay in L2 for the split sum."""
    per_sm = 2 if bm <= 64 else 1
    return max(1, min(k // KB // 2, math.ceil(per_sm * sms / (n // bm))))


def pick_launch(bt: int) -> tuple[int, int]:
    """(warps, ring slots) for a token tile. H200 sweep (``decode_plumbing.py --sweep-wg``,
    each V4.1-Flash dense shape alone): at 32 and 64 tokens one warpgroup with 3 slots is
    within 5% of each shape's best (sum of the six: 93.5 / 124.9 us against 90.7 / 121.5
    for the best per shape); 8 or 6 slots lose up to 1.6x, 8 warps lose on the big shapes.
    At 128 tokens two warpgroups with 4 slots win on five of the six."""
    return (8, 4) if bt >= 128 else (4, 3)


def pick_stages(bt: int, bm: int = 16 * WARPS, smem: int = 200 * 1024) -> int:
    """The deepest ring that fits in ``smem`` (weights, activations and scale words per
    slot), at most 8: the sweep's upper end (deeper lost)."""
    per = bm * KB + bt * KB * 2 + bm * 4
    return max(2, min(8, smem // per))


def launch(x: torch.Tensor, w: torch.Tensor, words: torch.Tensor, refs: torch.Tensor,
           out: torch.Tensor, m: int, split: int, bt: int, b0: int, stages: int,
           warps: int = WARPS) -> None:  # fmt: skip
    """``out[s, :m] (+)= x @ W^T`` over K split s: ``x`` bf16 / fp16 [m, K] (16-byte aligned
    rows), ``w`` e4m3 [N, K], ``words`` int32 [ceil(N / b0), K / 128] (four e8m0 codes per
    128 columns), ``refs`` int32 [N] (``moe_decode.fp8_refs``), ``out`` [split, >= m, N]: x's
    dtype when ``split`` is 1, else fp32 partials (the caller sums them). K a multiple of KB,
    N of 16 x ``warps``."""
    n, k = w.shape
    bm = 16 * warps
    if k % KB or n % bm or x.dtype not in (torch.bfloat16, torch.float16) or bt not in TOKEN_TILES:
        raise ValueError(f"dense wgmma GEMM: K={k} (x {KB}), N={n} (x {bm}), x {x.dtype}, "
                         f"token tile {bt}")  # fmt: skip
    per = -(-(k // KB) // split) * KB
    grid = (n // bm, split, -(-m // bt))
    _dense_wg_kernel[grid](
        x, x.stride(0), w.view(torch.uint8), w.stride(0), words, words.stride(0), refs, out,
        out.stride(0), out.stride(1), m, n, k, per, BM=bm, BT=bt, KB=KB, STAGES=stages,
        SB_N=b0, WARPS=warps, num_warps=warps,
    )  # fmt: skip

