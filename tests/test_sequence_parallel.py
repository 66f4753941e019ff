"""The sequence-parallel toolkit: labels shifted before sharding, a loss and gradients equal to the unsharded
ones, gather, on spawned gloo ranks (no attention needed: a per-token model shows the bookkeeping alone)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringattn
from ringattn.parallel import LAYOUTS
from ringattn.sequence_parallel import IGNORE_INDEX, cross_entropy, shift_labels, sync_gradients
from tests.distributed import run_ranks


def test_shift_labels():
    labels = torch.tensor([[5, 6, 7, 8], [1, -100, 3, 4]])
    assert shift_labels(labels).tolist() == [[6, 7, 8, -100], [-100, 3, 4, -100]]
    assert shift_labels(labels, ignore_index=-1)[:, -1].tolist() == [-1, -1]


def test_toolkit_without_process_group_raises():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringattn.SequenceParallel()
    with pytest.raises(RuntimeError, match="collective"):
        cross_entropy(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.int64))


def _per_token_model(vocab, dim):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), torch.nn.Tanh(), torch.nn.Linear(dim, vocab)).double()


def _toolkit_matches_unsharded(rank, world_size, seqlen):
    vocab, batch = 11, 3
    gen = torch.Generator().manual_seed(seqlen)
    input_ids = torch.randint(0, vocab, (batch, seqlen), generator=gen)
    labels = input_ids.clone()
    labels[0, : seqlen // 2] = IGNORE_INDEX
    labels[2, ::3] = IGNORE_INDEX

    ref_model = _per_token_model(vocab, 8)
    logits = ref_model(input_ids)  # (B, S, V)
    ref_loss = F.cross_entropy(logits.flatten(0, 1), shift_labels(labels).flatten(), ignore_index=IGNORE_INDEX)
    ref_loss.backward()

    for layout in LAYOUTS:
        sp = ringattn.SequenceParallel(layout=layout)
        batch_l = sp.shard_batch(input_ids, labels)
        s_pad = -(-seqlen // sp.multiple) * sp.multiple
        assert batch_l.seqlen == s_pad and batch_l.unpadded_seqlen == seqlen
        assert batch_l.input_ids.shape == batch_l.labels.shape == batch_l.position_ids.shape == (batch, s_pad // 3)
        idx = ringattn.shard_indices(s_pad, rank, world_size, layout)
        assert torch.equal(batch_l.position_ids, idx.expand(batch, -1))
        # each token's target is the next global token, even where that token lives on another rank
        full_targets = F.pad(shift_labels(labels), (0, s_pad - seqlen), value=IGNORE_INDEX)
        assert torch.equal(batch_l.labels, full_targets[:, idx])

        for reduction, factor in (("sum", 1), ("mean", world_size)):
            model = _per_token_model(vocab, 8)
            logits_l = model(batch_l.input_ids)  # (B, S_local, V)
            loss = sp.cross_entropy(logits_l, batch_l.labels, grad_reduction=reduction)
            loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-14, atol=0)
            sync_gradients(model)
            for p, p_ref in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p.grad, factor * p_ref.grad, rtol=1e-12, atol=1e-15)

        # DistributedDataParallel over the same group averages the gradients: grad_reduction="mean"
        ddp = torch.nn.parallel.DistributedDataParallel(_per_token_model(vocab, 8))
        sp.cross_entropy(ddp(batch_l.input_ids), batch_l.labels, grad_reduction="mean").backward()
        for p, p_ref in zip(ddp.module.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-12, atol=1e-15)

        gathered = sp.gather(logits_l.detach(), seqlen=seqlen)
        torch.testing.assert_close(gathered, logits.detach(), rtol=0, atol=0)

    # nothing counted anywhere: 0 with zero gradients, not NaN
    logits = torch.randn(2, 4, 5, dtype=torch.float64, requires_grad=True)
    loss = cross_entropy(logits, torch.full((2, 4), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        cross_entropy(logits, torch.zeros(2, 4, dtype=torch.int64), grad_reduction="avg")
    with pytest.raises(ValueError, match="labels must have logits' leading shape"):
        cross_entropy(logits, torch.zeros(2, 3, dtype=torch.int64))
    return True


@pytest.mark.parametrize("seqlen", [24, 17], ids=["S24", "S17-padded"])
def test_loss_and_gradients_equal_unsharded_on_3_ranks(seqlen):
    """W = 3; S = 17 is padded to 18 (contiguous) or 18 (zigzag, 2W = 6); float64 so any bookkeeping slip shows."""
    assert run_ranks(_toolkit_matches_unsharded, 3, seqlen) == [True] * 3
