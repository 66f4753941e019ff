"""FinalRows: where an attention call writes the rows of its result that are finished.

The ring keeps each rank's output and dQ in an fp32 running state across its steps and returns them in
the inputs' dtype. The last call that touches a row writes it rounded, straight from the kernel, so the
fp32 values of finished rows are never stored and read back for a separate rounding pass.
"""

from typing import NamedTuple

import torch


class FinalRows(NamedTuple):
    """Rows `rows` of a call's result go, rounded to `out`'s dtype, into `out` instead of the call's own output
    (or running state), whose rows there are then unspecified (the kernels leave them as they were, the
    references write them too). `out`'s other rows are left as they were.

    out: shaped like the call's output, (B, Sq, Hq, D), last dim contiguous (a view of a larger tensor is fine).
    rows: a range of the call's query rows, step 1, inside [0, Sq]; empty for none.
    """

    out: torch.Tensor
    rows: range


def check_final_rows(final: FinalRows | None, like: torch.Tensor, name: str = "final") -> None:
    """Check `final` for a call whose output is shaped like `like` (B, Sq, Hq, D); None passes.

    Raises:
        TypeError: not a FinalRows of a floating-point tensor and a range.
        ValueError: a wrong shape, device or last-dim stride, or rows outside [0, Sq] or with a step other than 1.
    """
    if final is None:
        return
    if not isinstance(final, FinalRows) or not isinstance(final.rows, range):
        raise TypeError(f"{name} must be a FinalRows(out, rows) with rows a range, got {final!r}")
    out, rows = final
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TypeError(f"{name}.out must be a floating-point tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != like.shape or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(
            f"{name}.out must have shape {tuple(like.shape)} on {like.device} with a contiguous last dim, got "
            f"shape {tuple(out.shape)} on {out.device} with strides {out.stride()}"
        )
    if rows.step != 1 or not 0 <= rows.start <= rows.stop <= like.shape[1]:
        raise ValueError(f"{name}.rows must be a range of step 1 inside [0, {like.shape[1]}], got {rows}")


def check_dq_final(dq_final: FinalRows | None, q: torch.Tensor, dq_acc: torch.Tensor | None) -> None:
    """check_final_rows for a backward's dq_final, which splits rows off the dQ accumulator and so needs one.

    Raises:
        ValueError: dq_final without dq_acc; as check_final_rows.
        TypeError: as check_final_rows.
    """
    if dq_final is not None and dq_acc is None:
        raise ValueError("dq_final needs the accumulators dq_acc, dk_acc and dv_acc")
    check_final_rows(dq_final, q, "dq_final")
