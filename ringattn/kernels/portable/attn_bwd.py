"""Backward attention kernels (FlashAttention-2 scheme): P is recomputed from (Q, K, lse).

Three launches, no atomics:
  _attn_bwd_preprocess_kernel  the row stats: lse in log2 units as an      grid (Sq tiles, Hq, B)
                               fp32 pair, delta = rowsum(dOut * Out)
  _attn_bwd_dkdv_kernel        dK, dV for one K/V tile, looping over Q      grid (Sk tiles, Hkv, B)
                               tiles of every q head of its GQA group
  _attn_bwd_dq_kernel          dQ for one Q tile, looping over K/V tiles    grid (Sq tiles, Hq, B)
With ACCUMULATE the gradients are added to what the output buffers hold (the ring's fp32
accumulators); with HAS_FINAL_ROWS the dQ rows the ring finishes go rounded to their own buffer.
P = exp2((s * scale - lse2_hi) - lse2_lo): the row's normaliser lse * log2(e) (from the forward's float64 lse)
split into fp32 hi + lo, so that P is as exact as fp32 scores allow at any |lse| (one fp32 lse would carry half
an ulp of |lse|: 2.4e-4 at 4096). 16-bit inputs leave lse2_lo unread (LSE_LO false), as the Hopper kernels do
(kernels/sm90/attn_bwd_gluon.py says why): one add a score less. Rows whose lse is -inf (every key masked) get
lse2_hi = +inf: P = 0 everywhere, so they give zero gradients. HAS_DOCS masks pairs of different documents and
skips tiles whose documents do not meet, LOWER and UPPER mask a sliding window's (or causal's) edges and skip tiles
outside it, as in the forward; with SOFTCAP, dS gains tanh's derivative 1 - t^2. Derivation in docs/design.md.
"""

import triton
import triton.language as tl

from ..merge import LOG2E_F64
from .common import (
    _capped,
    _doc_span,
    _key_range,
    _key_tile_visible,
    _load_kv_tile,
    _q_tile_docs,
    _store_rows,
)


@triton.jit
def _stats_plane(stride_stat, plane: tl.constexpr):
    """The offset of row-stats plane `plane` (0 lse2_hi, 1 lse2_lo, 2 delta), planes stride_stat elements apart, in
    64 bits: triton passes a stride under 2^31 in 32, which would wrap at plane 2 from B Hq Sq = 2^30 on."""
    return plane * stride_stat.to(tl.int64)


