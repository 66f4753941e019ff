"""The ring schedule as pure functions (docs/design.md, section 4): which K/V block a rank holds
at each step, and which (query rows, key rows) sub-blocks of it to compute, with which mask.
No communication; unit-tested directly.
"""

from enum import Enum
from typing import NamedTuple

from ..ops.calls import causal_window
from .layout import check_layout, check_local_seqlen, check_rank


class BlockMode(Enum):
    """How one (query rows, key rows) sub-block is computed."""

    FULL = "full"  # every query sees every key
    CAUSAL = "causal"  # bottom-right aligned causal mask (with equal lengths: local key j <= local query i)
    BAND = "band"  # local query i sees local keys j with i - left <= j <= i + right: the task's window


class BlockTask(NamedTuple):
    """One kernel call of a ring step: local query rows of this rank vs local rows of the K/V block in hand; for
    BAND, the kernel's window (left, right) in those rows (None: no limit on that side)."""

    q_rows: range
    kv_rows: range
    mode: BlockMode
    window: tuple[int | None, int | None] = (None, None)


def kv_source_rank(rank: int, step: int, world_size: int) -> int:
    """Group rank whose K/V block `rank` holds at `step` (blocks travel to rank + 1 each step)."""
    return (rank - step) % world_size


def _band_task(
    rank: int, kv_rank: int, causal: bool, window: tuple[int | None, int | None], seqlen_local: int
) -> list[BlockTask]:
    """The contiguous layout's task of `rank` against the block of `kv_rank` under a sliding window (left, right)
    over global positions (causal: right at most 0): global query p sees global key p' with
    p - left <= p' <= p + right. In local rows, with d = (rank - kv_rank) * S_local, local query i sees local key
    j when d - left <= j - i <= d + right; a side that every pair of the block satisfies is dropped, and a block
    no pair of which is visible is skipped."""
    left, right = causal_window(causal, window)
    d = (rank - kv_rank) * seqlen_local
    lo = None if left is None else d - left
    hi = None if right is None else d + right
    reach = seqlen_local - 1  # j - i spans [-reach, reach]
    if (lo is not None and lo > reach) or (hi is not None and hi < -reach):
        return []
    lo = None if lo is None or lo <= -reach else lo
    hi = None if hi is None or hi >= reach else hi
    whole = range(0, seqlen_local)
    if lo is None and hi is None:
        return [BlockTask(whole, whole, BlockMode.FULL)]
    if lo is None and hi == 0:
        return [BlockTask(whole, whole, BlockMode.CAUSAL)]
    return [BlockTask(whole, whole, BlockMode.BAND, (None if lo is None else -lo, hi))]


def block_tasks(
    layout: str,
    rank: int,
    kv_rank: int,
    world_size: int,
    causal: bool,
    seqlen_local: int,
    window: tuple[int | None, int | None] = (None, None),
) -> list[BlockTask]:
    """The sub-blocks `rank` computes against the K/V block of `kv_rank`; an empty list means skip.

    Rows are local: range(0, seqlen_local) is the whole local shard (see layout.shard_ranges for
    their global positions). The tasks of all ranks and steps cover each visible (query, key)
    pair of the global attention matrix exactly once.

    - not causal: the whole block, FULL.
    - "contiguous", causal: kv_rank < rank: FULL; kv_rank == rank: CAUSAL; kv_rank > rank: skip.
    - "zigzag", causal (rank r holds chunks c_r, c_{2W-1-r}; C = seqlen_local / 2):
      kv_rank == r: the whole block, CAUSAL (local order is global order);
      kv_rank < r: all queries vs the first kv chunk (c_kv_rank, earlier than both query chunks), FULL;
      kv_rank > r: the second query chunk (c_{2W-1-r}, later than both kv chunks) vs the whole block, FULL.
      Every rank computes C * (2C + 1) pairs at step 0 and 2 C^2 at every other step.
    - a sliding window `window` = (left, right) over global positions (None: no limit; "contiguous" only): one
      task, FULL, CAUSAL or BAND as the window cuts the block, or none where it misses the block (_band_task).

    Raises:
        ValueError: unknown layout; an odd seqlen_local with "zigzag"; a rank outside [0, world_size); a window
            with "zigzag".
    """
    check_layout(layout)
    check_rank(rank, world_size)
    check_rank(kv_rank, world_size, name="kv_rank")
    check_local_seqlen(seqlen_local, layout)
    if window != (None, None):
        if layout != "contiguous":
            raise ValueError(f"a sliding window needs layout 'contiguous', got {layout!r}")
        return _band_task(rank, kv_rank, causal, window, seqlen_local)
    whole = range(0, seqlen_local)
    if not causal:
        return [BlockTask(whole, whole, BlockMode.FULL)]
    if kv_rank == rank:
        return [BlockTask(whole, whole, BlockMode.CAUSAL)]
    if layout == "contiguous":
        return [BlockTask(whole, whole, BlockMode.FULL)] if kv_rank < rank else []
    chunk = seqlen_local // 2
    if kv_rank < rank:
        return [BlockTask(whole, range(0, chunk), BlockMode.FULL)]
    return [BlockTask(range(chunk, seqlen_local), whole, BlockMode.FULL)]


def last_computing_step(
    layout: str, world_size: int, causal: bool, seqlen_local: int, window: tuple[int | None, int | None] = (None, None)
) -> int:
    """The last ring step at which any rank has a task (block_tasks), the same on every rank: the forward stops
    there, and no K/V travels further. W - 1 but for sliding windows shorter than the ring.

    At step t a rank r >= t holds the block t shards before its own, a rank r < t the block W - t shards after it,
    and a window's tasks depend on that distance only (_band_task); so ranks W - 1 and 0 answer for all of them.
    """
    if window == (None, None):
        return world_size - 1
    last = world_size - 1
    return max(
        (t for t in range(world_size)
         if block_tasks(layout, last, last - t, world_size, causal, seqlen_local, window)
         or (t > 0 and block_tasks(layout, 0, world_size - t, world_size, causal, seqlen_local, window))),
        default=0,
    )  # fmt: skip
