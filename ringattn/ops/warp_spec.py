"""When the backward's dK/dV runs the warp-specialised kernel (kernels/attn_bwd_ws.py), and the scratch memory its
in-kernel tensor descriptors need.

Triton's Hopper partitioner splits that kernel into a TMA producer warpgroup and two consumer warpgroups. It is on
by default on Hopper GPUs with triton 3.9: its form (results stored through descriptors) passed the test suite on
the H200 (`tests/ops`, `tests/parallel/test_simulate.py`, bf16 and fp16) and gave the default kernel's bits in a
diagnostic run (docs/performance.md, "Warp-specialised dK/dV"). It is taken only with triton 3.9, the version
checked: the partitioner has turned correct-looking code into wrong gradients (the kernel's docstring says how), so
a version not checked on a GPU keeps attn_bwd's kernel (3.6, the GPU image's, fails in the partitioner anyway).
So do causal calls, fp32 on a GPU, GQA and MQA, documents, accumulating calls and layouts the descriptors cannot
address.
"""

import contextvars
import os
from collections.abc import Callable

import torch
import triton

WS_TRITON = (3, 9)  # the triton (major, minor) whose Hopper partitioner was checked to split the kernel right
WS_HEAD_DIMS = (64, 128)  # the head dims with a measured launch config


def bwd_ws_enabled(device: torch.device) -> bool:
    """$RINGATTN_BWD_WS: unset, the backward on a GPU may take the warp-specialised dK/dV kernel where it applies
    (Hopper GPUs with triton 3.9) and the interpreter (CPU tensors) never does; "1" lets the interpreter take it too
    (the CPU tests of that kernel); "0" never."""
    value = os.environ.get("RINGATTN_BWD_WS")
    if value not in (None, "0", "1"):
        raise ValueError(f"$RINGATTN_BWD_WS must be 0 or 1 (or unset), got {value!r}")
    return value == "1" or (value is None and device.type == "cuda")


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def descriptor_aligned(t: torch.Tensor) -> bool:
    """Whether TMA descriptors can address t's rows: the last dim contiguous, the base address and every other
    stride 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


def dkdv_ws_ready(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    has_docs: bool,
    add_dkdv: bool,
) -> bool:
    """Whether the backward of q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), dout like q and contiguous lse, delta
    (B, Hq, Sq), into dk, dv like k, takes the warp-specialised dK/dV kernel: enabled (bwd_ws_enabled),
    triton 3.9, not causal, no documents, dK and dV stored rather than added (add_dkdv False: the ring's shares,
    or no accumulators), Hq == Hkv, D of 64 or 128, Sq a multiple of 4, tensors the descriptors can address, and
    on a GPU a Hopper one (compute capability 9.0) and fp16 or bf16 (fp32 would multiply in tf32 there)."""
    if not bwd_ws_enabled(q.device) or causal or has_docs or add_dkdv or _triton_version() != WS_TRITON:
        return False
    if q.shape[2] != k.shape[2] or q.shape[-1] not in WS_HEAD_DIMS or q.shape[1] % 4:
        return False
    if q.is_cuda and (
        torch.cuda.get_device_capability(q.device) != (9, 0) or q.dtype not in (torch.float16, torch.bfloat16)
    ):
        return False
    stats_aligned = lse.data_ptr() % 16 == 0 and delta.data_ptr() % 16 == 0  # with Sq % 4 == 0: every row
    return stats_aligned and all(descriptor_aligned(t) for t in (q, k, v, dout, dk, dv))


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for a launch, from PyTorch's caching allocator on the current device and stream (its blocks
    are 512-byte aligned, more than triton asks)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch_with_torch_scratch(launch: Callable[[], None]) -> None:
    triton.set_allocator(_torch_scratch)
    launch()


def run_with_scratch(launch: Callable[[], None]) -> None:
    """Run launch() with PyTorch's allocator as triton's scratch allocator, set in a copy of the current context,
    so that an allocator the caller set is neither needed nor replaced."""
    contextvars.copy_context().run(_launch_with_torch_scratch, launch)
