"""Autograd Functions and the public functions `flash_attn_func` and `ring_attn_func`.

Signatures follow flash-attn: tensors are (batch, seqlen, nheads, headdim); GQA/MQA by
passing fewer K/V heads; lse is (batch, nheads, seqlen) fp32 in natural log.
"""

import torch
import torch.distributed as dist

from .ops import KERNEL_OPS, attn_bwd, attn_fwd
from .ops.validation import check_attn_inputs, check_runnable_device, default_softmax_scale
from .parallel import RingComm, check_layout, check_local_seqlen, ring_attn_backward, ring_attn_forward


class FlashAttnFunction(torch.autograd.Function):
    """Single-device fused attention; backward recomputes P from the saved lse."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal):
        out, lse = attn_fwd(q, k, v, softmax_scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal = softmax_scale, causal
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal)
        return dq, dk, dv, None, None


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
):
    """Exact attention with a fused Triton kernel on one device.

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (GQA/MQA).
            headdim a multiple of 8 up to 256; fp16, bf16 or fp32; any strides.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask (row i sees keys j <= i + seqlen_k - seqlen_q);
            rows that see no key give zeros.
        return_lse: also return the log-sum-exp of each row.
    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with return_lse also
        lse (batch, nheads, seqlen_q) fp32, natural log (-inf for rows that see no key).
    Raises:
        ValueError, TypeError: bad shapes, dtypes, devices or scale.
        RuntimeError: CPU tensors without TRITON_INTERPRET=1.
    """
    check_attn_inputs(q, k, v)
    scale = default_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = FlashAttnFunction.apply(q, k, v, scale, bool(causal))
    return (out, lse) if return_lse else out


class RingAttnFunction(torch.autograd.Function):
    """Ring attention over the ranks of a process group; forward and backward each go round the ring."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, group, layout):
        out, lse = ring_attn_forward(RingComm(group), KERNEL_OPS, q, k, v, softmax_scale, causal, layout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.group, ctx.layout = softmax_scale, causal, group, layout
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_attn_backward(
            RingComm(ctx.group), KERNEL_OPS, dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.layout
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, layout: str) -> None:
    """Local checks before any communication: shapes and dtypes, layout, the group and its backend.

    Raises:
        ValueError, TypeError: bad inputs, an unknown layout, an odd local length with "zigzag",
            a device the backend cannot carry.
        RuntimeError: torch.distributed is not initialised; a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    check_layout(layout)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q, k and v must hold the same local sequence length in a ring, got q {q.shape[1]}, k/v {k.shape[1]}"
        )
    check_local_seqlen(q.shape[1], layout, name="q.shape[1]")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ring_attn_func needs torch.distributed initialised (dist.init_process_group); "
            "for one device use flash_attn_func"
        )
    backend = str(dist.get_backend(group)).lower()
    if q.is_cuda and "nccl" not in backend and "cuda" not in backend:
        raise ValueError(f"q, k, v are CUDA tensors but the group's backend {backend!r} cannot carry them; use nccl")
    if not q.is_cuda and backend == "nccl":
        raise ValueError(f"q, k, v are on {q.device} but the group's backend is nccl; move them to the rank's GPU")


def ring_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
):
    """Exact attention over one global sequence split across the ranks of `group`.

    Every rank of the group calls it with its own shard of the global sequence of
    S = W * S_local tokens (W ranks). With layout "contiguous", group rank r holds global tokens
    [r * S_local, (r + 1) * S_local). With layout "zigzag", the sequence is cut into 2W chunks
    of C = S_local / 2 tokens and rank r holds chunk r followed by chunk 2W - 1 - r, which
    balances causal work over the ranks (docs/design.md, section 4). ringattn.shard,
    ringattn.unshard and ringattn.position_ids map between full tensors and shards.

    Args:
        q: (batch, S_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, S_local, nheads_k, headdim), this rank's shards; nheads % nheads_k == 0.
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: causal over global positions.
        group: the process group forming the ring (default: the world). NCCL for CUDA
            tensors, gloo for CPU tensors (with TRITON_INTERPRET=1).
        layout: "contiguous" or "zigzag" (S_local must then be even); all ranks pass the same.
        return_lse: also return this shard's lse.
    Returns:
        out (batch, S_local, nheads, headdim) in q's dtype, this rank's shard of the global
        attention output; with return_lse also lse (batch, nheads, S_local) fp32, natural log.
    Raises:
        ValueError, TypeError: bad local inputs, raised before any communication.
        RuntimeError: torch.distributed not initialised, or tensors on a device the kernels
            cannot run on (CPU tensors need TRITON_INTERPRET=1 before ringattn is imported).
    """
    check_ring_inputs(q, k, v, group, layout)
    scale = default_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = RingAttnFunction.apply(q, k, v, scale, bool(causal), group, layout)
    return (out, lse) if return_lse else out
