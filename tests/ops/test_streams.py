"""The backward's two kernels on two CUDA streams (ops/streams.py): when they are, and that they give the bits of
one stream."""

import pytest
import torch

import ringattn
from ringattn.ops import attn_bwd, attn_fwd
from ringattn.ops.streams import SHORT_BWD_SCORES, bwd_on_two_streams, short_bwd
from tests.utils import DEVICE, DTYPES, make_qkv

ENV = "RINGATTN_BWD_STREAMS"


def test_short_backwards_are_counted_in_score_entries():
    """B * Hq * Sq * Sk, halved when causal, up to SHORT_BWD_SCORES: the ring's blocks at S_local = 8k and the
    fused causal call at 16k are short, longer calls are not."""
    assert SHORT_BWD_SCORES == 2**32
    assert short_bwd(1, 32, 8192, 8192, causal=False)  # 2^31
    assert short_bwd(1, 32, 8192, 8192, causal=True)
    assert short_bwd(1, 32, 16384, 16384, causal=True)  # 2^33 halved: the bound itself
    assert short_bwd(8, 32, 4096, 4096, causal=False)
    assert not short_bwd(1, 32, 16384, 16384, causal=False)
    assert not short_bwd(2, 32, 16384, 16384, causal=True)
    assert not short_bwd(1, 32, 8192, 16385 * 2, causal=True)


def test_two_streams_only_on_cuda_and_when_switched_on(monkeypatch):
    q = torch.empty(1, 64, 4, 32, device=DEVICE)
    assert bwd_on_two_streams(q, q, causal=False) == (DEVICE.type == "cuda")
    monkeypatch.setenv(ENV, "0")
    assert not bwd_on_two_streams(q, q, causal=False)


def test_a_bad_setting_raises_on_any_device(monkeypatch):
    q, k, v, dout = make_qkv(1, 16, 16, 2, 1, 16, DTYPES[0], seed=1)
    out, lse = attn_fwd(q, k, v, 0.25, True)
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=r"\$RINGATTN_BWD_STREAMS must be 0 or 1, got 'yes'"):
        attn_bwd(dout, q, k, v, out, lse, 0.25, True)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA streams")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("form", ["public", "ring-step", "own-block"])
def test_two_streams_give_the_bits_of_one(form, causal, monkeypatch):
    """Public bf16/fp16 results, the ring's later step (dQ added into fp32, the dK/dV share stored) and its
    first (all stored): the same bits on two streams as on one, read on the current stream right after the
    call, with no synchronisation. With few keys against many queries (GQA) the dK/dV kernel on the side stream
    runs several times as long as dQ on the current one, so a missing join would be read before it is done."""
    q, k, v, dout = make_qkv(1, 8000, 100, 8, 1, 64, DTYPES[0], seed=5)
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    results = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(ENV, setting)
        assert bwd_on_two_streams(q, k, causal) == (setting == "1")
        if form == "public":
            grads = attn_bwd(dout, q, k, v, out, lse, 0.125, causal)
        else:
            accs = [torch.ones(t.shape, dtype=torch.float32, device=DEVICE) for t in (q, k, v)]
            adds = form == "ring-step"
            grads = attn_bwd(dout, q, k, v, out, lse, 0.125, causal, None, *accs, add_dq=adds, add_dkdv=False)
        results[setting] = [g.clone() for g in grads]
    for one, two in zip(results["0"], results["1"], strict=True):
        assert torch.equal(one, two)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs")
def test_two_streams_capture_in_a_cuda_graph():
    """flash_attn_func's forward and backward (two streams: short) captured in a CUDA graph, as
    torch.compile's "reduce-overhead" does: the replay gives the eager gradients bitwise (the fork and join are
    events, which capture records)."""
    q, k, v, dout = make_qkv(1, 2048, 2048, 8, 8, 64, DTYPES[0], seed=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert bwd_on_two_streams(q, k, causal=True)

    def step():
        for t in (q, k, v):
            t.grad = None
        ringattn.flash_attn_func(q, k, v, causal=True).backward(dout)

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
