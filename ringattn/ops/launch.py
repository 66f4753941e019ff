"""What every backend's launchers share: a launch built but not run, its config, stride and alignment helpers,
the scratch memory of in-kernel tensor descriptors, and two launches side by side on two CUDA streams.

Layout everywhere: q, out (B, Sq, Hq, D); k, v (B, Sk, Hkv, D); lse (B, Hq, Sq) float64; the backward's row stats
(3, B, Hq, Sq) fp32.
"""

import contextlib
import contextvars
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .calls import BwdCall, FwdCall, key_band
from .final_rows import FinalRows

LOG2E = math.log2(math.e)
# Triton's interpreter patches triton.language for the whole process while a launch runs and restores it after, so
# interpreted launches from two threads at once break each other: they take turns.
_INTERPRETER_LOCK = threading.Lock()


def band_args(call: FwdCall | BwdCall) -> tuple[tuple, dict]:
    """The kernels' (lower, upper, qk_scale, cap_scale) arguments and LOWER, UPPER, SOFTCAP constexprs of a call:
    its key band (calls.key_band) and scale, soft-capped or not (qk_scale then carries softcap * log2(e) and
    cap_scale = softmax_scale / softcap)."""
    lower, upper = key_band(call.causal, call.window, call.q.shape[1], call.k.shape[1])
    scale, cap = call.softmax_scale, call.softcap
    scales = (cap * LOG2E, scale / cap) if cap else (scale * LOG2E, 1.0)
    args = (lower or 0, upper or 0, *scales)
    return args, dict(LOWER=lower is not None, UPPER=upper is not None, SOFTCAP=bool(cap))


def final_args(final: FinalRows | None, out: torch.Tensor) -> tuple:
    """(tensor, its batch, seq and head strides, first row, end row) of a kernel's HAS_FINAL_ROWS arguments; out
    and empty rows when there is none (the kernel then reads none of them)."""
    if final is None:
        return out, 0, 0, 0, 0, 0
    return final.out, *strides(final.out), final.rows.start, final.rows.stop


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and compiler hints of one launch: BLOCK_M query rows and BLOCK_N keys per tile, num_warps,
    num_stages (for the Gluon forward: the depth of its key and value rings)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch, built but not run: kernel[grid](*args, **kwargs), between prepare() and finish() where
    given (tensor work the kernel needs before it, or leaves to after it). `name` is the backend's name of the
    kernel ("portable.fwd", "sm90.bwd", ...: ringattn.ops.KERNELS); launch/tools/kernel_resources.py compiles the
    same launches for a GPU architecture without running them."""

    name: str
    kernel: triton.JITFunction
    grid: tuple[int, int, int]
    args: tuple
    kwargs: dict
    scratch: bool = False  # the kernel makes tensor descriptors, in global scratch memory (run_with_scratch)
    prepare: Callable[[], None] | None = None
    finish: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.prepare is not None:
            self.prepare()
        if self.scratch:
            run_with_scratch(self._launch)
        else:
            self._launch()
        if self.finish is not None:
            self.finish()

    def _launch(self) -> None:
        interpreted = isinstance(self.kernel, InterpretedFunction)
        with _INTERPRETER_LOCK if interpreted else contextlib.nullcontext():
            self.kernel[self.grid](*self.args, **self.kwargs)


def strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def padded_head_dim(head_dim: int) -> int:
    """Head dim rounded up to a power of two of at least 16 (tl.dot's smallest K)."""
    return max(16, triton.next_power_of_2(head_dim))


def descriptor_aligned(t: torch.Tensor) -> bool:
    """Whether TMA descriptors can address t's rows: the last dim contiguous, the base address and every other
    stride 16-byte aligned, and no dimension of more than one element broadcast (stride 0: an expanded tensor,
    which a descriptor's strides are not meant to hold; the launchers' pointer paths take it)."""
    size = t.element_size()
    aligned = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])
    return aligned and all(st != 0 for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)


def device_guard(t: torch.Tensor):
    """Launch on t's GPU, whichever device is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


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


_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """One side stream per device and priority, made once."""
    key = (device, priority)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device, priority=priority)
    return _side_streams[key]


def run_side_by_side(first: Callable[[], None], second: Callable[[], None], device: torch.device) -> None:
    """Launch first() on a side stream of the current stream's priority and second() on the current stream, at
    once; the current stream then waits for both. Work queued on the current stream before this call precedes
    both, and work queued after follows both, so tensors used by first() may be freed once this returns, or once
    either raised (an out-of-memory error a caller catches must not leave first()'s kernel writing memory the
    allocator hands out again)."""
    main = torch.cuda.current_stream(device)
    side = _side_stream(device, main.priority)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            first()
        second()
    finally:
        main.wait_stream(side)
