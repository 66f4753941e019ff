"""One attention call as the dispatch and the backends see it: its tensors, checked and allocated by ops/attn.py,
and its flags. Layout: q, out, dout, dq (B, Sq, Hq, D); k, v, dk, dv (B, Sk, Hkv, D); lse (B, Hq, Sq) float64; the
backward's row stats (3, B, Hq, Sq) fp32 (ops/attn.py's attn_bwd_preprocess); document ids q_doc_ids (B, Sq),
k_doc_ids (B, Sk) int32 with contiguous rows (batch stride 0: one row for all).

Every call may carry a sliding window, `window = (left, right)`: row i sees keys j with
i + Sk - Sq - left <= j <= i + Sk - Sq + right (bottom-right aligned, as flash-attn's window_size; None: no limit
on that side; any integers, the ring's blocks need negative ones), combined with causal (right at most 0); and
`softcap`: scores -> softcap * tanh(scores / softcap) after the scale (0: none).
"""

import functools
from typing import NamedTuple

import torch

from .final_rows import FinalRows


class FwdCall(NamedTuple):
    """A forward into out and lse (with merge_state: merged into the running state they hold); final: rows written,
    rounded, into final.out instead of out."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    softmax_scale: float
    causal: bool
    out: torch.Tensor
    lse: torch.Tensor
    q_doc_ids: torch.Tensor | None = None
    k_doc_ids: torch.Tensor | None = None
    merge_state: bool = False
    final: FinalRows | None = None
    window: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0


class BwdCall(NamedTuple):
    """A backward into dq, dk, dv (add_dq, add_dkdv: added into what they hold, else stored), from the row stats
    (3, B, Hq, Sq) fp32 contiguous (attn_bwd_preprocess: lse in log2 units as hi + lo, and delta); dq_final: dQ's
    rows written, rounded, into dq_final.out instead of dq; deterministic: the same bits every run (no kernel that
    adds dQ atomically)."""

    dout: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    stats: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    softmax_scale: float
    causal: bool
    q_doc_ids: torch.Tensor | None = None
    k_doc_ids: torch.Tensor | None = None
    add_dq: bool = False
    add_dkdv: bool = False
    dq_final: FinalRows | None = None
    deterministic: bool = False
    window: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0


def causal_window(causal: bool, window: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    """The window (left, right) that causal and `window` together leave: causal caps the right side at 0."""
    left, right = window
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def key_band(
    causal: bool, window: tuple[int | None, int | None], seqlen_q: int, seqlen_k: int
) -> tuple[int | None, int | None]:
    """(lower, upper): row i sees keys j with i + lower <= j <= i + upper, None where that side has no limit, for
    a call's causal flag and window (module docstring) at lengths Sq, Sk. A side that cuts no (row, key) pair is
    None too, so that a window of any size (sys.maxsize for no limit) gives the kernels bounds within the lengths."""
    left, right = causal_window(causal, window)
    shift = seqlen_k - seqlen_q
    lower = None if left is None or shift - left <= 1 - seqlen_q else shift - left
    upper = None if right is None or shift + right >= seqlen_k - 1 else shift + right
    return lower, upper


def plain_scores(call: "FwdCall | BwdCall") -> bool:
    """Whether a call's scores are the plain scaled q k^T: no window, no soft-capping (what the Hopper kernels
    take)."""
    return call.window == (None, None) and not call.softcap


class Target(NamedTuple):
    """What a launch is built for: a GPU of compute capability `capability`, or (None) Triton's interpreter."""

    capability: tuple[int, int] | None

    @staticmethod
    def of(t: torch.Tensor) -> "Target":
        """The target of a tensor's device: its GPU, or the interpreter for CPU tensors."""
        return Target(_capability(t.device.index) if t.is_cuda else None)  # a CUDA tensor's device has its index

    @property
    def gpu(self) -> bool:
        return self.capability is not None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """GPU `index`'s compute capability, asked once: every launch is planned for its device."""
    return torch.cuda.get_device_capability(index)
