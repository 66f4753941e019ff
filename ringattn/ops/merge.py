"""Log-sum-exp merge of partial attention states (derivation in docs/design.md).

Two softmax-normalised partial results over disjoint key sets, (out_a, lse_a) and
(out_b, lse_b), combine exactly into the result over the union:
    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
A side with lse = -inf (no visible key) has weight 0; both sides -inf stay (0, -inf).
"""

import torch


def merge_attn_states_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge (block_out, block_lse) into the running state (out, lse), in place.

    Args:
        out: (B, S, H, D) fp32 running output, updated in place.
        lse: (B, H, S) fp32 running natural-log normaliser, updated in place.
        block_out: (B, S, H, D) the new block's normalised output (any float dtype).
        block_lse: (B, H, S) the new block's lse.
    """
    neg_inf = float("-inf")
    lse_max = torch.maximum(lse, block_lse)
    lse_max = lse_max.masked_fill(lse_max == neg_inf, 0.0)  # both sides empty: weights exp(-inf) = 0
    w_run = torch.exp(lse - lse_max)
    w_blk = torch.exp(block_lse - lse_max)
    total = w_run + w_blk
    lse.copy_(lse_max + torch.log(total))  # log(0) = -inf for rows still empty
    total = total.masked_fill(total == 0.0, 1.0)
    w_run = (w_run / total).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_blk = (w_blk / total).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_run).add_(block_out * w_blk)