@triton.jit(do_not_specialize=["seqlen_q", "stride_stat"])  # one compile for every length
def _attn_bwd_preprocess_kernel(
    Out, DOut, Lse, Stats,
    stride_ob, stride_os, stride_oh,
    stride_dob, stride_dos, stride_doh,
    seqlen_q, num_heads_q, stride_stat,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """The backward's row stats, Stats (3, B, Hq, Sq) fp32 contiguous (planes stride_stat = B Hq Sq apart), from
    Lse (B, Hq, Sq) float64 contiguous: [0] lse2_hi = lse * log2(e) rounded to fp32 (+inf where lse is -inf),
    [1] lse2_lo = the rest (0 there), [2] delta[b, h, m] = sum_d Out[b, m, h, d] * DOut[b, m, h, d] in fp32."""
    start_m = tl.program_id(0)
    off_h = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + rows * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + off_b * stride_dob + off_h * stride_doh + rows * stride_dos + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    mask_m = offs_m < seqlen_q
    row = (off_b * num_heads_q + off_h) * seqlen_q + offs_m
    lse2 = tl.load(Lse + row, mask=mask_m, other=0.0) * LOG2E_F64
    hi = lse2.to(tl.float32)
    lo = tl.where(lse2 == float("-inf"), 0.0, (lse2 - hi.to(tl.float64)).to(tl.float32))
    tl.store(Stats + row, tl.where(lse2 == float("-inf"), float("inf"), hi), mask=mask_m)
    tl.store(Stats + _stats_plane(stride_stat, 1) + row, lo, mask=mask_m)
    tl.store(Stats + _stats_plane(stride_stat, 2) + row, delta, mask=mask_m)


@triton.jit
def _load_row_stats(stats_base, stride_stat, offs_m, seqlen_q, LSE_LO: tl.constexpr):
    """(lse2_hi, lse2_lo, delta) of rows offs_m from the row stats at stats_base (planes stride_stat apart); rows
    past seqlen_q get lse2_hi = +inf (P = 0). Without LSE_LO, lse2_lo is zeros, not loaded (and not used)."""
    mask_m = offs_m < seqlen_q
    lse2_hi = tl.load(stats_base + offs_m, mask=mask_m, other=float("inf"))
    if LSE_LO:
        lse2_lo = tl.load(stats_base + _stats_plane(stride_stat, 1) + offs_m, mask=mask_m, other=0.0)
    else:
        lse2_lo = tl.zeros_like(lse2_hi)
    delta = tl.load(stats_base + _stats_plane(stride_stat, 2) + offs_m, mask=mask_m, other=0.0)
    return lse2_hi, lse2_lo, delta


@triton.jit
def _attn_bwd_dkdv_tile(
    dk, dv, k, v, k_doc, q_base, do_base, stats_base, stride_stat, QDoc, stride_qm, stride_dom,
    offs_n, offs_d, mask_d, m0, seqlen_q, lower, upper, qk_scale, cap_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, LSE_LO: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Add the Q tile at m0's share to dK (unscaled) and dV of one K/V tile.

    MASKED zeroes P where key offs_n comes before row + lower (LOWER) or after row + upper (UPPER); DOCS where
    documents differ.
    """
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_mask = (offs_m[:, None] < seqlen_q) & mask_d[None, :]
    rows = offs_m[:, None].to(tl.int64)
    q = tl.load(q_base + rows * stride_qm + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(do_base + rows * stride_dom + offs_d[None, :], mask=row_mask, other=0.0)
    lse2_hi, lse2_lo, delta = _load_row_stats(stats_base, stride_stat, offs_m, seqlen_q, LSE_LO)
    # (BLOCK_M, BLOCK_N) scores, tanh-capped with SOFTCAP
    t = _capped(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), cap_scale, SOFTCAP, APPROX_TANH)
    x = t * qk_scale - lse2_hi[:, None]  # one FMA a score
    if MASKED:  # mask the exponents, not P: exp2 of a masked score past fp32's range would be inf
        if LOWER:
            x = tl.where(offs_n[None, :] >= offs_m[:, None] + lower, x, float("-inf"))
        if UPPER:
            x = tl.where(offs_n[None, :] <= offs_m[:, None] + upper, x, float("-inf"))
    if DOCS:
        q_doc = tl.load(QDoc + offs_m, mask=offs_m < seqlen_q, other=-1)
        x = tl.where(q_doc[:, None] == k_doc[None, :], x, float("-inf"))
    if LSE_LO:
        x = x - lse2_lo[:, None]
    p = tl.math.exp2(x)  # masked: exp2(-inf) = 0
    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_tiles(
    dk, dv, k, v, k_doc, k_doc_first, k_doc_last, q_base, do_base, stats_base, stride_stat, QDoc,
    stride_qm, stride_dom, offs_n, offs_d, mask_d, start_m, end_m, seqlen_q, lower, upper, qk_scale, cap_scale,
    BLOCK_M: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, LSE_LO: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Q tiles [start_m, end_m); DOCS skips tiles whose document span misses [k_doc_first, k_doc_last]."""
    for m0 in range(start_m, end_m, BLOCK_M):
        if DOCS:
            q_doc_first, q_doc_last = _doc_span(QDoc, m0, seqlen_q, BLOCK_M)
            if (q_doc_last >= k_doc_first) & (q_doc_first <= k_doc_last):
                dk, dv = _attn_bwd_dkdv_tile(
                    dk, dv, k, v, k_doc, q_base, do_base, stats_base, stride_stat, QDoc, stride_qm, stride_dom,
                    offs_n, offs_d, mask_d, m0, seqlen_q, lower, upper, qk_scale, cap_scale,
                    BLOCK_M, MASKED, LOWER, UPPER, DOCS, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
                )
        else:
            dk, dv = _attn_bwd_dkdv_tile(
                dk, dv, k, v, k_doc, q_base, do_base, stats_base, stride_stat, QDoc, stride_qm, stride_dom,
                offs_n, offs_d, mask_d, m0, seqlen_q, lower, upper, qk_scale, cap_scale,
                BLOCK_M, MASKED, LOWER, UPPER, DOCS, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
            )
    return dk, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])  # one compile for every length
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Stats, DK, DV, QDoc, KDoc,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_qdb, stride_kdb,
    seqlen_q, seqlen_k, num_heads_k, stride_stat, lower, upper, qk_scale, cap_scale, sm_scale,
    GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOWER: tl.constexpr, UPPER: tl.constexpr, SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, HAS_DOCS: tl.constexpr,
    ACCUMULATE: tl.constexpr, LSE_LO: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """dK, dV (B, Sk, Hkv, HEAD_DIM) for one BLOCK_N tile of keys of one (batch, kv head).

    Q, DOut (B, Sq, Hq, HEAD_DIM); Stats (3, B, Hq, Sq) the row stats (_attn_bwd_preprocess_kernel; planes
    stride_stat apart). The GROUP_SIZE q heads that
    share this kv head are summed in registers, so no two programs write the same rows.
    lower, upper, LOWER, UPPER, qk_scale, cap_scale, SOFTCAP, APPROX_TANH, and QDoc, KDoc, stride_qdb, stride_kdb,
    HAS_DOCS: as in the forward kernel.
    """
    start_n = tl.program_id(0)
    off_hk = tl.program_id(1).to(tl.int64)
    off_b = tl.program_id(2).to(tl.int64)
    num_heads_q = num_heads_k * GROUP_SIZE
    if HAS_DOCS:  # this batch row's document ids
        QDoc += off_b * stride_qdb
        KDoc += off_b * stride_kdb

    n0 = start_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    kv_mask = (offs_n[:, None] < seqlen_k) & mask_d[None, :]
    cols = offs_n[:, None].to(tl.int64)
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh + cols * stride_ks + offs_d[None, :]
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh + cols * stride_vs + offs_d[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # row i sees key j iff i >= j - upper (UPPER) and i <= j - lower (LOWER): rows before start_m and from end_m on
    # see no key of this tile, the Q tiles of [full_start, full_end) all of it
    if UPPER:
        start_m = tl.minimum(tl.maximum(n0 - upper, 0), seqlen_q) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.minimum(tl.maximum(n0 + BLOCK_N - 1 - upper, 0), seqlen_q), BLOCK_M) * BLOCK_M
    else:
        start_m = 0
        full_start = 0
    if LOWER:
        end_m = tl.minimum(tl.maximum(n0 + BLOCK_N - lower, 0), seqlen_q)
        full_end = tl.minimum(tl.maximum(n0 - lower + 1, 0), seqlen_q) // BLOCK_M * BLOCK_M
    else:
        end_m = seqlen_q
        full_end = seqlen_q
    if HAS_DOCS:  # any tile may cross a document boundary: all in the last, masked stage
        full_start = start_m
        full_end = start_m
        k_doc = tl.load(KDoc + offs_n, mask=offs_n < seqlen_k, other=-2)
        k_doc_first, k_doc_last = _doc_span(KDoc, n0, seqlen_k, BLOCK_N)
    else:
        k_doc = offs_n
        k_doc_first = 0
        k_doc_last = 0

    for g in range(GROUP_SIZE):
        off_hq = off_hk * GROUP_SIZE + g
        q_base = Q + off_b * stride_qb + off_hq * stride_qh
        do_base = DOut + off_b * stride_dob + off_hq * stride_doh
        row_offset = (off_b * num_heads_q + off_hq) * seqlen_q
        stats_base = Stats + row_offset
        if UPPER:
            dk, dv = _attn_bwd_dkdv_tiles(
                dk, dv, k, v, k_doc, k_doc_first, k_doc_last, q_base, do_base, stats_base, stride_stat, QDoc,
                stride_qs, stride_dos, offs_n, offs_d, mask_d, start_m, tl.minimum(full_start, end_m), seqlen_q,
                lower, upper, qk_scale, cap_scale, BLOCK_M, True, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, LSE_LO,
                DOT_PRECISION,
            )
        dk, dv = _attn_bwd_dkdv_tiles(
            dk, dv, k, v, k_doc, k_doc_first, k_doc_last, q_base, do_base, stats_base, stride_stat, QDoc,
            stride_qs, stride_dos, offs_n, offs_d, mask_d, full_start, full_end, seqlen_q,
            lower, upper, qk_scale, cap_scale, BLOCK_M, False, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, LSE_LO,
            DOT_PRECISION,
        )
        dk, dv = _attn_bwd_dkdv_tiles(
            dk, dv, k, v, k_doc, k_doc_first, k_doc_last, q_base, do_base, stats_base, stride_stat, QDoc,
            stride_qs, stride_dos, offs_n, offs_d, mask_d, tl.maximum(full_start, full_end), end_m, seqlen_q,
            lower, upper, qk_scale, cap_scale, BLOCK_M, True, LOWER, UPPER, HAS_DOCS, SOFTCAP, APPROX_TANH, LSE_LO,
            DOT_PRECISION,
        )

    dk = dk * sm_scale
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh + cols * stride_dks + offs_d[None, :]
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh + cols * stride_dvs + offs_d[None, :]
    if ACCUMULATE:
        dk += tl.load(dk_ptrs, mask=kv_mask, other=0.0)
        dv += tl.load(dv_ptrs, mask=kv_mask, other=0.0)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _attn_bwd_dq_tile(
    dq, q, do, lse2_hi, lse2_lo, delta, q_doc, k_base, v_base, KDoc, stride_kn, stride_vn,
    offs_m, offs_d, mask_d, n0, seqlen_k, lower, upper, qk_scale, cap_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, LSE_LO: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Add the key tile at n0's share to dQ (unscaled) of one Q tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(k_base, v_base, stride_kn, stride_vn, offs_n, offs_d, mask_d, seqlen_k, MASKED)
    t = _capped(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), cap_scale, SOFTCAP, APPROX_TANH)
    x = t * qk_scale - lse2_hi[:, None]  # one FMA a score
    if MASKED:  # mask the exponents, not P (as in the dK/dV kernel)
        visible = _key_tile_visible(offs_m, offs_n, seqlen_k, lower, upper, q_doc, KDoc, LOWER, UPPER, DOCS)
        x = tl.where(visible, x, float("-inf"))
    if LSE_LO:
        x = x - lse2_lo[:, None]
    p = tl.math.exp2(x)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


