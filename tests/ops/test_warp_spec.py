"""The warp-specialised kernels (kernels/attn_fwd_ws.py, kernels/attn_bwd_ws.py) and when the forward and backward
take them (ops/warp_spec.py).

On a Hopper GPU with triton 3.9 the calls take the forms checked there (warp_spec.CHECKED_FORMS); the
interpreter takes them only with $RINGATTN_WS=1. These tests set that, or keep "all" (every form, on a GPU too:
how a form gets checked) when the environment has it, so they run every form on the CPU and the allowed ones on
such a GPU; elsewhere the backward keeps attn_bwd's kernels and the tests that need the new ones skip.
"""

import contextvars
import os

import pytest
import torch
import triton

from ringattn.kernels.attn_bwd_ws import _attn_bwd_dkdv_ws_kernel, _attn_bwd_dq_ws_kernel
from ringattn.kernels.attn_fwd_ws import _attn_fwd_ws_kernel
from ringattn.ops import KERNEL_OPS, attn_bwd, attn_fwd, attn_fwd_merge_, warp_spec
from ringattn.ops import attn as attn_ops
from ringattn.parallel import LAYOUTS
from ringattn.parallel.simulate import simulate_ring_attn
from ringattn.testing import check_close
from tests.utils import DEVICE, DTYPES, check_against_reference, make_qkv, reference_attention

CHECKED_TRITON = warp_spec._triton_version() == warp_spec.WS_TRITON
needs_checked_triton = pytest.mark.skipif(not CHECKED_TRITON, reason=f"triton {triton.__version__}, not 3.9")
# Sq a multiple of 4 (the kernels' condition); ragged tiles on both sides, Sq != Sk both ways (Sq > Sk causal:
# rows that see no key)
WS_SEQLENS = [(4, 4), (100, 100), (96, 160), (160, 36)]
HEADS = [(2, 2), (4, 2), (4, 1)]  # MHA, GQA, MQA
CPU = torch.device("cpu")
GPU = torch.device("cuda", 0)


@pytest.fixture
def ws_on(monkeypatch):
    """$RINGATTN_WS=1, or "all" where the environment has it, and no Gluon forward ($RINGATTN_GLUON=0: it would take
    the D = 128 forward); skips where the kernels are never taken."""
    monkeypatch.setenv("RINGATTN_WS", "all" if os.environ.get("RINGATTN_WS") == "all" else "1")
    monkeypatch.setenv("RINGATTN_GLUON", "0")
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernels are taken on Hopper GPUs only")


def _launched(q, k, v, dout, causal, grads_dtype=None, **kwargs):
    """The (dK/dV, dQ) kernels the backward into gradients of grads_dtype (default: the inputs') launches."""
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    delta = attn_ops.attn_bwd_preprocess(out, dout)
    grads = [torch.empty_like(t, dtype=grads_dtype) for t in (q, k, v)]
    cfgs = attn_ops._bwd_configs(attn_ops._padded_head_dim(q.shape[-1]), q.dtype, q.device)
    args = dict(q_doc_ids=None, k_doc_ids=None, add_dq=False, add_dkdv=False, dq_final=None) | kwargs
    launches = attn_ops._bwd_launches(
        dout, q, k, v, lse, delta, *grads, 0.125, causal, args["q_doc_ids"], args["k_doc_ids"], args["add_dq"],
        args["add_dkdv"], args["dq_final"], *cfgs,
    )  # fmt: skip
    return tuple(launch.kernel for launch in launches)


def _expected(q, k, causal, add_dq=False, fp32=False):
    """The (dK/dV, dQ) kernels the forms allowed here mean (all of them in the interpreter); fp32: gradients stored
    in fp32 from 16-bit inputs (the ring's shares)."""
    grouped = q.shape[2] != k.shape[2]
    head_dim = q.shape[-1]
    dkdv = warp_spec.ws_allowed(warp_spec.ws_form("dkdv", causal, grouped=grouped, fp32=fp32), q.device, head_dim)
    dq_form = warp_spec.ws_form("dq", causal, fp32=fp32 and not add_dq, accumulate=add_dq)
    dq = warp_spec.ws_allowed(dq_form, q.device, head_dim)
    return (
        _attn_bwd_dkdv_ws_kernel if dkdv else attn_ops._attn_bwd_dkdv_kernel,
        _attn_bwd_dq_ws_kernel if dq else attn_ops._attn_bwd_dq_kernel,
    )


