"""ringattn: exact ring attention over sequences sharded across ranks, with fused Triton kernels."""

from .functional import flash_attn_func, flash_attn_varlen_func, ring_attn_func, ring_attn_varlen_func
from .parallel.documents import cu_seqlens_from_position_ids, pad_cu_seqlens
from .parallel.layout import (
    LAYOUTS,
    grid_shard_indices,
    pad_to_multiple,
    position_ids,
    shard,
    shard_indices,
    unshard,
)
from .ulysses import ulysses_ring_attn_func, ulysses_ring_attn_varlen_func

__all__ = [
    "LAYOUTS",
    "cu_seqlens_from_position_ids",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "grid_shard_indices",
    "pad_cu_seqlens",
    "pad_to_multiple",
    "position_ids",
    "ring_attn_func",
    "ring_attn_varlen_func",
    "shard",
    "shard_indices",
    "ulysses_ring_attn_func",
    "ulysses_ring_attn_varlen_func",
    "unshard",
]
__version__ = "0.1.0"

# the model-level surface: a layer, and the sequence-parallel toolkit (ringattn.sequence_parallel)
from . import nn  # noqa: E402
from .nn import RingAttention  # noqa: E402
from .sequence_parallel import SequenceParallel, ShardedBatch  # noqa: E402

__all__ += ["RingAttention", "SequenceParallel", "ShardedBatch", "nn"]
