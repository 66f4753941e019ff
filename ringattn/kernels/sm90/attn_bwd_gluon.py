"""Backward attention kernel written in Gluon for Hopper: dK, dV and dQ of one key tile in one program.

One program owns one BLOCK_N tile of keys of one (batch, kv head) and loops over the query tiles of every q head of
its GQA group, in four partitions: a one-warp producer loads K and V once, then each step's Q and dO tiles into a
ring of NUM_BUFFERS shared-memory slots by TMA; two consumer warpgroups, BLOCK_N // 2 keys each, keep their rows
of dK and dV in registers across the steps; a one-warp writer adds the steps' dQ into the fp32 dQ. A step costs five
products, the scores and dP computed once:

    Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (issued together), Pᵀ = exp2(Sᵀ scale - lse2_hi), dSᵀ = Pᵀ (dPᵀ - delta),
    dV += Pᵀ dO, dQ = dS K, dK += dSᵀ Q.

The products are asynchronous: the exponentials run while dPᵀ is computed, dV while the two consumers exchange dS,
dK while dQ goes to the writer; each step waits for its own last product before the next step's first (a product
issued in one step and retired in the next made ptxas serialise every product of the kernel, its note C7514, which
cost the backward an eighth of its speed: docs/performance.md, decisions). For dQ the two consumers put their halves
of dSᵀ into shared memory and meet at a barrier; each then multiplies half of dS by K (at 64 rows a step all rows by
half of K's columns; at 128, half the rows by all of them, so that each product is 64 wide, not 32) and hands its
fp32 half tile to the writer through shared memory, which adds it into DQ by TMA's reduce-add while the consumers
go on. The consumers meet each other and the writer at hardware named barriers (_named_barrier), and each of their
threads frees a slot by its own arrival: Gluon's mbarrier arrival is one thread's behind a barrier of its
warpgroup, and a wait on an mbarrier after it costs another (docs/performance.md, decisions). A program visits only
the query tiles whose band reaches its keys (row i sees keys j with i + lower <= j <= i + upper: causal and sliding
windows), and only the steps on the band's edges compare positions. SOFTCAP recomputes the capped scores t =
tanh(q k^T * cap_scale) as the forward (kernels/sm90/attn_fwd.py's tanh), and dS gains tanh's derivative 1 - t^2.
The rows' lse is the row stats' lse2_hi alone (lse * log2(e) rounded to fp32): the rest, lse2_lo, moves P by at
most 2^-24 |lse| relative, under half an ulp of P in the 16-bit input dtype up to |lse| = 8192 (fp16) and 65536
(bf16), and would cost an add per score (ops/attn.py's attn_bwd_preprocess). At D = 256 (SPLIT_COLS) the
consumers split the columns instead of the keys (_grad_cols): each computes the scores and dP of half the keys, both
put their P and dS into shared memory, and each multiplies the whole tiles by its half of the columns, so that it
holds half of dK and dV for every key. ops/sm90.py says when it is taken.
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

from .attn_fwd import _band_visible, _tanh, _tile

# hardware named barriers (16 a CTA; triton's partitions take the lowest ids for barriers of their own warps): both
# consumers' halves of a step's dS stored (2 x 128 threads); per consumer h, its dQ buffer read by the writer (id
# DQ_FREE + 2h: its 128 threads wait, the writer's 32 arrive) and its half tile of dQ stored (DQ_FULL + 2h: the
# other way round)
DS_STORED = gl.constexpr(8)
DQ_FREE = gl.constexpr(9)
DQ_FULL = gl.constexpr(10)


@gluon.jit
def _named_barrier(barrier_id: gl.constexpr, threads: gl.constexpr, ARRIVE: gl.constexpr):
    """Named barrier barrier_id of `threads` threads (whole warps): wait there (bar.sync), or with ARRIVE arrive
    and go on (bar.arrive). Shared-memory writes before it are seen by the threads that wait after it."""
    if ARRIVE:
        gl.inline_asm("bar.arrive $0, $1;", "r,r", [barrier_id, threads])
    else:
        gl.inline_asm("bar.sync $0, $1;", "r,r", [barrier_id, threads])


@gluon.jit
def _arrive(bar):
    """This thread's arrival at mbarrier bar, behind its own earlier reads and writes of shared memory (bar counts
    every thread that frees the slot)."""
    gl.inline_asm("mbarrier.arrive.shared::cta.b64 _, [$0];", "r", [bar])


@gluon.jit
def _query_tile(i, num_m, start_m, first_hq, BLOCK_M: gl.constexpr):
    """The q head and first row of loop step i: num_m query tiles from row start_m for each q head from first_hq."""
    g = i // num_m
    return first_hq + g, start_m + (i - g * num_m) * BLOCK_M


@gluon.jit
def _step_tiles(i, num_m, start_m, first_hq, q_bufs, do_bufs, qdo_bars):
    """Loop step i's q head, first row and slot, and its Q and dO tiles (BLOCK_M, BLOCK_D), once they landed."""
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    hq, m0 = _query_tile(i, num_m, start_m, first_hq, BLOCK_M)
    slot = i % num_buffers
    q_tile = _tile(q_bufs, slot)
    do_tile = _tile(do_bufs, slot)
    mbarrier.wait(qdo_bars.index(2 * slot), i // num_buffers & 1)
    return hq, m0, slot, q_tile, do_tile


@gluon.jit
def _unmasked_rows(first_key, KEYS: gl.constexpr, BLOCK_M: gl.constexpr, seqlen_q, lower, upper, LOWER: gl.constexpr,
                   UPPER: gl.constexpr):  # fmt: skip
    """(full_lo, full_hi): a step's query tile [m0, m0 + BLOCK_M) sees every key of [first_key, first_key + KEYS) (no
    mask) for full_lo <= m0 <= full_hi."""
    full_lo = 0
    full_hi = seqlen_q
    if UPPER:
        full_lo = first_key + KEYS - 1 - upper
    if LOWER:
        full_hi = first_key - lower - (BLOCK_M - 1)
    return full_lo, full_hi


@gluon.jit
def _probabilities(s, lse2_hi, offs_n, band, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr,
                   KEYS_DIM: gl.constexpr):  # fmt: skip
    """(P, t) of a step's unscaled scores s, keys along dim KEYS_DIM and rows along the other: P = exp2(t * qk_scale
    - lse2_hi), one FMA a score, with t = tanh(s * cap_scale) (SOFTCAP; kept for tanh's derivative) or s, and -inf
    outside each row's band at the band's edge (m0 < full_lo or m0 > full_hi: some key outside some row's band).
    lse2_hi (rows,) and offs_n (keys,) in s's slice layouts; band: (m0, full_lo, full_hi, lower, upper, qk_scale,
    cap_scale)."""
    m0, full_lo, full_hi, lower, upper, qk_scale, cap_scale = band
    if SOFTCAP:
        s = _tanh(s * cap_scale)
    if KEYS_DIM == 0:
        x = s * qk_scale - lse2_hi[None, :]
    else:
        x = s * qk_scale - lse2_hi[:, None]
    if LOWER or UPPER:
        if (m0 < full_lo) | (m0 > full_hi):
            offs_m = m0 + gl.arange(0, s.shape[1 - KEYS_DIM], layout=gl.SliceLayout(KEYS_DIM, s.type.layout))
            if KEYS_DIM == 0:
                visible = _band_visible(offs_m[None, :], offs_n[:, None], lower, upper, LOWER, UPPER)
            else:
                visible = _band_visible(offs_m[:, None], offs_n[None, :], lower, upper, LOWER, UPPER)
            x = gl.where(visible, x, float("-inf"))
    return gl.exp2(x), s


@gluon.jit
def _scores_and_dp(q_tile, do_tile, k_keys, v_keys, s_zero, hi_bufs, slot, offs_n, band, LOWER: gl.constexpr,
                   UPPER: gl.constexpr, SOFTCAP: gl.constexpr, KEYS_DIM: gl.constexpr):  # fmt: skip
    """A step's (P, t, dP) for keys k_keys, v_keys (KEYS, BLOCK_D) against rows q_tile, do_tile (BLOCK_M, BLOCK_D),
    keys along dim KEYS_DIM of each (0: Sᵀ = K Qᵀ and dPᵀ = V dOᵀ; 1: S = Q Kᵀ and dP = dO Vᵀ): the two products
    issued together, P and t of the scores as _probabilities gives them, dP still in flight (warpgroup_mma_wait).
    hi_bufs, slot: the lse2_hi ring and the step's slot; s_zero: zeros in the scores' shape and layout; band as
    _probabilities's."""
    if KEYS_DIM == 0:
        s = warpgroup_mma(k_keys, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(v_keys, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        s = warpgroup_mma(q_tile, k_keys.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_keys.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    # rows past seqlen_q load stats 0 (and add nothing: their Q and dO rows are zeros); rows that see no key have
    # lse2_hi = +inf, so that their P is 0
    lse2_hi = hi_bufs.index(slot).reshape([hi_bufs.type.shape[3]]).load(gl.SliceLayout(KEYS_DIM, s_zero.type.layout))
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
    p, t = _probabilities(s, lse2_hi, offs_n, band, LOWER, UPPER, SOFTCAP, KEYS_DIM)
    return p, t, dp


@gluon.jit
def _hand_dq(dq, dq_smem, sm_scale, HALF: gl.constexpr):
    """Consumer HALF's share of a step's dQ, times sm_scale, into its buffer dq_smem for the writer, once the writer
    has read the last one."""
    _named_barrier(DQ_FREE + 2 * HALF, 160, False)
    dq_smem.store(dq * sm_scale)
    fence_async_shared()
    _named_barrier(DQ_FULL + 2 * HALF, 160, True)


@gluon.jit
def _load_partition(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
                    SPLIT_COLS: gl.constexpr):  # fmt: skip
    """The producer: K and V once, then step i's Q and dO tiles into slot i % NUM_BUFFERS once both consumers freed
    it, with the rows' lse2_hi and delta. args: the kernel's descriptors, buffers, barriers and scalars, as
    _attn_bwd_gluon_kernel packs them."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs = args[:11]
    kv_bar, qdo_bars, n0, start_m, num_m, first_hq, num_steps = args[11:18]
    hi_desc, delta_desc, hi_bufs, delta_bufs, off_b, off_hk = args[18:24]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    num_buffers: gl.constexpr = q_bufs.type.shape[0]
    tiles_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * hi_desc.block_type.nbytes
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_load(k_desc, [off_b, n0, off_hk, 0], kv_bar, k_smem)
    tma.async_load(v_desc, [off_b, n0, off_hk, 0], kv_bar, v_smem)
    for i in range(num_steps):
        hq, m0 = _query_tile(i, num_m, start_m, first_hq, BLOCK_M)
        slot = i % num_buffers
        mbarrier.wait(qdo_bars.index(2 * slot + 1), (i // num_buffers & 1) ^ 1)  # a fresh barrier passes phase 1
        ready = qdo_bars.index(2 * slot)
        mbarrier.expect(ready, tiles_bytes)
        tma.async_load(q_desc, [off_b, m0, hq, 0], ready, q_bufs.index(slot))
        tma.async_load(do_desc, [off_b, m0, hq, 0], ready, do_bufs.index(slot))
        tma.async_load(hi_desc, [off_b, hq, m0], ready, hi_bufs.index(slot))
        tma.async_load(delta_desc, [off_b, hq, m0], ready, delta_bufs.index(slot))


@gluon.jit
def _grad_rows(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
               HALF: gl.constexpr):  # fmt: skip
    """A consumer: dK and dV of keys [n0 + HALF * BLOCK_N // 2, + BLOCK_N // 2) over every step, and at each step
    its half of dQ (of the columns; of the rows at 128 rows a step) handed to the writer in dq_bufs[HALF]; dK, dV
    stored (ADD_DKDV: added) at the end (keys past seqlen_k are not)."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs = args[:11]
    kv_bar, qdo_bars, n0, start_m, num_m, first_hq, num_steps = args[11:18]
    hi_desc, delta_desc, hi_bufs, delta_bufs = args[18:22]
    DK, DV, stride_ks, stride_vs, seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, sm_scale = args[24:35]
    head_dim = args[35]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    BLOCK_D: gl.constexpr = k_smem.type.shape[3]  # head_dim's columns, and past them (BLOCK_D > head_dim) zeros
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    KEYS: gl.constexpr = BLOCK_N // 2
    FIRST: gl.constexpr = HALF * KEYS
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])  # fmt: skip
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_D, 16])  # fmt: skip
    DQ_ROWS: gl.constexpr = dq_bufs.type.shape[2]  # this consumer's dQ tile: all rows and half the columns, or
    DQ_COLS: gl.constexpr = dq_bufs.type.shape[4]  # (128 rows a step) half the rows and all the columns
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])  # fmt: skip
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_tile = k_smem.reshape([BLOCK_N, BLOCK_D])
    k_rows = k_tile.slice(FIRST, KEYS)
    v_rows = v_smem.reshape([BLOCK_N, BLOCK_D]).slice(FIRST, KEYS)
    if DQ_ROWS == BLOCK_M:
        k_cols = k_tile.slice(HALF * DQ_COLS, DQ_COLS, dim=1)
    else:
        k_cols = k_tile
    dq_smem = dq_bufs.index(HALF).reshape([DQ_ROWS, DQ_COLS])
    offs_n = n0 + FIRST + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    full_lo, full_hi = _unmasked_rows(n0 + FIRST, KEYS, BLOCK_M, seqlen_q, lower, upper, LOWER, UPPER)
    s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, dq_layout)
    dk = gl.zeros([KEYS, BLOCK_D], gl.float32, acc_layout)
    dv = gl.zeros([KEYS, BLOCK_D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(num_steps):
        hq, m0, slot, q_tile, do_tile = _step_tiles(i, num_m, start_m, first_hq, q_bufs, do_bufs, qdo_bars)
        band = (m0, full_lo, full_hi, lower, upper, qk_scale, cap_scale)
        pt, st, dpt = _scores_and_dp(q_tile, do_tile, k_rows, v_rows, s_zero, hi_bufs, slot, offs_n, band, LOWER, UPPER,
                                     SOFTCAP, 0)  # fmt: skip
        pt16 = gl.convert_layout(pt.to(dtype), op_layout)
        if SOFTCAP:  # dS's factors but dP - delta, so that only one (KEYS, BLOCK_M) tile stays live till dP is in
            pt = pt * (1.0 - st * st)
        delta = delta_bufs.index(slot).reshape([BLOCK_M]).load(col_layout)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        ds16 = (pt * (dpt - delta[None, :])).to(dtype)
        # this half of dSᵀ into the step's dS buffer; then this consumer's rows of dS (both halves of the keys) times
        # its columns of K. The buffer of two steps ago is free: the other consumer's dQ of that step, which read it,
        # retired before it stored its half of the last step's dS, whose barrier this consumer passed
        ds_tile = ds_bufs.index(i % 2)
        ds_tile.slice(FIRST, KEYS).store(ds16)
        fence_async_shared()
        dv = warpgroup_mma(pt16, do_tile, dv, is_async=True)
        _named_barrier(DS_STORED, 256, False)
        if DQ_ROWS == BLOCK_M:
            dq = warpgroup_mma(ds_tile.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
        else:
            ds_rows = ds_tile.slice(HALF * DQ_ROWS, DQ_ROWS, dim=1)
            dq = warpgroup_mma(ds_rows.permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv,))
        dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q_tile, dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq,))
        _hand_dq(dq, dq_smem, sm_scale, HALF)
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        _arrive(qdo_bars.index(2 * slot + 1))

    rows = n0 + FIRST + gl.arange(0, KEYS, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, acc_layout))
    _store_grads(DK, DV, dk * sm_scale, dv, rows, cols, stride_ks, stride_vs, seqlen_k, head_dim, ADD_DKDV)


