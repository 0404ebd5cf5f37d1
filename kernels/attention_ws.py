"""Warp-specialized sparse decode attention for Hopper (Gluon): the contract of
``kernels.attention.sparse_attention_ref`` at 64-head blocks, D = 512, bf16 queries.

One CTA per (token, block of 64 heads, KV split), three partitions over one ring of
shared-memory key tiles (FlashMLA's division of work: the heads of a token share every
row load, and no warpgroup waits on memory):

    producer (4 warps, 96 registers): Q -> smem (cp.async), then one software pipeline over
        the token's key blocks of BLOCK_N rows (the window source's, then the compressed
        source's): ids two blocks ahead -> cp.async of the stored rows and their scale rows
        into three raw slots -> the landed block decoded to bf16 (``kernels.attention_ws_keys``:
        fp8 e4m3 x 2^e per 32 channels, with integer ops for e8m0 codes; nvfp4 through
        ``fp4_to_fp`` x its e4m3 scale per 16, exact in bf16; plain bf16 rows) -> K tile
        [BLOCK_N, D] in the ring + the keys' bias (0 / -inf) -> mbarrier ``ready``
    consumer h = 0, 1 (one warpgroup each, D/2 output channels each, 208 registers):
        wait ``ready`` -> S = Q K^T (wgmma, A and B from smem; each consumer computes the
        whole S, so there is no exchange between them) -> online softmax (exp2; the sink
        seeds the running max and, in split 0, the denominator) -> O_h += P K[:, h] (wgmma,
        P from registers) -> arrive ``empty`` (count 2: the producer refills a stage once
        both consumers are done with it)

The output's inverse RoPE (the last R channels: consumer 1) is fused into the epilogue;
with KV splits each split's unnormalized O goes out in bf16 (fp32 for a fp32 ``part``) and
``kernels.attention``'s combine kernel merges the splits with their (m, l) in fp32. bf16
tiles leave through the key ring as whole-row stores (``_store_staged``). Gluon does not
run under the interpreter: the Triton ``tl`` kernel (``kernels.attention_tl``) stays the
portable path and the interpreter-tested implementation of the same contract; tests/gpu
checks this one against the torch reference and the ``tl`` kernel at real shapes.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.attention_ws_keys import _block_ids, _decode_block, _issue_block

HEADS = 64  # heads per CTA: one wgmma M


@gluon.jit
def _producer(q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
              out_ptr, part_ptr, ml_ptr, T, H, lo, hi, lo2, hi2, scale_log2, s_qt, s_qh, s_kv,
              s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, q_smem, k_bufs, bias_bufs,
              raw_bufs, sc_bufs, ready, empty, q_bar, D: gl.constexpr, R: gl.constexpr,
              FMT: gl.constexpr, SC_E8: gl.constexpr, FMT2: gl.constexpr, SC2_E8: gl.constexpr,
              ROPE: gl.constexpr, SPLIT1: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """Q into smem (cp.async), then every key block of both sources into the ring.

    One software pipeline over the token's key blocks b (source 1's, then source 2's, so
    no bubble between them), three slots of stored rows + scale rows: at step b the rows of
    block b + 2 are copied (cp.async; their ids were loaded a step earlier, the ids of
    b + 3 now), then block b -- landed -- is decoded into the ring, 16 rows at a time.
    No load of a step waits on a load of the same step."""
    t = gl.program_id(0)
    h0 = gl.program_id(1) * 64
    idx1 = idx_ptr + t * s_it
    idx2 = idx2_ptr + t * s_it2
    nb1 = gl.cdiv(hi - lo, BLOCK_N)
    nb = nb1 + gl.cdiv(hi2 - lo2, BLOCK_N)

    ql: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    d = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    hh = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ql))
    async_copy.async_copy_global_to_shared(
        q_smem, q_ptr + t * s_qt + gl.expand_dims(hh, 1) * s_qh + gl.expand_dims(d, 0)
    )
    async_copy.commit_group()
    ids0 = _block_ids(idx1, lo, hi, nb1, idx2, lo2, hi2, 0, BLOCK_N)
    ids1 = _block_ids(idx1, lo, hi, nb1, idx2, lo2, hi2, 1, BLOCK_N)
    ids2 = _block_ids(idx1, lo, hi, nb1, idx2, lo2, hi2, 2, BLOCK_N)
    for j in gl.static_range(2):
        idj = ids0 if j == 0 else ids1
        if j < nb1:
            _issue_block(raw_bufs.index(j), sc_bufs.index(j), kv_ptr, sc_ptr, kv2_ptr, sc2_ptr,
                         idj, s_kv, s_sc, s_kv2, s_sc2, True, D, FMT, FMT2, BLOCK_N)  # fmt: skip
        else:
            _issue_block(raw_bufs.index(j), sc_bufs.index(j), kv_ptr, sc_ptr, kv2_ptr, sc2_ptr,
                         idj, s_kv, s_sc, s_kv2, s_sc2, False, D, FMT, FMT2, BLOCK_N)  # fmt: skip
    async_copy.wait_group(2)  # Q (the oldest group) has landed, for every producer thread
    gl.thread_barrier()
    fence_async_shared()
    mbarrier.arrive(q_bar, count=1)

    for b in range(nb):
        ids3 = _block_ids(idx1, lo, hi, nb1, idx2, lo2, hi2, b + 3, BLOCK_N)
        nxt = (b + 2) % 3
        if b + 2 < nb1:
            _issue_block(raw_bufs.index(nxt), sc_bufs.index(nxt), kv_ptr, sc_ptr, kv2_ptr,
                         sc2_ptr, ids2, s_kv, s_sc, s_kv2, s_sc2, True, D, FMT, FMT2,
                         BLOCK_N)  # fmt: skip
        else:
            _issue_block(raw_bufs.index(nxt), sc_bufs.index(nxt), kv_ptr, sc_ptr, kv2_ptr,
                         sc2_ptr, ids2, s_kv, s_sc, s_kv2, s_sc2, False, D, FMT, FMT2,
                         BLOCK_N)  # fmt: skip
        async_copy.wait_group(2)  # this thread's copies of block b have landed
        gl.thread_barrier()  # ... and every producer thread's (scales are read across threads)
        st = b % STAGES
        mbarrier.wait(empty.index(st), ((b // STAGES) & 1) ^ 1)
        cur = b % 3
        if b < nb1:
            _decode_block(k_bufs.index(st), raw_bufs.index(cur), sc_bufs.index(cur), kv_ptr,
                          sc_ptr, D, FMT, SC_E8, BLOCK_N)  # fmt: skip
        else:
            _decode_block(k_bufs.index(st), raw_bufs.index(cur), sc_bufs.index(cur), kv2_ptr,
                          sc2_ptr, D, FMT2, SC2_E8, BLOCK_N)  # fmt: skip
        bias_bufs.index(st).store(gl.where(ids0 >= 0, 0.0, float("-inf")))
        fence_async_shared()
        mbarrier.arrive(ready.index(st), count=1)
        ids0, ids1, ids2 = ids1, ids2, ids3
    async_copy.wait_group(0)  # the over-issued (all-masked) copies


@gluon.jit
def _consumer(q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
              out_ptr, part_ptr, ml_ptr, T, H, lo, hi, lo2, hi2, scale_log2, s_qt, s_qh, s_kv,
              s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, q_smem, k_bufs, bias_bufs,
              raw_bufs, sc_bufs, ready, empty, q_bar, D: gl.constexpr, R: gl.constexpr,
              FMT: gl.constexpr, SC_E8: gl.constexpr, FMT2: gl.constexpr, SC2_E8: gl.constexpr,
              ROPE: gl.constexpr, SPLIT1: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """One warpgroup: the whole S of every key block, output channels [HALF*D/2, +D/2).
    Consumer 0 is the default partition, consumer 1 a worker (workers share a signature:
    the producer's, which this one has too)."""
    h0 = gl.program_id(1) * 64
    split = gl.program_id(2)
    DH: gl.constexpr = D // 2
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, DH, 16])  # fmt: skip
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    heads = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
    m_i = gl.load(sink_ptr + heads) * 1.4426950408889634
    l_i = gl.where(split == 0, 1.0, 0.0) + gl.zeros([64], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([64, DH], gl.float32, o_l)
    n_blocks = gl.cdiv(hi - lo, BLOCK_N) + gl.cdiv(hi2 - lo2, BLOCK_N)
    mbarrier.wait(q_bar, 0)
    for i in range(n_blocks):
        st = i % STAGES
        mbarrier.wait(ready.index(st), (i // STAGES) & 1)
        kb = k_bufs.index(st)
        s = warpgroup_mma(q_smem, kb.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_l),
                          use_acc=False, is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        bias = bias_bufs.index(st).load(gl.SliceLayout(0, s_l))
        s = s * scale_log2 + gl.expand_dims(bias, 0)
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_l)), 1)
        pa = gl.convert_layout(p.to(gl.bfloat16), p_l)
        acc = warpgroup_mma(pa, kb.slice(HALF * DH, DH, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(st), count=1)
        m_i = m_new

    _epilogue(acc, m_i, l_i, ang_ptr, out_ptr, part_ptr, ml_ptr, T, H, s_at, s_ot, s_oh,
              k_bufs, empty, n_blocks, D, R, ROPE, SPLIT1, STAGES, HALF)


@gluon.jit
def _epilogue(acc, m_i, l_i, ang_ptr, out_ptr, part_ptr, ml_ptr, T, H, s_at, s_ot, s_oh, k_bufs,
              empty, n_blocks, D: gl.constexpr, R: gl.constexpr, ROPE: gl.constexpr,
              SPLIT1: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """A consumer's output: with one split O / l (inverse RoPE on the last R channels), else
    the split's unnormalized O and (consumer 0) its (m, l)."""
    t = gl.program_id(0)
    h0 = gl.program_id(1) * 64
    split = gl.program_id(2)
    DH: gl.constexpr = D // 2
    o_l: gl.constexpr = acc.type.layout
    s_l: gl.constexpr = m_i.type.layout.parent
    if SPLIT1:
        o = acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_l)), 1)
        if ROPE and (HALF + 1) * DH > D - R:  # inverse RoPE on the last R/2 pairs (2j, 2j+1):
            # a pair sits in one thread of the wgmma layout, so the split moves no data
            a, b = gl.split(gl.reshape(o, [64, DH // 2, 2]))
            pl: gl.constexpr = a.type.layout
            # cos / sin of the half's D/4 pair angles once each, one per thread (0 off the
            # RoPE channels: cos 1, sin 0), then to the columns' layout through shared
            # memory; in ``pl`` each thread would evaluate all of its 32 columns' angles
            j1 = gl.arange(0, DH // 2, layout=gl.BlockedLayout([1], [32], [4], [0]))
            k1 = (HALF * DH // 2 - (D // 2 - R // 2)) + j1
            a1 = gl.load(ang_ptr + t * s_at + k1, mask=k1 >= 0, other=0.0)
            c = gl.expand_dims(gl.convert_layout(gl.cos(a1), gl.SliceLayout(0, pl)), 0)
            sn = gl.expand_dims(gl.convert_layout(gl.sin(a1), gl.SliceLayout(0, pl)), 0)
            o = gl.reshape(gl.join(a * c + b * sn, b * c - a * sn), [64, DH])
        _store_staged(
            o.to(gl.bfloat16),
            k_bufs,
            empty,
            n_blocks,
            out_ptr + t * s_ot + h0 * s_oh + HALF * DH,
            s_oh,
            HALF,
            DH,
            STAGES,
        )
    else:  # partials [SPLITS, T, H, D] and (m, l) [.., 2]
        row0 = (split * T + t) * H + h0
        if part_ptr.dtype.element_ty == gl.bfloat16:
            _store_staged(
                acc.to(gl.bfloat16),
                k_bufs,
                empty,
                n_blocks,
                part_ptr + row0 * D + HALF * DH,
                D,
                HALF,
                DH,
                STAGES,
            )
        else:
            hr = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
            cols = HALF * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, o_l))
            gl.store(part_ptr + gl.expand_dims(hr, 1) * D + gl.expand_dims(cols, 0), acc)
        if HALF == 0:
            rs = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))
            gl.store(ml_ptr + rs * 2, m_i)
            gl.store(ml_ptr + rs * 2 + 1, l_i)


@gluon.jit
def _store_staged(v, k_bufs, empty, n_blocks, rows_ptr, s_row, HALF: gl.constexpr,
                  DH: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """One consumer's [64, DH] bf16 tile to ``rows_ptr + head * s_row + channel`` through the
    key ring: once both consumers have released the ring's last blocks, this half's 32 KB of
    it takes the tile (stmatrix) and is written back as whole-row 16-byte stores. From the
    wgmma layout each thread holds 4-byte pieces, and those half-sector stores took longer
    than fp32's whole sectors (H200)."""
    gl.static_assert(STAGES * k_bufs.shape[1] * k_bufs.shape[2] >= 2 * 64 * DH,
                     "the key ring must hold both consumers' tiles")  # fmt: skip
    for st in gl.static_range(STAGES):
        if n_blocks > st:
            mbarrier.wait(empty.index(st), ((n_blocks - 1 - st) // STAGES) & 1)
    stage_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DH], gl.bfloat16)
    ob = k_bufs._reinterpret(gl.bfloat16, [2, 64, DH], stage_l).index(HALF)
    ob.store(v)
    gl.thread_barrier()
    wl: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, wl))
    c = gl.arange(0, DH, layout=gl.SliceLayout(0, wl))
    gl.store(rows_ptr + gl.expand_dims(r, 1) * s_row + gl.expand_dims(c, 0), ob.load(wl))


