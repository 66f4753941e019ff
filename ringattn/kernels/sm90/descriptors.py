"""TMA descriptors of the Gluon kernels' operands, made on the host once a launch and passed as kernel parameters,
so that no program writes and fences descriptors of its own in global memory before its first load."""

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def head_tiles(t: torch.Tensor, rows: int, cols: int | None = None) -> TensorDescriptor:
    """Descriptor of t (B, S, H, D) in (1, rows, 1, cols) tiles (cols: D unless given), 128-byte swizzled: the tile
    of batch b, rows [s, s + rows), head h and columns from c is at coordinates (b, s, h, c); rows past S load as
    zeros and are not stored. t's last dim contiguous, its base and other strides 16-byte aligned."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=t.element_size() * 8, rank=4)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, rows, 1, cols or t.shape[-1]], layout)


def row_tiles(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of t (B, H, S) fp32 (a plane of the row stats), last dim contiguous, in (1, 1, rows) tiles, not
    swizzled: batch b, head h, rows [s, s + rows) at coordinates (b, h, s)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows], layout)
