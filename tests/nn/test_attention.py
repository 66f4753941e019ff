"""ringattn.nn.RingAttention: the module is ring_attn_func with its arguments bound."""

import pytest
import torch

import ringattn
from ringattn.testing import check_close, magnitude
from tests.distributed import RING_BACKENDS, rank_device, run_ranks, skip_without_gpus
from tests.utils import make_qkv, reference_attention


def test_extra_repr_and_bad_layout():
    layer = ringattn.nn.RingAttention(causal=True, softmax_scale=0.125, layout="zigzag")
    assert repr(layer) == "RingAttention(causal=True, softmax_scale=0.125, layout='zigzag', group=world)"
    assert list(layer.parameters()) == []
    with pytest.raises(ValueError, match="layout must be one of"):
        ringattn.nn.RingAttention(layout="striped")


def _layer_matches_reference(rank, world_size, backend, dtype):
    seqlen, scale = 2 * 13 * world_size, 0.2  # zigzag chunks of 13; a scale that is not the default
    device = rank_device(rank, backend)
    idx = ringattn.shard_indices(seqlen, rank, world_size, "zigzag", device=device)
    q, k, v, dout = make_qkv(2, seqlen, seqlen, 4, 2, 24, dtype, device=device, seed=3)
    layer = ringattn.nn.RingAttention(causal=True, softmax_scale=scale, layout="zigzag")
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = layer(q_l, k_l, v_l, return_lse=True)
    out.backward(dout[:, idx])
    ref = reference_attention(q, k, v, dout, scale, True, torch.float64)
    pt = reference_attention(q, k, v, dout, scale, True, dtype)
    grad_scale = max(magnitude(g) for g in ref[2:])
    check_close(f"rank {rank} out", out, pt[0][:, idx], ref[0][:, idx])
    check_close(f"rank {rank} lse", lse, pt[1][:, :, idx], ref[1][:, :, idx])
    for name, ours, i in (("dq", q_l.grad, 2), ("dk", k_l.grad, 3), ("dv", v_l.grad, 4)):
        check_close(f"rank {rank} {name}", ours, pt[i][:, idx], ref[i][:, idx], grad_scale)
    assert torch.equal(layer(q_l, k_l, v_l), out)  # return_lse=False: out only
    return True


@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_layer_matches_reference_on_2_ranks(backend, dtype):
    """Zigzag, causal, GQA (4 q heads, 2 kv heads), head dim 24, an explicit softmax_scale."""
    skip_without_gpus(backend, 2)
    assert run_ranks(_layer_matches_reference, 2, backend, dtype, backend=backend) == [True, True]