@gluon.jit
def _store_grads(DK, DV, dk, dv, rows, cols, stride_ks, stride_vs, seqlen_k, head_dim, ADD_DKDV: gl.constexpr):
    """dk, dv (their rows, cols of a consumer's accumulators) stored into DK, DV (ADD_DKDV: added into them), but
    keys past seqlen_k and columns past head_dim."""
    in_bounds = (rows < seqlen_k)[:, None] & (cols < head_dim)[None, :]
    dk_ptrs = DK + rows[:, None].to(gl.int64) * stride_ks + cols[None, :]
    dv_ptrs = DV + rows[:, None].to(gl.int64) * stride_vs + cols[None, :]
    if ADD_DKDV:
        dk += gl.load(dk_ptrs, mask=in_bounds, other=0.0)
        dv += gl.load(dv_ptrs, mask=in_bounds, other=0.0)
    gl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=in_bounds)
    gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=in_bounds)


@gluon.jit
def _grad_cols(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
               HALF: gl.constexpr):  # fmt: skip
    """A consumer of the column split (SPLIT_COLS, wide heads): columns [HALF * BLOCK_D // 2, + BLOCK_D // 2) of dK
    and dV of every key of the tile over every step. At each step it computes the scores and dP of keys
    [n0 + HALF * BLOCK_N // 2, + BLOCK_N // 2) against the step's rows, puts their P and dS into the step's shared
    buffers, and, once both consumers have, multiplies the whole P and dS: its columns of dV, dK and dQ (handed to
    the writer in dq_bufs[HALF]); dK, dV stored (ADD_DKDV: added) at the end (keys past seqlen_k are not)."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs = args[:11]
    kv_bar, qdo_bars, n0, start_m, num_m, first_hq, num_steps = args[11:18]
    hi_desc, delta_desc, hi_bufs, delta_bufs = args[18:22]
    DK, DV, stride_ks, stride_vs, seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, sm_scale = args[24:35]
    head_dim, p_bufs = args[35:37]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    BLOCK_D: gl.constexpr = k_smem.type.shape[3]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    KEYS: gl.constexpr = BLOCK_N // 2
    COLS: gl.constexpr = BLOCK_D // 2
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KEYS, 16])  # fmt: skip
    # dK and dV (BLOCK_N keys x COLS), and dQ (BLOCK_M rows x COLS)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, COLS, 16])  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_tile = k_smem.reshape([BLOCK_N, BLOCK_D])
    k_keys = k_tile.slice(HALF * KEYS, KEYS)
    v_keys = v_smem.reshape([BLOCK_N, BLOCK_D]).slice(HALF * KEYS, KEYS)
    k_cols = k_tile.slice(HALF * COLS, COLS, dim=1)
    dq_smem = dq_bufs.index(HALF).reshape([BLOCK_M, COLS])
    offs_n = n0 + HALF * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
    full_lo, full_hi = _unmasked_rows(n0 + HALF * KEYS, KEYS, BLOCK_M, seqlen_q, lower, upper, LOWER, UPPER)
    s_zero = gl.zeros([BLOCK_M, KEYS], gl.float32, s_layout)
    dq_zero = gl.zeros([BLOCK_M, COLS], gl.float32, acc_layout)
    dk = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, COLS], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(num_steps):
        hq, m0, slot, q_tile, do_tile = _step_tiles(i, num_m, start_m, first_hq, q_bufs, do_bufs, qdo_bars)
        band = (m0, full_lo, full_hi, lower, upper, qk_scale, cap_scale)
        p, s, dp = _scores_and_dp(q_tile, do_tile, k_keys, v_keys, s_zero, hi_bufs, slot, offs_n, band, LOWER, UPPER,
                                  SOFTCAP, 1)  # fmt: skip
        # the buffers of two steps ago are free, as _grad_rows's dS buffer
        p_tile = p_bufs.index(i % 2)
        ds_tile = ds_bufs.index(i % 2)
        p_tile.slice(HALF * KEYS, KEYS, dim=1).store(p.to(dtype))
        if SOFTCAP:
            p = p * (1.0 - s * s)
        delta = delta_bufs.index(slot).reshape([BLOCK_M]).load(row_layout)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds_tile.slice(HALF * KEYS, KEYS, dim=1).store((p * (dp - delta[:, None])).to(dtype))
        fence_async_shared()
        _named_barrier(DS_STORED, 256, False)
        dq = warpgroup_mma(ds_tile, k_cols, dq_zero, use_acc=False, is_async=True)
        dv = warpgroup_mma(p_tile.permute((1, 0)), do_tile.slice(HALF * COLS, COLS, dim=1), dv, is_async=True)
        dk = warpgroup_mma(ds_tile.permute((1, 0)), q_tile.slice(HALF * COLS, COLS, dim=1), dk, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=2, deps=(dq,))
        _hand_dq(dq, dq_smem, sm_scale, HALF)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        _arrive(qdo_bars.index(2 * slot + 1))

    rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = HALF * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, acc_layout))
    _store_grads(DK, DV, dk * sm_scale, dv, rows, cols, stride_ks, stride_vs, seqlen_k, head_dim, ADD_DKDV)


@gluon.jit
def _dq_writer_partition(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr,
                         ADD_DKDV: gl.constexpr, SPLIT_COLS: gl.constexpr):  # fmt: skip
    """The dQ writer, one warp: each step's two halves of dQ, as the consumers hand them over in shared memory, added
    into DQ by TMA's reduce-add; each buffer handed back once the add has read it."""
    q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs = args[:11]
    n0, start_m, num_m, first_hq, num_steps = args[13:18]
    off_b = args[22]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[2]
    DQ_ROWS: gl.constexpr = dq_bufs.type.shape[2]
    DQ_COLS: gl.constexpr = dq_bufs.type.shape[4]
    for i in range(num_steps):
        hq, m0 = _query_tile(i, num_m, start_m, first_hq, BLOCK_M)
        for half in gl.static_range(2):  # the last step's adds have read the buffers
            tma.store_wait(pendings=1 - half)
            _named_barrier(DQ_FREE + 2 * half, 160, True)
        for half in gl.static_range(2):
            _named_barrier(DQ_FULL + 2 * half, 160, False)
            # rows past seqlen_q are clipped
            if DQ_ROWS == BLOCK_M:
                tma.async_atomic_add(dq_desc, [off_b, m0, hq, half * DQ_COLS], dq_bufs.index(half))
            else:
                tma.async_atomic_add(dq_desc, [off_b, m0 + half * DQ_ROWS, hq, 0], dq_bufs.index(half))
    tma.store_wait(pendings=0)


