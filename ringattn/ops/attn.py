"""The attention launchers: validate, allocate, ask the dispatch (ops/dispatch.py) for the launches, run them.

The pure-PyTorch twins with the same signatures live in ops/attn_ref.py.
Layout everywhere: q, out (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); lse (B, Hq, Sq) float64, natural log (the
backward recomputes P = exp(s - lse), so lse keeps the digits an fp32 lse would lose at large |lse|; the public
functions return it in fp32); the backward's row stats (3, B, Hq, Sq) fp32 (attn_bwd_preprocess). Causal masking is
aligned bottom-right (row i sees keys j <= i + Sk - Sq); so are sliding windows (ops/calls.py).
Each launcher takes `backend` (None or "auto", "portable", "sm90": ops/dispatch.py); its reference does not.
"""

import torch

from . import dispatch
from .calls import BwdCall, FwdCall
from .final_rows import FinalRows, check_dq_final, check_final_rows
from .launch import device_guard, run_side_by_side
from .validation import (
    LSE_DTYPE,
    check_attn_inputs,
    check_attn_state,
    check_bwd_stats,
    check_doc_ids,
    check_lse,
    check_runnable_device,
    check_softcap,
    check_window,
)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_fwd(call: FwdCall, backend: str | None) -> None:
    launch = dispatch.fwd_launch(call, backend)
    with device_guard(call.q):
        launch()


def attn_fwd(
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
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention forward.

    Args:
        q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D), Hq % Hkv == 0; any strides, last dim contiguous
            preferred (otherwise copied). D a multiple of 8 up to 256; fp16, bf16 or fp32.
        softmax_scale: multiplies q k^T before the softmax; positive (the kernel folds it into the row max).
        causal: bottom-right aligned causal mask.
        out_dtype: dtype of out (default q.dtype).
        q_doc_ids, k_doc_ids: optional int32 document ids, non-decreasing along the rows (packed
            variable-length sequences): (Sq,) and (Sk,) for every batch row alike, or (B, Sq) and (B, Sk), each
            batch row its own (last dim contiguous). Row i of batch row b sees key j only if their ids are equal
            (and, with causal, j <= i + Sk - Sq). Both or neither.
        final: rows of out to write, rounded, into final.out instead (ops/final_rows.py); out's rows there are
            then unspecified.
        window: (left, right) sliding window, None for no limit on a side: row i sees keys j with
            i + Sk - Sq - left <= j <= i + Sk - Sq + right (with causal, right at most 0); any integers.
        softcap: scores -> softcap * tanh(scores / softcap) after the scale; 0 for none.
        backend: the kernels' backend, None or "auto", "portable" or "sm90" (ops/dispatch.py).
    Returns:
        out (B, Sq, Hq, D) and lse (B, Hq, Sq) float64 natural log; rows that see no key get out 0, lse -inf.
    Raises:
        ValueError, TypeError: bad shapes, dtypes or devices (see check_attn_inputs, check_doc_ids,
            check_final_rows); a backend that is unknown or cannot run here.
        RuntimeError: tensors on a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    check_final_rows(final, q)
    window, softcap = check_window(window), check_softcap(softcap, softmax_scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=LSE_DTYPE, device=q.device)
    call = FwdCall(q, k, v, softmax_scale, bool(causal), out, lse, q_doc_ids, k_doc_ids, False, final, window, softcap)
    _launch_fwd(call, backend)
    return out, lse


def attn_fwd_merge_(
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
    backend: str | None = None,
    fresh: bool = False,
) -> None:
    """Fused attention forward merged into a running state in place: the ring's step, with no merge pass.

    (out, lse) becomes the log-sum-exp merge (ops/merge.py) of itself with attn_fwd(q, k, v, ...).
    Args:
        q, k, v, softmax_scale, causal, q_doc_ids, k_doc_ids, final, window, softcap, backend: as in attn_fwd
            (final's rows of the merged out go to final.out; lse is updated in every row).
        out: (B, Sq, Hq, D) fp32 running output, last dim contiguous (views of a larger state are fine).
        lse: (B, Hq, Sq) float64 running lse, natural log, -inf for rows without keys yet; last dim contiguous.
        fresh: the state holds nothing yet (any bits): taken as the merge's identity (out 0, lse -inf) without being
            read, so the result is stored, the same bits as merging into a filled identity (the first visit of
            these rows).
    Raises:
        as attn_fwd; ValueError or TypeError for a state of the wrong shape, dtype, device or strides.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    check_attn_state(out, lse, q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    check_final_rows(final, q)
    window, softcap = check_window(window), check_softcap(softcap, softmax_scale)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    call = FwdCall(q, k, v, softmax_scale, bool(causal), out, lse, q_doc_ids, k_doc_ids, not fresh, final, window,
                   softcap)  # fmt: skip
    _launch_fwd(call, backend)


def attn_bwd_preprocess(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The backward's row stats, (3, B, Hq, Sq) fp32 contiguous, from out, dout (B, Sq, Hq, D) and lse (B, Hq, Sq)
    float64: [0] lse * log2(e) rounded to fp32 (+inf where lse is -inf: P = 0), [1] the rest of lse * log2(e) (so
    that P = exp2((s log2(e) - [0]) - [1]) misses no digit of lse), [2] delta = rowsum(dout * out)."""
    check_runnable_device(out)
    check_lse(lse, out)
    out, dout, lse = _last_dim_contiguous(out), _last_dim_contiguous(dout), lse.contiguous()
    batch, seqlen_q, heads_q, _ = out.shape
    stats = torch.empty((3, batch, heads_q, seqlen_q), dtype=torch.float32, device=out.device)
    launch = dispatch.preprocess_launch(out, dout, lse, stats)
    with device_guard(out):
        launch()
    return stats


