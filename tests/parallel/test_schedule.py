"""The ring schedule as pure functions, checked without any communication."""

import pytest

from ringattn.parallel import BlockMode, contiguous_block_mode, kv_source_rank

F, C, S = BlockMode.FULL, BlockMode.CAUSAL, BlockMode.SKIP


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


def test_contiguous_causal_table_w4():
    """Rows: rank; columns: step. Rank r computes its own diagonal block, then blocks of earlier ranks."""
    expected = [
        [C, S, S, S],
        [C, F, S, S],
        [C, F, F, S],
        [C, F, F, F],
    ]
    table = [
        [contiguous_block_mode(rank, kv_source_rank(rank, step, 4), causal=True) for step in range(4)]
        for rank in range(4)
    ]
    assert table == expected


def test_contiguous_non_causal_computes_everything():
    assert all(contiguous_block_mode(r, s, causal=False) is F for r in range(4) for s in range(4))
