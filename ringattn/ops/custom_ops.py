"""The launchers as torch.library custom ops with fake (meta) twins, so torch.compile can trace
through flash_attn_func without looking inside Triton (docs/design.md, section 7).

- ringattn::attn_fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap, q_doc_ids, k_doc_ids,
  out_dtype) -> (out, lse)
- ringattn::attn_bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left, window_right,
  softcap, q_doc_ids, k_doc_ids) -> (dq, dk, dv)

The window's sides and the document ids are optional (None: no limit, no documents), as in ops/attn.py.

Both return fresh tensors. The ring keeps calling the plain Python launchers (attn_fwd with an fp32
out_dtype, attn_bwd accumulating into fp32 buffers in place): its loop is not traced.
"""

import torch

from .attn import attn_bwd, attn_fwd
from .validation import LSE_DTYPE


@torch.library.custom_op("ringattn::attn_fwd", mutates_args=())
def attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float = 0.0,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """attn_fwd as a custom op: out (B, Sq, Hq, D) contiguous in out_dtype (default q's), lse (B, Hq, Sq)
    float64."""
    return attn_fwd(q, k, v, softmax_scale, causal, out_dtype, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                    window=(window_left, window_right), softcap=softcap)  # fmt: skip


@attn_fwd_op.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal, window_left=None, window_right=None, softcap=0.0, q_doc_ids=None,
                   k_doc_ids=None, out_dtype=None):  # fmt: skip
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=LSE_DTYPE, device=q.device)
    return out, lse


@torch.library.custom_op("ringattn::attn_bwd", mutates_args=())
def attn_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool = False,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float = 0.0,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attn_bwd as a custom op: (dq, dk, dv) shaped like q, k, v, contiguous, in q's dtype."""
    grads = attn_bwd(dout, q, k, v, out, lse, softmax_scale, causal, q_doc_ids=q_doc_ids, k_doc_ids=k_doc_ids,
                     deterministic=deterministic, window=(window_left, window_right), softcap=softcap)  # fmt: skip
    return tuple(g if g.is_contiguous() else g.contiguous() for g in grads)


@attn_bwd_op.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, window_left=None,
                   window_right=None, softcap=0.0, q_doc_ids=None, k_doc_ids=None):  # fmt: skip
    return tuple(torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v))
