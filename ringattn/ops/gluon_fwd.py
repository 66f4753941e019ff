"""When a forward, public or the ring's step, runs the Gluon kernel (kernels/attn_fwd_gluon.py).

The kernel is Hopper code (warpgroup MMA, TMA, mbarriers) written against triton 3.9's Gluon; the interpreter cannot
run Gluon, so CPU calls never take it, and GPU calls take it only on a Hopper GPU (compute capability 9.0) under
triton 3.9, for the forward of 16-bit inputs, public or the ring's step (merged into its fp32 state): no
documents, no rows finished into another buffer, at the head dims where it was checked and timed faster on the H200
(docs/performance.md, "The Gluon forward"). $RINGATTN_GLUON says otherwise.
"""

import os

import torch

from .warp_spec import _triton_version, descriptor_aligned

GLUON_TRITON = (3, 9)  # the triton (major, minor) whose Gluon the kernel is written against
GLUON_HEAD_DIMS = (64, 128)  # the head dims with a launch config, checked on the H200
FASTER_HEAD_DIMS = (128,)  # where it was timed faster than the other kernels (D = 64: 0.92 to 0.99x)
GLUON_MODES = ("0", "1")


def gluon_mode() -> str | None:
    """$RINGATTN_GLUON, checked: unset (None), the Gluon forward is taken at FASTER_HEAD_DIMS; "1", at every head dim
    of GLUON_HEAD_DIMS (the GPU tests); "0", never."""
    value = os.environ.get("RINGATTN_GLUON")
    if value is not None and value not in GLUON_MODES:
        raise ValueError(f"$RINGATTN_GLUON must be one of {', '.join(GLUON_MODES)} (or unset), got {value!r}")
    return value


def fwd_gluon_ready(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    has_docs: bool,
    merge_state: bool,
    has_final: bool,
) -> bool:
    """Whether the forward of q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) into out (B, Sq, Hq, D) and lse (B, Hq, Sq) (merged
    into them with merge_state: the ring's step) takes the Gluon kernel: a Hopper GPU and triton 3.9, fp16 or bf16
    with out in the same dtype (merging: the fp32 state), no documents, no rows finished into another buffer, a
    head dim gluon_mode allows, and q, k, v, out addressable by TMA descriptors (lse's last dim contiguous)."""
    mode = gluon_mode()
    if mode == "0" or not q.is_cuda or has_docs or has_final:
        return False
    if _triton_version() != GLUON_TRITON or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or out.dtype != (torch.float32 if merge_state else q.dtype):
        return False
    if q.shape[-1] not in (GLUON_HEAD_DIMS if mode == "1" else FASTER_HEAD_DIMS):
        return False
    return lse.stride(-1) == 1 and all(descriptor_aligned(t) for t in (q, k, v, out))
