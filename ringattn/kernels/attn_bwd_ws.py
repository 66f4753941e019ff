"""Backward dK/dV kernel for triton's warp specialisation on Hopper (triton 3.9): the gradients of
attn_bwd._attn_bwd_dkdv_kernel without a mask (not causal, no documents) for one q head per kv head (MHA),
written so that triton's Hopper partitioner splits it, and splits it right.

One program computes dK, dV for one BLOCK_N tile of keys of one (batch, head), looping over the Q tiles. Every
tile it loads or stores goes through a tensor descriptor made in the kernel for its (batch, head), so that a
producer warpgroup issues the loads by TMA, and the scores are transposed (Sᵀ = K Qᵀ, (BLOCK_N, BLOCK_M)), so that
every product in the loop has the key tile as its left operand and the partitioner can split the tile's keys
between two consumer warpgroups. What the partitioner (triton 3.9) got right and wrong was measured on the H200
(docs/performance.md, "Warp-specialised dK/dV"): this form, one plain loop with the results stored through
descriptors, gave attn_bwd's bits. The same loop with masked pointer stores of the results, or with a causal
mask in it, gave wrong gradients; a second loop after it or a loop nest around it (causal stages, GQA's heads)
did not compile. So it covers what it covers, and ops/warp_spec.py sends everything else to attn_bwd's kernel.
"""

import triton
import triton.language as tl

from .common import LOG2E


@triton.jit
def _attn_bwd_dkdv_ws_tile(dk, dv, k, v, q_desc, do_desc, lse_desc, delta_desc, m0, qk_scale):
    """Add the Q tile at m0's share to dK (unscaled) and dV of one key tile (k, v (BLOCK_N, HEAD_DIM)).

    Rows past Sq load as zeros, stats too: their P is 1 against zero Q and dOut rows, so they add nothing.
    """
    q = q_desc.load([m0, 0])  # (BLOCK_M, HEAD_DIM)
    do = do_desc.load([m0, 0])
    lse2 = lse_desc.load([m0]) * LOG2E
    delta = delta_desc.load([m0])
    st = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M)
    pt = tl.math.exp2(st - lse2[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    return tl.dot(dst.to(q.dtype), q, dk), dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # one compile for every length
def _attn_bwd_dkdv_ws_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    seqlen_q, seqlen_k, num_heads, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK, dV (B, Sk, H, HEAD_DIM) for one BLOCK_N tile of keys of one (batch, head); grid (Sk tiles, H, B).

    Q, DOut (B, Sq, H, HEAD_DIM) and K, V (B, Sk, H, HEAD_DIM): HEAD_DIM a power of two, the base addresses and
    every stride but the last 16-byte aligned; Lse, Delta (B, H, Sq) fp32 contiguous, Sq a multiple of 4 (each
    head's row of stats 16-byte aligned); DK, DV like K and V, aligned alike. dK and dV are stored in DK's and
    DV's dtype (the ring's shares: fp32).
    """
    start_n = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    q_desc = tl.make_tensor_descriptor(Q + off_b * stride_qb + off_h * stride_qh, shape=[seqlen_q, HEAD_DIM],
                                       strides=[stride_qs, 1], block_shape=[BLOCK_M, HEAD_DIM])
    do_desc = tl.make_tensor_descriptor(DOut + off_b * stride_dob + off_h * stride_doh, shape=[seqlen_q, HEAD_DIM],
                                        strides=[stride_dos, 1], block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off_b * stride_kb + off_h * stride_kh, shape=[seqlen_k, HEAD_DIM],
                                       strides=[stride_ks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off_b * stride_vb + off_h * stride_vh, shape=[seqlen_k, HEAD_DIM],
                                       strides=[stride_vs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    row = (off_b * num_heads + off_h) * seqlen_q
    lse_desc = tl.make_tensor_descriptor(Lse + row, shape=[seqlen_q], strides=[1], block_shape=[BLOCK_M])
    delta_desc = tl.make_tensor_descriptor(Delta + row, shape=[seqlen_q], strides=[1], block_shape=[BLOCK_M])

    n0 = start_n * BLOCK_N
    k = k_desc.load([n0, 0])  # (BLOCK_N, HEAD_DIM); rows past Sk load as zeros
    v = v_desc.load([n0, 0])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    for m0 in tl.range(0, seqlen_q, BLOCK_M, warp_specialize=True):
        dk, dv = _attn_bwd_dkdv_ws_tile(dk, dv, k, v, q_desc, do_desc, lse_desc, delta_desc, m0, qk_scale)

    dk_desc = tl.make_tensor_descriptor(DK + off_b * stride_dkb + off_h * stride_dkh, shape=[seqlen_k, HEAD_DIM],
                                        strides=[stride_dks, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dv_desc = tl.make_tensor_descriptor(DV + off_b * stride_dvb + off_h * stride_dvh, shape=[seqlen_k, HEAD_DIM],
                                        strides=[stride_dvs, 1], block_shape=[BLOCK_N, HEAD_DIM])
    dk_desc.store([n0, 0], (dk * sm_scale).to(DK.dtype.element_ty))  # rows past Sk are not written
    dv_desc.store([n0, 0], dv.to(DV.dtype.element_ty))
