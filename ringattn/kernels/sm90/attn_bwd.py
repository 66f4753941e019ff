"""Backward kernels for triton's warp specialisation on Hopper: the portable dK/dV and dQ kernels without
documents, written so that triton's Hopper partitioner splits them into a TMA producer warpgroup and two consumer
warpgroups, and splits them right.

  _attn_bwd_dkdv_ws_kernel  dK, dV for one 128-key tile, looping over the Q tiles of every q head of its GQA
                            group; grid (Sk tiles, Hkv, B)
  _attn_bwd_dq_ws_kernel    dQ for one Q tile, looping over the key tiles; grid (Sq tiles, Hq, B)

Every tile they load or store goes through a tensor descriptor made in the kernel, so that the producer issues
the loads by TMA. Each product in the loop has the program's own tile as its left operand (the dK/dV kernel's
scores are transposed, Sᵀ = K Qᵀ), so that the partitioner can give each consumer half of its rows. What the
partitioner (triton 3.9) got right and wrong was measured on the H200 (docs/performance.md, "Warp-specialised
dK/dV"): one plain loop with the results stored through descriptors gave attn_bwd's bits; masked pointer stores
of the results, or a causal mask computed from the loop's index, gave wrong gradients; a second loop after the
first, or a loop nest, did not compile. Hence one loop per kernel: GQA's (head, Q tile) pairs are flattened into
it, and the causal mask compares positions loaded from memory like the other row data, on both sides. A position
made as `start + tl.arange(...)` from the program's own tile start is wrong in the second consumer: the
partitioner (triton 3.9) moves both `start` and the range by that consumer's offset, so the sum has it twice (seen
in a causal kernel's TTGIR). P = exp2(s scale - lse2_hi), from the row stats of the portable preprocess: 16-bit
kernels leave lse2_lo unread, as the Gluon backward does (kernels/sm90/attn_bwd_gluon.py says why). ops/sm90.py says
where they are taken.
"""

import triton
import triton.language as tl

from ..portable.attn_bwd import _stats_plane


