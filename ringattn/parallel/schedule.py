"""The ring schedule as pure functions (docs/design.md, section 4): which K/V block a rank holds
at each step, and which (query rows, key rows) sub-blocks of it to compute, with which mask.
No communication; unit-tested directly.
"""

import functools
from enum import Enum
from typing import NamedTuple

from ..ops.calls import causal_window
from .layout import check_layout, check_local_seqlen, check_rank, chunks_per_rank


class BlockMode(Enum):
    """How one (query rows, key rows) sub-block is computed."""

    FULL = "full"  # every query sees every key
    CAUSAL = "causal"  # bottom-right aligned causal mask (with equal lengths: local key j <= local query i)
    BAND = "band"  # the task's window (left, right), bottom-right aligned as flash-attn's window_size


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


def _segments(layout: str, rank: int, world_size: int, seqlen_local: int) -> list[tuple[range, int]]:
    """`rank`'s shard as maximal runs of consecutive global positions: (local rows, global position of the first).
    One run for "contiguous"; two for "zigzag" but on rank W - 1, whose chunks c_{W-1} and c_W are adjacent."""
    chunk = seqlen_local // chunks_per_rank(layout)
    chunk_ids = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    runs: list[tuple[range, int]] = []
    for i, c in enumerate(chunk_ids):
        if runs and runs[-1][1] + len(runs[-1][0]) == c * chunk:
            runs[-1] = (range(runs[-1][0].start, (i + 1) * chunk), runs[-1][1])
        else:
            runs.append((range(i * chunk, (i + 1) * chunk), c * chunk))
    return runs


def _pair_task(
    q_rows: range, kv_rows: range, d: int, causal: bool, window: tuple[int | None, int | None]
) -> BlockTask | None:
    """The task of query rows q_rows (global positions p0 + i) against key rows kv_rows (global p0 - d + j), both
    runs of consecutive positions: global query p sees global key p' when p - left <= p' <= p + right (causal:
    right at most 0), that is when d - left <= j - i <= d + right. A side every pair satisfies is dropped; None
    when no pair is visible. CAUSAL and BAND are the kernels' bottom-right aligned masks: with Sq, Sk rows and
    shift = Sk - Sq, CAUSAL is j - i <= shift and BAND (L, R) is shift - L <= j - i <= shift + R."""
    left, right = causal_window(causal, window)
    sq, sk = len(q_rows), len(kv_rows)
    lo = None if left is None else d - left
    hi = None if right is None else d + right
    if (lo is not None and lo > sk - 1) or (hi is not None and hi < -(sq - 1)):
        return None
    lo = None if lo is None or lo <= -(sq - 1) else lo
    hi = None if hi is None or hi >= sk - 1 else hi
    shift = sk - sq
    if lo is None and hi is None:
        return BlockTask(q_rows, kv_rows, BlockMode.FULL)
    if lo is None and hi == shift:
        return BlockTask(q_rows, kv_rows, BlockMode.CAUSAL)
    return BlockTask(q_rows, kv_rows, BlockMode.BAND, (None if lo is None else shift - lo, None if hi is None
                                                      else hi - shift))  # fmt: skip


