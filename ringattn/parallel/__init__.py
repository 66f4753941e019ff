"""The ring: communication, the step schedule and the op-agnostic forward/backward loops."""

from .comm import RingComm
from .ring import ring_attn_backward, ring_attn_forward
from .schedule import BlockMode, contiguous_block_mode, kv_source_rank

__all__ = [
    "BlockMode",
    "RingComm",
    "contiguous_block_mode",
    "kv_source_rank",
    "ring_attn_backward",
    "ring_attn_forward",
]
