"""Packed-document bookkeeping of the ring, as pure functions (no communication)."""

import re

import pytest
import torch

from ringattn.parallel.documents import (
    ShardDocuments,
    check_cu_seqlens,
    cu_seqlens_from_position_ids,
    document_ids,
    pad_cu_seqlens,
)
from ringattn.parallel.layout import shard_indices


def _cu(*bounds):
    return torch.tensor(bounds, dtype=torch.int32)


def test_document_ids_follow_the_boundaries():
    assert document_ids(_cu(0, 1, 4, 9), 9).tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2]


def test_cu_seqlens_from_position_ids_of_packed_documents():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 4, 8]
    assert cu_seqlens_from_position_ids(torch.arange(5)).tolist() == [0, 5]


COUNTING = "position_ids must count 0, 1, 2, ... inside each document and restart at 0 at the next one; "


@pytest.mark.parametrize(
    "pos,error,message",
    [
        ([0, 1, 5, 9, 0, 1, 2, 3], ValueError, COUNTING + "token 2 has position 5 after 1 (expected 2, or 0)"),
        ([0, 1, -1, 0, 1], ValueError, COUNTING + "token 2 has position -1 after 1 (expected 2, or 0)"),
        ([0, 1, 2, 1, 2, 3], ValueError, COUNTING + "token 3 has position 1 after 2 (expected 3, or 0)"),
        ([0, 1, 2, 0, 3], ValueError, COUNTING + "token 4 has position 3 after 0 (expected 1, or 0)"),
        ([1, 2, 0], ValueError, "position_ids must start at 0 (the first document's first token), got 1"),
        ([[0, 1], [0, 1]], ValueError, "position_ids must be (S,) or (1, S) with S > 0, got shape (2, 2)"),
        ([0.0, 1.0], TypeError, "position_ids must be an integer tensor, got torch.float32"),
        ([False, True, False], TypeError, "position_ids must be an integer tensor, got torch.bool"),  # was 0, 1, 0
    ],
    ids=["gap", "negative", "decrease", "restart-at-3", "first-not-0", "two-rows", "float", "bool"],
)
def test_position_ids_that_do_not_count_each_document_from_0_raise(pos, error, message):
    """Regression: cu_seqlens_from_position_ids looked only at the zeros, so gaps, negatives and decreases without
    a 0 became document boundaries ([0, 1, 5, 9, 0, 1, 2, 3] -> [0, 4, 8]) instead of an error."""
    with pytest.raises(error, match=re.escape(message)):
        cu_seqlens_from_position_ids(torch.tensor(pos))


def test_padding_is_a_document_of_its_own():
    padded, pad = pad_cu_seqlens(_cu(0, 5, 11), 8)
    assert pad == 5 and padded.tolist() == [0, 5, 11, 16]
    same, none = pad_cu_seqlens(_cu(0, 5, 16), 8)
    assert none == 0 and same.tolist() == [0, 5, 16]
    for multiple in (0, -2, 4.0, True, "8"):  # regression: 0 divided by zero, -2 gave [0, 5, 11, 10], 4.0 a float
        with pytest.raises(ValueError, match="multiple must be a positive integer"):
            pad_cu_seqlens(_cu(0, 5, 11), multiple)
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        pad_cu_seqlens(torch.tensor([0.0, 5.0]), 8)
    # regression: boundaries that are not documents came back padded ([0, 5, 3] -> [0, 5, 3, 8]), refused far away
    with pytest.raises(ValueError, match=r"cu_seqlens must be nondecreasing .*\[0, 5, 3\]"):
        pad_cu_seqlens(_cu(0, 5, 3), 8)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, got 2"):
        pad_cu_seqlens(_cu(2, 5), 8)


@pytest.mark.parametrize(
    "cu,error,match",
    [
        (_cu(0, 4, 8).float(), TypeError, "must be int32 or int64, got torch.float32"),
        ([0, 4, 8], TypeError, "must be a torch.Tensor"),
        (_cu(0), ValueError, "n_docs \\+ 1 >= 2"),
        (_cu(1, 4, 8), ValueError, "must start at 0"),
        (_cu(0, 5, 3, 8), ValueError, "nondecreasing"),
        (_cu(0, 4, 7), ValueError, "must end at the global length 8"),
    ],
    ids=["float", "list", "short", "start", "decreasing", "end"],
)
def test_bad_cu_seqlens_raise(cu, error, match):
    with pytest.raises(error, match=match):
        check_cu_seqlens(cu, 8)


ROWS = {
    # batch: flattened boundaries of batch rows of 24 tokens; documents cross rank and chunk boundaries
    1: (0, 1, 2, 9, 10, 17, 24),  # lengths 1, 1, 7, 1, 7, 7
    2: (0, 1, 2, 9, 10, 17, 24, 36, 41, 48),  # and a row of lengths 12, 5, 7
    3: (0, 1, 2, 9, 10, 17, 24, 48, 49, 55, 72),  # and one document, then lengths 1, 6, 17
    4: (0, 0, 1, 2, 2, 9, 24, 24, 30, 48, 48, 48, 60, 72, 96, 96),  # empty documents: first, inside, at row ends
}


@pytest.mark.parametrize("batch", sorted(ROWS), ids=[f"B{b}" for b in sorted(ROWS)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_documents_match_global_ids_and_blocks_meet_iff_a_pair_shares_a_document(layout, batch):
    """Every rank's ids are its shard of the global ids; a block meets where some pair shares a document, and lies
    in one document where, in every batch row, all its rows do."""
    world_size, seqlen_local = 3, 8
    seqlen = world_size * seqlen_local
    cu = _cu(*ROWS[batch])
    check_cu_seqlens(cu, batch * seqlen, row=seqlen)
    docs = ShardDocuments(cu, seqlen_local, world_size, layout, "cpu", batch)
    ids = document_ids(cu, batch * seqlen).reshape(batch, seqlen)
    for rank in range(world_size):
        local = docs.ids(rank, range(0, seqlen_local))
        assert local.shape == (batch, seqlen_local) and local.stride(-1) == 1
        assert torch.equal(local, ids[:, shard_indices(seqlen, rank, world_size, layout)])
    halves = [range(0, seqlen_local // 2), range(seqlen_local // 2, seqlen_local), range(0, seqlen_local)]
    for q_rank in range(world_size):
        for kv_rank in range(world_size):
            for q_rows in halves:
                for kv_rows in halves:
                    q_ids = docs.ids(q_rank, q_rows)  # (B, n)
                    k_ids = docs.ids(kv_rank, kv_rows)
                    shares = bool((q_ids[:, :, None] == k_ids[:, None, :]).any())  # in the same batch row
                    one = all(len(set(q.tolist() + k.tolist())) == 1 for q, k in zip(q_ids, k_ids, strict=True))
                    assert docs.meeting(q_rank, q_rows, kv_rank, kv_rows) == (shares, one)


def test_cu_seqlens_of_a_batch_need_every_row_start():
    """Flattened boundaries of 2 rows of 8 tokens: a document crossing rows is refused, naming the row start."""
    check_cu_seqlens(_cu(0, 3, 8, 16), 16, row=8)
    with pytest.raises(ValueError, match=r"every row start .* row length 8\) .* missing \[8\]"):
        check_cu_seqlens(_cu(0, 3, 9, 16), 16, row=8)
    with pytest.raises(ValueError, match=r"must end at the global length 24 \(3 rows of 8 tokens\), got 16"):
        check_cu_seqlens(_cu(0, 8, 16), 24, row=8)
