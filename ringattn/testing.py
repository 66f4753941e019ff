"""The tolerance rule shared by the test suite and the main job's check (docs/design.md).

The error of ringattn's result against a high-precision reference (float64, or fp32 on the
GPU) may be at most 2x the error of a plain PyTorch implementation computed in the same
dtype as ringattn's inputs, plus a floor of a few fp32 ulps of the reference's magnitude
(for cases where the plain implementation happens to be exact).
"""

import torch

ERROR_RATIO = 2.0
FLOOR_ULPS = 8.0


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


def tolerance(pt: torch.Tensor, ref: torch.Tensor) -> float:
    """Allowed max-abs error: 2 x the plain implementation's error + FLOOR_ULPS fp32 ulps of max |ref|."""
    finite = ref.detach()[torch.isfinite(ref.detach())]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(scale, 1.0)
    return ERROR_RATIO * max_abs_error(pt, ref) + floor


def check_close(name: str, ours: torch.Tensor, pt: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Return (error, allowed) for `ours`; raise AssertionError naming the tensor when error > allowed."""
    if ours.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(ours.shape)} != reference shape {tuple(ref.shape)}")
    err, allowed = max_abs_error(ours, ref), tolerance(pt, ref)
    if not err <= allowed:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} vs reference exceeds {allowed:.3e} "
            f"(2 x plain-PyTorch error {max_abs_error(pt, ref):.3e} + floor)"
        )
    return err, allowed
