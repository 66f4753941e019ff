"""Attention sinks (learnable_sink) through flash_attn_func, flash_attn_varlen_func and ring_attn_func, against a
float64 reference in which each head's sink is one more key with logit sink[h] and a zero value (the tolerance
rule, the sinks' gradient included)."""

import pytest
import torch

import ringattn
from ringattn.ops import attn_fwd_ref
from ringattn.parallel import shard_indices
from ringattn.testing import check_close, magnitude
from tests.distributed import run_ranks
from tests.utils import DEVICE, DTYPES, make_qkv

DTYPE = DTYPES[0]


def sink_reference(q, k, v, dout, sink, scale, causal, dtype, **options):
    """(out, lse, dq, dk, dv, dsink) in `dtype`: softmax over [scores, sink[h]] as an explicit extra column of the
    score matrix (a key of value 0), by autograd; options as attn_fwd_ref's (window)."""
    q, k, v, sink = (t.detach().to(dtype).requires_grad_() for t in (q, k, v, sink))
    out_keys, lse_keys = attn_fwd_ref(q, k, v, scale, causal, **options)  # the keys alone
    batch, heads, seqlen = lse_keys.shape
    column = sink[None, :, None, None].expand(batch, heads, seqlen, 1)
    lse = torch.logsumexp(torch.cat([lse_keys[..., None], column], dim=-1), dim=-1)
    out = out_keys * torch.exp(lse_keys - lse).transpose(1, 2)[..., None]
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, sink.grad


def _check(what, ours, q, k, v, dout, sink, scale, causal, **options):
    ref = sink_reference(q, k, v, dout, sink, scale, causal, torch.float64, **options)
    pt = sink_reference(q, k, v, dout, sink, scale, causal, q.dtype, **options)
    grad_scale = max(magnitude(g) for g in ref[2:5])
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv", "dsink")):
        check_close(f"{what} {name}", ours[i], pt[i], ref[i], grad_scale if 2 <= i < 5 else None)


SINK_CASES = {  # (seqlen_q, seqlen_k, causal, window_size): rows that see no key get the sink alone (out 0)
    "full": (45, 45, False, (-1, -1)),
    "causal": (45, 45, True, (-1, -1)),
    "causal-window": (60, 60, True, (7, 0)),
    "Sq>Sk-causal": (50, 20, True, (-1, -1)),
}


@pytest.mark.parametrize("case", list(SINK_CASES))
def test_sinks_match_the_extra_key_reference(case):
    seqlen_q, seqlen_k, causal, window_size = SINK_CASES[case]
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, 4, 2, 32, DTYPE, seed=seqlen_q + seqlen_k)
    sink = torch.tensor([-1.0, 0.5, 2.0, 6.0], device=DEVICE)  # from a small share of the mass to most of it
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, sink))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, window_size=window_size, learnable_sink=sink,
                                        return_lse=True)  # fmt: skip
    out.backward(dout)
    window = tuple(None if side == -1 else side for side in window_size)
    _check(case, (out, lse, q.grad, k.grad, v.grad, sink.grad), q, k, v, dout, sink, 32**-0.5, causal, window=window)


def test_a_minus_inf_sink_with_rows_that_see_no_key_has_zero_gradient():
    """A head whose sink is -inf (no sink) where some rows see no key (lse -inf, out 0): its gradient is 0, not NaN
    (regression: exp(sink - lse) was exp(-inf + inf)); everything else as the reference with that sink at -1e4, which
    no row's exp reaches in float64."""
    q, k, v, dout = make_qkv(1, 50, 20, 2, 2, 32, DTYPE, seed=7)
    sink = torch.tensor([0.5, float("-inf")], device=DEVICE)
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, sink))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_lse=True)
    out.backward(dout)
    assert sink.grad[1].item() == 0.0
    no_key = lse == float("-inf")  # rows 0..29 (row i sees keys j <= i - 30) of the head without a sink
    assert no_key[:, 1, :30].all() and no_key.sum() == 30
    finite_sink = torch.tensor([0.5, -1e4], device=DEVICE)
    ours = (out, lse.masked_fill(no_key, -1e4), q.grad, k.grad, v.grad, sink.grad)  # the reference's lse there
    _check("-inf sink", ours, q, k, v, dout, finite_sink, 32**-0.5, True)


