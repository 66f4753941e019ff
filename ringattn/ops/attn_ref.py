"""Pure-PyTorch references of the attention launchers in ops/attn.py, same signatures.

They materialise the (Sq, Sk) score matrix and repeat K/V heads for GQA: O(S^2) memory,
meant for tests, for small CPU rings and as the float64 ground truth. They compute in the
dtype of their inputs (upcast the inputs for a float64 reference).
"""

import math

import torch
from einops import reduce, repeat

from .calls import key_band
from .final_rows import FinalRows, check_dq_final, check_final_rows
from .merge import merge_attn_states_
from .validation import LSE_DTYPE


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """(B, Sk, Hkv, D) -> (B, Sk, Hq, D) by repeating each kv head over its query group."""
    return repeat(t, "b s h d -> b s (h g) d", g=heads_q // t.shape[2])


def _reduce_kv(t: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, Sk, Hq, D) -> (B, Sk, Hkv, D) by summing each query group."""
    return reduce(t, "b s (h g) d -> b s h d", "sum", h=heads_k)


def band_visible(
    causal: bool, window: tuple[int | None, int | None], seqlen_q: int, seqlen_k: int, device: torch.device
) -> torch.Tensor | None:
    """(Sq, Sk) bool: which keys each row sees under causal and a sliding window (ops/calls.py); None: all."""
    lower, upper = key_band(causal, window, seqlen_q, seqlen_k)
    if lower is None and upper is None:
        return None
    offset = torch.arange(seqlen_k, device=device)[None, :] - torch.arange(seqlen_q, device=device)[:, None]
    visible = torch.ones_like(offset, dtype=torch.bool)
    if lower is not None:
        visible &= offset >= lower
    if upper is not None:
        visible &= offset <= upper
    return visible


def _scores(
    q, k, softmax_scale, causal, q_doc_ids=None, k_doc_ids=None, window=(None, None), softcap=0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores (B, Hq, Sq, Sk) in q's dtype as the softmax takes them, -inf where masked (causal, window, other
    document), and with softcap the tanh t they were capped by (scores = softcap * t), else None."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, _expand_kv(k, q.shape[2])) * softmax_scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    visible = band_visible(causal, window, q.shape[1], k.shape[1], q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if q_doc_ids is not None:  # (Sq,) and (Sk,) for every batch row, or (B, Sq) and (B, Sk)
        other = q_doc_ids[..., None, :, None] != k_doc_ids[..., None, None, :]  # (B or 1, 1, Sq, Sk)
        s = s.masked_fill(other, float("-inf"))
    return s, t


def _write_final(final: FinalRows | None, result: torch.Tensor) -> None:
    """Copy final's rows of result (B, Sq, Hq, D), rounded, into final.out (as the kernels' HAS_FINAL epilogue)."""
    if final is not None:
        rows = slice(final.rows.start, final.rows.stop)
        final.out[:, rows].copy_(result[:, rows])


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows of lse = -inf (no visible key) giving 0, never NaN."""
    lse_safe = lse.masked_fill(lse == float("-inf"), float("inf"))
    return torch.exp(s - lse_safe[..., None].to(s.dtype))


def attn_fwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    out_dtype: torch.dtype | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    final: FinalRows | None = None,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of attn_fwd: out (B, Sq, Hq, D) in out_dtype (default q.dtype), lse (B, Hq, Sq) float64 (computed
    in fp32, or float64 for float64 inputs); final's rows also go to final.out (out keeps them too)."""
    check_final_rows(final, q)
    s, _ = _scores(q, k, softmax_scale, causal, q_doc_ids, k_doc_ids, window, softcap)
    stat_dtype = torch.promote_types(q.dtype, torch.float32)
    lse = torch.logsumexp(s.to(stat_dtype), dim=-1)  # -inf for rows with no visible key
    p = _probs(s.to(stat_dtype), lse).to(v.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2])).to(out_dtype or q.dtype)
    _write_final(final, out)
    return out, lse.to(LSE_DTYPE)