def attn_bwd(
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
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused attention backward: gradients of out = softmax(q k^T * scale) v.

    Args:
        dout, out: (B, Sq, Hq, D); q (B, Sq, Hq, D); k, v (B, Sk, Hkv, D).
        lse: (B, Hq, Sq) float64 natural log, the softmax normaliser of each row; in the ring it is the
            global one, so P computed here is this block's slice of the global softmax.
        stats: the row stats (3, B, Hq, Sq) of attn_bwd_preprocess(out, dout, lse), which the ring computes once
            for all its steps; computed here when None (lse is then read through them alone).
        dq_acc, dk_acc, dv_acc: optional buffers shaped like q, k, v (the ring passes fp32
            accumulators); when given, the gradients are added to them in place and they are returned.
            All three or none.
        q_doc_ids, k_doc_ids: document ids as in attn_fwd.
        add_dq, add_dkdv: with accumulators, False stores dQ into dq_acc (add_dq), or dK and dV into dk_acc and
            dv_acc (add_dkdv), instead of adding: whatever they held is ignored, not read. The ring stores both
            at its first step, and dK, dV alone (its share of a block in transit) at later ones.
        dq_final: with accumulators, rows of dq (the sum, after add_dq) to write, rounded, into dq_final.out
            instead of dq_acc, whose rows there are then unspecified (ops/final_rows.py): the ring's last
            step of those rows.
        deterministic: the same bits every run. The portable and split kernels always give them (every gradient row
            has one writer); the Gluon backward adds dQ atomically, so deterministic calls skip it.
        window, softcap, backend: as in attn_fwd.
    Returns:
        (dq, dk, dv), new tensors in q's dtype unless accumulators were given.
    Raises:
        ValueError, TypeError: bad shapes, dtypes or devices; accumulators not all given, or dq_final without them;
            a backend that is unknown or cannot run here.
        RuntimeError: tensors on a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_runnable_device(q)
    q_doc_ids, k_doc_ids = check_doc_ids(q_doc_ids, k_doc_ids, q, k)
    window, softcap = check_window(window), check_softcap(softcap, softmax_scale)
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    stats = attn_bwd_preprocess(out, dout, lse) if stats is None else check_bwd_stats(stats, q)
    accumulate = dq_acc is not None
    if accumulate != (dk_acc is not None) or accumulate != (dv_acc is not None):
        raise ValueError("dq_acc, dk_acc and dv_acc must be given together or not at all")
    check_dq_final(dq_final, q, dq_acc)
    if accumulate:
        for name, acc, ref in (("dq_acc", dq_acc, q), ("dk_acc", dk_acc, k), ("dv_acc", dv_acc, v)):
            if acc.shape != ref.shape or acc.stride(-1) != 1:
                raise ValueError(f"{name} must have shape {tuple(ref.shape)} with a contiguous last dim")
        dq, dk, dv = dq_acc, dk_acc, dv_acc
    else:
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    call = BwdCall(
        dout, q, k, v, stats, dq, dk, dv, softmax_scale, bool(causal), q_doc_ids, k_doc_ids,
        accumulate and add_dq, accumulate and add_dkdv, dq_final, bool(deterministic), window, softcap,
    )  # fmt: skip
    launches = dispatch.bwd_launches(call, backend)
    with device_guard(q):
        if dispatch.bwd_on_two_streams(call, launches):  # dK/dV on a side stream, dQ on the current
            run_side_by_side(*launches, q.device)
        else:
            for launch in launches:
                launch()
    return dq, dk, dv
