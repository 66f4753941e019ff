"""The backward's dK/dV and dQ kernels on two CUDA streams at once, for short backwards.

The two kernels read the same inputs and write different outputs. Run one after the other, each
launch ends in a last wave that leaves SMs idle. On two streams, one kernel's programs fill them.
On the H200 the ring's 8k blocks (B = 1, H = 32, D = 128) ran 1.6 to 2.9% faster so, and 16k causal ones 0.5 to
3.6%. Longer backwards, from 2^33 score entries on, were as fast or up to 3.6% slower: the two kernels then run
side by side through their whole length (docs/performance.md, "Backward kernels on two streams"). So only short
ones use two streams.
"""

import os

import torch

SHORT_BWD_SCORES = 2**32  # B * Hq * Sq * Sk (halved when causal) up to which the two streams measured faster
_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def bwd_streams_enabled() -> bool:
    """$RINGATTN_BWD_STREAMS: "1" (default) runs a short backward's two kernels on two streams, "0" never."""
    value = os.environ.get("RINGATTN_BWD_STREAMS", "1")
    if value not in ("0", "1"):
        raise ValueError(f"$RINGATTN_BWD_STREAMS must be 0 or 1, got {value!r}")
    return value == "1"


def short_bwd(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    """Whether a backward has at most SHORT_BWD_SCORES score entries (B * Hq * Sq * Sk, halved when causal)."""
    scores = batch * heads_q * seqlen_q * seqlen_k
    return (scores // 2 if causal else scores) <= SHORT_BWD_SCORES


def bwd_on_two_streams(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether the backward of q (B, Sq, Hq, D) against k (B, Sk, Hkv, D) runs its kernels on two streams: on a
    CUDA device, switched on ($RINGATTN_BWD_STREAMS, checked on every device) and short (short_bwd)."""
    if not bwd_streams_enabled() or not q.is_cuda:
        return False
    batch, seqlen_q, heads_q, _ = q.shape
    return short_bwd(batch, heads_q, seqlen_q, k.shape[1], causal)


def _side_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """One side stream per device and priority, made once."""
    key = (device, priority)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device, priority=priority)
    return _side_streams[key]


def run_side_by_side(first, second, device: torch.device, side: torch.cuda.Stream | None = None) -> None:
    """Launch first() on `side` (default: a side stream of the current stream's priority) and second() on the
    current stream, at once; the current stream then waits for both. Work queued on the current stream before
    this call precedes both, and work queued after follows both, so tensors used by first() may be freed once
    this returns."""
    main = torch.cuda.current_stream(device)
    side = side or _side_stream(device, main.priority)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        first()
    second()
    main.wait_stream(side)
