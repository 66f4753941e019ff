"""Pieces shared by the forward and backward kernels: log-base constants, key ranges, document spans,
tile loads and masks, soft-capping, the online-softmax step, and the result's store with the rows the ring finishes
split off."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # natural log -> log2 units


@triton.jit
def _key_range(
    start_m, seqlen_k, lower, upper, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOWER: tl.constexpr,
    UPPER: tl.constexpr,
):
    """Key tiles a Q tile visits: (start_n, full_start, full_end, end_n).

    Row i sees keys j with (LOWER) i + lower <= j and (UPPER) j <= i + upper. Keys before start_n and from end_n on
    are seen by no row of the tile; the tiles of [full_start, full_end) are visible to every row (no mask); the
    tiles of [start_n, min(full_start, end_n)) and [max(full_start, full_end), end_n) need the masks of the window
    edges and the sequence end. All but end_n are multiples of BLOCK_N.
    """
    m_first = start_m * BLOCK_M
    m_last = m_first + BLOCK_M - 1
    if UPPER:
        full_end = tl.minimum(m_first + upper + 1, seqlen_k)
        end_n = tl.minimum(m_last + upper + 1, seqlen_k)
    else:
        full_end = seqlen_k
        end_n = seqlen_k
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    end_n = tl.maximum(end_n, 0)
    if LOWER:
        start_n = tl.minimum(tl.maximum(m_first + lower, 0), seqlen_k) // BLOCK_N * BLOCK_N
        full_start = tl.cdiv(tl.minimum(tl.maximum(m_last + lower, 0), seqlen_k), BLOCK_N) * BLOCK_N
    else:
        start_n = 0
        full_start = 0
    return start_n, full_start, full_end, end_n


@triton.jit
def _doc_span(Doc, start, seqlen, BLOCK: tl.constexpr):
    """(first, last) document id of rows [start, min(start + BLOCK, seqlen)); ids are non-decreasing in rows."""
    return tl.load(Doc + start), tl.load(Doc + tl.minimum(start + BLOCK, seqlen) - 1)


@triton.jit
def _q_tile_docs(QDoc, offs_m, start_m, seqlen_q, BLOCK_M: tl.constexpr, HAS_DOCS: tl.constexpr):
    """(document id per row, first id, last id) of a Q tile; row ids themselves and zeros without documents."""
    if HAS_DOCS:
        q_doc = tl.load(QDoc + offs_m, mask=offs_m < seqlen_q, other=-1)
        q_doc_first, q_doc_last = _doc_span(QDoc, start_m * BLOCK_M, seqlen_q, BLOCK_M)
    else:
        q_doc = offs_m
        q_doc_first = 0
        q_doc_last = 0
    return q_doc, q_doc_first, q_doc_last


@triton.jit
def _load_kv_tile(k_base, v_base, stride_kn, stride_vn, offs_n, offs_d, mask_d, seqlen_k, MASKED: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tiles of K and V at rows offs_n; MASKED tiles zero-fill rows past seqlen_k."""
    if MASKED:
        kv_mask = (offs_n[:, None] < seqlen_k) & mask_d[None, :]
    else:
        kv_mask = mask_d[None, :]
    rows = offs_n[:, None].to(tl.int64)
    k = tl.load(k_base + rows * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + rows * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _load_kv_tile_tma(k_desc, v_desc, kv_coords, n0, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """(BLOCK_N, BLOCK_D) tiles of K and V at rows [n0, n0 + BLOCK_N) of (batch, head) kv_coords, by TMA from
    descriptors of the (B, Sk, Hkv, D) tensors with block (1, BLOCK_N, 1, BLOCK_D); rows past Sk load as zeros."""
    off_b, off_h = kv_coords
    k = k_desc.load([off_b, n0, off_h, 0]).reshape(BLOCK_N, BLOCK_D)
    v = v_desc.load([off_b, n0, off_h, 0]).reshape(BLOCK_N, BLOCK_D)
    return k, v


@triton.jit
def _key_tile_visible(
    offs_m, offs_n, seqlen_k, lower, upper, q_doc, KDoc, LOWER: tl.constexpr, UPPER: tl.constexpr,
    DOCS: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) bool: which keys offs_n rows offs_m may see in a masked tile of the row-major loops
    (forward, dQ): keys before seqlen_k, (LOWER) from row + lower, (UPPER) up to row + upper, (DOCS) of the row's
    document."""
    visible = offs_n[None, :] < seqlen_k
    if LOWER:
        visible = visible & (offs_n[None, :] >= offs_m[:, None] + lower)
    if UPPER:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + upper)
    if DOCS:
        k_doc = tl.load(KDoc + offs_n, mask=offs_n < seqlen_k, other=-2)
        visible = visible & (q_doc[:, None] == k_doc[None, :])
    return visible


@triton.jit
def _tanh(x):
    """tanh in fp32 to about one ulp, from exp2 alone (the interpreter has no libdevice): an odd polynomial in x
    below |x| = 0.625, where (1 - e) / (1 + e) with e = exp(-2 |x|) would cancel, that quotient above."""
    y = x * x
    poly = 0.00218271 * y - 0.00822017
    poly = poly * y + 0.02171769
    poly = poly * y - 0.05394979
    poly = poly * y + 0.13333229
    poly = poly * y - 0.33333331
    small = x + x * (poly * y)
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    large = (1.0 - e) / (1.0 + e)
    large = tl.where(x < 0, -large, large)
    return tl.where(tl.abs(x) < 0.625, small, large)


@triton.jit
def _tanh_approx(x):
    """tanh by the GPU's tanh.approx.f32 (relative error below 2^-10.9, under the 16-bit inputs' rounding; one
    instruction where _tanh takes an exp2, a division and a polynomial)."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _capped(s, cap_scale, SOFTCAP: tl.constexpr, APPROX_TANH: tl.constexpr):
    """Scores as the softmax takes them: s (q k^T, unscaled), or with SOFTCAP tanh(s * cap_scale)
    (cap_scale = softmax_scale / softcap; the kernels' qk_scale then carries softcap * log2(e)), by tanh.approx
    with APPROX_TANH (16-bit inputs on a GPU), else to about one ulp."""
    if SOFTCAP:
        if APPROX_TANH:
            return _tanh_approx(s * cap_scale)
        return _tanh(s * cap_scale)
    return s


@triton.jit
def _store_rows(
    x, ptrs, row_mask, offs_m, offs_d, Final, off_b, off_h, stride_fb, stride_fs, stride_fh, final_lo, final_hi,
    HAS_FINAL_ROWS: tl.constexpr,
):
    """Store the (BLOCK_M, BLOCK_D) result tile x (rows offs_m) at ptrs where row_mask, in ptrs' dtype.

    HAS_FINAL_ROWS: rows [final_lo, final_hi) go instead to Final, shaped like the result (B, Sq, H, D) in its own
    dtype, at (off_b, off_h), rounded; ptrs' rows there are left as they were (ops/final_rows.py).
    """
    if HAS_FINAL_ROWS:
        finished = (offs_m >= final_lo) & (offs_m < final_hi)
        rows = offs_m[:, None].to(tl.int64)
        f_ptrs = Final + off_b * stride_fb + off_h * stride_fh + rows * stride_fs + offs_d[None, :]
        tl.store(f_ptrs, x.to(Final.dtype.element_ty), mask=row_mask & finished[:, None])
        row_mask = row_mask & ((offs_m < final_lo) | (offs_m >= final_hi))[:, None]
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=row_mask)


@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, qk_scale, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(acc, l_i, m_i) updated by one key tile: s (BLOCK_M, BLOCK_N) unscaled scores, -inf where MASKED masks them,
    v (BLOCK_N, HEAD_DIM) the tile's values; m_i in log2 units. Rows whose keys are all masked keep m_i = -inf and
    gain nothing."""
    # the scale goes into max (exact: x -> x * scale is monotone) and into exp2's argument as one fused
    # multiply-add per score
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        # a row that has seen no key yet keeps m = -inf, and subtracts 0 instead (exp2(-inf - 0) = 0): a finite
        # stand-in kept as its max would scale its first visible keys' P away from 1 and cost them precision when P
        # is rounded to v's dtype
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s * qk_scale - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new