def attn_fwd_merge_ref_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    final: FinalRows | None = None,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    fresh: bool = False,
) -> None:
    """Reference of attn_fwd_merge_: attn_fwd_ref in out's dtype, then merge_attn_states_ into (out, lse) (fresh:
    into the identity, out 0 and lse -inf, written first), then final's rows of the merged out to final.out."""
    check_final_rows(final, q)
    if fresh:
        out.zero_()
        lse.fill_(-torch.inf)
    block_out, block_lse = attn_fwd_ref(q, k, v, softmax_scale, causal, out.dtype, q_doc_ids, k_doc_ids,
                                        window=window, softcap=softcap)  # fmt: skip
    merge_attn_states_(out, lse, block_out, block_lse)
    _write_final(final, out)


def attn_bwd_preprocess_ref(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Reference of attn_bwd_preprocess: the row stats (3, B, Hq, Sq), fp32 or wider: lse * log2(e) as hi (+inf
    where lse is -inf) + lo, and delta = rowsum(dout * out)."""
    stat_dtype = torch.promote_types(out.dtype, torch.float32)
    lse2 = lse.to(torch.float64) * math.log2(math.e)
    empty = lse2 == float("-inf")
    hi = lse2.to(stat_dtype)
    lo = (lse2 - hi.to(torch.float64)).masked_fill(empty, 0.0).to(stat_dtype)
    delta = (dout.to(stat_dtype) * out.to(stat_dtype)).sum(-1).transpose(1, 2)
    return torch.stack((hi.masked_fill(empty, float("inf")), lo, delta))


def attn_bwd_ref(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    stats: torch.Tensor | None = None,
    dq_acc: torch.Tensor | None = None,
    dk_acc: torch.Tensor | None = None,
    dv_acc: torch.Tensor | None = None,
    q_doc_ids: torch.Tensor | None = None,
    k_doc_ids: torch.Tensor | None = None,
    add_dq: bool = True,
    add_dkdv: bool = True,
    dq_final: FinalRows | None = None,
    deterministic: bool = False,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of attn_bwd: P = exp(s - lse) (lse rounded to the inputs' precision); dV = P^T dO;
    dS = P (dO V^T - delta) (with softcap times 1 - t^2, tanh's derivative); dQ = scale dS K; dK = scale dS^T Q.
    Accumulators, when given, are added to in place (dQ stored instead with add_dq False, dK and dV with add_dkdv
    False); then dq_final's rows of dq_acc go to dq_final.out. deterministic is taken for attn_bwd's signature: the
    reference always is."""
    check_dq_final(dq_final, q, dq_acc)
    heads_q, heads_k = q.shape[2], k.shape[2]
    stat_dtype = torch.promote_types(q.dtype, torch.float32)
    delta = (attn_bwd_preprocess_ref(out, dout, lse) if stats is None else stats)[2]
    s, t = _scores(q, k, softmax_scale, causal, q_doc_ids, k_doc_ids, window, softcap)
    p = _probs(s.to(stat_dtype), lse.to(stat_dtype))
    dout_c = dout.to(stat_dtype)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout_c)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout_c, _expand_kv(v, heads_q).to(stat_dtype))
    ds = p * (dp - delta[..., None].to(stat_dtype)) * softmax_scale
    if t is not None:
        ds = ds * (1 - t.to(stat_dtype) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, _expand_kv(k, heads_q).to(stat_dtype))
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(stat_dtype))
    grads = (dq, _reduce_kv(dk, heads_k), _reduce_kv(dv, heads_k))
    if dq_acc is None:
        return tuple(g.to(q.dtype) for g in grads)
    for acc, g, add in zip((dq_acc, dk_acc, dv_acc), grads, (add_dq, add_dkdv, add_dkdv), strict=True):
        if add:
            acc.add_(g.to(acc.dtype))
        else:
            acc.copy_(g)
    _write_final(dq_final, dq_acc)
    return dq_acc, dk_acc, dv_acc
