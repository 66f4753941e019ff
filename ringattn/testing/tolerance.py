"""The tolerance rule shared by the test suite and the main job's check (docs/design.md).

The error of ringattn's result against a high-precision reference (float64, or fp32 on the
GPU) may be at most 2x the error of a plain PyTorch implementation computed in the same
dtype as ringattn's inputs, plus a floor of FLOOR_ULPS fp32 ulps of the reference's magnitude
(at least 1), or of a given scale. The floor covers cases where the plain implementation is
exact by structure (e.g. one key: its softmax gradient is 0 identically, while the
FlashAttention-2 form dP - delta cancels two fp32 dot products): a dot product of n rounded
terms is off by about sqrt(n) ulps, and 16 covers head dims up to 256.

reference() gives the two sides of the rule for a whole (long) sequence: the ground truth (float64)
and the plain implementation (the inputs' dtype), chunked so that it fits where S x S does not.
"""

from collections.abc import Mapping

import torch

from ..ops import attn_bwd_ref, attn_fwd_ref

ERROR_RATIO = 2.0
FLOOR_ULPS = 16.0
RESULTS = ("out", "lse", "dq", "dk", "dv")  # an attention call's results, forward then backward


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over finite reference entries; inf if x is non-finite (NaN too) where ref is finite, or other
    than ref where ref is not (an lse of -inf must stay -inf, a NaN stay NaN).

    Raises:
        ValueError: x and ref of different shapes (no broadcasting: it would compare other entries).
    """
    if x.shape != ref.shape:
        raise ValueError(f"max_abs_error needs x and ref of one shape, got {tuple(x.shape)} and {tuple(ref.shape)}")
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    finite = torch.isfinite(ref)
    x_off, ref_off = x[~finite], ref[~finite]
    if not ((x_off == ref_off) | (x_off.isnan() & ref_off.isnan())).all():
        return float("inf")
    if not torch.isfinite(x[finite]).all():
        return float("inf")
    if not finite.any():
        return 0.0
    return (x[finite] - ref[finite]).abs().max().item()


def magnitude(t: torch.Tensor) -> float:
    """max |t| over finite entries (0 when there are none)."""
    finite = t.detach()[torch.isfinite(t.detach())]
    return finite.abs().max().item() if finite.numel() else 0.0


def tolerance(pt: torch.Tensor, ref: torch.Tensor, scale: float | None = None) -> float:
    """Allowed max-abs error: 2 x the plain implementation's error + FLOOR_ULPS fp32 ulps of
    max(scale, 1); scale defaults to max |ref|."""
    scale = magnitude(ref) if scale is None else scale
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(scale, 1.0)
    return ERROR_RATIO * max_abs_error(pt, ref) + floor


def check_close(
    name: str, ours: torch.Tensor, pt: torch.Tensor, ref: torch.Tensor, scale: float | None = None
) -> tuple[float, float]:
    """Return (error, allowed) for `ours`; raise AssertionError naming the tensor when error > allowed.

    scale: magnitude of the terms `ours` is summed from, for the floor (default max |ref|). For
    gradients pass the largest of the three gradients' magnitudes: a gradient that is zero by
    structure (dq, dk with one key) is still a sum of O(dv)-sized fp32 terms.
    """
    for label, t in (("", ours), ("plain result's ", pt)):
        if t.shape != ref.shape:
            raise AssertionError(f"{name}: {label}shape {tuple(t.shape)} != reference shape {tuple(ref.shape)}")
    err, allowed = max_abs_error(ours, ref), tolerance(pt, ref, scale)
    if not err <= allowed:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} vs reference exceeds {allowed:.3e} "
            f"(2 x plain-PyTorch error {max_abs_error(pt, ref):.3e} + floor)"
        )
    return err, allowed


def check_results(
    what: str, ours: Mapping[str, torch.Tensor], pt: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """check_close on each of `ours` (any of RESULTS by name) against `ref`, with `pt` (all of RESULTS) the plain
    implementation: out and lse at their own magnitude, the gradients at the largest of ref's three (check_close
    says why). Returns name -> (error, allowed); raises AssertionError, naming `what` and the tensor, at the first
    one off."""
    grad_scale = max(magnitude(ref[name]) for name in RESULTS[2:])
    return {
        name: check_close(f"{what} {name}".strip(), t, pt[name], ref[name], None if name in RESULTS[:2] else grad_scale)
        for name, t in ours.items()
    }


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Attention forward and backward by the pure-PyTorch reference ops (attn_fwd_ref + attn_bwd_ref),
    computed in `dtype`: float64 for the ground truth, the inputs' dtype for the plain implementation.

    The reference materialises (S, S) scores, so it runs one (batch, query head) at a time: peak memory
    about 6 S^2 elements of `dtype` (or fp32, whichever is wider). Gradients accumulate in that wider type
    across the query heads of a K/V group, as the unchunked reference does, and are rounded to `dtype` at
    the end; lse stays in the wider type.

    Args:
        q, dout: (B, S, H, D); k, v: (B, S, Hkv, D), H a multiple of Hkv. Cast to `dtype` first.
    Returns:
        {"out": (B, S, H, D), "lse": (B, H, S) natural log, "dq": (B, S, H, D), "dk", "dv": (B, S, Hkv, D)}.
    """
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    batch, _, heads, _ = q.shape
    group = heads // k.shape[2]
    acc_dtype = torch.promote_types(dtype, torch.float32)
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, q.shape[1]), dtype=acc_dtype, device=q.device)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    for b in range(batch):
        for h in range(heads):
            bs, hs, ks = slice(b, b + 1), slice(h, h + 1), slice(h // group, h // group + 1)
            qh, kh, vh, dh = q[bs, :, hs], k[bs, :, ks], v[bs, :, ks], dout[bs, :, hs]
            out_h, lse_h = attn_fwd_ref(qh, kh, vh, softmax_scale, causal)
            attn_bwd_ref(
                dh, qh, kh, vh, out_h, lse_h, softmax_scale, causal,
                dq_acc=dq[bs, :, hs], dk_acc=dk[bs, :, ks], dv_acc=dv[bs, :, ks],
            )  # fmt: skip
            out[bs, :, hs], lse[bs, hs] = out_h, lse_h
    return {"out": out, "lse": lse, "dq": dq.to(dtype), "dk": dk.to(dtype), "dv": dv.to(dtype)}
