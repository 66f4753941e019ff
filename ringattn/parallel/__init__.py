"""The ring: communication, sequence layouts, the step schedule and the op-agnostic forward/backward loops; the
Ulysses x ring grid (grid.py) and its all-to-all exchange (ulysses.py)."""

from .comm import RingComm
from .layout import (
    LAYOUTS,
    check_grid_seqlen,
    check_layout,
    check_local_seqlen,
    check_seqlen,
    chunks_per_rank,
    grid_shard_indices,
    grid_shard_ranges,
    pad_to_multiple,
    position_ids,
    shard,
    shard_indices,
    shard_ranges,
    unshard,
)
from .ring import ring_attn_backward, ring_attn_forward
from .schedule import BlockMode, BlockTask, KVStream, block_tasks, held_blocks, kv_source_rank, ring_streams

__all__ = [
    "LAYOUTS",
    "BlockMode",
    "BlockTask",
    "KVStream",
    "RingComm",
    "block_tasks",
    "check_layout",
    "check_local_seqlen",
    "check_grid_seqlen",
    "check_seqlen",
    "chunks_per_rank",
    "grid_shard_indices",
    "grid_shard_ranges",
    "held_blocks",
    "kv_source_rank",
    "pad_to_multiple",
    "position_ids",
    "ring_attn_backward",
    "ring_attn_forward",
    "ring_streams",
    "shard",
    "shard_indices",
    "shard_ranges",
    "unshard",
]
