"""Log-sum-exp merge of partial attention states (derivation in docs/design.md).

Two softmax-normalised partial results over disjoint key sets, (out_a, lse_a) and
(out_b, lse_b), combine exactly into the result over the union:
    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)
A side with lse = -inf (no visible key) has weight 0; both sides -inf stay (0, -inf).
An attention sink (a learned logit per head that joins every row's softmax denominator, gpt-oss's) is one more
such side: a key with logit sink[h] and a zero value, (out_b, lse_b) = (0, sink[h]), merged once into the finished
result (add_sink_).
"""

import torch


def merge_attn_states_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge (block_out, block_lse) into the running state (out, lse), in place.

    Args:
        out: (B, S, H, D) fp32 running output, updated in place.
        lse: (B, H, S) float64 running natural-log normaliser, updated in place.
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


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> None:
    """Merge the attention sinks into a finished state, in place: every row's denominator gains exp(sink[h]).

    Args:
        out: (B, S, H, D) fp32 (or wider) output, updated in place: scaled by exp(lse - lse_new).
        lse: (B, H, S) natural-log normaliser, updated in place to logaddexp(lse, sink[h]).
        sink: (H,) the sink logits.
    """
    sink_lse = sink.to(lse.dtype)[None, :, None].expand_as(lse)
    merge_attn_states_(out, lse, out.new_zeros(()), sink_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The loss's gradient with respect to the sinks, (H,) in sink's dtype: the sink is a key of value 0, so its dS
    is -P_sink * delta, P_sink = exp(sink[h] - lse), delta = rowsum(dout * out), summed over batch and rows. A row
    whose lse is -inf (no key and a -inf sink: its output is 0) adds nothing.

    Args:
        dout, out: (B, S, H, D), out with the sinks merged in; lse: (B, H, S) with them; sink: (H,).
    """
    stat = torch.promote_types(lse.dtype, torch.float32)
    delta = (dout.to(stat) * out.to(stat)).sum(-1).transpose(1, 2)  # (B, H, S)
    lse = lse.to(stat)
    p_sink = torch.exp(sink.to(stat)[None, :, None] - lse).masked_fill_(lse == float("-inf"), 0.0)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sink.dtype)
