"""Forward attention kernel: exp2 online softmax over K/V tiles (FlashAttention-2 scheme).

One program computes one (BLOCK_M, HEAD_DIM) tile of the output for one (batch, q head). The key loop runs in three
stages: the tiles that need the window's lower-edge mask, the tiles that every row of the Q tile may fully see (no mask
at all), then the tiles that need the causal (upper-edge) or the sequence-end mask. Tiles wholly outside the band a row
sees (above the causal diagonal, before a sliding window) are never visited. SOFTCAP caps the scores with tanh. With
document ids (HAS_DOCS, packed variable-length sequences) a query row sees only keys of its own document: every tile is
masked, and tiles whose documents do not meet the Q tile's are skipped. With MERGE_STATE the tile's result is merged
into a running (out fp32, lse float64) state in place (the ring's step), in the epilogue, so a ring step needs no
separate merge pass. With HAS_FINAL_ROWS the rows the ring finishes in this call are written rounded to the output
dtype, not to the fp32 state. See docs/design.md.
"""

import triton
import triton.language as tl

from ..merge import _merge_into_state, _row_lse
from .common import (
    _capped,
    _doc_span,
    _key_range,
    _key_tile_visible,
    _load_kv_tile,
    _load_kv_tile_tma,
    _online_softmax_step,
    _q_tile_docs,
    _store_rows,
)


@triton.jit
def _attn_fwd_tile(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, kv_coords,
    offs_m, offs_d, mask_d, n0, seqlen_k, lower, upper, qk_scale, cap_scale, q_doc, KDoc,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, KV_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) by the key tile starting at n0.

    MASKED tiles mask keys past seqlen_k, (LOWER) keys before row + lower, (UPPER) keys after row + upper and
    (DOCS) keys of other documents with -inf; rows whose keys are all masked keep m_i = -inf and gain nothing.
    KV_TMA: k_base, v_base are tensor descriptors of K and V and kv_coords their (batch, head).
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if KV_TMA:
        k, v = _load_kv_tile_tma(k_base, v_base, kv_coords, n0, BLOCK_N, offs_d.shape[0])
    else:
        k, v = _load_kv_tile(k_base, v_base, stride_kn, stride_vn, offs_n, offs_d, mask_d, seqlen_k, MASKED)
    # (BLOCK_M, BLOCK_N) scores, tanh-capped with SOFTCAP
    s = _capped(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), cap_scale, SOFTCAP, APPROX_TANH)
    if MASKED:
        visible = _key_tile_visible(offs_m, offs_n, seqlen_k, lower, upper, q_doc, KDoc, LOWER, UPPER, DOCS)
        s = tl.where(visible, s, float("-inf"))
    return _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, MASKED, DOT_PRECISION)


