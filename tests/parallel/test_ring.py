"""Ring attention on W spawned ranks against single-device float64 attention on the whole sequence,
in both layouts: each rank's rows of the reference are its shard_indices."""

import pytest
import torch
import torch.distributed as dist

import ringattn
from ringattn.ops import REFERENCE_OPS
from ringattn.parallel import LAYOUTS, ring_attn_backward, ring_attn_forward, shard_indices
from ringattn.testing import check_close, magnitude
from tests.distributed import RING_BACKENDS, rank_device, run_ranks, skip_without_gpus
from tests.parallel.test_comm_volume import ByteCountingComm
from tests.utils import make_qkv, reference_attention

WORLD_SIZES = [1, 2, 3, 4]


def _ring_matches_reference(
    rank, world_size, backend, dtype, seqlen_local, heads_q, heads_k, head_dim, causal, layout="contiguous"
):
    seqlen = seqlen_local * world_size
    device = rank_device(rank, backend)
    idx = shard_indices(seqlen, rank, world_size, layout, device=device)  # this rank's global positions
    batch = 2 if world_size <= 2 else 1  # the batch's strides on the small rings; the larger ones cost W² steps
    q, k, v, dout = make_qkv(batch, seqlen, seqlen, heads_q, heads_k, head_dim, dtype, device=device, seed=seqlen)
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ring_attn_func(q_l, k_l, v_l, causal=causal, layout=layout, return_lse=True)
    out.backward(dout[:, idx])
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert q_l.grad.dtype == dtype and k_l.grad.dtype == dtype and v_l.grad.dtype == dtype

    scale = head_dim**-0.5
    ref = reference_attention(q, k, v, dout, scale, causal, torch.float64)
    pt = reference_attention(q, k, v, dout, scale, causal, dtype)
    grad_scale = max(magnitude(g) for g in ref[2:])

    def local(i, t):  # lse is (B, H, S); the rest (B, S, H, D)
        return t[:, :, idx] if i == 1 else t[:, idx]

    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        check_close(f"rank {rank} {name}", ours[i], local(i, pt[i]), local(i, ref[i]), None if i < 2 else grad_scale)
    # the gathered output and lse are the whole sequence's, in global order, on every rank
    check_close(f"rank {rank} unshard(out)", ringattn.unshard(out, layout=layout), pt[0], ref[0])
    check_close(f"rank {rank} unshard(lse)", ringattn.unshard(lse, dim=2, layout=layout), pt[1], ref[1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_ring_matches_single_device_reference(backend, dtype, world_size, causal):
    """S_local = 37 is not a multiple of any block size; GQA (4 q heads, 2 kv heads), D = 40."""
    skip_without_gpus(backend, world_size)
    run_ranks(_ring_matches_reference, world_size, backend, dtype, 37, 4, 2, 40, causal, backend=backend)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ring_mqa_matches_single_device_reference(causal):
    run_ranks(_ring_matches_reference, 3, "gloo", torch.float32, 33, 4, 1, 64, causal)


# (world size, q heads, kv heads): GQA on even rings, MQA on the odd one
ZIGZAG_RINGS = [(2, 4, 2), (3, 4, 1), (4, 4, 2)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "world_size,heads_q,heads_k", ZIGZAG_RINGS, ids=[f"W{w}-Hq{hq}-Hkv{hk}" for w, hq, hk in ZIGZAG_RINGS]
)
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_zigzag_ring_matches_single_device_reference(backend, dtype, world_size, heads_q, heads_k, causal):
    """Chunks of 19 tokens (S_local = 38): neither the chunks nor the local shard are block multiples,
    so the sub-block views start and end inside kernel tiles; D = 40."""
    skip_without_gpus(backend, world_size)
    run_ranks(
        _ring_matches_reference, world_size, backend, dtype, 38, heads_q, heads_k, 40, causal, "zigzag", backend=backend
    )


def _ring_of_one_is_the_fused_call(rank, world_size, layout):
    q, k, v, dout = make_qkv(2, 46, 46, 4, 2, 40, torch.float32, device="cpu", seed=5)  # zigzag: chunks of 23
    results = []
    for attn in (ringattn.flash_attn_func, lambda *a, **kw: ringattn.ring_attn_func(*a, layout=layout, **kw)):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = attn(q_, k_, v_, causal=True, return_lse=True)
        out.backward(dout)
        results.append((out, lse, q_.grad, k_.grad, v_.grad))
    for name, fused, ring in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(fused, ring), f"{layout} {name}"
    return True


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_of_one_rank_is_the_fused_call(layout):
    """W = 1: no state to merge and nothing to send; the ring is flash_attn_func, bit for bit."""
    assert run_ranks(_ring_of_one_is_the_fused_call, 1, layout) == [True]


def _ring_loops_are_exact_in_float64(rank, world_size, layout):
    seqlen_local = 14  # zigzag: chunks of 7
    seqlen = seqlen_local * world_size
    idx = shard_indices(seqlen, rank, world_size, layout)
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 4, 2, 8, torch.float64, "cpu", 9)
    q_l, k_l, v_l, dout_l = (t[:, idx] for t in (q, k, v, dout))
    for causal in (False, True):
        comm = ByteCountingComm()
        out, lse = ring_attn_forward(comm, REFERENCE_OPS, q_l, k_l, v_l, 0.5, causal, layout)
        sent_fwd = comm.sent_tensors
        dq, dk, dv = ring_attn_backward(comm, REFERENCE_OPS, dout_l, q_l, k_l, v_l, out, lse, 0.5, causal, layout)
        sent_bwd = comm.sent_tensors - sent_fwd
        ref = reference_attention(q, k, v, dout, 0.5, causal, torch.float64)
        for ours, r in zip((out, dq, dk, dv), (ref[0], ref[2], ref[3], ref[4]), strict=True):
            torch.testing.assert_close(ours.double(), r[:, idx], rtol=0, atol=1e-12)
        torch.testing.assert_close(lse.double(), ref[1][:, :, idx], rtol=0, atol=1e-12)
        # forward: k and v for W - 1 hops; backward: k, v for W - 1 hops and dk, dv for W hops
        assert sent_fwd == 2 * (world_size - 1)
        assert sent_bwd == 2 * (world_size - 1) + (2 * world_size if world_size > 1 else 0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_loops_with_reference_ops_are_exact(layout):
    """The ring's schedule and merge alone, free of kernel rounding: float64 reference block ops
    must reproduce float64 attention to 1e-12 (causal and not), and the loops send the expected
    number of tensors."""
    run_ranks(_ring_loops_are_exact_in_float64, 4, layout)


def _bad_layout_raises_before_communication(rank, world_size):
    q = torch.zeros(1, 8, 2, 32)
    with pytest.raises(ValueError, match="layout must be one of"):
        ringattn.ring_attn_func(q, q, q, layout="striped")
    with pytest.raises(ValueError, match="same local sequence length"):
        ringattn.ring_attn_func(q, q[:, :4], q[:, :4], layout="contiguous")
    with pytest.raises(ValueError, match=r"q.shape\[1\] = 7 must be divisible by 2 for layout 'zigzag'"):
        ringattn.ring_attn_func(q[:, :7], q[:, :7], q[:, :7], layout="zigzag")
    return True


def test_bad_ring_inputs_raise_on_every_rank():
    assert run_ranks(_bad_layout_raises_before_communication, 2) == [True, True]


def test_ring_without_process_group_raises():
    assert not dist.is_initialized()
    q = torch.zeros(1, 8, 2, 32)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ringattn.ring_attn_func(q, q, q, layout="contiguous")


def _ring_window_matches_reference(rank, world_size, seqlen_local, window_size, causal, softcap, layout):
    seqlen = seqlen_local * world_size
    idx = shard_indices(seqlen, rank, world_size, layout)
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 2, 1, 32, torch.float32, device="cpu", seed=seqlen)
    q = q * 2  # scores of a few units, so that soft-capping bends them
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ring_attn_func(q_l, k_l, v_l, causal=causal, window_size=window_size, softcap=softcap,
                                       layout=layout, return_lse=True)  # fmt: skip
    out.backward(dout[:, idx])
    window = tuple(None if side == -1 else side for side in window_size)
    options = dict(window=window, softcap=softcap)
    ref = reference_attention(q, k, v, dout, 32**-0.5, causal, torch.float64, **options)
    pt = reference_attention(q, k, v, dout, 32**-0.5, causal, torch.float32, **options)
    grad_scale = max(magnitude(g) for g in ref[2:])
    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        sel = (slice(None), slice(None), idx) if i == 1 else (slice(None), idx)
        check_close(f"rank {rank} {name}", ours[i], pt[i][sel], ref[i][sel], None if i < 2 else grad_scale)


RING_WINDOWS = {  # (world size, window_size, causal, softcap, layout); S_local = 22: zigzag chunks of 11
    "W2-w0-0": (2, (0, 0), False, 0.0, "contiguous"),
    "W3-w5-causal": (3, (5, -1), True, 0.0, "contiguous"),
    "W3-w30-causal": (3, (30, -1), True, 0.0, "contiguous"),
    "W4-w8-3": (4, (8, 3), False, 0.0, "contiguous"),
    "W3-w-1-25": (3, (-1, 25), False, 0.0, "contiguous"),
    "W3-softcap-causal": (3, (-1, -1), True, 3.0, "contiguous"),
    "W2-w6-softcap": (2, (6, 6), False, 1.5, "contiguous"),
    "zigzag-W3-w5-causal": (3, (5, -1), True, 0.0, "zigzag"),
    "zigzag-W3-w12-causal": (3, (12, -1), True, 0.0, "zigzag"),  # K/V both ways, in rows shared by the two
    "zigzag-W3-w30-causal": (3, (30, -1), True, 0.0, "zigzag"),
    "zigzag-W4-w8-3-softcap": (4, (8, 3), False, 2.0, "zigzag"),
    "zigzag-W3-w-1-2": (3, (-1, 2), False, 0.0, "zigzag"),  # a backward step's tasks overlap in K/V rows
}


@pytest.mark.parametrize("case", list(RING_WINDOWS))
def test_ring_window_and_softcap_match_single_device_reference(case):
    """Windows shorter than a shard (zigzag: than a chunk, so a rank's own block splits into a band per chunk),
    crossing one or two shard boundaries and the gap between a zigzag rank's chunks, one-sided and two-sided,
    causal and not, and soft-capping: K/V travel only as far, one way or both, and in the rows the windows reach
    (ring_streams), the gradients of rows travelling both ways summed at home."""
    world_size, window_size, causal, softcap, layout = RING_WINDOWS[case]
    run_ranks(_ring_window_matches_reference, world_size, 22, window_size, causal, softcap, layout)
