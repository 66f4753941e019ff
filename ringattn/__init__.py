"""ringattn: exact ring attention over sequences sharded across ranks, with fused Triton kernels."""

from .functional import flash_attn_func, ring_attn_func

__all__ = ["flash_attn_func", "ring_attn_func"]
__version__ = "0.1.0"
