"""The ring schedule as pure functions: which K/V block a rank holds at each step and how
that block is computed against the local queries. No communication; unit-tested directly.
"""

from enum import Enum


class BlockMode(Enum):
    """How one (Q block, K/V block) pair is computed."""

    FULL = "full"  # every query sees every key
    CAUSAL = "causal"  # the diagonal block: bottom-right aligned causal mask
    SKIP = "skip"  # no query sees any key: not computed


def kv_source_rank(rank: int, step: int, world_size: int) -> int:
    """Group rank whose K/V block `rank` holds at `step` (blocks travel to rank + 1 each step)."""
    return (rank - step) % world_size


def contiguous_block_mode(rank: int, kv_rank: int, causal: bool) -> BlockMode:
    """Mode of rank's queries against kv_rank's keys in the contiguous layout
    (rank r holds tokens [r * S_local, (r + 1) * S_local))."""
    if not causal or kv_rank < rank:
        return BlockMode.FULL
    if kv_rank == rank:
        return BlockMode.CAUSAL
    return BlockMode.SKIP
