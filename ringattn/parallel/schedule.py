"""The ring schedule as pure functions (docs/design.md, section 4): which K/V blocks a rank holds
at each step (ring_streams: round the ring, or with a sliding window only as far as it reaches, one way or both,
in the rows it reads), and which (query rows, key rows) sub-blocks of them to compute, with which mask.
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


def kv_source_rank(rank: int, step: int, world_size: int, direction: int = 1) -> int:
    """Group rank whose K/V block `rank` holds at `step` when blocks travel to rank + direction each step (1: the
    ring's way; -1: a KVStream going the other way)."""
    return (rank - direction * step) % world_size


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
    right at most 0), that is when d - left <= j - i <= d + right. The task is the smallest rectangle of rows that
    holds every visible pair (a window cuts off the rows that see nothing, and the key rows nothing sees), None
    when no pair is visible. A side every pair satisfies is dropped. CAUSAL and BAND are the kernels' bottom-right
    aligned masks: with Sq, Sk rows and shift = Sk - Sq, CAUSAL is j - i <= shift and BAND (L, R) is
    shift - L <= j - i <= shift + R."""
    left, right = causal_window(causal, window)
    lo = None if left is None else d - left
    hi = None if right is None else d + right
    # the visible rows: i with some j in [0, Sk) in [i + lo, i + hi], and j with some i in [0, Sq) in [j - hi, j - lo]
    sq, sk = len(q_rows), len(kv_rows)
    i0, i1 = max(0, 0 if hi is None else -hi), min(sq, sq if lo is None else sk - lo)
    j0, j1 = max(0, 0 if lo is None else lo), min(sk, sk if hi is None else sq + hi)
    if i0 >= i1 or j0 >= j1:
        return None
    q_rows, kv_rows = q_rows[i0:i1], kv_rows[j0:j1]
    lo = None if lo is None or lo - j0 + i0 <= -(len(q_rows) - 1) else lo - j0 + i0
    hi = None if hi is None or hi - j0 + i0 >= len(kv_rows) - 1 else hi - j0 + i0
    shift = len(kv_rows) - len(q_rows)
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
    return list(_block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local, window))


@functools.lru_cache(maxsize=8192)
def _block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local, window) -> tuple[BlockTask, ...]:
    """block_tasks of checked arguments, cached: every ring call of a model's layers asks for the same tasks, at
    every step and again for its finishing plan."""
    tasks = [
        task
        for q_rows, q_start in _segments(layout, rank, world_size, seqlen_local)
        for kv_rows, kv_start in _segments(layout, kv_rank, world_size, seqlen_local)
        if (task := _pair_task(q_rows, kv_rows, q_start - kv_start, causal, window)) is not None
    ]
    return tuple(_joined(tasks, seqlen_local))


class KVStream(NamedTuple):
    """K/V blocks travelling the ring one way: each step to rank + direction (1 or -1), so that at steps
    t = 1 .. steps rank r holds the block of rank r - direction * t (kv_source_rank). Only the block's `rows`
    travel (disjoint, increasing; (range(0, S_local),) for all of them), packed in that order."""

    direction: int
    steps: int
    rows: tuple[range, ...]


def union(ranges) -> tuple[range, ...]:
    """The rows of `ranges` as disjoint, non-adjacent ranges in increasing order."""
    merged: list[range] = []
    for r in sorted((r for r in ranges if len(r)), key=lambda r: r.start):
        if merged and r.start <= merged[-1].stop:
            merged[-1] = range(merged[-1].start, max(merged[-1].stop, r.stop))
        else:
            merged.append(r)
    return tuple(merged)


@functools.lru_cache(maxsize=256)
def ring_streams(
    layout: str, world_size: int, causal: bool, seqlen_local: int, window: tuple[int | None, int | None] = (None, None)
) -> tuple[KVStream, ...]:
    """How K/V travel the ring, the same on every rank: one KVStream, or two (forward first) for a sliding window;
    none when W = 1 or every rank's window lies inside its own block.

    Without a window the blocks go round the ring whole, W - 1 steps. With one, a block o places back (ahead:
    W - o back) is needed by the ranks that have tasks with it (block_tasks), and only in the rows those tasks
    read. The blocks wanted 1 .. T_f places back travel forward for T_f steps, those wanted 1 .. T_b places ahead
    backward for T_b steps, each stream with the rows any of its steps reads; the split between the two is the
    one that moves the fewest rows per rank (T_f |rows_f| + T_b |rows_b|), one forward stream on a tie. So a causal
    window over zigzag shards, whose second chunk needs its successor's block, sends the window's rows of the first
    chunk one hop forward and of the second one hop back, instead of the whole block round the ring; a contiguous
    causal window of w <= S_local keys, the last w rows one hop.
    """
    if world_size == 1:
        return ()
    if window == (None, None):
        return (KVStream(1, world_size - 1, (range(0, seqlen_local),)),)
    # contiguous: at each distance every rank's tasks are those of rank W - 1 (blocks back) or 0 (ahead)
    ranks = (world_size - 1, 0) if layout == "contiguous" else range(world_size)
    wanted = {}  # places back -> the rows of the block read there
    for back in range(1, world_size):
        rows = [t.kv_rows for r in ranks
                for t in block_tasks(layout, r, kv_source_rank(r, back, world_size), world_size, causal, seqlen_local,
                                     window)]  # fmt: skip
        if rows:
            wanted[back] = union(rows)
    best = None
    for split in range(world_size - 1, -1, -1):  # forward takes the distances <= split
        fwd = [b for b in wanted if b <= split]
        bwd = [world_size - b for b in wanted if b > split]
        streams = tuple(
            KVStream(direction, max(steps), union(r for b in wanted if (b <= split) == (direction == 1)
                                                   for r in wanted[b]))
            for direction, steps in ((1, fwd), (-1, bwd)) if steps
        )  # fmt: skip
        cost = sum(s.steps * sum(map(len, s.rows)) for s in streams)
        if best is None or cost < best[0]:
            best = (cost, streams)
    return best[1]


def held_blocks(streams: tuple[KVStream, ...], rank: int, step: int, world_size: int) -> list[tuple[int, int]]:
    """(index of the stream, kv_rank) of each block `rank` holds at `step` >= 1, in the streams' order."""
    return [(i, kv_source_rank(rank, step, world_size, s.direction)) for i, s in enumerate(streams) if step <= s.steps]