def _joined(tasks: list[BlockTask], seqlen_local: int) -> list[BlockTask]:
    """Fewer, larger tasks with the same visible pairs: FULL tasks side by side (the same rows of one, adjacent
    rows of the other) become one, and the pattern of an own zigzag block, CAUSAL on both diagonal chunks with the
    second query chunk FULL against the first key chunk, becomes the whole block CAUSAL."""
    whole = range(0, seqlen_local)
    half = seqlen_local // 2
    first, second = range(0, half), range(half, seqlen_local)
    if len(tasks) == 3 and tasks == [
        BlockTask(first, first, BlockMode.CAUSAL), BlockTask(second, first, BlockMode.FULL),
        BlockTask(second, second, BlockMode.CAUSAL),
    ]:  # fmt: skip
        return [BlockTask(whole, whole, BlockMode.CAUSAL)]
    joined = list(tasks)
    merged = True
    while merged:
        merged = False
        for a in range(len(joined)):
            for b in range(a + 1, len(joined)):
                x, y = joined[a], joined[b]
                if x.mode is not BlockMode.FULL or y.mode is not BlockMode.FULL:
                    continue
                if x.kv_rows == y.kv_rows and x.q_rows.stop == y.q_rows.start:
                    joined[a] = BlockTask(range(x.q_rows.start, y.q_rows.stop), x.kv_rows, BlockMode.FULL)
                elif x.q_rows == y.q_rows and x.kv_rows.stop == y.kv_rows.start:
                    joined[a] = BlockTask(x.q_rows, range(x.kv_rows.start, y.kv_rows.stop), BlockMode.FULL)
                else:
                    continue
                del joined[b]
                merged = True
                break
            if merged:
                break
    return joined


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
    pair of the global attention matrix exactly once. Each run of consecutive global positions of the
    queries meets each run of the keys in one task (_pair_task), FULL, CAUSAL or BAND as the causal mask
    and the sliding window `window` = (left, right) over global positions (None: no limit) cut it, or none
    where no pair is visible; adjacent FULL tasks are then joined (_joined). Without a window that gives:

    - not causal: the whole block, FULL.
    - "contiguous", causal: kv_rank < rank: FULL; kv_rank == rank: CAUSAL; kv_rank > rank: skip.
    - "zigzag", causal (rank r holds chunks c_r, c_{2W-1-r}; C = seqlen_local / 2):
      kv_rank == r: the whole block, CAUSAL (local order is global order);
      kv_rank < r: all queries vs the first kv chunk (c_kv_rank, earlier than both query chunks), FULL;
      kv_rank > r: the second query chunk (c_{2W-1-r}, later than both kv chunks) vs the whole block, FULL.
      Every rank computes C * (2C + 1) pairs at step 0 and 2 C^2 at every other step.

    With a window shorter than a chunk a zigzag rank's own block is up to three tasks (each chunk's band, and
    the second chunk against the first where the window reaches across the gap between them).

    Raises:
        ValueError: unknown layout; an odd seqlen_local with "zigzag"; a rank outside [0, world_size).
    """
    check_layout(layout)
    check_rank(rank, world_size)
    check_rank(kv_rank, world_size, name="kv_rank")
    check_local_seqlen(seqlen_local, layout)
    tasks = [
        task
        for q_rows, q_start in _segments(layout, rank, world_size, seqlen_local)
        for kv_rows, kv_start in _segments(layout, kv_rank, world_size, seqlen_local)
        if (task := _pair_task(q_rows, kv_rows, q_start - kv_start, causal, window)) is not None
    ]
    return _joined(tasks, seqlen_local)


@functools.lru_cache(maxsize=256)
def last_computing_step(
    layout: str, world_size: int, causal: bool, seqlen_local: int, window: tuple[int | None, int | None] = (None, None)
) -> int:
    """The last ring step at which any rank has a task (block_tasks), the same on every rank: the forward stops
    there, and no K/V travels further. W - 1 but for sliding windows shorter than the ring in "contiguous".

    "contiguous": at step t a rank r >= t holds the block t shards before its own, a rank r < t the block W - t
    shards after it, and a window's tasks depend on that distance only; so ranks W - 1 and 0 answer for all of
    them. "zigzag": every rank is asked (a rank's second chunk needs its successor's block, at step W - 1).
    """
    if window == (None, None):
        return world_size - 1
    ranks = (world_size - 1, 0) if layout == "contiguous" else range(world_size)
    return max(
        (t for t in range(world_size)
         if any(block_tasks(layout, r, kv_source_rank(r, t, world_size), world_size, causal, seqlen_local, window)
                for r in ranks)),
        default=0,
    )  # fmt: skip