@triton.jit
def _attn_fwd_tiles(
    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, kv_coords,
    offs_m, offs_d, mask_d, start_n, end_n, seqlen_k, lower, upper, qk_scale, cap_scale,
    q_doc, q_doc_first, q_doc_last, KDoc,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, KV_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Key tiles [start_n, end_n); DOCS skips tiles whose document span misses [q_doc_first, q_doc_last]."""
    for n0 in range(start_n, end_n, BLOCK_N):
        if DOCS:
            k_doc_first, k_doc_last = _doc_span(KDoc, n0, seqlen_k, BLOCK_N)
            if (k_doc_last >= q_doc_first) & (k_doc_first <= q_doc_last):
                acc, l_i, m_i = _attn_fwd_tile(
                    acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, kv_coords, offs_m, offs_d, mask_d, n0,
                    seqlen_k, lower, upper, qk_scale, cap_scale, q_doc, KDoc, BLOCK_N, MASKED, LOWER, UPPER, DOCS,
                    SOFTCAP, APPROX_TANH, KV_TMA, DOT_PRECISION,
                )
        else:
            acc, l_i, m_i = _attn_fwd_tile(
                acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, kv_coords, offs_m, offs_d, mask_d, n0,
                seqlen_k, lower, upper, qk_scale, cap_scale, q_doc, KDoc, BLOCK_N, MASKED, LOWER, UPPER, DOCS,
                SOFTCAP, APPROX_TANH, KV_TMA, DOT_PRECISION,
            )
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "final_lo", "final_hi"])  # one compile for every length
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, QDoc, KDoc, Final,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    stride_fb, stride_fs, stride_fh,
    stride_qdb, stride_kdb,
    seqlen_q, seqlen_k, lower, upper, qk_scale, cap_scale, final_lo, final_hi,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWER: tl.constexpr, UPPER: tl.constexpr, SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, HAS_DOCS: tl.constexpr,
    MERGE_STATE: tl.constexpr, HAS_FINAL_ROWS: tl.constexpr, KV_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Out[b, m, h] = softmax(Q K^T * scale) V for one Q tile; Lse[b, h, m] in natural log.

    Shapes: Q (B, Sq, Hq, HEAD_DIM), K and V (B, Sk, Hq // GROUP_SIZE, HEAD_DIM), Out like Q,
    Lse (B, Hq, Sq) float64 with a contiguous last dim. qk_scale = softmax_scale * log2(e), or with SOFTCAP
    softcap * log2(e), the scores then being tanh(q k^T * cap_scale), cap_scale = softmax_scale / softcap.
    Grid (Sq tiles, Hq, B).
    MERGE_STATE: Out (fp32) and Lse hold a running state on entry; the tile's result is merged into it.
    HAS_FINAL_ROWS: rows [final_lo, final_hi) of the result go to Final (shaped like Out, its own dtype), rounded,
    and not to Out, whose rows there are left as they were; Lse is written for every row.
    Row i sees keys j with (LOWER) i + lower <= j and (UPPER) j <= i + upper: causal is UPPER with upper =
    Sk - Sq (bottom-right), a sliding window (left, right) lower = Sk - Sq - left, upper = Sk - Sq + right.
    HAS_DOCS: QDoc (B, Sq) and KDoc (B, Sk) int32 document ids with batch strides stride_qdb, stride_kdb (0: one
    row of ids for every batch row) and contiguous rows, non-decreasing along each row; row i of batch b sees key j
    only if QDoc[b, i] == KDoc[b, j].
    KV_TMA: K and V are tensor descriptors of the (B, Sk, Hkv, HEAD_DIM) tensors with block
    (1, BLOCK_N, 1, HEAD_DIM) (HEAD_DIM == BLOCK_D): tiles load by TMA, rows past Sk as zeros.
    """
    start_m = tl.program_id(0)
    off_hq = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_hq // GROUP_SIZE).to(tl.int64)
    off_hq = off_hq.to(tl.int64)
    if HAS_DOCS:  # this batch row's document ids
        QDoc += off_b * stride_qdb
        KDoc += off_b * stride_kdb

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < seqlen_q
    row_mask = mask_m[:, None] & mask_d[None, :]

    q_ptrs = Q + off_b * stride_qb + off_hq * stride_qh + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)
    if KV_TMA:
        k_base, v_base = K, V
    else:
        k_base = K + off_b * stride_kb + off_hk * stride_kh
        v_base = V + off_b * stride_vb + off_hk * stride_vh
    kv_coords = (off_b.to(tl.int32), off_hk.to(tl.int32))

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    start_n, full_start, full_end, end_n = _key_range(start_m, seqlen_k, lower, upper, BLOCK_M, BLOCK_N, LOWER, UPPER)
    q_doc, q_doc_first, q_doc_last = _q_tile_docs(QDoc, offs_m, start_m, seqlen_q, BLOCK_M, HAS_DOCS)
    if HAS_DOCS:  # any tile may cross a document boundary: all in the last, masked stage
        full_start = start_n
        full_end = start_n

    if LOWER:
        acc, l_i, m_i = _attn_fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kv_coords, offs_m, offs_d, mask_d,
            start_n, tl.minimum(full_start, end_n), seqlen_k, lower, upper, qk_scale, cap_scale,
            q_doc, q_doc_first, q_doc_last, KDoc, BLOCK_N, True, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, KV_TMA,
            DOT_PRECISION,
        )
    acc, l_i, m_i = _attn_fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kv_coords, offs_m, offs_d, mask_d,
        full_start, full_end, seqlen_k, lower, upper, qk_scale, cap_scale, q_doc, q_doc_first, q_doc_last, KDoc,
        BLOCK_N, False, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, KV_TMA, DOT_PRECISION,
    )
    acc, l_i, m_i = _attn_fwd_tiles(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kv_coords, offs_m, offs_d, mask_d,
        tl.maximum(full_start, full_end), end_n, seqlen_k, lower, upper, qk_scale, cap_scale,
        q_doc, q_doc_first, q_doc_last, KDoc, BLOCK_N, True, LOWER, UPPER, HAS_DOCS, SOFTCAP, APPROX_TANH, KV_TMA,
        DOT_PRECISION,
    )

    lse, l_safe = _row_lse(m_i, l_i)  # every key masked: output 0, lse -inf
    out = acc / l_safe[:, None]

    o_ptrs = Out + off_b * stride_ob + off_hq * stride_oh + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :]
    lse_ptrs = Lse + off_b * stride_lb + off_hq * stride_lh + offs_m
    if MERGE_STATE:
        out, lse = _merge_into_state(out, lse, o_ptrs, lse_ptrs, row_mask, mask_m)
    _store_rows(out, o_ptrs, row_mask, offs_m, offs_d, Final, off_b, off_hq, stride_fb, stride_fs, stride_fh,
                final_lo, final_hi, HAS_FINAL_ROWS)  # fmt: skip
    tl.store(lse_ptrs, lse, mask=mask_m)
