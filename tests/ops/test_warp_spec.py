"""The warp-specialised dK/dV kernel (kernels/attn_bwd_ws.py) and when the backward takes it (ops/warp_spec.py).

It is on by default on Hopper GPUs with triton 3.9 and off in the interpreter unless $RINGATTN_BWD_WS=1: these tests
set that, so they run it on the CPU and on such a GPU; elsewhere the backward keeps attn_bwd's kernel and the tests
that need the new one skip.
"""

import contextvars

import pytest
import torch
import triton

from ringattn.kernels.attn_bwd_ws import _attn_bwd_dkdv_ws_kernel
from ringattn.ops import KERNEL_OPS, attn_bwd, attn_fwd, warp_spec
from ringattn.ops import attn as attn_ops
from ringattn.parallel import LAYOUTS
from ringattn.parallel.simulate import simulate_ring_attn
from ringattn.testing import check_close, magnitude
from tests.utils import DEVICE, DTYPES, make_qkv, reference_attention

CHECKED_TRITON = warp_spec._triton_version() == warp_spec.WS_TRITON
needs_checked_triton = pytest.mark.skipif(not CHECKED_TRITON, reason=f"triton {triton.__version__}, not 3.9")
# Sq a multiple of 4 (the kernel's condition); ragged tiles on both sides, Sq != Sk both ways
WS_SEQLENS = [(4, 4), (100, 100), (96, 160), (160, 36)]


def _dkdv_kernel(q, k, v, dout, causal, **kwargs):
    """The kernel the backward launches for dK/dV."""
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    delta = attn_ops.attn_bwd_preprocess(out, dout)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    cfgs = attn_ops._bwd_configs(attn_ops._padded_head_dim(q.shape[-1]), q.dtype, q.device)
    args = dict(q_doc_ids=None, k_doc_ids=None, add_dq=False, add_dkdv=False, dq_final=None) | kwargs
    launches = attn_ops._bwd_launches(
        dout, q, k, v, lse, delta, *grads, 0.125, causal, args["q_doc_ids"], args["k_doc_ids"], args["add_dq"],
        args["add_dkdv"], args["dq_final"], *cfgs,
    )  # fmt: skip
    return launches[0].kernel


@needs_checked_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=["D64", "D128"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", WS_SEQLENS, ids=[f"Sq{a}-Sk{b}" for a, b in WS_SEQLENS])
def test_ws_backward_matches_reference(seqlen_q, seqlen_k, head_dim, causal, monkeypatch):
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    dtype = DTYPES[0]
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, 2, 2, head_dim, dtype, seed=seqlen_q + 7 * seqlen_k)
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is picked on Hopper GPUs only")
    assert (_dkdv_kernel(q, k, v, dout, causal) is _attn_bwd_dkdv_ws_kernel) == (not causal)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    ref = reference_attention(q, k, v, dout, scale, causal, torch.float64)
    pt = reference_attention(q, k, v, dout, scale, causal, q.dtype)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for name, ours, p, r in zip(("dq", "dk", "dv"), (dq, dk, dv), pt[2:], ref[2:], strict=True):
        check_close(name, ours, p, r, grad_scale)


@needs_checked_triton
def test_ws_ring_share_is_stored_in_fp32(monkeypatch):
    """The ring's form: dK, dV stored (add_dkdv=False) into fp32 buffers, dQ added: the same gradients as the
    public call's, in fp32."""
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is picked on Hopper GPUs only")
    q, k, v, dout = make_qkv(1, 64, 64, 2, 2, 64, DTYPES[0], seed=5)
    out, lse = attn_fwd(q, k, v, 0.125, False)
    dq, dk, dv = (torch.zeros(t.shape, device=DEVICE) for t in (q, k, v))
    dk.fill_(float("nan"))  # stored, not read
    delta = attn_ops.attn_bwd_preprocess(out, dout)
    assert warp_spec.dkdv_ws_ready(q, k, v, dout, lse, delta, dk, dv, causal=False, has_docs=False, add_dkdv=False)
    attn_bwd(dout, q, k, v, out, lse, 0.125, False, dq_acc=dq, dk_acc=dk, dv_acc=dv, add_dkdv=False)
    want = attn_bwd(dout, q, k, v, out, lse, 0.125, False)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to(ref.dtype), ref, msg=name)