def _fwd_kernel(q, k, v, causal, merge_state=False, fp32=False, **kwargs):
    """The kernel the forward (merge_state: the ring's step into an fp32 state; fp32: into an fp32 out) launches."""
    out = torch.empty(q.shape, device=DEVICE, dtype=torch.float32 if merge_state or fp32 else q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=DEVICE)
    args = dict(q_doc_ids=None, k_doc_ids=None, final=None) | kwargs
    launch = attn_ops._pick_fwd_launch(
        q, k, v, 0.125, causal, out, lse, args["q_doc_ids"], args["k_doc_ids"], merge_state, args["final"]
    )
    return launch.kernel


def _expected_fwd(q, causal, merge_state=False, fp32=False):
    form = warp_spec.ws_form("fwd", causal, fp32=fp32, merge=merge_state)
    allowed = warp_spec.ws_allowed(form, q.device, q.shape[-1])
    return _attn_fwd_ws_kernel if allowed else attn_ops._attn_fwd_kernel


# every length and head layout at D = 64; D = 128 at two lengths, MHA and MQA (its own tiles, fewer cases)
GRID = [(*lengths, 64, heads) for lengths in WS_SEQLENS for heads in HEADS]
GRID += [(*lengths, 128, heads) for lengths in WS_SEQLENS[1::2] for heads in HEADS[::2]]


@needs_checked_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim,heads", GRID, ids=[f"Sq{a}-Sk{b}-D{d}-Hq{h[0]}-Hkv{h[1]}"
                                                                      for a, b, d, h in GRID])  # fmt: skip
def test_ws_forward_and_backward_match_reference(seqlen_q, seqlen_k, head_dim, heads, causal, ws_on):
    """out, lse, dq, dk, dv against float64, rows that see no key included (lse -inf, out 0, zero gradients)."""
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, DTYPES[0], seed=seqlen_q + 7 * seqlen_k)
    assert _fwd_kernel(q, k, v, causal) is _expected_fwd(q, causal)
    assert _launched(q, k, v, dout, causal) == _expected(q, k, causal)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads))


@needs_checked_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ws_forward_merges_into_the_ring_state(causal, ws_on):
    """The ring's step: the last Sq keys (causal: the diagonal block) merged into the fp32 state of the first 36,
    which every row sees, give the whole call's out and lse against float64 (Sk = 100; the first block's key tile
    padded). Against the reference, not the one-pass call: in 16-bit the two round P to the dtype against
    different maxima, so they differ by more than fp32's rounding."""
    q, k, v, dout = make_qkv(1, 64, 100, 4, 2, 64, DTYPES[0], seed=9)
    fp32 = q.dtype != torch.float32
    assert _fwd_kernel(q, k[:, 36:], v[:, 36:], causal, merge_state=True) is _expected_fwd(q, causal, True)
    assert _fwd_kernel(q, k[:, :36], v[:, :36], False, fp32=True) is _expected_fwd(q, False, fp32=fp32)
    out, lse = attn_fwd(q, k[:, :36], v[:, :36], 0.125, False, out_dtype=torch.float32)
    attn_fwd_merge_(q, k[:, 36:], v[:, 36:], 0.125, causal, out, lse)
    ref, plain = (reference_attention(q, k, v, dout, 0.125, causal, dtype)[:2] for dtype in (torch.float64, q.dtype))
    for name, ours, p, r in zip(("out", "lse"), (out, lse), plain, ref, strict=True):
        assert ours.dtype == torch.float32
        check_close(name, ours, p, r)


