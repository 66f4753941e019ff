"""The fp32 log-sum-exp merge of partial attention states."""

import torch

from ringattn.ops import attn_fwd_ref, merge_attn_states_
from tests.utils import make_qkv

NEG_INF = float("-inf")


def test_merging_two_key_halves_gives_full_attention():
    q, k, v, _ = make_qkv(2, 19, 41, 4, 2, 16, torch.float64, device="cpu", seed=2)
    out_full, lse_full = attn_fwd_ref(q, k, v, 0.3, False)
    out, lse = attn_fwd_ref(q, k[:, :13], v[:, :13], 0.3, False)
    block_out, block_lse = attn_fwd_ref(q, k[:, 13:], v[:, 13:], 0.3, False)
    merge_attn_states_(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, out_full, rtol=0, atol=1e-13)
    torch.testing.assert_close(lse, lse_full, rtol=0, atol=1e-13)


def test_merge_is_order_independent():
    q, k, v, _ = make_qkv(1, 7, 30, 2, 2, 8, torch.float64, device="cpu", seed=4)
    parts = [attn_fwd_ref(q, k[:, i : i + 10], v[:, i : i + 10], 1.0, False) for i in (0, 10, 20)]
    results = []
    for order in ((0, 1, 2), (2, 0, 1)):
        out, lse = (t.clone() for t in parts[order[0]])
        for i in order[1:]:
            merge_attn_states_(out, lse, *parts[i])
        results.append((out, lse))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-14)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-14)


def test_empty_side_contributes_nothing():
    """A block with lse = -inf (no visible key) must leave the running state exactly as it was."""
    out = torch.randn(1, 5, 2, 8)
    lse = torch.randn(1, 2, 5)
    out0, lse0 = out.clone(), lse.clone()
    merge_attn_states_(out, lse, torch.zeros_like(out), torch.full_like(lse, NEG_INF))
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_empty_running_state_takes_the_block():
    out = torch.zeros(1, 5, 2, 8)
    lse = torch.full((1, 2, 5), NEG_INF)
    block_out, block_lse = torch.randn(1, 5, 2, 8), torch.randn(1, 2, 5)
    merge_attn_states_(out, lse, block_out, block_lse)
    assert torch.equal(out, block_out) and torch.equal(lse, block_lse)


def test_both_sides_empty_stay_zero_and_minus_inf_without_nan():
    out = torch.zeros(1, 5, 2, 8)
    lse = torch.full((1, 2, 5), NEG_INF)
    merge_attn_states_(out, lse, torch.zeros_like(out), torch.full_like(lse, NEG_INF))
    assert (out == 0).all() and (lse == NEG_INF).all()


def test_mixed_rows_some_empty():
    """Row-wise: rows empty on one side take the other side; rows empty on both stay empty."""
    out = torch.randn(1, 3, 1, 4)
    lse = torch.tensor([[[0.5, NEG_INF, NEG_INF]]])
    block_out = torch.randn(1, 3, 1, 4)
    block_lse = torch.tensor([[[NEG_INF, 1.5, NEG_INF]]])
    expect_out = torch.stack([out[0, 0], block_out[0, 1], torch.zeros(1, 4)])[None]
    out_row0 = out[:, 0].clone()
    merge_attn_states_(out, lse, block_out.clone(), block_lse)
    assert torch.equal(out[:, 0], out_row0)
    assert torch.equal(out, expect_out)
    assert torch.equal(lse, torch.tensor([[[0.5, 1.5, NEG_INF]]]))


def test_extreme_lse_gap_does_not_overflow():
    out, lse = torch.ones(1, 1, 1, 4), torch.tensor([[[-1000.0]]])
    merge_attn_states_(out, lse, torch.full((1, 1, 1, 4), 2.0), torch.tensor([[[1000.0]]]))
    assert torch.equal(out, torch.full((1, 1, 1, 4), 2.0)) and lse.item() == 1000.0