def test_varlen_sinks_count_once_per_row():
    lengths = [9, 30, 21]
    q, k, v, dout = make_qkv(1, sum(lengths), sum(lengths), 2, 1, 32, DTYPE, seed=3)
    sink = torch.tensor([0.3, -2.0], device=DEVICE, requires_grad=True)
    cu = torch.tensor([0, 9, 39, 60], dtype=torch.int32, device=DEVICE)
    q, k, v = (t[0].requires_grad_() for t in (q, k, v))
    out = ringattn.flash_attn_varlen_func(q, k, v, cu, cu, 30, 30, causal=True, learnable_sink=sink)
    out.backward(dout[0])
    for b in range(3):  # each sequence alone against the reference, its share of the sinks' gradient summed
        rows = slice(cu[b], cu[b + 1])
        ref = sink_reference(q[None, rows], k[None, rows], v[None, rows], dout[:, rows], sink, 32**-0.5, True,
                             torch.float64)  # fmt: skip
        pt = sink_reference(q[None, rows], k[None, rows], v[None, rows], dout[:, rows], sink, 32**-0.5, True, DTYPE)
        check_close(f"sequence {b} out", out[None, rows], pt[0], ref[0])
    full_ref = [sink_reference(q[None, cu[b]:cu[b + 1]], k[None, cu[b]:cu[b + 1]], v[None, cu[b]:cu[b + 1]],
                               dout[:, cu[b]:cu[b + 1]], sink, 32**-0.5, True, dt)[5]
                for b in range(3) for dt in (torch.float64, DTYPE)]  # fmt: skip
    check_close("dsink", sink.grad, sum(full_ref[1::2]), sum(full_ref[0::2]))


@pytest.mark.parametrize(
    "sink,error,match",
    [
        (torch.zeros(3), ValueError, r"learnable_sink must have shape \(4,\) \(one logit per query head\), got \(3,\)"),
        (torch.zeros(4, dtype=torch.int64), TypeError, "learnable_sink must be a floating tensor or None"),
        ([0.0] * 4, TypeError, "learnable_sink must be a floating tensor or None"),
    ],
    ids=["shape", "int", "list"],
)
def test_bad_sinks_raise(sink, error, match):
    q = torch.zeros(1, 8, 4, 32, device=DEVICE, dtype=DTYPE)
    if isinstance(sink, torch.Tensor):
        sink = sink.to(DEVICE)
    with pytest.raises(error, match=match):
        ringattn.flash_attn_func(q, q, q, learnable_sink=sink)


def _ring_sinks(rank, world_size, layout, causal):
    seqlen = 24 * world_size
    idx = shard_indices(seqlen, rank, world_size, layout)
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 4, 2, 32, torch.float32, device="cpu", seed=seqlen)
    sink = torch.tensor([1.0, -0.5, 3.0, 0.0], requires_grad=True)
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ring_attn_func(q_l, k_l, v_l, causal=causal, layout=layout, learnable_sink=sink,
                                       return_lse=True)  # fmt: skip
    out.backward(dout[:, idx])
    grads = torch.stack([sink.grad])
    torch.distributed.all_reduce(grads)  # the ranks' shares of the sinks' gradient
    ref = sink_reference(q, k, v, dout, sink, 32**-0.5, causal, torch.float64)
    pt = sink_reference(q, k, v, dout, sink, 32**-0.5, causal, torch.float32)
    grad_scale = max(magnitude(g) for g in ref[2:5])
    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        sel = (slice(None), slice(None), idx) if i == 1 else (slice(None), idx)
        check_close(f"rank {rank} {name}", ours[i], pt[i][sel], ref[i][sel], None if i < 2 else grad_scale)
    check_close(f"rank {rank} dsink", grads[0], pt[5], ref[5])
    return True


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")
@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)], ids=["zigzag-causal", "full"])
def test_ring_sinks_are_merged_once_into_the_global_softmax(layout, causal):
    """Three ranks: each row's denominator gains exp(sink) once, not once per ring step; the ranks' shares of the
    sinks' gradient sum to the unsharded one."""
    assert run_ranks(_ring_sinks, 3, layout, causal) == [True] * 3


