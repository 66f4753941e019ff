"""The tolerance rule shared by the test suite and the main job's check (docs/design.md).

The error of ringattn's result against a high-precision reference (float64, or fp32 on the
GPU) may be at most 2x the error of a plain PyTorch implementation computed in the same
dtype as ringattn's inputs, plus a floor of FLOOR_ULPS fp32 ulps of the reference's magnitude
(at least 1), or of a given scale. The floor covers cases where the plain implementation is
exact by structure (e.g. one key: its softmax gradient is 0 identically, while the
FlashAttention-2 form dP - delta cancels two fp32 dot products): a dot product of n rounded
terms is off by about sqrt(n) ulps, and 16 covers head dims up to 256.
"""

import torch

ERROR_RATIO = 2.0
FLOOR_ULPS = 16.0


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| over finite reference entries; inf if x is non-finite where ref is finite,
    or finite where ref is infinite (an lse of -inf must stay -inf)."""
    x, ref = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    finite = torch.isfinite(ref)
    if not torch.equal(x[~finite], ref[~finite]):
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
    if ours.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} != reference shape {tuple(ref.shape)}")
    err, allowed = max_abs_error(ours, ref), tolerance(pt, ref, scale)
    if not err <= allowed:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} vs reference exceeds {allowed:.3e} "
            f"(2 x plain-PyTorch error {max_abs_error(pt, ref):.3e} + floor)"
        )
    return err, allowed