@gluon.jit
def _attn_ws_kernel(
    q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr, out_ptr,
    part_ptr, ml_ptr, T, H, K, K2, SPLITS, scale_log2, s_qt, s_qh, s_kv, s_sc, s_it, s_kv2,
    s_sc2, s_it2, s_at, s_ot, s_oh, D: gl.constexpr, R: gl.constexpr, FMT: gl.constexpr,
    SC_E8: gl.constexpr, FMT2: gl.constexpr, SC2_E8: gl.constexpr, ROPE: gl.constexpr,
    SPLIT1: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    P_REGS: gl.constexpr, C_REGS: gl.constexpr,
):  # fmt: skip
    split = gl.program_id(2)
    q_smem = gl.allocate_shared_memory(
        gl.bfloat16, [64, D], gl.NVMMASharedLayout.get_default_for([64, D], gl.bfloat16)
    )
    k_bufs = gl.allocate_shared_memory(
        gl.bfloat16, [STAGES, BLOCK_N, D],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16),
    )  # fmt: skip
    bias_bufs = gl.allocate_shared_memory(
        gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    # three slots of stored rows in flight (cp.async), viewed per source format; a slot holds
    # the widest format's tile (bf16 rows: BLOCK_N x 2D bytes, else BLOCK_N x D)
    RAW: gl.constexpr = BLOCK_N * D * (2 if FMT == 0 or FMT2 == 0 else 1)
    raw_bufs = gl.allocate_shared_memory(gl.uint8, [3, RAW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sc_bufs = gl.allocate_shared_memory(  # scale rows: at most D/32 fp32 = D/8 bytes
        gl.uint8, [3, BLOCK_N * D // 8], gl.SwizzledSharedLayout(1, 1, 1, [0])
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    mbarrier.init(q_bar, count=1)

    # A split takes whole blocks of each source in proportion (as the tl kernel does).
    per = gl.cdiv(gl.cdiv(K, BLOCK_N), SPLITS) * BLOCK_N
    lo = split * per
    hi = gl.maximum(gl.minimum(lo + per, K), lo)
    per2 = gl.cdiv(gl.cdiv(K2, BLOCK_N), SPLITS) * BLOCK_N
    lo2 = split * per2
    hi2 = gl.maximum(gl.minimum(lo2 + per2, K2), lo2)

    # (the partitions' argument tuples are written out: a tuple built here would not keep
    # the constexprs)
    gl.warp_specialize([
        (_consumer, (
            q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
            out_ptr, part_ptr, ml_ptr, T, H, lo, hi, lo2, hi2, scale_log2, s_qt, s_qh, s_kv,
            s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, q_smem, k_bufs, bias_bufs,
            raw_bufs, sc_bufs, ready, empty, q_bar, D, R, FMT, SC_E8, FMT2, SC2_E8, ROPE,
            SPLIT1, BLOCK_N, STAGES, 0)),
        (_consumer, (
            q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
            out_ptr, part_ptr, ml_ptr, T, H, lo, hi, lo2, hi2, scale_log2, s_qt, s_qh, s_kv,
            s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, q_smem, k_bufs, bias_bufs,
            raw_bufs, sc_bufs, ready, empty, q_bar, D, R, FMT, SC_E8, FMT2, SC2_E8, ROPE,
            SPLIT1, BLOCK_N, STAGES, 1)),
        (_producer, (
            q_ptr, kv_ptr, sc_ptr, idx_ptr, kv2_ptr, sc2_ptr, idx2_ptr, sink_ptr, ang_ptr,
            out_ptr, part_ptr, ml_ptr, T, H, lo, hi, lo2, hi2, scale_log2, s_qt, s_qh, s_kv,
            s_sc, s_it, s_kv2, s_sc2, s_it2, s_at, s_ot, s_oh, q_smem, k_bufs, bias_bufs,
            raw_bufs, sc_bufs, ready, empty, q_bar, D, R, FMT, SC_E8, FMT2, SC2_E8, ROPE,
            SPLIT1, BLOCK_N, STAGES, 1)),
    ], [4, 4], [C_REGS, P_REGS])  # fmt: skip


SMEM_LIMIT = 232448  # bytes of shared memory one sm_90 CTA may hold


def smem_bytes(block_n: int, stages: int, plain: bool, scaled: bool, D: int = 512) -> int:
    """Shared memory of one CTA (an upper bound: 1 KB over the compiler's count): Q, the
    bf16 key ring + its biases, three slots of stored rows (``plain`` bf16 rows take twice
    the bytes) and, when a source is ``scaled``, of scale rows; the barriers."""
    raw = block_n * D * (2 if plain else 1)
    return (HEADS * D * 2 + stages * (block_n * D * 2 + block_n * 4) + 3 * raw
            + (3 * block_n * D // 8 if scaled else 0) + (2 * stages + 1) * 8 + 1024)  # fmt: skip


def fit_block_n(block_n: int, stages: int, plain: bool, scaled: bool, D: int = 512) -> int:
    """The launch's key block: ``block_n`` halved (down to 16) until the CTA fits in shared
    memory; a ValueError when it does not, or when the key ring (``stages`` x the block)
    holds fewer than 64 rows: the epilogue stages two [64, D/2] bf16 tiles in it."""
    while smem_bytes(block_n, stages, plain, scaled, D) > SMEM_LIMIT and block_n > 16:
        block_n //= 2
    if smem_bytes(block_n, stages, plain, scaled, D) > SMEM_LIMIT:
        raise ValueError(f"block_n {block_n} x {stages} stages exceeds shared memory")
    if stages * block_n < HEADS:
        raise ValueError(f"block_n {block_n} x {stages} stages: the key ring must hold at "
                         f"least {HEADS} rows for the epilogue's output tiles")  # fmt: skip
    return block_n


def launch_ws(q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S,
              scale_log2, strides, *, D, R, fmt, e8, fmt2, e82, block_n=32, stages=2,
              p_regs=96, c_regs=208):  # fmt: skip
    """Launch over (T, H / 64, S); ``strides`` as ``sparse_attention_triton`` passes them.
    Plain bf16 rows, twice the bytes of fp8 in the copy ring, halve ``block_n`` when the
    default tile would not fit (an explicit one that does not fit raises). fp8 rows with
    e8m0 codes take the integer decode (``SC_E8``)."""
    block_n = fit_block_n(block_n, stages, plain=fmt == 0 or fmt2 == 0,
                          scaled=fmt != 0 or fmt2 != 0, D=D)  # fmt: skip
    # maxnreg x 12 warps x 32 lanes must fit the 64K-register file; the default partition
    # (consumer 0) gets 3 * maxnreg - c_regs - p_regs.
    _attn_ws_kernel[(T, triton.cdiv(H, HEADS), S)](
        q, kv, sc, idx, kv2, sc2, idx2, sink, ang, out, part, ml, T, H, K, K2, S, scale_log2,
        *strides, D=D, R=R, FMT=fmt, SC_E8=e8, FMT2=fmt2, SC2_E8=e82, ROPE=R > 0,
        SPLIT1=S == 1, BLOCK_N=block_n, STAGES=stages, P_REGS=p_regs, C_REGS=c_regs,
        num_warps=4, maxnreg=168,
    )  # fmt: skip