@triton.jit
def _attn_bwd_dq_tiles(
    dq, q, do, lse2_hi, lse2_lo, delta, q_doc, q_doc_first, q_doc_last, k_base, v_base, KDoc, stride_kn,
    stride_vn, offs_m, offs_d, mask_d, start_n, end_n, seqlen_k, lower, upper, qk_scale, cap_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, DOCS: tl.constexpr,
    SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr, LSE_LO: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Key tiles [start_n, end_n); DOCS skips tiles whose document span misses [q_doc_first, q_doc_last]."""
    for n0 in range(start_n, end_n, BLOCK_N):
        if DOCS:
            k_doc_first, k_doc_last = _doc_span(KDoc, n0, seqlen_k, BLOCK_N)
            if (k_doc_last >= q_doc_first) & (k_doc_first <= q_doc_last):
                dq = _attn_bwd_dq_tile(
                    dq, q, do, lse2_hi, lse2_lo, delta, q_doc, k_base, v_base, KDoc, stride_kn, stride_vn, offs_m,
                    offs_d, mask_d, n0, seqlen_k, lower, upper, qk_scale, cap_scale, BLOCK_N, MASKED, LOWER, UPPER,
                    DOCS, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
                )
        else:
            dq = _attn_bwd_dq_tile(
                dq, q, do, lse2_hi, lse2_lo, delta, q_doc, k_base, v_base, KDoc, stride_kn, stride_vn, offs_m, offs_d,
                mask_d, n0, seqlen_k, lower, upper, qk_scale, cap_scale, BLOCK_N, MASKED, LOWER, UPPER, DOCS,
                SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
            )
    return dq


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "final_lo", "final_hi"])  # one compile for every length
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Stats, DQ, QDoc, KDoc, DQFinal, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
    stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh, stride_dqb, stride_dqs, stride_dqh,
    stride_fb, stride_fs, stride_fh, seqlen_q, seqlen_k, num_heads_q, stride_stat, lower, upper, qk_scale, cap_scale,
    sm_scale, stride_qdb, stride_kdb,
    final_lo, final_hi, GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOWER: tl.constexpr, UPPER: tl.constexpr, SOFTCAP: tl.constexpr,
    APPROX_TANH: tl.constexpr,
    HAS_DOCS: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_FINAL_ROWS: tl.constexpr, LSE_LO: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ (B, Sq, Hq, HEAD_DIM) for one BLOCK_M tile of rows of one (batch, q head).

    HAS_FINAL_ROWS: rows [final_lo, final_hi) of dQ (after the ACCUMULATE add) go to DQFinal (shaped like DQ, its own
    dtype), rounded, and not to DQ, whose rows there are left as they were. lower, upper, LOWER, UPPER, qk_scale,
    cap_scale, SOFTCAP, APPROX_TANH, and QDoc, KDoc, stride_qdb, stride_kdb, HAS_DOCS: as in the forward kernel.
    """
    start_m = tl.program_id(0)
    off_hq = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_hq // GROUP_SIZE).to(tl.int64)
    off_hq = off_hq.to(tl.int64)
    off_bh = off_b * num_heads_q + off_hq
    if HAS_DOCS:  # this batch row's document ids
        QDoc += off_b * stride_qdb
        KDoc += off_b * stride_kdb

    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask_m = offs_m < seqlen_q
    row_mask = mask_m[:, None] & mask_d[None, :]
    rows = offs_m[:, None].to(tl.int64)
    q_ptrs = Q + off_b * stride_qb + off_hq * stride_qh + rows * stride_qs + offs_d[None, :]
    do_ptrs = DOut + off_b * stride_dob + off_hq * stride_doh + rows * stride_dos + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)
    do = tl.load(do_ptrs, mask=row_mask, other=0.0)
    lse2_hi, lse2_lo, delta = _load_row_stats(Stats + off_bh * seqlen_q, stride_stat, offs_m, seqlen_q, LSE_LO)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    start_n, full_start, full_end, end_n = _key_range(start_m, seqlen_k, lower, upper, BLOCK_M, BLOCK_N, LOWER, UPPER)
    q_doc, q_doc_first, q_doc_last = _q_tile_docs(QDoc, offs_m, start_m, seqlen_q, BLOCK_M, HAS_DOCS)
    if HAS_DOCS:  # any tile may cross a document boundary: all in the last, masked stage
        full_start = start_n
        full_end = start_n

    if LOWER:
        dq = _attn_bwd_dq_tiles(
            dq, q, do, lse2_hi, lse2_lo, delta, q_doc, q_doc_first, q_doc_last, k_base, v_base, KDoc, stride_ks,
            stride_vs, offs_m, offs_d, mask_d, start_n, tl.minimum(full_start, end_n), seqlen_k, lower, upper, qk_scale,
            cap_scale, BLOCK_N, True, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
        )
    dq = _attn_bwd_dq_tiles(
        dq, q, do, lse2_hi, lse2_lo, delta, q_doc, q_doc_first, q_doc_last, k_base, v_base, KDoc, stride_ks, stride_vs,
        offs_m, offs_d, mask_d, full_start, full_end, seqlen_k, lower, upper, qk_scale, cap_scale,
        BLOCK_N, False, LOWER, UPPER, False, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
    )
    dq = _attn_bwd_dq_tiles(
        dq, q, do, lse2_hi, lse2_lo, delta, q_doc, q_doc_first, q_doc_last, k_base, v_base, KDoc, stride_ks, stride_vs,
        offs_m, offs_d, mask_d, tl.maximum(full_start, full_end), end_n, seqlen_k, lower, upper, qk_scale,
        cap_scale, BLOCK_N, True, LOWER, UPPER, HAS_DOCS, SOFTCAP, APPROX_TANH, LSE_LO, DOT_PRECISION,
    )

    dq = dq * sm_scale
    dq_ptrs = DQ + off_b * stride_dqb + off_hq * stride_dqh + rows * stride_dqs + offs_d[None, :]
    if ACCUMULATE:
        dq += tl.load(dq_ptrs, mask=row_mask, other=0.0)
    _store_rows(dq, dq_ptrs, row_mask, offs_m, offs_d, DQFinal, off_b, off_hq, stride_fb, stride_fs, stride_fh,
                final_lo, final_hi, HAS_FINAL_ROWS)  # fmt: skip
