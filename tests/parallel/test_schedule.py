"""The ring schedule as pure functions, checked without any communication."""

import pytest
import torch

from ringattn.ops.attn_ref import band_visible
from ringattn.parallel import (
    BlockMode,
    BlockTask,
    KVStream,
    block_tasks,
    held_blocks,
    kv_source_rank,
    ring_streams,
    shard_indices,
)

F, C = BlockMode.FULL, BlockMode.CAUSAL
WORLD_SIZES = [1, 2, 3, 4, 5]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_rank_sees_every_block_once(world_size):
    for rank in range(world_size):
        sources = [kv_source_rank(rank, step, world_size) for step in range(world_size)]
        assert sorted(sources) == list(range(world_size))
        assert sources[0] == rank  # step 0: the rank's own block


def test_blocks_travel_to_the_next_rank():
    """What rank r holds at step t + 1 is what rank r - 1 held at step t."""
    world_size = 5
    for step in range(world_size - 1):
        for rank in range(world_size):
            assert kv_source_rank(rank, step + 1, world_size) == kv_source_rank(
                (rank - 1) % world_size, step, world_size
            )


def _table(layout, world_size, causal, seqlen_local):
    """[rank][step] -> the tasks of that rank at that step."""
    return [
        [
            block_tasks(layout, rank, kv_source_rank(rank, step, world_size), world_size, causal, seqlen_local)
            for step in range(world_size)
        ]
        for rank in range(world_size)
    ]


def test_contiguous_causal_table_w4():
    """Rows: rank; columns: step. Rank r computes its own diagonal block, then blocks of earlier ranks."""
    whole = range(0, 7)
    diag, full, skip = [BlockTask(whole, whole, C)], [BlockTask(whole, whole, F)], []
    expected = [
        [diag, skip, skip, skip],
        [diag, full, skip, skip],
        [diag, full, full, skip],
        [diag, full, full, full],
    ]
    assert _table("contiguous", 4, True, 7) == expected


def test_zigzag_causal_table_w4():
    """Rank r holds chunks (c_r, c_{7-r}); C = 5 rows each. At step 0 the whole block is causal; K/V of an
    earlier rank s: all queries vs its first chunk c_s; of a later rank: the second query chunk vs all of it."""
    first, second, whole = range(0, 5), range(5, 10), range(0, 10)
    diag = [BlockTask(whole, whole, C)]
    early = [BlockTask(whole, first, F)]  # K/V from s < r
    late = [BlockTask(second, whole, F)]  # K/V from s > r
    expected = [  # step:  0     1 (kv r-1)  2 (kv r-2)  3 (kv r-3)
        [diag, late, late, late],  # rank 0: kv 3, 2, 1
        [diag, early, late, late],  # rank 1: kv 0, 3, 2
        [diag, early, early, late],  # rank 2: kv 1, 0, 3
        [diag, early, early, early],  # rank 3: kv 2, 1, 0
    ]
    assert _table("zigzag", 4, True, 10) == expected


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_non_causal_computes_every_block_whole(layout):
    whole = range(0, 6)
    assert all(tasks == [BlockTask(whole, whole, F)] for row in _table(layout, 4, False, 6) for tasks in row)


def _area(task: BlockTask) -> int:
    """(query, key) pairs a task computes: all of them, or those with local key j <= local query i."""
    n_q, n_k = len(task.q_rows), len(task.kv_rows)
    if task.mode is F:
        return n_q * n_k
    return sum(min(max(i + n_k - n_q + 1, 0), n_k) for i in range(n_q))


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
def test_zigzag_causal_is_balanced_at_every_step(world_size):
    """The balance claim: every rank computes the same number of (query, key) pairs at every step:
    C (2C + 1) at step 0 and 2 C^2 at every other step (C = chunk length)."""
    chunk = 7
    table = _table("zigzag", world_size, True, 2 * chunk)
    for step in range(world_size):
        areas = [sum(_area(t) for t in table[rank][step]) for rank in range(world_size)]
        assert areas == [chunk * (2 * chunk + 1) if step == 0 else 2 * chunk**2] * world_size, (step, areas)


def test_contiguous_causal_is_unbalanced():
    """The problem zigzag solves: with the contiguous layout rank 0 idles after step 0."""
    table = _table("contiguous", 4, True, 8)
    work = [sum(_area(t) for tasks in row for t in tasks) for row in table]
    assert work == [36, 100, 164, 228]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_tasks_cover_the_attention_matrix_exactly_once(layout, world_size, causal):
    """Mapping every task's local rows to global positions (layout.shard_indices), the tasks of all
    ranks and steps cover the global causal lower triangle (or the whole square) once, and nothing else.
    This also checks that a CAUSAL task's local mask is the global causal mask on its rows."""
    seqlen_local = 6
    seqlen = seqlen_local * world_size
    count = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    for rank in range(world_size):
        q_pos = shard_indices(seqlen, rank, world_size, layout)
        for step in range(world_size):
            kv_rank = kv_source_rank(rank, step, world_size)
            kv_pos = shard_indices(seqlen, kv_rank, world_size, layout)
            for task in block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local):
                n_q, n_k = len(task.q_rows), len(task.kv_rows)
                local = torch.ones(n_q, n_k, dtype=torch.int64)
                if task.mode is C:
                    local = torch.tril(local, diagonal=n_k - n_q)
                rows = q_pos[task.q_rows.start : task.q_rows.stop]
                cols = kv_pos[task.kv_rows.start : task.kv_rows.stop]
                count[rows[:, None], cols[None, :]] += local
    expected = torch.ones(seqlen, seqlen, dtype=torch.int64)
    assert torch.equal(count, torch.tril(expected) if causal else expected)


