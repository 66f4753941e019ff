"""Sequence layouts: the pure index maps, padding, and shard / unshard / position_ids on spawned ranks."""

import re

import pytest
import torch
import torch.distributed as dist

import ringattn
from ringattn.parallel import LAYOUTS, check_seqlen, shard_ranges
from ringattn.parallel.comm import CommunicationError
from tests.distributed import raised_errors, run_ranks

WORLD_SIZES = [1, 2, 3, 4, 5]


def test_zigzag_index_map_w4():
    """16 tokens, 8 chunks of 2: rank r holds c_r then c_{7-r}."""
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [ringattn.shard_indices(16, r, 4, "zigzag").tolist() for r in range(4)] == expected
    assert shard_ranges(16, 1, 4, "zigzag") == [range(2, 4), range(12, 14)]


def test_contiguous_index_map_w3():
    assert [ringattn.shard_indices(12, r, 3, "contiguous").tolist() for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shards_partition_the_sequence_in_increasing_order(layout, world_size):
    """Every global position is on exactly one rank, each rank holds S / W of them, and local order is
    global order (the schedule's CAUSAL tasks rely on it)."""
    seqlen = 2 * world_size * 3
    shards = [ringattn.shard_indices(seqlen, r, world_size, layout) for r in range(world_size)]
    assert all(s.dtype == torch.int64 and s.numel() == seqlen // world_size for s in shards)
    assert all(bool((s[1:] > s[:-1]).all()) for s in shards)
    assert sorted(torch.cat(shards).tolist()) == list(range(seqlen))


def test_index_maps_reject_bad_lengths_layouts_and_ranks():
    with pytest.raises(ValueError, match=r"seqlen = 10 must be a non-negative multiple of 6 \(2 x world size 3\)"):
        ringattn.shard_indices(10, 0, 3, "zigzag")
    with pytest.raises(ValueError, match=r"seqlen = 10 must be a non-negative multiple of 4 \(world size 4\)"):
        ringattn.shard_indices(10, 0, 4, "contiguous")
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 9 .* multiple of 4"):
        check_seqlen(9, 2, "zigzag", name="x.shape[1]")
    with pytest.raises(ValueError, match="layout must be one of"):
        ringattn.shard_indices(8, 0, 2, "striped")
    with pytest.raises(ValueError, match="rank must be in"):
        ringattn.shard_indices(8, 2, 2, "zigzag")
    with pytest.raises(ValueError, match="rank and world_size must be ints, got True and 2"):  # was read as rank 1
        ringattn.shard_indices(8, True, 2, "zigzag")
    # a sequence of 0 tokens holds no token on any rank (regression: the grid's raised torch.cat's error)
    assert ringattn.grid_shard_indices(0, 1, 2, 1, 2, "zigzag").tolist() == []
    assert ringattn.shard_indices(0, 1, 2, "zigzag").tolist() == []


def test_pad_to_multiple():
    x = torch.arange(2 * 10, dtype=torch.int64).view(2, 10)
    padded, length = ringattn.pad_to_multiple(x, dim=1, multiple=8, value=-100)
    assert length == 10 and padded.shape == (2, 16)
    assert torch.equal(padded[:, :10], x) and bool((padded[:, 10:] == -100).all())
    y = torch.randn(1, 5, 2, 8)
    padded, length = ringattn.pad_to_multiple(y, dim=-3, multiple=6)
    assert length == 5 and padded.shape == (1, 6, 2, 8) and torch.equal(padded[:, :5], y)
    assert bool((padded[:, 5:] == 0).all())
    same, length = ringattn.pad_to_multiple(y, dim=1, multiple=5)
    assert same is y and length == 5
    for multiple in (0, 2.0, True):
        with pytest.raises(ValueError, match="multiple must be a positive integer"):
            ringattn.pad_to_multiple(y, 1, multiple)
    with pytest.raises(ValueError, match=r"dim must be in \[-4, 4\) for a tensor of 4 dims, got 4"):
        ringattn.pad_to_multiple(y, 4, 6)
    # a value the dtype cannot hold is refused, not written changed (regression: -100.5 padded int labels with -100)
    for value in (-100.5, float("inf"), float("nan"), 2**63):
        with pytest.raises(
            ValueError, match=rf"value {re.escape(repr(value))} must be an integer in \[-9223372036854775808"
        ):
            ringattn.pad_to_multiple(x, 1, 8, value)
    with pytest.raises(ValueError, match=r"value 2 must be an integer in \[0, 1\] for a tensor of dtype torch.bool"):
        ringattn.pad_to_multiple(x > 3, 1, 8, 2)
    with pytest.raises(TypeError, match="value must be a real number, got str"):
        ringattn.pad_to_multiple(y, 1, 6, "0")
    assert ringattn.pad_to_multiple(y, 1, 6, float("-inf"))[0][:, 5:].isneginf().all()  # infinities for floats
    # regression: int64 values past 2^53 went through a double (2^63 - 1 written as -2^63), and a float past the
    # dtype's range raised torch's RuntimeError
    for value in (2**53 + 1, 2**63 - 1, -(2**63) + 1):
        assert ringattn.pad_to_multiple(x, 1, 8, value)[0][0, -1].item() == value
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=r"value 1e\+300 is out of range for a tensor of dtype"):
            ringattn.pad_to_multiple(y.to(dtype), 1, 6, 1e300)
    with pytest.raises(ValueError, match=r"value 1000000000000000000000\d* is out of range for a tensor of dtype"):
        ringattn.pad_to_multiple(y, 1, 6, 10**400)  # an int past float's range: not an OverflowError
    with pytest.raises(ValueError, match=r"must be an integer in \[-9223372036854775808"):
        ringattn.pad_to_multiple(x, 1, 8, -(10**400))
    # regression: a float length failed inside range(): 'float' object cannot be interpreted as an integer
    with pytest.raises(TypeError, match=r"seqlen must be an int, got 16.0 \(float\)"):
        ringattn.shard_indices(16.0, 0, 2, "zigzag")


def test_helpers_without_process_group_raise():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringattn.shard(torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringattn.position_ids(8)


def _shard_unshard_round_trip(rank, world_size):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4 * world_size * 3, 3, 8, generator=gen)  # (B, S, H, D), the same on every rank
    lse = torch.randn(2, 3, 4 * world_size * 3, generator=gen)  # (B, H, S)
    for layout in LAYOUTS:
        idx = ringattn.shard_indices(x.shape[1], rank, world_size, layout)
        pos = ringattn.position_ids(x.shape[1], layout=layout)
        assert torch.equal(pos, idx)
        x_local = ringattn.shard(x, layout=layout)
        assert x_local.is_contiguous() and torch.equal(x_local, x[:, idx])
        assert torch.equal(ringattn.unshard(x_local, layout=layout), x)
        lse_local = ringattn.shard(lse, dim=-1, layout=layout)
        assert torch.equal(lse_local, lse[:, :, idx])
        assert torch.equal(ringattn.unshard(lse_local, dim=2, layout=layout), lse)
        # shard is differentiable; unshard is not
        x_req = x.clone().requires_grad_()
        ringattn.shard(x_req, layout=layout).sum().backward()
        assert torch.equal(x_req.grad, torch.zeros_like(x).index_fill_(1, idx, 1.0))
        assert not ringattn.unshard(x_local.requires_grad_(), layout=layout).requires_grad
    with pytest.raises(ValueError, match=r"x.shape\[1\] = 5 must be a non-negative multiple"):
        ringattn.shard(torch.zeros(1, 5), layout="zigzag")
    with pytest.raises(ValueError, match=r"x_local.shape\[1\] = 3 must be divisible by 2"):
        ringattn.unshard(torch.zeros(1, 3), layout="zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        ringattn.position_ids(8, layout="striped")
    # a dim out of range is refused, not taken modulo the number of dims
    with pytest.raises(ValueError, match=r"dim must be in \[-4, 4\) for a tensor of 4 dims, got 7"):
        ringattn.shard(x, dim=7)
    with pytest.raises(ValueError, match=r"dim must be in \[-4, 4\) for a tensor of 4 dims, got -5"):
        ringattn.unshard(ringattn.shard(x), dim=-5)
    assert torch.equal(ringattn.shard(x, dim=-3), ringattn.shard(x, dim=1))
    # a 1 x 1 grid (this rank's own group as the Ulysses group, no ring) exchanges nothing: unshard still returns a
    # new tensor, as every other path does (it returned x_local's own memory)
    alone = [torch.distributed.new_group([r]) for r in range(world_size)]  # every process makes every group
    x_local = ringattn.shard(x, ulysses_group=alone[rank])
    whole = ringattn.unshard(x_local, ulysses_group=alone[rank])
    assert torch.equal(whole, x) and whole.data_ptr() != x_local.data_ptr()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_unshard_round_trip_on_ranks(world_size):
    assert run_ranks(_shard_unshard_round_trip, world_size) == [True] * world_size


def _helpers_that_disagree(rank, world_size):
    """Each case: every rank's call, which only differs on rank 1; returns {case: (message, seconds)}."""
    sp = ringattn.SequenceParallel()
    cases = {
        "unshard-lengths": lambda: ringattn.unshard(torch.zeros(1, 6 if rank == 1 else 8, 2, 8)),
        "unshard-dtype": lambda: ringattn.unshard(torch.zeros(1, 8, 2, 8, dtype=torch.int32 if rank else None)),
        "unshard-dim": lambda: ringattn.unshard(torch.zeros(4, 4), dim=rank),
        "unshard-zigzag-odd": lambda: ringattn.unshard(torch.zeros(1, 3 if rank == 1 else 4)),
        "shard-lengths": lambda: ringattn.shard(torch.zeros(1, 24 if rank == 1 else 16)),
        "shard-dim": lambda: ringattn.shard(torch.zeros(8, 8, 2), dim=9 if rank == 1 else 1),
        "gather-lengths": lambda: sp.gather(torch.zeros(2, 6 if rank == 1 else 8, 97)),
    }
    # a regression: an AttributeError on rank 1 alone, the other waiting out the timeout
    not_tensors = {"shard-not-a-tensor": lambda: ringattn.shard([[0.0] * 8] if rank == 1 else torch.zeros(1, 8))}
    results = raised_errors(cases) | raised_errors(not_tensors, TypeError)
    # last: ranks making different calls are out of step, and the group is refused from then on
    results |= raised_errors({"shard-or-unshard": lambda: (ringattn.unshard if rank == 1 else ringattn.shard)(
        torch.zeros(1, 8))})  # fmt: skip
    after = raised_errors({"after": lambda: ringattn.shard(torch.zeros(1, 8))}, CommunicationError)
    return results, after["after"]


EXPECTED = {
    "unshard-lengths": "unshard: the ranks of the group disagree on x_local.shape (rank 0: (1, 8, 2, 8), rank 1: "
    "(1, 6, 2, 8))",
    "unshard-dtype": "x_local.dtype (rank 0: float32, rank 1: int32)",
    "unshard-dim": "dim (rank 0: 0, rank 1: 1)",
    "unshard-zigzag-odd": "unshard refused on group rank 1 of 2: x_local.shape[1] = 3 must be divisible by 2",
    "shard-lengths": "shard: the ranks of the group disagree on x.shape (rank 0: (1, 16), rank 1: (1, 24))",
    "shard-dim": "shard refused on group rank 1 of 2: dim must be in [-3, 3) for a tensor of 3 dims, got 9",
    "gather-lengths": "x_local.shape (rank 0: (2, 8, 97), rank 1: (2, 6, 97))",
    "shard-or-unshard": "different collective calls (rank 0: shard, rank 1: unshard)",
    "shard-not-a-tensor": "shard refused on group rank 1 of 2: x must be a torch.Tensor, got list",
}


def test_helpers_that_disagree_raise_on_every_rank():
    """Regression: unshard with shard lengths that differ across ranks (8 against 6) aborted the process (gloo:
    "Received data size doesn't match expected size"); with equal byte sizes (another dtype or dim) it returned a
    wrong tensor silently; shard(x, dim=7) on a 4-D tensor sharded dim 3. Now shard, unshard and
    SequenceParallel.gather compare the ranks' shapes, dtypes, dim and layout (and which helper each rank calls)
    before any data moves, and a local refusal on one rank is raised by every rank: the same ValueError on both
    ranks, within a second. Ranks calling different helpers are out of step: later calls on the group raise at once."""
    results, after = zip(*run_ranks(_helpers_that_disagree, 2), strict=True)
    for rank, (message, elapsed) in enumerate(after):
        assert message.startswith(f"shard's agreement check (all_gather) on group rank {rank} of 2: the group cannot "
                                  "be used again on this rank: its ranks fell out of step at an earlier call (rank 0: "
                                  "shard, rank 1: unshard)"), message  # fmt: skip
        assert elapsed < 0.1
    for name, expected in EXPECTED.items():
        assert results[0][name][0] == results[1][name][0], f"{name}: {results[0][name]} vs {results[1][name]}"
        assert expected in results[0][name][0], results[0][name][0]
        assert all(r[name][1] < 1.0 for r in results), f"{name}: {[r[name][1] for r in results]}"