@needs_checked_triton
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ws_in_the_simulated_ring_matches_reference(layout, monkeypatch):
    """Not causal, every ring step's dK/dV share goes through the kernel (S_local = 32 rows per rank, W = 2)."""
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernel is picked on Hopper GPUs only")
    q, k, v, dout = make_qkv(1, 64, 64, 2, 2, 64, DTYPES[0], seed=11)
    ours = simulate_ring_attn(KERNEL_OPS, q, k, v, 0.125, False, 2, layout, dout=dout)
    ref = reference_attention(q, k, v, dout, 0.125, False, torch.float64)
    pt = reference_attention(q, k, v, dout, 0.125, False, q.dtype)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for name, got, p, r in zip(("dq", "dk", "dv"), ours[2:], pt[2:], ref[2:], strict=True):
        check_close(name, got.to(q.dtype), p, r, grad_scale)


def _offset_view(shape, dtype):
    """A (B, S, H, D) tensor whose base address is one element past an allocation's: off 16 bytes."""
    return torch.randn(torch.Size(shape).numel() + 1, device=DEVICE, dtype=dtype)[1:].view(shape)


@needs_checked_triton
def test_ws_is_taken_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    dtype = DTYPES[0]
    q, k, v, dout = make_qkv(1, 64, 64, 2, 2, 64, dtype, seed=1)
    ws = _attn_bwd_dkdv_ws_kernel
    assert _dkdv_kernel(q, k, v, dout, False) is ws
    assert _dkdv_kernel(q, k, v, dout, True) is not ws  # causal
    ids = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    assert _dkdv_kernel(q, k, v, dout, False, q_doc_ids=ids, k_doc_ids=ids) is not ws  # documents
    gqa = make_qkv(1, 64, 64, 2, 1, 64, dtype, seed=1)
    assert _dkdv_kernel(*gqa, False) is not ws
    padded = make_qkv(1, 64, 64, 2, 2, 40, dtype, seed=1)
    assert _dkdv_kernel(*padded, False) is not ws
    ragged = make_qkv(1, 97, 64, 2, 2, 64, dtype, seed=1)  # Sq % 4: a head's stats row off 16 bytes
    assert _dkdv_kernel(*ragged, False) is not ws
    assert _dkdv_kernel(q, _offset_view(k.shape, dtype), v, dout, False) is not ws
    monkeypatch.setenv("RINGATTN_BWD_WS", "0")
    assert _dkdv_kernel(q, k, v, dout, False) is not ws
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    for version in ((3, 6), (3, 10)):  # older, or not yet checked on a GPU
        monkeypatch.setattr(warp_spec, "_triton_version", lambda version=version: version)
        assert _dkdv_kernel(q, k, v, dout, False) is not ws


def test_ws_default_is_on_for_gpus_only(monkeypatch):
    monkeypatch.delenv("RINGATTN_BWD_WS", raising=False)
    assert warp_spec.bwd_ws_enabled(torch.device("cuda", 0))
    assert not warp_spec.bwd_ws_enabled(torch.device("cpu"))
    monkeypatch.setenv("RINGATTN_BWD_WS", "1")
    assert warp_spec.bwd_ws_enabled(torch.device("cpu"))
    monkeypatch.setenv("RINGATTN_BWD_WS", "0")
    assert not warp_spec.bwd_ws_enabled(torch.device("cuda", 0))


def test_bad_ws_mode_raises(monkeypatch):
    monkeypatch.setenv("RINGATTN_BWD_WS", "auto")
    with pytest.raises(ValueError, match=r"\$RINGATTN_BWD_WS must be 0 or 1 \(or unset\), got 'auto'"):
        warp_spec.bwd_ws_enabled(torch.device("cpu"))


def test_scratch_allocator_is_set_for_the_launch_only():
    """run_with_scratch gives the launch PyTorch's allocator and leaves the caller's in place."""
    from triton.runtime import _allocation

    def caller_allocator(size, alignment, stream):
        raise AssertionError("the caller's allocator was used")

    seen = []

    def in_caller_context():
        triton.set_allocator(caller_allocator)
        warp_spec.run_with_scratch(lambda: seen.append(_allocation._allocator.get()))
        seen.append(_allocation._allocator.get())

    contextvars.copy_context().run(in_caller_context)  # the test's own context keeps its allocator too
    assert seen == [warp_spec._torch_scratch, caller_allocator]
