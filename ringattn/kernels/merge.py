"""The row normaliser of a tile's attention result, and its log-sum-exp merge into a running state, inside a kernel.

lse is carried in float64 between kernels: the backward recomputes P = exp(s - lse), and an fp32 lse is off by up to
half an ulp of |lse| (2.4e-4 at |lse| = 4096), an error every P of the row would carry. The arithmetic on scores
stays fp32; only the per-row normaliser and the merge's per-row sums touch float64. The merge is the arithmetic of
ops/merge.py::merge_attn_states_ (derivation in docs/design.md), on one (BLOCK_M, BLOCK_D) tile held in registers: the
forward kernels' MERGE_STATE epilogue.
"""

import triton
import triton.language as tl

LN2_F64 = tl.constexpr(0.6931471805599453)  # log2 units -> natural log, applied in float64
LOG2E_F64 = tl.constexpr(1.4426950408889634)  # natural log -> log2 units, applied in float64


@triton.jit
def _row_lse(m_i, l_i):
    """(lse (BLOCK_M,) float64 natural log, the divisor of the rows' outputs) of rows with running max m_i (log2
    units, fp32) and sum l_i: lse = (m_i + log2(l_i)) ln 2 in float64 and l_i, or -inf and 1 for rows that saw no key
    (l_i = 0: their output stays 0)."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = (m_i.to(tl.float64) + tl.log2(l_safe).to(tl.float64)) * LN2_F64
    return tl.where(empty, float("-inf"), lse), l_safe


@triton.jit
def _merge_states(out, lse, run_out, run_lse):
    """(out, lse) merged with the state (run_out, run_lse): out, run_out (BLOCK_M, BLOCK_D) fp32 normalised, lse,
    run_lse (BLOCK_M,) float64 natural log; a side with lse = -inf weighs 0, and rows empty on both sides stay
    (0, -inf). The weights' exponents are float64 differences rounded to fp32 (relative error 6e-8)."""
    lse_max = tl.maximum(run_lse, lse)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w_run = tl.exp((run_lse - lse_max).to(tl.float32))
    w_blk = tl.exp((lse - lse_max).to(tl.float32))
    total = w_run + w_blk
    empty = total == 0.0  # rows that have seen no key on either side
    total = tl.where(empty, 1.0, total)
    new_lse = tl.where(empty, float("-inf"), lse_max + tl.log(total).to(tl.float64))
    new_out = run_out * (w_run / total)[:, None] + out * (w_blk / total)[:, None]
    return new_out, new_lse


@triton.jit
def _merge_into_state(out, lse, out_ptrs, lse_ptrs, row_mask, mask_m):
    """(out, lse) of rows offs_m merged (_merge_states) with the state stored at (out_ptrs fp32, lse_ptrs float64)."""
    run_out = tl.load(out_ptrs, mask=row_mask, other=0.0)
    run_lse = tl.load(lse_ptrs, mask=mask_m, other=float("-inf"))
    return _merge_states(out, lse, run_out, run_lse)
