"""The forward kernel merging into a running fp32 (out, lse) state in place (attn_fwd_merge_, the ring's step)."""

import pytest
import torch

from ringattn.ops import attn_fwd, attn_fwd_merge_, attn_fwd_merge_ref_, attn_fwd_ref
from ringattn.testing import check_close
from tests.utils import DEVICE, DTYPES, dtype_id, make_qkv

NEG_INF = float("-inf")
EMPTY_ROWS = 5  # rows 0..4 start with an empty running state (no key seen yet)


def _running_state(q, k_seen, v_seen, softmax_scale, pad=3):
    """A running state after the keys k_seen, v_seen, as views into a larger buffer (the ring's sub-blocks):
    out (B, Sq, Hq, D) fp32 and lse (B, Hq, Sq) float64 from a float64 reference; rows < EMPTY_ROWS reset to
    (0, -inf)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    out64, lse64 = attn_fwd_ref(q.double(), k_seen.double(), v_seen.double(), softmax_scale, False)
    out_buf = torch.full((batch, seqlen_q + 2 * pad, heads_q, head_dim), float("nan"), device=q.device)
    lse_buf = torch.full((batch, heads_q, seqlen_q + 2 * pad), float("nan"), dtype=torch.float64, device=q.device)
    out, lse = out_buf.narrow(1, pad, seqlen_q), lse_buf.narrow(2, pad, seqlen_q)
    out.copy_(out64)
    lse.copy_(lse64)
    out[:, :EMPTY_ROWS] = 0.0
    lse[:, :, :EMPTY_ROWS] = NEG_INF
    return out, lse, out_buf, lse_buf


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q,heads_k", [(4, 4), (4, 1)], ids=["MHA", "MQA"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(17, 17), (97, 41), (41, 97), (129, 65)], ids=lambda s: str(s))
def test_fwd_merge_matches_attention_over_both_key_sets(seqlen_q, seqlen_k, heads_q, heads_k, causal, dtype):
    """State after keys A (float64-exact, rows 0..4 empty), merged in the kernel with a block B (causal or
    not): out and lse follow the tolerance rule against the float64 merge; padding around the views is
    untouched; with causal and Sq > Sk rows that see no key of B keep their state, and rows empty on both
    sides stay exactly (0, -inf)."""
    head_dim = 40
    scale = head_dim**-0.5
    q, k, v, _ = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, seed=seqlen_q + seqlen_k)
    _, k_seen, v_seen, _ = make_qkv(2, seqlen_q, 23, heads_q, heads_k, head_dim, dtype, seed=seqlen_q + 1)
    out, lse, out_buf, lse_buf = _running_state(q, k_seen, v_seen, scale)
    ref_out, ref_lse = out.double(), lse.double()
    attn_fwd_merge_ref_(q.double(), k.double(), v.double(), scale, causal, ref_out, ref_lse)
    pt_out, pt_lse = out.clone(), lse.clone()
    attn_fwd_merge_ref_(q, k, v, scale, causal, pt_out, pt_lse)  # block in the input dtype, merged in fp32
    start_out, start_lse = out.clone(), lse.clone()

    attn_fwd_merge_(q, k, v, scale, causal, out, lse)

    check_close("out", out, pt_out, ref_out)
    check_close("lse", lse, pt_lse, ref_lse)
    assert out_buf[:, :3].isnan().all() and out_buf[:, -3:].isnan().all(), "wrote outside the out view"
    assert lse_buf[:, :, :3].isnan().all() and lse_buf[:, :, -3:].isnan().all(), "wrote outside the lse view"
    unseen = max(seqlen_q - seqlen_k, 0) if causal else 0  # rows that see no key of the block
    assert torch.equal(out[:, EMPTY_ROWS:unseen], start_out[:, EMPTY_ROWS:unseen])
    assert torch.equal(lse[:, :, EMPTY_ROWS:unseen], start_lse[:, :, EMPTY_ROWS:unseen])
    both_empty = min(unseen, EMPTY_ROWS)
    assert (out[:, :both_empty] == 0).all() and (lse[:, :, :both_empty] == NEG_INF).all()
    assert not out.isnan().any() and not lse.isnan().any()


def test_fwd_merge_into_the_empty_state_is_the_forward():
    """From (0, -inf), one merge gives attn_fwd's fp32 result (the ring's first step)."""
    q, k, v, _ = make_qkv(1, 33, 50, 2, 2, 32, DTYPES[0], seed=3)
    out = torch.zeros(q.shape, device=DEVICE)
    lse = torch.full((1, 2, 33), NEG_INF, dtype=torch.float64, device=DEVICE)
    attn_fwd_merge_(q, k, v, 0.2, True, out, lse)
    want_out, want_lse = attn_fwd(q, k, v, 0.2, True, out_dtype=torch.float32)
    torch.testing.assert_close(out, want_out, rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [32, 128])
@pytest.mark.parametrize("window", [(None, None), (6, 0)], ids=["plain", "window"])
@pytest.mark.parametrize("merge", [attn_fwd_merge_, attn_fwd_merge_ref_], ids=["kernel", "reference"])
def test_fwd_merge_into_a_fresh_state_stores_what_merging_into_the_identity_gives(merge, window, head_dim):
    """fresh=True: views of a state holding garbage (NaN) get the same bits as merging into a filled identity
    (out 0, lse -inf), rows that see no key included, and nothing outside the views changes (the ring's first task
    to reach its rows; D = 128 runs the Gluon forward on Hopper)."""
    q, k, v, _ = make_qkv(2, 41, 29, 4, 2, head_dim, DTYPES[0], seed=5)
    out, lse, out_buf, lse_buf = _running_state(q, k, v, 0.3)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    want_out, want_lse = torch.zeros_like(out), torch.full_like(lse, NEG_INF)
    merge(q, k, v, 0.3, True, want_out, want_lse, window=window)
    merge(q, k, v, 0.3, True, out, lse, window=window, fresh=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert (lse[:, :, :12] == NEG_INF).all()  # causal with Sq - Sk = 12: rows that see no key
    assert out_buf[:, :3].isnan().all() and lse_buf[:, :, -3:].isnan().all(), "wrote outside the views"


def test_bad_running_state_raises_clear_errors():
    q, k, v, _ = make_qkv(1, 8, 8, 2, 1, 32, DTYPES[0])
    out, lse = torch.zeros(q.shape, device=DEVICE), torch.zeros(1, 2, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match=r"out \(running state\) must be a float32 tensor"):
        attn_fwd_merge_(q, k, v, 1.0, False, out.double(), lse)
    with pytest.raises(TypeError, match=r"lse \(running state\) must be a float64 tensor"):
        attn_fwd_merge_(q, k, v, 1.0, False, out, lse.float())
    with pytest.raises(ValueError, match=r"lse \(running state\) must have shape \(1, 2, 8\)"):
        attn_fwd_merge_(q, k, v, 1.0, False, out, lse[:, :, :7])
    with pytest.raises(ValueError, match="out \\(running state\\) must have a contiguous last dim"):
        attn_fwd_merge_(q, k, v, 1.0, False, out.transpose(1, 3).contiguous().transpose(1, 3), lse)