@triton.jit
def _rows_descriptor(base, seqlen, stride_s, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A tensor descriptor, made in the kernel, of one head's (seqlen, HEAD_DIM) rows from base (row stride
    stride_s) in (BLOCK, HEAD_DIM) tiles: rows past seqlen load as zeros and are not stored."""
    return tl.make_tensor_descriptor(base, shape=[seqlen, HEAD_DIM], strides=[stride_s, 1],
                                     block_shape=[BLOCK, HEAD_DIM])  # fmt: skip


@triton.jit
def _ws_q_tile(q_desc, do_desc, hi_desc, delta_desc, m0, hq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
               GROUPED: tl.constexpr):  # fmt: skip
    """Q, dO (BLOCK_M, HEAD_DIM) and the stats lse2_hi, delta (BLOCK_M,) of the rows from m0 of q head hq
    (GROUPED: descriptors over a batch's heads, Q and dO over its (Sq, Hq x HEAD_DIM) rows, the head at column
    hq x HEAD_DIM; else over one head's rows, hq unused). Rows past Sq load as zeros."""
    if GROUPED:
        q = q_desc.load([m0, hq * HEAD_DIM])
        do = do_desc.load([m0, hq * HEAD_DIM])
        lse2_hi = hi_desc.load([hq, m0]).reshape(BLOCK_M)
        delta = delta_desc.load([hq, m0]).reshape(BLOCK_M)
    else:
        q = q_desc.load([m0, 0])
        do = do_desc.load([m0, 0])
        lse2_hi = hi_desc.load([m0])
        delta = delta_desc.load([m0])
    return q, do, lse2_hi, delta


@triton.jit
def _ws_stats_descriptors(Stats, start, stride_plane, num_heads_q, seqlen_q, BLOCK_M: tl.constexpr,
                          GROUPED: tl.constexpr):  # fmt: skip
    """Descriptors of the row stats lse2_hi and delta (planes 0 and 2, stride_plane apart) from element start:
    GROUPED over a batch's (Hq, Sq) rows in (1, BLOCK_M) blocks, else over one head's Sq in BLOCK_M blocks."""
    if GROUPED:
        hi = tl.make_tensor_descriptor(Stats + start, shape=[num_heads_q, seqlen_q], strides=[seqlen_q, 1],
                                       block_shape=[1, BLOCK_M])
        delta = tl.make_tensor_descriptor(Stats + _stats_plane(stride_plane, 2) + start, shape=[num_heads_q, seqlen_q],
                                          strides=[seqlen_q, 1], block_shape=[1, BLOCK_M])
    else:
        hi = tl.make_tensor_descriptor(Stats + start, shape=[seqlen_q], strides=[1], block_shape=[BLOCK_M])
        delta = tl.make_tensor_descriptor(Stats + _stats_plane(stride_plane, 2) + start, shape=[seqlen_q], strides=[1],
                                          block_shape=[BLOCK_M])
    return hi, delta


@triton.jit
def _attn_bwd_dkdv_ws_tile(dk, dv, k, v, offs_n, q, do, lse2_hi, delta, pos_desc, m0, causal_shift, qk_scale,
                           CAUSAL: tl.constexpr):  # fmt: skip
    """Add the share of the Q tile at row m0 to dK (unscaled) and dV of a key tile (k, v (BLOCK_N, HEAD_DIM), keys
    offs_n).

    Zero rows past Sq add nothing: their P is 1 (stats load as zeros) against zero Q and dOut rows. CAUSAL masks
    key n for row m where n > m + causal_shift, m loaded through pos_desc (the positions); rows that see no key at
    all (lse2_hi +inf) get P = 0.
    """
    st = tl.dot(k, tl.trans(q)) * qk_scale - lse2_hi[None, :]  # (BLOCK_N, BLOCK_M); one FMA a score
    if CAUSAL:  # masked after the FMA (exp2's argument, not P): a mask between the product and the sum splits it
        last_key = pos_desc.load([m0]) + causal_shift
        st = tl.where(offs_n[:, None] <= last_key[None, :], st, float("-inf"))
    pt = tl.math.exp2(st)
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    return tl.dot(dst.to(q.dtype), q, dk), dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # one compile for every length
def _attn_bwd_dkdv_ws_kernel(
    Q, K, V, DOut, Stats, DK, DV, Pos,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, num_heads_k, stride_plane, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """dK, dV (B, Sk, Hkv, HEAD_DIM) for one BLOCK_N tile of keys of one (batch, kv head); grid (Sk tiles, Hkv, B).

    Q, DOut (B, Sq, Hq, HEAD_DIM) and K, V (B, Sk, Hkv, HEAD_DIM): HEAD_DIM a power of two, the base addresses and
    every stride but the last 16-byte aligned (GROUP_SIZE > 1: Q's and DOut's heads packed, stride_qh = stride_doh =
    HEAD_DIM); Stats the row stats (3, B, Hq, Sq) fp32 contiguous (ops/attn.py's attn_bwd_preprocess; planes
    stride_plane apart), Sq a multiple of 4 (each head's row of stats 16-byte aligned); DK, DV like K and V, aligned
    alike, written in their dtype (the ring's shares: fp32). The GROUP_SIZE q heads sharing the kv head are summed
    in registers. CAUSAL (bottom-right): Pos int32 (>= max(Sq, Sk),) holds
    0, 1, 2, ..., and the loop starts at the first Q tile that sees a key of the tile.
    """
    start_n = tl.program_id(0)
    off_hk = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    GROUPED: tl.constexpr = GROUP_SIZE > 1
    num_heads_q = num_heads_k * GROUP_SIZE
    if GROUPED:  # the batch's q heads side by side in each row (stride_qh = stride_doh = HEAD_DIM), by column
        # 2D, not a 3D (BLOCK_M, 1, HEAD_DIM) block reshaped: through the reshape the partitioner lost the products'
        # uses of the tile and released its buffer to the producer before them (seen in the TTGIR)
        q_desc = tl.make_tensor_descriptor(Q + off_b * stride_qb, shape=[seqlen_q, num_heads_q * HEAD_DIM],
                                           strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
        do_desc = tl.make_tensor_descriptor(DOut + off_b * stride_dob, shape=[seqlen_q, num_heads_q * HEAD_DIM],
                                            strides=[stride_dos, 1], block_shape=[BLOCK_M, HEAD_DIM])
    else:  # the one q head's rows
        q_desc = _rows_descriptor(Q + off_b * stride_qb + off_hk * stride_qh, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M)
        do_desc = _rows_descriptor(DOut + off_b * stride_dob + off_hk * stride_doh, seqlen_q, stride_dos, HEAD_DIM,
                                   BLOCK_M)
    k_desc = _rows_descriptor(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N)
    v_desc = _rows_descriptor(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N)
    start = off_b * num_heads_q * seqlen_q if GROUPED else (off_b * num_heads_k + off_hk) * seqlen_q
    hi_desc, delta_desc = _ws_stats_descriptors(Stats, start, stride_plane, num_heads_q, seqlen_q, BLOCK_M, GROUPED)

    n0 = start_n * BLOCK_N
    k = k_desc.load([n0, 0])  # (BLOCK_N, HEAD_DIM); rows past Sk load as zeros
    v = v_desc.load([n0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    causal_shift = seqlen_k - seqlen_q
    if CAUSAL:  # rows before start_m see no key of this tile
        start_m = tl.maximum(n0 - causal_shift, 0) // BLOCK_M * BLOCK_M
        pos_desc = tl.make_tensor_descriptor(Pos, shape=[seqlen_q], strides=[1], block_shape=[BLOCK_M])
        # the keys' positions loaded like K (keys past Sk load as 0; their rows are not stored), not n0 +
        # tl.arange: the partitioner offsets both n0 and the range for the second consumer's keys
        keys_desc = tl.make_tensor_descriptor(Pos, shape=[seqlen_k], strides=[1], block_shape=[BLOCK_N])
        offs_n = keys_desc.load([n0])
    else:
        start_m = 0
        pos_desc = None
        offs_n = None
    if GROUPED:  # one loop over (q head, Q tile) pairs
        num_m = tl.cdiv(tl.maximum(seqlen_q - start_m, 0), BLOCK_M)
        for i in tl.range(0, GROUP_SIZE * num_m, warp_specialize=True):
            # clamped: the pipeline computes the coordinates of the iteration after the last one ahead of time
            g = tl.minimum(i // tl.maximum(num_m, 1), GROUP_SIZE - 1)
            m0 = start_m + (i - g * num_m) * BLOCK_M
            hq = (off_hk * GROUP_SIZE + g).to(tl.int32)
            q, do, lse2_hi, delta = _ws_q_tile(q_desc, do_desc, hi_desc, delta_desc, m0, hq, HEAD_DIM, BLOCK_M, True)
            dk, dv = _attn_bwd_dkdv_ws_tile(dk, dv, k, v, offs_n, q, do, lse2_hi, delta, pos_desc, m0, causal_shift,
                                            qk_scale, CAUSAL)  # fmt: skip
    else:
        for m0 in tl.range(start_m, seqlen_q, BLOCK_M, warp_specialize=True):
            q, do, lse2_hi, delta = _ws_q_tile(q_desc, do_desc, hi_desc, delta_desc, m0, 0, HEAD_DIM, BLOCK_M, False)
            dk, dv = _attn_bwd_dkdv_ws_tile(dk, dv, k, v, offs_n, q, do, lse2_hi, delta, pos_desc, m0, causal_shift,
                                            qk_scale, CAUSAL)  # fmt: skip

    dk_desc = _rows_descriptor(DK + off_b * stride_dkb + off_hk * stride_dkh, seqlen_k, stride_dks, HEAD_DIM, BLOCK_N)
    dv_desc = _rows_descriptor(DV + off_b * stride_dvb + off_hk * stride_dvh, seqlen_k, stride_dvs, HEAD_DIM, BLOCK_N)
    dk_desc.store([n0, 0], (dk * sm_scale).to(DK.dtype.element_ty))  # rows past Sk are not written
    dv_desc.store([n0, 0], dv.to(DV.dtype.element_ty))


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # one compile for every length
def _attn_bwd_dq_ws_kernel(
    Q, K, V, DOut, Stats, DQ, Pos,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    seqlen_q, seqlen_k, num_heads_q, stride_plane, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dQ (B, Sq, Hq, HEAD_DIM) for one BLOCK_M tile of rows of one (batch, q head); grid (Sq tiles, Hq, B).

    Inputs as _attn_bwd_dkdv_ws_kernel's; DQ like Q, aligned alike, in its own dtype (the ring's accumulator:
    fp32); ACCUMULATE adds dQ to what DQ holds. Zero keys past Sk add nothing to dQ (dS K with zero K rows); rows
    that see no key (lse2_hi +inf) get P = 0.
    """
    start_m = tl.program_id(0)
    off_hq = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_hq // GROUP_SIZE).to(tl.int64)
    off_hq = off_hq.to(tl.int64)
    q_desc = _rows_descriptor(Q + off_b * stride_qb + off_hq * stride_qh, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M)
    do_desc = _rows_descriptor(DOut + off_b * stride_dob + off_hq * stride_doh, seqlen_q, stride_dos, HEAD_DIM, BLOCK_M)
    k_desc = _rows_descriptor(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N)
    v_desc = _rows_descriptor(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N)
    hi_desc, delta_desc = _ws_stats_descriptors(Stats, (off_b * num_heads_q + off_hq) * seqlen_q, stride_plane,
                                                num_heads_q, seqlen_q, BLOCK_M, False)

    m0 = start_m * BLOCK_M
    q, do, lse2_hi, delta = _ws_q_tile(q_desc, do_desc, hi_desc, delta_desc, m0, 0, HEAD_DIM, BLOCK_M, False)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    causal_shift = seqlen_k - seqlen_q
    if CAUSAL:  # keys from end_n on are seen by no row of the tile
        # the rows' positions loaded like Q (rows past Sq load as 0 and are not stored), not m0 + tl.arange
        rows_desc = tl.make_tensor_descriptor(Pos, shape=[seqlen_q], strides=[1], block_shape=[BLOCK_M])
        last_key = rows_desc.load([m0]) + causal_shift
        end_n = tl.maximum(tl.minimum(m0 + BLOCK_M + causal_shift, seqlen_k), 0)
        pos_desc = tl.make_tensor_descriptor(Pos, shape=[seqlen_k], strides=[1], block_shape=[BLOCK_N])
    else:
        end_n = seqlen_k
    for n0 in tl.range(0, end_n, BLOCK_N, warp_specialize=True):
        k = k_desc.load([n0, 0])  # (BLOCK_N, HEAD_DIM); rows past Sk load as zeros
        v = v_desc.load([n0, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale - lse2_hi[:, None]  # (BLOCK_M, BLOCK_N); one FMA a score
        if CAUSAL:  # masked after the FMA, as in the dK/dV tile
            s = tl.where(pos_desc.load([n0])[None, :] <= last_key[:, None], s, float("-inf"))
        p = tl.math.exp2(s)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)

    dq_desc = _rows_descriptor(DQ + off_b * stride_dqb + off_hq * stride_dqh, seqlen_q, stride_dqs, HEAD_DIM, BLOCK_M)
    dq = dq * sm_scale
    if ACCUMULATE:
        dq += dq_desc.load([m0, 0])
    dq_desc.store([m0, 0], dq.to(DQ.dtype.element_ty))  # rows past Sq are not written