@needs_checked_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
def test_ws_ring_step_forms(heads, causal, ws_on):
    """The ring's forms: dK, dV stored (add_dkdv=False) into fp32 buffers that are not read, dQ added into an fp32
    accumulator: the public call's gradients, in fp32, plus what the accumulator held."""
    q, k, v, dout = make_qkv(1, 64, 64, *heads, 64, DTYPES[0], seed=5)
    launched = _launched(q, k, v, dout, causal, grads_dtype=torch.float32, add_dq=True)
    assert launched == _expected(q, k, causal, add_dq=True, fp32=q.dtype != torch.float32)
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    held = torch.randn(q.shape, device=DEVICE)
    dq = held.clone()
    dk, dv = (torch.full(t.shape, float("nan"), device=DEVICE) for t in (k, v))  # stored, not read
    attn_bwd(dout, q, k, v, out, lse, 0.125, causal, dq_acc=dq, dk_acc=dk, dv_acc=dv, add_dkdv=False)
    want = attn_bwd(dout, q, k, v, out, lse, 0.125, causal)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq - held, dk, dv), want, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to(ref.dtype), ref, msg=name)


@needs_checked_triton
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ws_in_the_simulated_ring_matches_reference(layout, causal, ws_on):
    """Every ring step through the kernels the forms allow, forward merges, dK/dV shares and dQ additions
    (S_local = 32 rows per rank, W = 2, GQA 4:2): out, lse and the gradients against float64."""
    q, k, v, dout = make_qkv(1, 64, 64, 4, 2, 64, DTYPES[0], seed=11)
    ours = simulate_ring_attn(KERNEL_OPS, q, k, v, 0.125, causal, 2, layout, dout=dout)
    check_against_reference(q, k, v, dout, 0.125, causal, ours)


def _offset_view(shape, dtype):
    """A (B, S, H, D) tensor whose base address is one element past an allocation's: off 16 bytes."""
    return torch.randn(torch.Size(shape).numel() + 1, device=DEVICE, dtype=dtype)[1:].view(shape)


@needs_checked_triton
def test_ws_is_taken_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("RINGATTN_WS", "all")
    monkeypatch.setenv("RINGATTN_GLUON", "0")
    if DEVICE.type == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernels are taken on Hopper GPUs only")
    dtype = DTYPES[0]
    q, k, v, dout = make_qkv(1, 64, 64, 2, 2, 64, dtype, seed=1)
    ws = (_attn_bwd_dkdv_ws_kernel, _attn_bwd_dq_ws_kernel)
    old = (attn_ops._attn_bwd_dkdv_kernel, attn_ops._attn_bwd_dq_kernel)
    assert _launched(q, k, v, dout, False) == ws
    assert _launched(q, k, v, dout, True) == ws
    ids = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    assert _launched(q, k, v, dout, False, q_doc_ids=ids, k_doc_ids=ids) == old  # documents
    assert _launched(*make_qkv(1, 64, 64, 2, 2, 40, dtype, seed=1), False) == old  # D = 40
    assert _launched(*make_qkv(1, 97, 64, 2, 2, 64, dtype, seed=1), False) == old  # Sq % 4: stats rows off 16 B
    assert _launched(q, _offset_view(k.shape, dtype), v, dout, False) == old  # k off 16 bytes: both read it
    assert _launched(q, k, v, dout, False, add_dkdv=True) == (old[0], ws[1])  # dK, dV added into accumulators
    gq, gk, gv, gdout = make_qkv(1, 64, 64, 4, 2, 64, dtype, seed=1)
    assert _launched(gq, gk, gv, gdout, False) == ws  # GQA, heads packed in each row
    unpacked = gq.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) view of (B, H, S, D): head stride S x D
    assert _launched(unpacked, gk, gv, gdout, False) == (old[0], ws[1])  # GQA's dK/dV descriptors need them packed
    final = attn_ops.FinalRows(torch.empty_like(q), range(0, 32))
    assert _launched(q, k, v, dout, False, dq_final=final) == (ws[0], old[1])  # rows finished elsewhere
    assert _fwd_kernel(q, k, v, True) is _attn_fwd_ws_kernel
    assert _fwd_kernel(q, k, v, False, merge_state=True) is _attn_fwd_ws_kernel
    assert _fwd_kernel(q, k, v, False, q_doc_ids=ids, k_doc_ids=ids) is attn_ops._attn_fwd_kernel
    assert _fwd_kernel(q, k, v, False, final=final) is attn_ops._attn_fwd_kernel  # rows finished elsewhere
    monkeypatch.setenv("RINGATTN_FWD_TMA", "0")  # no descriptors at all
    assert _fwd_kernel(q, k, v, False) is attn_ops._attn_fwd_kernel
    monkeypatch.delenv("RINGATTN_FWD_TMA")
    monkeypatch.setenv("RINGATTN_WS", "0")
    assert _launched(q, k, v, dout, False) == old
    assert _fwd_kernel(q, k, v, False) is attn_ops._attn_fwd_kernel
    monkeypatch.setenv("RINGATTN_WS", "all")
    for version in ((3, 6), (3, 10)):  # older, or not yet checked on a GPU
        monkeypatch.setattr(warp_spec, "_triton_version", lambda version=version: version)
        assert _launched(q, k, v, dout, False) == old


