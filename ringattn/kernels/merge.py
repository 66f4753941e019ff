"""The log-sum-exp merge of a tile's attention result into a running state, inside a kernel.

The same arithmetic as ops/merge.py::merge_attn_states_ (derivation in docs/design.md), on one
(BLOCK_M, BLOCK_D) tile held in registers: the forward kernels' MERGE_STATE epilogue.
"""

import triton
import triton.language as tl


@triton.jit
def _merge_states(out, lse, run_out, run_lse):
    """(out, lse) merged with the state (run_out, run_lse): out, run_out (BLOCK_M, BLOCK_D) fp32 normalised, lse,
    run_lse (BLOCK_M,) natural log; a side with lse = -inf weighs 0, and rows empty on both sides stay (0, -inf)."""
    lse_max = tl.maximum(run_lse, lse)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w_run = tl.exp(run_lse - lse_max)
    w_blk = tl.exp(lse - lse_max)
    total = w_run + w_blk
    empty = total == 0.0  # rows that have seen no key on either side
    total = tl.where(empty, 1.0, total)
    new_lse = tl.where(empty, float("-inf"), lse_max + tl.log(total))
    new_out = run_out * (w_run / total)[:, None] + out * (w_blk / total)[:, None]
    return new_out, new_lse


@triton.jit
def _merge_into_state(out, lse, out_ptrs, lse_ptrs, row_mask, mask_m):
    """(out, lse) of rows offs_m merged (_merge_states) with the fp32 state stored at (out_ptrs, lse_ptrs)."""
    run_out = tl.load(out_ptrs, mask=row_mask, other=0.0)
    run_lse = tl.load(lse_ptrs, mask=mask_m, other=float("-inf"))
    return _merge_states(out, lse, run_out, run_lse)
