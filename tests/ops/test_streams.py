"""The backward's two kernels on two CUDA streams (ops/dispatch.py decides, ops/launch.py runs them): when they
are, and that they give the bits of one stream."""

import dataclasses
import time

import pytest
import torch

import ringattn
from ringattn.ops import BwdCall, attn_bwd_preprocess, attn_fwd, bwd_launches, dispatch
from ringattn.ops.launch import run_side_by_side
from tests.utils import DEVICE, DTYPES, make_qkv


def _call(batch, heads_q, seqlen_q, seqlen_k, causal):
    """A BwdCall of those sizes over expanded (unallocated) views: only its shapes are read."""
    q = torch.empty(1, 1, 1, 8).expand(batch, seqlen_q, heads_q, 8)
    k = torch.empty(1, 1, 1, 8).expand(batch, seqlen_k, 1, 8)
    stats = torch.empty(1, 1, 1, 1).expand(3, batch, heads_q, seqlen_q)
    return BwdCall(q, q, k, k, stats, q, k, k, 0.125, causal)


def test_short_backwards_are_counted_in_score_entries():
    """B * Hq * Sq * Sk, halved when causal, up to SHORT_BWD_SCORES: the ring's blocks at S_local = 8k and the
    fused causal call at 16k are short, longer calls are not."""
    assert dispatch.SHORT_BWD_SCORES == 2**32
    assert dispatch.short_backward(_call(1, 32, 8192, 8192, causal=False))  # 2^31
    assert dispatch.short_backward(_call(1, 32, 8192, 8192, causal=True))
    assert dispatch.short_backward(_call(1, 32, 16384, 16384, causal=True))  # 2^33 halved: the bound itself
    assert dispatch.short_backward(_call(8, 32, 4096, 4096, causal=False))
    assert not dispatch.short_backward(_call(1, 32, 16384, 16384, causal=False))
    assert not dispatch.short_backward(_call(2, 32, 16384, 16384, causal=True))
    assert not dispatch.short_backward(_call(1, 32, 8192, 16385 * 2, causal=True))


def test_two_streams_only_on_cuda():
    q = torch.empty(1, 64, 4, 32, device=DEVICE)
    stats = torch.empty(3, 1, 4, 64, device=DEVICE)
    call = BwdCall(q, q, q, q, stats, q, q, q, 0.125, False)
    pair = bwd_launches(call, "portable")
    assert dispatch.bwd_on_two_streams(call, pair) == (DEVICE.type == "cuda")
    # two launches of the Hopper backward (groups of kv heads sharing one dQ scratch) run in turn, never side by side
    assert not dispatch.bwd_on_two_streams(call, tuple(dataclasses.replace(launch, name="sm90.bwd") for launch in pair))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA streams")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["public", "ring-step", "own-block"])
def test_two_streams_give_the_bits_of_one(form, causal):
    """Public bf16/fp16 results, the ring's later step (dQ added into fp32, the dK/dV share stored) and its
    first (all stored): the same bits on two streams as on one, read on the current stream right after the
    call, with no synchronisation. With few keys against many queries (GQA) the dK/dV kernel on the side stream
    runs several times as long as dQ on the current one, so a missing join would be read before it is done."""
    q, k, v, dout = make_qkv(1, 8000, 100, 8, 1, 64, DTYPES[0], seed=5)
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    stats = attn_bwd_preprocess(out, dout, lse)
    results = {}
    for two_streams in (False, True):
        if form == "public":
            grads = [torch.empty_like(t) for t in (q, k, v)]
        else:
            grads = [torch.ones(t.shape, dtype=torch.float32, device=DEVICE) for t in (q, k, v)]
        call = BwdCall(dout, q, k, v, stats, *grads, 0.125, causal, add_dq=form == "ring-step")
        dkdv, dq = bwd_launches(call, "portable")  # a pair (on Hopper the Gluon backward is one kernel)
        assert dispatch.bwd_on_two_streams(call, (dkdv, dq))
        if two_streams:
            run_side_by_side(dkdv, dq, q.device)
        else:
            dkdv()
            dq()
        results[two_streams] = [g.clone() for g in grads]
    for one, two in zip(results[False], results[True], strict=True):
        assert torch.equal(one, two)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
def test_two_streams_capture_in_a_cuda_graph():
    """flash_attn_func's forward and backward (two streams: short) captured in a CUDA graph, as
    torch.compile's "reduce-overhead" does: the replay gives the eager gradients bitwise (the fork and join are
    events, which capture records). deterministic=True: the (dK/dV, dQ) pair on every GPU (the Gluon backward's
    atomic dQ additions would vary in their last bits)."""
    q, k, v, dout = make_qkv(1, 2048, 2048, 8, 8, 64, DTYPES[0], seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        for t in (q, k, v):
            t.grad = None
        ringattn.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)

    warmup = torch.cuda.Stream()  # capture wants its warm-up off the default stream
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(warmup)
    eager = [t.grad.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    for want, t in zip(eager, (q, k, v), strict=True):
        assert torch.equal(t.grad, want)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA streams")
def test_a_launch_that_raises_still_orders_the_side_stream_before_what_follows():
    """The second launch raising (out of memory, a failed compile) after the first is queued on the side stream:
    the current stream still waits for the side one, so that memory the caller frees on catching the error is not
    handed out while the first kernel writes it."""

    def first():
        torch.cuda._sleep(200_000_000)  # a kernel of about a tenth of a second on the side stream

    def second():
        raise RuntimeError("CUDA out of memory (raised by the test)")

    with pytest.raises(RuntimeError, match="raised by the test"):
        run_side_by_side(first, second, DEVICE)
    after = torch.cuda.Event()
    after.record()  # on the current stream, after the failed call
    time.sleep(0.02)
    assert not after.query()  # still behind the side stream's kernel
    torch.cuda.synchronize()