def test_ws_forms_allowed_by_mode(monkeypatch):
    """Unset: the checked forms on a GPU at the head dims where they were timed faster, none in the interpreter;
    "1": the checked forms at any head dim on a GPU, every form in the interpreter; "all": every form anywhere;
    "0": none."""
    checked, unchecked, faster, untimed = "dq", "dq causal", 128, 64
    # every form is checked now: the test takes one out
    monkeypatch.setattr(warp_spec, "CHECKED_FORMS", warp_spec.CHECKED_FORMS - {unchecked})
    assert faster in warp_spec.FASTER_HEAD_DIMS["dq"] and untimed not in warp_spec.FASTER_HEAD_DIMS["dq"]
    monkeypatch.delenv("RINGATTN_WS", raising=False)
    assert warp_spec.ws_allowed(checked, GPU, faster) and not warp_spec.ws_allowed(unchecked, GPU, faster)
    assert not warp_spec.ws_allowed(checked, GPU, untimed)
    assert not warp_spec.ws_allowed(checked, CPU, faster)
    monkeypatch.setenv("RINGATTN_WS", "1")
    assert warp_spec.ws_allowed(checked, GPU, untimed) and not warp_spec.ws_allowed(unchecked, GPU, faster)
    assert warp_spec.ws_allowed(unchecked, CPU, untimed)
    monkeypatch.setenv("RINGATTN_WS", "all")
    assert warp_spec.ws_allowed(unchecked, GPU, untimed) and warp_spec.ws_allowed(unchecked, CPU, untimed)
    monkeypatch.setenv("RINGATTN_WS", "0")
    assert not warp_spec.ws_allowed(checked, GPU, faster) and not warp_spec.ws_allowed(checked, CPU, faster)


def test_every_kernel_has_its_faster_head_dims():
    """FASTER_HEAD_DIMS has an entry for each kernel and causal setting of the checked forms, and no other."""
    assert set(warp_spec.FASTER_HEAD_DIMS) == {warp_spec._timed_as(form) for form in warp_spec.CHECKED_FORMS}
    assert warp_spec._timed_as("dkdv causal gqa fp32") == "dkdv causal" and warp_spec._timed_as("dq fp32") == "dq"
    assert all(set(dims) <= set(warp_spec.WS_HEAD_DIMS) for dims in warp_spec.FASTER_HEAD_DIMS.values())


def test_ws_form_names():
    assert warp_spec.ws_form("dkdv", False) == "dkdv"
    assert warp_spec.ws_form("dkdv", True, grouped=True) == "dkdv causal gqa"
    assert warp_spec.ws_form("dq", True, accumulate=True) == "dq causal accumulate"
    assert warp_spec.ws_form("fwd", False, merge=True) == "fwd merge"
    assert warp_spec.ws_form("dkdv", True, grouped=True, fp32=True) == "dkdv causal gqa fp32"
    assert warp_spec.ws_form("dq", False, fp32=True) == "dq fp32"


def test_bad_ws_mode_raises(monkeypatch):
    monkeypatch.setenv("RINGATTN_WS", "auto")
    with pytest.raises(ValueError, match=r"\$RINGATTN_WS must be one of 0, 1, all \(or unset\), got 'auto'"):
        warp_spec.ws_mode()


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
