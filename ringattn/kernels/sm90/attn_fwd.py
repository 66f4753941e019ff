"""Forward attention kernel written in Gluon for Hopper (triton.experimental.gluon): the warp
specialisation, the shared-memory ring of key/value tiles and the order of the tensor-core work are spelled out,
not left to triton's partitioner.

One program computes one (BLOCK_M, HEAD_DIM) tile of the output for one (batch, q head), in three partitions: a
one-warp producer loads Q once and the key/value tiles into a ring of NUM_BUFFERS shared-memory slots by TMA, and
two consumer warpgroups, BLOCK_M // 2 rows each, run the online softmax and store their rows. The consumers meet
only at the ring's barriers (a slot is free once both have arrived), so each runs at its own pace. A consumer's
loop is software-pipelined as FA3's is: the scores of tile j (S = Q K_j^T) are issued before the product of
tile j - 1 (O += P V), so the tensor cores work on one while the softmax of the other runs. A program visits only
the key tiles its rows' band reaches (row i sees keys j with i + lower <= j <= i + upper: causal and sliding
windows), and only the tiles that need a mask (the band's edges, and the last tile where Sk is not a multiple of
BLOCK_N) compare positions: a branch on the tile, which triton's automatic partitioner cannot take. SOFTCAP caps
the scores with tanh (the GPU's tanh.approx, within the 16-bit inputs' rounding). ops/sm90.py says when it is
taken.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..merge import _merge_states, _row_lse


@gluon.jit
def _tanh(x):
    """tanh by the GPU's tanh.approx.f32 (relative error below 2^-10.9, under the 16-bit inputs' rounding)."""
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _capped(x, cap_scale, MASKED: gl.constexpr):
    """tanh(x * cap_scale); MASKED keeps x's -inf (masked scores, a row with every key masked) at -inf, where tanh
    gives -1. Taken from x itself, so that no mask stays live across the tanh (it spilled); a score that overflowed
    fp32 to -inf (|q . k| > 3.4e38) counts as masked there."""
    t = _tanh(x * cap_scale)
    if MASKED:
        t = gl.where(x == float("-inf"), x, t)
    return t


@gluon.jit
def _band_visible(offs_m, offs_n, lower, upper, LOWER: gl.constexpr, UPPER: gl.constexpr):
    """(rows, keys) bool of rows offs_m against keys offs_n (broadcast as the two are laid out): the key is at or
    after row + lower (LOWER) and at or before row + upper (UPPER); one of the two is set."""
    if LOWER:
        visible = offs_n >= offs_m + lower
        if UPPER:
            visible = visible & (offs_n <= offs_m + upper)
    else:
        visible = offs_n <= offs_m + upper
    return visible


@gluon.jit
def _softmax_tile(s, m_i, l_i, n0, band, MASKED: gl.constexpr, LOWER: gl.constexpr, UPPER: gl.constexpr,
                  SOFTCAP: gl.constexpr):  # fmt: skip
    """One key tile's online-softmax step on the unscaled scores s (ROWS, BLOCK_N) of keys from n0: (P, alpha, m,
    l), m in log2 units, alpha the factor that moves the accumulator to the new m. band: the rows' positions offs_m
    (ROWS,), seqlen_k, lower, upper, qk_scale, cap_scale. SOFTCAP: s -> tanh(s * cap_scale) first.
    MASKED masks keys past seqlen_k and outside each row's band (lower, upper) with -inf; a row with no key yet
    keeps m = -inf and gets P = 0."""
    offs_m, seqlen_k, lower, upper, qk_scale, cap_scale = band
    if MASKED:
        offs_n = n0 + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        visible = offs_n[None, :] < seqlen_k
        if LOWER or UPPER:
            visible = visible & _band_visible(offs_m[:, None], offs_n[None, :], lower, upper, LOWER, UPPER)
        s = gl.where(visible, s, float("-inf"))
    s_max = gl.max(s, 1)
    if SOFTCAP:
        # tanh is increasing: the capped row max is the max's tanh, so the max runs beside the tanh of the scores,
        # not after it
        s = _capped(s, cap_scale, MASKED)
        s_max = _capped(s_max, cap_scale, MASKED)
    m_new = gl.maximum(m_i, s_max * qk_scale)
    if MASKED:
        # a row that has seen no key yet keeps m = -inf and subtracts 0 instead (exp2(-inf - 0) = 0), as the
        # portable kernels (kernels/portable/common.py): 0 kept as its max would scale its first visible keys' P
        # away from 1 (a negative score) and cost them precision when P is rounded to 16 bits
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _load_partition(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, MERGE_STATE: gl.constexpr,
                    OUT_FP32: gl.constexpr, HAS_FINAL_ROWS: gl.constexpr):  # fmt: skip
    """The producer: Q into q_smem, then the t-th key and value tiles the program visits (from first_n) into slot
    t % NUM_BUFFERS of their rings, each
    once both consumers freed it (keys and values have their own barriers: a key slot frees as soon as its scores
    are computed, a tile before its values' slot).
    args: the kernel's descriptors, buffers, barriers and scalars, as _attn_fwd_gluon_kernel packs them."""
    q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, Lse, m0, num_tiles = args[:13]
    first_n = args[13]
    off_b, off_hq, off_hk = args[26:29]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_load(q_desc, [off_b, m0, off_hq, 0], q_bar, q_smem)
    for j in range(num_tiles):
        slot = j % num_buffers
        free_phase = (j // num_buffers & 1) ^ 1  # a fresh barrier passes phase 1
        at = [off_b, first_n + j * BLOCK_N, off_hk, 0]
        _load_tile(k_desc, at, k_bufs.index(slot), k_bars.index(2 * slot), k_bars.index(2 * slot + 1), free_phase)
        _load_tile(v_desc, at, v_bufs.index(slot), v_bars.index(2 * slot), v_bars.index(2 * slot + 1), free_phase)


@gluon.jit
def _load_tile(desc, at, buf, ready, free, free_phase):
    """Load desc's tile at coordinates `at` into buf once the consumers freed it (free passed free_phase); ready counts
    it in."""
    mbarrier.wait(free, free_phase)
    mbarrier.expect(ready, desc.block_type.nbytes)
    tma.async_load(desc, at, ready, buf)


@gluon.jit
def _tile(bufs, slot):
    """Slot `slot` of a ring of (1, rows, 1, BLOCK_D) TMA tiles as the (rows, BLOCK_D) matrix the products read."""
    return bufs.index(slot).reshape([bufs.type.shape[2], bufs.type.shape[4]])


@gluon.jit
def _softmax_rows(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, MERGE_STATE: gl.constexpr,
                  OUT_FP32: gl.constexpr, HAS_FINAL_ROWS: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    """A consumer: rows [m0 + HALF * BLOCK_M // 2, + BLOCK_M // 2) of the output over the key tiles, stored with
    their lse (rows past seqlen_q are not; HAS_FINAL_ROWS: rows [final_lo, final_hi) into Final instead, rounded)."""
    q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, Lse, m0, num_tiles = args[:13]
    first_n, seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, Out, stride_os = args[13:22]
    Final, stride_fs, final_lo, final_hi, off_b, off_hq, off_hk, head_dim = args[22:]
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    BLOCK_D: gl.constexpr = q_smem.type.shape[3]  # head_dim's columns, and past them (BLOCK_D > head_dim) zeros
    BLOCK_N: gl.constexpr = k_bufs.type.shape[2]
    ROWS: gl.constexpr = BLOCK_M // 2
    num_buffers: gl.constexpr = k_bufs.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_D, 16])  # fmt: skip
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    acc_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    FIRST: gl.constexpr = HALF * ROWS
    r0 = m0 + FIRST
    q = q_smem.reshape([BLOCK_M, BLOCK_D]).slice(FIRST, ROWS)  # this consumer's rows of Q
    offs_m = r0 + gl.arange(0, ROWS, layout=row_layout)
    # a tile [n0, n0 + BLOCK_N) is seen whole by every row of this half (no mask) from n0 = full_lo on, up to
    # n0 + BLOCK_N = full_hi
    full_lo = 0
    full_hi = seqlen_k
    if LOWER:
        full_lo = r0 + ROWS - 1 + lower
    if UPPER:
        full_hi = gl.minimum(r0 + upper + 1, seqlen_k)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc = gl.zeros([ROWS, BLOCK_D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)  # always: the consumers' rows of Q stage their output, after the load lands
    if num_tiles > 0:
        # tile 0: its scores, then its softmax
        mbarrier.wait(k_bars.index(0), 0)
        s = warpgroup_mma(q, _tile(k_bufs, 0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_bars.index(1), count=1)
        band = (offs_m, seqlen_k, lower, upper, qk_scale, cap_scale)
        if (first_n >= full_lo) & (first_n + BLOCK_N <= full_hi):
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, first_n, band, False, LOWER, UPPER, SOFTCAP)
        else:
            p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, first_n, band, True, LOWER, UPPER, SOFTCAP)
        for j in range(1, num_tiles):
            slot = j % num_buffers
            prev = (j - 1) % num_buffers
            # tile j's scores issued first, then tile j - 1's product: the softmax of j runs beside the product
            mbarrier.wait(k_bars.index(2 * slot), j // num_buffers & 1)
            s = warpgroup_mma(q, _tile(k_bufs, slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            mbarrier.wait(v_bars.index(2 * prev), (j - 1) // num_buffers & 1)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            acc = warpgroup_mma(p_op, _tile(v_bufs, prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
            mbarrier.arrive(k_bars.index(2 * slot + 1), count=1)
            n0 = first_n + j * BLOCK_N
            if (n0 >= full_lo) & (n0 + BLOCK_N <= full_hi):
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, n0, band, False, LOWER, UPPER, SOFTCAP)
            else:
                p, alpha, m_i, l_i = _softmax_tile(s, m_i, l_i, n0, band, True, LOWER, UPPER, SOFTCAP)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(v_bars.index(2 * prev + 1), count=1)
            acc = acc * gl.convert_layout(alpha, acc_rows)[:, None]
        last = (num_tiles - 1) % num_buffers
        mbarrier.wait(v_bars.index(2 * last), (num_tiles - 1) // num_buffers & 1)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        acc = warpgroup_mma(p_op, _tile(v_bufs, last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(v_bars.index(2 * last + 1), count=1)

    lse, l_safe = _row_lse(m_i, l_i)  # every key masked: output 0, lse -inf
    out = acc / gl.convert_layout(l_safe, acc_rows)[:, None]
    if OUT_FP32:  # the ring's fp32 state, merged into (MERGE_STATE) or started, by pointers (any row stride)
        rows = r0 + gl.arange(0, ROWS, layout=acc_rows)
        cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, o_layout))
        ptrs = Out + rows[:, None].to(gl.int64) * stride_os + cols[None, :]
        row_mask = (rows < seqlen_q)[:, None] & (cols < head_dim)[None, :]
        lse = gl.convert_layout(lse, acc_rows)
        if MERGE_STATE:
            run_out = gl.load(ptrs, mask=row_mask, other=0.0)
            run_lse = gl.load(Lse + rows, mask=rows < seqlen_q, other=float("-inf"))
            out, lse = _merge_states(out, lse, run_out, run_lse)
        if HAS_FINAL_ROWS:
            done = (rows >= final_lo) & (rows < final_hi)
            f_ptrs = Final + rows[:, None].to(gl.int64) * stride_fs + cols[None, :]
            gl.store(f_ptrs, out.to(Final.dtype.element_ty), mask=row_mask & done[:, None])
            row_mask = row_mask & ((rows < final_lo) | (rows >= final_hi))[:, None]
        gl.store(ptrs, out, mask=row_mask)
        gl.store(Lse + rows, lse, mask=rows < seqlen_q)
    else:
        gl.store(Lse + offs_m, lse, mask=offs_m < seqlen_q)
        q.store(out.to(q_smem.dtype))  # its rows of Q, read by its products only, stage the output's TMA store
        fence_async_shared()
        tma.async_store(o_desc, [off_b, r0, off_hq, 0], q_smem.slice(FIRST, ROWS, dim=1))  # rows past Sq: clipped
        tma.store_wait(pendings=0)


@gluon.jit
def _softmax_partition_0(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr,
                         MERGE_STATE: gl.constexpr, OUT_FP32: gl.constexpr, HAS_FINAL_ROWS: gl.constexpr):  # fmt: skip
    _softmax_rows(args, LOWER, UPPER, SOFTCAP, MERGE_STATE, OUT_FP32, HAS_FINAL_ROWS, 0)


@gluon.jit
def _softmax_partition_1(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr,
                         MERGE_STATE: gl.constexpr, OUT_FP32: gl.constexpr, HAS_FINAL_ROWS: gl.constexpr):  # fmt: skip
    _softmax_rows(args, LOWER, UPPER, SOFTCAP, MERGE_STATE, OUT_FP32, HAS_FINAL_ROWS, 1)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k", "final_lo", "final_hi"])  # one compile for every length
def _attn_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, Final,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_fb, stride_fs, stride_fh,
    seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, final_lo, final_hi,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    GROUP_SIZE: gl.constexpr, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr,
    MERGE_STATE: gl.constexpr, OUT_FP32: gl.constexpr, HAS_FINAL_ROWS: gl.constexpr, NUM_BUFFERS: gl.constexpr,
):
    """Out[b, m, h] = softmax(Q K^T * scale) V for one Q tile and Lse[b, h, m] in natural log; grid (Sq tiles, Hq, B),
    4 warps (the first consumer; the partitions add 5).

    q_desc, k_desc, v_desc: host TMA descriptors (kernels/sm90/descriptors.py) of Q (B, Sq, Hq, HEAD_DIM) in
    (1, BLOCK_M, 1, BLOCK_D) tiles and K, V (B, Sk, Hq // GROUP_SIZE, HEAD_DIM) in (1, BLOCK_N, 1, BLOCK_D) tiles,
    all 16-bit (bf16 or fp16), BLOCK_D 64, 128 or 256 at or above HEAD_DIM (the columns past HEAD_DIM load as zeros and
    are not stored); o_desc Out's in (1, BLOCK_M // 2, 1, BLOCK_D) tiles where Out is
    in Q's dtype (with OUT_FP32 it is not read). Lse (B, Hq, Sq) float64 with its last dim contiguous. Row i sees keys
    j with (LOWER) i + lower <= j and (UPPER) j <= i + upper (ops/calls.py's key_band: causal and sliding windows,
    bottom-right aligned). qk_scale = softmax_scale * log2(e), or with SOFTCAP softcap * log2(e), the scores then
    tanh(q k^T * cap_scale), cap_scale = softmax_scale / softcap.
    OUT_FP32: Out is fp32 (the ring's running state, strides (stride_ob, stride_os, stride_oh, 1)), stored by
    pointers; else Out is in Q's dtype and stored by TMA. MERGE_STATE (with OUT_FP32): Out and Lse hold a running
    state on entry, and the tile's result is merged into it (the ring's step). HAS_FINAL_ROWS (with OUT_FP32): rows
    [final_lo, final_hi) of the result go, rounded, to Final (shaped like Out, its own dtype, last dim contiguous)
    instead (ops/final_rows.py). Rows that see no key get out 0, lse -inf.
    """
    start_m = gl.program_id(0)
    off_hq = gl.program_id(1)
    off_b = gl.program_id(2)
    off_hk = off_hq // GROUP_SIZE
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, 1, BLOCK_D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_N, 1, BLOCK_D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_N, 1, BLOCK_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # per slot of each ring, two barriers: [2 * slot] its tile landed, [2 * slot + 1] both consumers are done with it
    k_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(k_bars.index(2 * i), count=1)
        mbarrier.init(k_bars.index(2 * i + 1), count=2)  # one arrival from each consumer
        mbarrier.init(v_bars.index(2 * i), count=1)
        mbarrier.init(v_bars.index(2 * i + 1), count=2)

    m0 = start_m * BLOCK_M
    # the key tiles of [first_n, end_n) hold every key some row of the tile sees
    if LOWER:
        first_n = gl.minimum(gl.maximum(m0 + lower, 0), seqlen_k) // BLOCK_N * BLOCK_N
    else:
        first_n = 0
    if UPPER:
        end_n = gl.maximum(gl.minimum(m0 + BLOCK_M + upper, seqlen_k), 0)
    else:
        end_n = seqlen_k
    num_tiles = gl.cdiv(gl.maximum(end_n - first_n, 0), BLOCK_N)
    b64, hq64 = off_b.to(gl.int64), off_hq.to(gl.int64)
    lse_row = Lse + b64 * stride_lb + hq64 * stride_lh
    out_head = Out + b64 * stride_ob + hq64 * stride_oh
    final_head = Final + b64 * stride_fb + hq64 * stride_fh
    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_bufs, v_bufs, q_bar, k_bars, v_bars, lse_row, m0, num_tiles,
            first_n, seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, out_head, stride_os, final_head, stride_fs,
            final_lo, final_hi, off_b, off_hq, off_hk, HEAD_DIM)  # fmt: skip
    gl.warp_specialize(  # the flags beside args, not in it: a tuple made beforehand holds a constexpr as a plain value
        [
            (_softmax_partition_0, (args, LOWER, UPPER, SOFTCAP, MERGE_STATE, OUT_FP32, HAS_FINAL_ROWS)),
            (_softmax_partition_1, (args, LOWER, UPPER, SOFTCAP, MERGE_STATE, OUT_FP32, HAS_FINAL_ROWS)),
            (_load_partition, (args, LOWER, UPPER, SOFTCAP, MERGE_STATE, OUT_FP32, HAS_FINAL_ROWS)),
        ],
        [4, 1],
        [240, 24],
    )
