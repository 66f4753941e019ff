"""Forward attention kernel for triton's warp specialisation on Hopper (triton 3.9): attn_fwd's kernel without
documents or finished rows, in the form kernels/attn_bwd_ws.py's docstring explains (one loop, every tile loaded
and every result stored through descriptors made in the kernel, masks against positions loaded from memory).

One program computes one (BLOCK_M, HEAD_DIM) tile of the output for one (batch, q head), looping over the key
tiles; the partitioner gives each of two consumer warpgroups half of its rows. Keys past Sk would load as zero rows
and count in the softmax's sum, so where Sk is not a multiple of BLOCK_N (and always when causal) every tile is
masked by key positions loaded from Pos, an int32 0, 1, 2, ... long enough that no tile reads past its end; the
causal mask's row positions are loaded from it too.
ops/warp_spec.py says when it is taken.
"""

import triton
import triton.language as tl

from .common import LN2, _online_softmax_step, _rows_descriptor
from .merge import _merge_states


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_positions"])  # one compile for every length
def _attn_fwd_ws_kernel(
    Q, K, V, Out, Lse, Pos,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seqlen_q, seqlen_k, num_positions, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr, MASK_KEYS: tl.constexpr, MERGE_STATE: tl.constexpr,
):
    """Out[b, m, h] = softmax(Q K^T * scale) V for one Q tile and Lse[b, h, m] in natural log; grid (Sq tiles, Hq, B).

    Q (B, Sq, Hq, HEAD_DIM), K and V (B, Sk, Hq // GROUP_SIZE, HEAD_DIM), Out like Q in its own dtype: HEAD_DIM a
    power of two, base addresses and every stride but the last 16-byte aligned; Lse (B, Hq, Sq) fp32 with a
    contiguous last dim, its rows 16-byte aligned. qk_scale = softmax_scale * log2(e). CAUSAL (bottom-right: row i
    sees keys j <= i + Sk - Sq) and MASK_KEYS (Sk not a multiple of BLOCK_N, or CAUSAL): Pos holds num_positions
    >= cdiv(Sk, BLOCK_N) * BLOCK_N positions (and >= Sq: the rows' too). MERGE_STATE: Out (fp32) and Lse hold a
    running state on entry, and the tile's result is merged into it (the ring's step). Rows that see no key get
    out 0, lse -inf.
    """
    start_m = tl.program_id(0)
    off_hq = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_hq // GROUP_SIZE).to(tl.int64)
    off_hq = off_hq.to(tl.int64)
    q_desc = _rows_descriptor(Q + off_b * stride_qb + off_hq * stride_qh, seqlen_q, stride_qs, HEAD_DIM, BLOCK_M)
    k_desc = _rows_descriptor(K + off_b * stride_kb + off_hk * stride_kh, seqlen_k, stride_ks, HEAD_DIM, BLOCK_N)
    v_desc = _rows_descriptor(V + off_b * stride_vb + off_hk * stride_vh, seqlen_k, stride_vs, HEAD_DIM, BLOCK_N)

    m0 = start_m * BLOCK_M
    q = q_desc.load([m0, 0])  # rows past Sq load as zeros and are not stored
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    causal_shift = seqlen_k - seqlen_q
    if MASK_KEYS:
        pos_desc = tl.make_tensor_descriptor(Pos, shape=[num_positions], strides=[1], block_shape=[BLOCK_N])
    if CAUSAL:  # keys from end_n on are seen by no row of the tile
        # the rows' positions loaded like Q, not m0 + tl.arange: the partitioner offsets both m0 and the range for
        # the second consumer's rows, so the sum would count its offset twice
        rows_desc = tl.make_tensor_descriptor(Pos, shape=[num_positions], strides=[1], block_shape=[BLOCK_M])
        last_key = rows_desc.load([m0]) + causal_shift
        end_n = tl.maximum(tl.minimum(m0 + BLOCK_M + causal_shift, seqlen_k), 0)
    else:
        end_n = seqlen_k
    for n0 in tl.range(0, end_n, BLOCK_N, warp_specialize=True):
        k = k_desc.load([n0, 0])
        v = v_desc.load([n0, 0])
        s = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N), unscaled
        if MASK_KEYS:
            key = pos_desc.load([n0])
            visible = key[None, :] < seqlen_k
            if CAUSAL:
                visible = visible & (key[None, :] <= last_key[:, None])
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, MASK_KEYS, "tf32")  # 16-bit: ignored

    empty = l_i == 0.0  # every key masked: output 0, lse -inf
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    o_desc = _rows_descriptor(Out + off_b * stride_ob + off_hq * stride_oh, seqlen_q, stride_os, HEAD_DIM, BLOCK_M)
    lse_desc = tl.make_tensor_descriptor(Lse + off_b * stride_lb + off_hq * stride_lh, shape=[seqlen_q], strides=[1],
                                         block_shape=[BLOCK_M])
    if MERGE_STATE:
        out, lse = _merge_states(out, lse, o_desc.load([m0, 0]), lse_desc.load([m0]))
    o_desc.store([m0, 0], out.to(Out.dtype.element_ty))
    lse_desc.store([m0], lse)