@gluon.jit
def _grad_partition(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
                    SPLIT_COLS: gl.constexpr, HALF: gl.constexpr):  # fmt: skip
    if SPLIT_COLS:
        _grad_cols(args, LOWER, UPPER, SOFTCAP, ADD_DKDV, HALF)
    else:
        _grad_rows(args, LOWER, UPPER, SOFTCAP, ADD_DKDV, HALF)


@gluon.jit
def _grad_partition_0(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
                      SPLIT_COLS: gl.constexpr):  # fmt: skip
    _grad_partition(args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS, 0)


@gluon.jit
def _grad_partition_1(args, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
                      SPLIT_COLS: gl.constexpr):  # fmt: skip
    _grad_partition(args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS, 1)


@gluon.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # one compile for every length
def _attn_bwd_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, hi_desc, delta_desc, DK, DV,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, sm_scale,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    GROUP_SIZE: gl.constexpr, LOWER: gl.constexpr, UPPER: gl.constexpr, SOFTCAP: gl.constexpr, ADD_DKDV: gl.constexpr,
    NUM_BUFFERS: gl.constexpr, SPLIT_COLS: gl.constexpr,
):
    """dK, dV (B, Sk, Hkv, HEAD_DIM) of one BLOCK_N tile of keys of one (batch, kv head), and its share of dQ added
    into dQ; grid (Sk tiles, Hkv, B), 4 warps (the first consumer; the partitions add 6).

    Host TMA descriptors (kernels/sm90/descriptors.py): q_desc, do_desc of Q, dOut (B, Sq, Hq, HEAD_DIM) in
    (1, BLOCK_M, 1, BLOCK_D) tiles and k_desc, v_desc of K, V (B, Sk, Hkv, HEAD_DIM) in (1, BLOCK_N, 1, BLOCK_D)
    tiles, all 16-bit (bf16 or fp16), BLOCK_D 64, 128 or 256 at or above HEAD_DIM (the columns past HEAD_DIM load
    as zeros and are not stored); dq_desc of dQ (B, Sq, Hq, HEAD_DIM) fp32 in (1, BLOCK_M, 1, BLOCK_D // 2) tiles, or
    (1, BLOCK_M // 2, 1, BLOCK_D) at BLOCK_M >= 128: dQ is added into (atomically:
    every key tile adds its share); hi_desc, delta_desc of the row stats' lse2_hi and delta planes (B, Hq, Sq') fp32
    in (1, 1, BLOCK_M) tiles (ops/attn.py's attn_bwd_preprocess; lse2_lo is not read), Sq' >= Sq a multiple of
    BLOCK_M, the entries past Sq zeros. DK, DV like K and V, in their dtype or fp32 (the ring's shares), last dim
    contiguous; stored, or with ADD_DKDV added into.
    Row i sees keys j with (LOWER) i + lower <= j and (UPPER) j <= i + upper; qk_scale, cap_scale, SOFTCAP as in the
    forward kernel; rows whose lse2_hi is +inf (no key) add nothing. The additions into dQ come in the order the
    programs reach them, so dQ's last bits vary from run to run.
    SPLIT_COLS (wide heads, BLOCK_M = 64): the consumers split the columns of dK, dV and dQ instead of the keys
    (_grad_cols), so that each holds BLOCK_N x BLOCK_D / 2 of dK and of dV.
    """
    start_n = gl.program_id(0)
    off_hk = gl.program_id(1)
    off_b = gl.program_id(2)
    dtype: gl.constexpr = q_desc.dtype
    # each consumer's share of a step's dQ: half its columns, or (128 rows a step) half its rows
    DQ_ROWS: gl.constexpr = dq_desc.block_type.shape[1]
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    if SPLIT_COLS:  # P and dS (rows x keys), each consumer storing its half of the keys (whole swizzle rows)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_N), element_bitwidth=16,
                                                       rank=2)  # fmt: skip
        ds_shape: gl.constexpr = [2, BLOCK_M, BLOCK_N]
    else:  # dSᵀ (keys x rows) as the dQ product's left operand, transposed
        ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * BLOCK_M), element_bitwidth=16,
                                                       rank=2)  # fmt: skip
        ds_shape: gl.constexpr = [2, BLOCK_N, BLOCK_M]
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, 1, BLOCK_D], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_M, 1, BLOCK_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, 1, BLOCK_M, 1, BLOCK_D], do_desc.layout)
    ds_bufs = gl.allocate_shared_memory(dtype, ds_shape, ds_layout)
    if SPLIT_COLS:
        p_bufs = gl.allocate_shared_memory(dtype, ds_shape, ds_layout)
    else:
        p_bufs = ds_bufs  # not read
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, 1, DQ_ROWS, 1, DQ_COLS], dq_desc.layout)  # one a consumer
    hi_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, 1, 1, BLOCK_M], hi_desc.layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, 1, 1, BLOCK_M], delta_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # per slot, two barriers: [2 * slot] its tiles landed (Q, dO, the stats), [2 * slot + 1] every thread of both
    # consumers is done with it
    qdo_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(qdo_bars.index(2 * i), count=1)
        mbarrier.init(qdo_bars.index(2 * i + 1), count=256)

    n0 = start_n * BLOCK_N
    # the rows of [start_m, end_m) hold every row that sees some key of the tile (key j: rows j - upper to j - lower)
    if UPPER:
        start_m = gl.minimum(gl.maximum(n0 - upper, 0), seqlen_q) // BLOCK_M * BLOCK_M
    else:
        start_m = 0
    if LOWER:
        end_m = gl.maximum(gl.minimum(n0 + BLOCK_N - lower, seqlen_q), 0)
    else:
        end_m = seqlen_q
    num_m = gl.cdiv(gl.maximum(end_m - start_m, 0), BLOCK_M)
    b64, hk64 = off_b.to(gl.int64), off_hk.to(gl.int64)
    dk_base = DK + b64 * stride_dkb + hk64 * stride_dkh
    dv_base = DV + b64 * stride_dvb + hk64 * stride_dvh
    args = (q_desc, k_desc, v_desc, do_desc, dq_desc, k_smem, v_smem, q_bufs, do_bufs, ds_bufs, dq_bufs,
            kv_bar, qdo_bars, n0, start_m, num_m, off_hk * GROUP_SIZE, GROUP_SIZE * num_m,
            hi_desc, delta_desc, hi_bufs, delta_bufs, off_b, off_hk, dk_base, dv_base, stride_dks, stride_dvs,
            seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, sm_scale, HEAD_DIM, p_bufs)  # fmt: skip
    gl.warp_specialize(  # the flags beside args, not in it: a tuple made beforehand holds a constexpr as a plain value
        [
            (_grad_partition_0, (args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS)),
            (_grad_partition_1, (args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS)),
            (_load_partition, (args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS)),
            (_dq_writer_partition, (args, LOWER, UPPER, SOFTCAP, ADD_DKDV, SPLIT_COLS)),
        ],
        [4, 1, 1],
        [240, 24, 24],
    )