def _sink_grad_on_one_rank(rank, world_size):
    """q, k, v without gradients everywhere, the sink requiring grad on rank 1 only: {case: (message, seconds)}."""
    from tests.distributed import raised_errors

    q = torch.randn(1, 8, 2, 16)
    sink = torch.zeros(2, requires_grad=rank == 1)
    pure_ulysses = dict(ulysses_group=torch.distributed.group.WORLD, ring_group=None, layout="zigzag")
    return raised_errors({
        "ring": lambda: ringattn.ring_attn_func(q, q, q, causal=True, learnable_sink=sink, layout="contiguous"),
        "ulysses": lambda: ringattn.ulysses_ring_attn_func(q, q, q, causal=True, learnable_sink=sink, **pure_ulysses),
    })  # fmt: skip


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")
def test_a_sink_requiring_grad_on_some_ranks_only_is_refused_by_every_rank():
    """Regression: only q, k and v counted towards a call's recording a graph, so a sink requiring grad on one rank
    only passed the agreement check; that rank alone then ran the backward's ring (Ulysses: its all-to-all), and
    both ranks stalled until the P2P timeout. Now every rank raises the same ValueError at the forward."""
    results = run_ranks(_sink_grad_on_one_rank, 2)
    for case in ("ring", "ulysses"):
        (message, seconds), (other, _) = results[0][case], results[1][case]
        assert message == other and "which of q, k, v and learnable_sink require grad" in message, results
        assert seconds < 5.0, results


def _sinks_alone(rank, world_size):
    """q, k, v without gradients, the sink requiring grad on every rank: the backward runs no ring and the ranks'
    shares of dsink sum to the unsharded one; then q requiring grad on rank 0 only and k, v on rank 1 only under
    Ulysses (an all-to-all for q's gradient, another for k's and v's): {case: (message, seconds)}."""
    import ringattn.functional as functional
    from tests.distributed import raised_errors

    seqlen = 24 * world_size
    idx = shard_indices(seqlen, rank, world_size, "zigzag")
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 4, 2, 32, torch.float32, device="cpu", seed=seqlen)
    sink = torch.tensor([1.0, -0.5, 3.0, 0.0], requires_grad=True)

    def no_ring(*args):
        raise AssertionError("the backward ran the ring for the sinks alone")

    ring_bwd, functional.ring_attn_bwd_op = functional.ring_attn_bwd_op, no_ring
    try:
        out = ringattn.ring_attn_func(
            q[:, idx], k[:, idx], v[:, idx], causal=True, layout="zigzag", learnable_sink=sink
        )
        out.backward(dout[:, idx])
    finally:
        functional.ring_attn_bwd_op = ring_bwd
    grads = torch.stack([sink.grad])
    torch.distributed.all_reduce(grads)
    ref = sink_reference(q, k, v, dout, sink, 32**-0.5, True, torch.float64)
    pt = sink_reference(q, k, v, dout, sink, 32**-0.5, True, torch.float32)
    check_close(f"rank {rank} dsink", grads[0], pt[5], ref[5])
    q_l, k_l = q[:, idx].requires_grad_(rank == 0), k[:, idx].requires_grad_(rank == 1)
    grid = dict(ulysses_group=torch.distributed.group.WORLD, ring_group=None, layout="contiguous")
    return raised_errors({"ulysses": lambda: ringattn.ulysses_ring_attn_func(q_l, k_l, k_l, causal=True, **grid)})


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")
def test_sinks_alone_requiring_grad_run_no_ring_and_grads_must_agree():
    """With the sinks alone requiring grad the ring's backward (which would give q, k, v no gradient) is skipped on
    every rank, and the sinks' gradient is the unsharded one. Regression: which of q, k, v required grad was not
    compared, only whether any did, so a rank with q's and one with k's each ran a different all-to-all of Ulysses'
    backward and both stalled until the P2P timeout; now every rank raises the same ValueError at the forward."""
    results = run_ranks(_sinks_alone, 2)
    (message, seconds), (other, _) = results[0]["ulysses"], results[1]["ulysses"]
    assert message == other, results
    assert "which of q, k, v and learnable_sink require grad (rank 0: 'q', rank 1: 'k,v')" in message
    assert seconds < 5.0, results