def test_block_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError, match="layout must be one of"):
        block_tasks("striped", 0, 0, 2, True, 8)
    with pytest.raises(ValueError, match="seqlen_local = 7 must be divisible by 2"):
        block_tasks("zigzag", 0, 1, 2, True, 7)
    with pytest.raises(ValueError, match="kv_rank must be in"):
        block_tasks("zigzag", 0, 2, 2, True, 8)


WINDOWS = [(0, 0), (1, None), (5, 2), (None, 3), (7, None), (13, 13), (100, 100)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_window_tasks_cover_the_band_exactly_once(layout, world_size, window, causal):
    """A sliding window over global positions (S_local = 6: zigzag chunks of 3): mapping every task's local mask
    (bottom-right aligned, as the kernels apply it) to global positions, the tasks of every rank against its own
    block and the blocks the K/V streams bring it (ring_streams) cover the global band (cut by causal) once and
    nothing else, reading only the rows the streams carry; windows shorter, as long as and longer than a chunk
    and a shard, one-sided ones."""
    seqlen_local = 6
    seqlen = seqlen_local * world_size
    count = torch.zeros(seqlen, seqlen, dtype=torch.int64)
    streams = ring_streams(layout, world_size, causal, seqlen_local, window)
    for rank in range(world_size):
        q_pos = shard_indices(seqlen, rank, world_size, layout)
        held = [(rank, (range(0, seqlen_local),))] + [
            (kv_rank, streams[i].rows) for step in range(1, world_size) for i, kv_rank in
            held_blocks(streams, rank, step, world_size)
        ]  # fmt: skip
        for kv_rank, carried in held:
            kv_pos = shard_indices(seqlen, kv_rank, world_size, layout)
            for task in block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local, window):
                assert any(r.start <= task.kv_rows.start and task.kv_rows.stop <= r.stop for r in carried), task
                sq, sk = len(task.q_rows), len(task.kv_rows)
                visible = band_visible(task.mode is C, task.window, sq, sk, torch.device("cpu"))
                local = torch.ones(sq, sk, dtype=torch.int64) if visible is None else visible.to(torch.int64)
                rows, cols = q_pos[task.q_rows.start : task.q_rows.stop], kv_pos[task.kv_rows.start : task.kv_rows.stop]
                count[rows[:, None], cols[None, :]] += local
    left, right = window
    expected = band_visible(causal, window, seqlen, seqlen, torch.device("cpu"))
    assert torch.equal(count, torch.ones_like(count) if expected is None else expected.to(torch.int64))
    if layout == "contiguous" and left is not None and right is not None and max(left, right) < seqlen_local:
        assert all(  # only the neighbours' blocks
            not block_tasks("contiguous", r, kv, world_size, causal, seqlen_local, window)
            for r in range(world_size) for kv in range(world_size) if abs(r - kv) > 1
        )  # fmt: skip
    # no more rows travel than round the ring whole
    assert sum(s.steps * sum(map(len, s.rows)) for s in streams) <= (world_size - 1) * seqlen_local


def test_zigzag_window_own_block_is_a_band_per_chunk():
    """W = 4, rank 1 holds chunks c_1, c_6 (4 rows each): a window shorter than the gap between them gives each
    chunk its band; the last rank's chunks c_3, c_4 are adjacent, so its block is one band."""
    first, second, whole = range(0, 4), range(4, 8), range(0, 8)
    B = BlockMode.BAND
    assert block_tasks("zigzag", 1, 1, 4, True, 8, (2, 0)) == [
        BlockTask(first, first, B, (2, 0)), BlockTask(second, second, B, (2, 0))
    ]  # fmt: skip
    assert block_tasks("zigzag", 3, 3, 4, True, 8, (2, 0)) == [BlockTask(whole, whole, B, (2, 0))]


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_without_a_window_blocks_go_round_the_ring_whole(world_size):
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            want = () if world_size == 1 else (KVStream(1, world_size - 1, (range(0, 8),)),)
            assert ring_streams(layout, world_size, causal, 8) == want


def test_windowed_streams_carry_the_windows_rows_one_hop():
    """Shards of 16 over W = 8, a causal window of 3 keys. Contiguous: the last 3 rows of each block, one hop on.
    Zigzag (chunks of 8): a rank's first chunk needs the end of its predecessor's first chunk, its second chunk the
    end of its successor's second chunk: one hop each way, 3 rows each, instead of the whole block round the ring."""
    assert ring_streams("contiguous", 8, True, 16, (3, None)) == (KVStream(1, 1, (range(13, 16),)),)
    assert ring_streams("zigzag", 8, True, 16, (3, None)) == (
        KVStream(1, 1, (range(5, 8),)), KVStream(-1, 1, (range(13, 16),))
    )  # fmt: skip
    # two-sided without causal: contiguous needs both neighbours, zigzag both chunks' edges both ways
    assert ring_streams("contiguous", 8, False, 16, (3, 2)) == (
        KVStream(1, 1, (range(13, 16),)), KVStream(-1, 1, (range(0, 2),))
    )  # fmt: skip
    assert ring_streams("zigzag", 8, False, 16, (3, 2)) == (
        KVStream(1, 1, (range(5, 10),)), KVStream(-1, 1, (range(0, 2), range(13, 16)))
    )  # fmt: skip
    assert ring_streams("zigzag", 8, True, 16, (0, None)) == ()  # the own block only
