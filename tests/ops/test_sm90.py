"""The Hopper backend's kernels (kernels/sm90/, ops/sm90.py) against float64 under the tolerance rule.

The split dK/dV and dQ kernels are Triton-language code: the interpreter runs them when a call asks for the
"sm90" backend, so these tests run them on the CPU as on a Hopper GPU, where deterministic calls take them. The
Gluon kernels run on a Hopper GPU only (the interpreter cannot run Gluon); they compile offline in
tests/launch/tools/test_kernel_resources.py. Which call takes which kernel is tests/ops/test_dispatch.py's.
"""

import contextvars

import pytest
import torch
import triton

from ringattn.ops import (
    BwdCall,
    FinalRows,
    FwdCall,
    Target,
    attn_bwd,
    attn_fwd,
    attn_fwd_merge_,
    bwd_launches,
    dispatch,
    fwd_launch,
    kernel_ops,
    launch,
    sm90,
)
from ringattn.parallel import LAYOUTS
from ringattn.testing import RESULTS, check_results, simulate_ring_attn
from tests.utils import DEVICE, DTYPES, check_against_reference, dtype_id, make_qkv, reference_attention

HOPPER_HERE = dispatch.hopper_available(Target.of(torch.empty(0, device=DEVICE)))
needs_hopper = pytest.mark.skipif(not HOPPER_HERE, reason="the Hopper backend cannot run here")
needs_hopper_gpu = pytest.mark.skipif(
    not (HOPPER_HERE and DEVICE.type == "cuda"), reason="the Gluon kernels run on Hopper GPUs"
)
# Sq a multiple of 4 (the split kernels' condition); ragged tiles on both sides, Sq != Sk both ways (Sq > Sk causal:
# rows that see no key)
SPLIT_SEQLENS = [(4, 4), (100, 100), (96, 160), (160, 36)]
HEADS = [(2, 2), (4, 2), (4, 1)]  # MHA, GQA, MQA
# every length and head layout at D = 64 (dK/dV split, dQ portable); D = 128 (both split) at two lengths, MHA, MQA
GRID = [(*lengths, 64, heads) for lengths in SPLIT_SEQLENS for heads in HEADS]
GRID += [(*lengths, 128, heads) for lengths in SPLIT_SEQLENS[1::2] for heads in HEADS[::2]]


def _launched(q, k, v, dout, causal, grads_dtype=None, **kwargs):
    """The names of the kernels the backward on the Hopper backend launches."""
    stats = torch.empty(3, q.shape[0], q.shape[2], q.shape[1], device=q.device)
    grads = [torch.empty_like(t, dtype=grads_dtype) for t in (q, k, v)]
    call = BwdCall(dout, q, k, v, stats, *grads, 0.125, causal, **kwargs)
    return tuple(launch.name for launch in bwd_launches(call, "sm90"))


def _expected(head_dim, add_dkdv=False):
    """The (dK/dV, dQ) kernels of a deterministic backward on the Hopper backend."""
    return ("portable.dkdv" if add_dkdv else "sm90.dkdv", "sm90.dq" if head_dim == 128 else "portable.dq")


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim,heads", GRID, ids=[f"Sq{a}-Sk{b}-D{d}-Hq{h[0]}-Hkv{h[1]}"
                                                                      for a, b, d, h in GRID])  # fmt: skip
def test_split_backward_matches_reference(seqlen_q, seqlen_k, head_dim, heads, causal):
    """dq, dk, dv (and out, lse) against float64, rows that see no key included (lse -inf, out 0, zero
    gradients)."""
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, DTYPES[0], seed=seqlen_q + 7 * seqlen_k)
    assert _launched(q, k, v, dout, causal, deterministic=True) == _expected(head_dim)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal, backend="sm90")
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal, deterministic=True, backend="sm90")
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads))


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
def test_split_ring_step_forms(heads, causal):
    """The ring's forms: dK, dV stored (add_dkdv=False) into fp32 buffers that are not read, dQ added into an fp32
    accumulator: the public call's gradients, in fp32, plus what the accumulator held."""
    q, k, v, dout = make_qkv(1, 64, 64, *heads, 128, DTYPES[0], seed=5)
    launched = _launched(q, k, v, dout, causal, grads_dtype=torch.float32, add_dq=True, deterministic=True)
    assert launched == _expected(128)
    out, lse = attn_fwd(q, k, v, 0.125, causal)
    held = torch.randn(q.shape, device=DEVICE)
    dq = held.clone()
    dk, dv = (torch.full(t.shape, float("nan"), device=DEVICE) for t in (k, v))  # stored, not read
    attn_bwd(dout, q, k, v, out, lse, 0.125, causal, dq_acc=dq, dk_acc=dk, dv_acc=dv, add_dkdv=False,
             deterministic=True, backend="sm90")  # fmt: skip
    want = attn_bwd(dout, q, k, v, out, lse, 0.125, causal, deterministic=True, backend="sm90")
    for name, got, ref in zip(("dq", "dk", "dv"), (dq - held, dk, dv), want, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to(ref.dtype), ref, msg=name)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hopper_backend_in_the_simulated_ring_matches_reference(layout, causal):
    """Every ring step on the Hopper backend (forward merges, dK/dV shares, dQ additions; S_local = 32 rows per
    rank, W = 2, GQA 4:2, D = 128): out, lse and the gradients against float64."""
    q, k, v, dout = make_qkv(1, 64, 64, 4, 2, 128, DTYPES[0], seed=11)
    ours = simulate_ring_attn(kernel_ops("sm90"), q, k, v, 128**-0.5, causal, 2, layout, dout=dout)
    check_against_reference(q, k, v, dout, 128**-0.5, causal, ours)


# ragged tiles; Sq != Sk both ways (Sq > Sk causal: rows that see no key, and Q tiles with no key tile at all)
GLUON_SEQLENS = [(4, 4), (300, 300), (1000, 1000), (200, 456), (512, 136)]


def _fwd_name(q, k, v, causal, out_dtype=None, merge_state=False, **options):
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    return fwd_launch(FwdCall(q, k, v, 0.125, causal, out, lse, merge_state=merge_state, **options)).name


@needs_hopper_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS])
@pytest.mark.parametrize("seqlen_q,seqlen_k", GLUON_SEQLENS, ids=[f"Sq{a}-Sk{b}" for a, b in GLUON_SEQLENS])
@pytest.mark.parametrize("head_dim", [128, 256], ids=["D128", "D256"])
def test_gluon_forward_and_backward_match_reference(head_dim, seqlen_q, seqlen_k, heads, causal, dtype):
    """The forward by the Gluon kernel (the same bits twice), and the backward from its lse, against float64."""
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, dtype, seed=seqlen_q + heads[1])
    assert _fwd_name(q, k, v, causal) == "sm90.fwd"
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    again = attn_fwd(q, k, v, scale, causal)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what="gluon")


@needs_hopper_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
@pytest.mark.parametrize("head_dim", [96, 128, 256], ids=["D96", "D128", "D256"])
def test_gluon_forward_starts_and_merges_into_the_ring_state(head_dim, heads, causal, dtype):
    """The ring's steps by the Gluon kernel: keys 0 to 400 (which every row sees) into a fresh fp32 state (the
    ring's first step), then keys 400 to 1000 merged into it (causal, bottom-right: a block whose last rows see all
    of it), give the whole call's out and lse against float64, Sq = 300; the merge writes no column past D (the
    state's rows here at least 128 wide, a NaN past D)."""
    q, k, v, dout = make_qkv(1, 300, 1000, *heads, head_dim, dtype, seed=head_dim + heads[1])
    first, rest = slice(0, 400), slice(400, 1000)
    assert _fwd_name(q, k[:, first], v[:, first], False, torch.float32) == "sm90.fwd"
    assert _fwd_name(q, k[:, rest], v[:, rest], causal, torch.float32, merge_state=True) == "sm90.fwd"
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k[:, first], v[:, first], scale, False, out_dtype=torch.float32)
    state = torch.full((*out.shape[:3], max(128, head_dim)), float("nan"), device=DEVICE)
    state[..., :head_dim] = out
    out = state[..., :head_dim]
    attn_fwd_merge_(q, k[:, rest], v[:, rest], scale, causal, out, lse)
    ref, plain = (dict(zip(RESULTS, reference_attention(q, k, v, dout, scale, causal, t), strict=True))
                  for t in (torch.float64, q.dtype))  # fmt: skip
    check_results("gluon steps", {"out": out, "lse": lse}, plain, ref)
    assert state[..., head_dim:].isnan().all()


def test_scratch_allocator_is_set_for_the_launch_only():
    """run_with_scratch gives the launch PyTorch's allocator and leaves the caller's in place."""
    from triton.runtime import _allocation

    def caller_allocator(size, alignment, stream):
        raise AssertionError("the caller's allocator was used")

    seen = []

    def in_caller_context():
        triton.set_allocator(caller_allocator)
        launch.run_with_scratch(lambda: seen.append(_allocation._allocator.get()))
        seen.append(_allocation._allocator.get())

    contextvars.copy_context().run(in_caller_context)  # the test's own context keeps its allocator too
    assert seen == [launch._torch_scratch, caller_allocator]


# ragged tiles on both sides (BLOCK_M 64, BLOCK_N 128); Sq != Sk both ways (Sq > Sk causal: rows that see no key,
# and key tiles no row sees)
GLUON_BWD_SEQLENS = [(4, 4), (300, 300), (1000, 1000), (200, 456), (512, 136), (777, 2049)]
# D = 96 runs in 128-column tiles (the columns past 96 load as zeros and are not stored)
GLUON_BWD_CASES = [(d, c) for d in (64, 96, 128, 256) for c in (False, True)]
GLUON_BWD_IDS = [f"D{d}-{'causal' if c else 'full'}" for d, c in GLUON_BWD_CASES]


@needs_hopper_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", HEADS, ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS])
@pytest.mark.parametrize("head_dim,causal", GLUON_BWD_CASES, ids=GLUON_BWD_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", GLUON_BWD_SEQLENS, ids=[f"Sq{a}-Sk{b}" for a, b in GLUON_BWD_SEQLENS])
def test_gluon_backward_matches_reference(seqlen_q, seqlen_k, head_dim, heads, causal, dtype):
    """dq, dk, dv by the Gluon backward (dQ through its fp32 scratch) against float64."""
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, dtype, seed=seqlen_q + 3 * heads[1])
    assert _launched(q, k, v, dout, causal) == ("sm90.bwd",)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what="gluon backward")


@needs_hopper_gpu
@pytest.mark.parametrize("head_dim,causal", GLUON_BWD_CASES, ids=GLUON_BWD_IDS)
def test_gluon_kernels_take_any_head_stride(head_dim, causal):
    """q, k, v, dout as Hugging Face models pass them, (B, S, H, D) views of (B, H, S, D) tensors (head stride S x D):
    the Gluon forward and backward run them, against float64."""
    tensors = make_qkv(2, 300, 456, 4, 2, head_dim, torch.bfloat16, seed=head_dim)
    q, k, v, dout = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in tensors)
    assert q.stride(2) == q.shape[1] * head_dim and _launched(q, k, v, dout, causal) == ("sm90.bwd",)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what="gluon, any head stride")


def test_dq_scratch_spans_as_many_kv_heads_as_fit():
    """Launches over groups of kv heads, evenly spread, each group's fp32 dQ scratch within DQ_SCRATCH_BYTES (one kv
    head at least)."""
    cap = sm90.DQ_SCRATCH_BYTES
    per_kv_head = cap // 8  # (B, Sq, group, D) fp32 of one kv head
    assert sm90.scratch_kv_heads(1, per_kv_head // (4 * 2 * 64), 8, 2, 64) == 8  # all fit: one launch
    assert sm90.scratch_kv_heads(1, per_kv_head // (4 * 2 * 64), 32, 2, 64) == 8  # 4 launches of 8
    assert sm90.scratch_kv_heads(1, per_kv_head // (4 * 2 * 64), 12, 2, 64) == 6  # 2 of 6, not 8 + 4
    assert sm90.scratch_kv_heads(4, cap // 64, 3, 1, 64) == 1  # one kv head is over the cap: one at a time


@needs_hopper_gpu
@pytest.mark.parametrize("heads", HEADS, ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_backward_over_groups_of_kv_heads(monkeypatch, heads, causal):
    """With the scratch held to one kv head's q heads, the backward runs a launch per kv head: dq, dk, dv against
    float64, and dK, dV (one writer per row) the bits of the single launch."""
    q, k, v, dout = make_qkv(2, 777, 2049, heads[0] * 2, heads[1] * 2, 64, DTYPES[0], seed=11)
    scale = 0.125
    out, lse = attn_fwd(q, k, v, scale, causal)
    whole = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    monkeypatch.setattr(sm90, "DQ_SCRATCH_BYTES", 1)
    assert _launched(q, k, v, dout, causal) == ("sm90.bwd",) * k.shape[2]
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what="gluon backward by kv heads")
    assert torch.equal(grads[1], whole[1]) and torch.equal(grads[2], whole[2])


@needs_hopper_gpu
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
@pytest.mark.parametrize("head_dim,causal", GLUON_BWD_CASES, ids=GLUON_BWD_IDS)
def test_gluon_backward_ring_step_forms(head_dim, heads, causal):
    """The ring's forms on the Gluon backward: dQ added into an fp32 accumulator, or stored into one (whatever it
    held ignored), rows of it finished into another buffer; dK, dV stored into fp32 shares that are not read, or
    added into what they hold. Each against the fp32 gradients added into zeros, and those against the public
    call's."""
    q, k, v, dout = make_qkv(1, 300, 200, *heads, head_dim, DTYPES[0], seed=5 + head_dim)
    assert _launched(q, k, v, dout, causal, grads_dtype=torch.float32, add_dq=True) == ("sm90.bwd",)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    want = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    grads = [torch.zeros(t.shape, device=DEVICE) for t in (q, k, v)]
    attn_bwd(dout, q, k, v, out, lse, scale, causal, dq_acc=grads[0], dk_acc=grads[1], dv_acc=grads[2])
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        torch.testing.assert_close(got.to(ref.dtype), ref, msg=f"added into zeros: {name}")
    held = [torch.randn(t.shape, device=DEVICE) for t in (q, k, v)]
    nans = [torch.full(t.shape, float("nan"), device=DEVICE) for t in (q, k, v)]

    def close(form, got, held_by):
        for name, g, h, ref in zip(("dq", "dk", "dv"), got, held_by, grads, strict=True):
            assert g.dtype == torch.float32 and not g.isnan().any(), f"{form}: {name}"
            torch.testing.assert_close(g - h if h is not None else g, ref, msg=f"{form}: {name}")

    dq, dk, dv = held[0].clone(), nans[1].clone(), nans[2].clone()
    attn_bwd(dout, q, k, v, out, lse, scale, causal, dq_acc=dq, dk_acc=dk, dv_acc=dv, add_dkdv=False)
    close("dq added, dk dv stored", (dq, dk, dv), (held[0], None, None))
    dq, dk, dv = nans[0].clone(), held[1].clone(), held[2].clone()
    attn_bwd(dout, q, k, v, out, lse, scale, causal, dq_acc=dq, dk_acc=dk, dv_acc=dv, add_dq=False)
    close("dq stored, dk dv added", (dq, dk, dv), (None, held[1], held[2]))
    rows = range(100, 250)
    final = FinalRows(torch.full(q.shape, float("nan"), device=DEVICE, dtype=q.dtype), rows)
    dq = held[0].clone()
    attn_bwd(dout, q, k, v, out, lse, scale, causal, dq_acc=dq, dk_acc=nans[1].clone(), dv_acc=nans[2].clone(),
             dq_final=final)  # fmt: skip
    torch.testing.assert_close(final.out[:, 100:250], (held[0] + grads[0])[:, 100:250].to(q.dtype))
    assert final.out[:, :100].isnan().all() and final.out[:, 250:].isnan().all()


# (Sq, Sk, window in ops' form (None: no limit; any integers), causal, softcap): causal sliding windows, two-sided
# ones and a single key (Sq = Sk, and Sq != Sk: no tolerance for P's rounding then), Sq != Sk both ways
# (bottom-right), a band wholly past the diagonal, soft-capping alone and with a window
BAND_CASES = {
    "1000-w256-causal": (1000, 1000, (256, None), True, 0.0),
    "1000-w100-37": (1000, 1000, (100, 37), False, 0.0),
    "777-2049-w300-300": (777, 2049, (300, 300), False, 0.0),
    "512-136-w40-causal": (512, 136, (40, None), True, 0.0),
    "300-w0-0": (300, 300, (0, 0), False, 0.0),
    "300-456-w0-0": (300, 456, (0, 0), False, 0.0),  # rows whose first key tile is all outside their band
    "200-456-w-30-50": (200, 456, (-30, 50), False, 0.0),
    "1000-cap30-causal": (1000, 1000, (None, None), True, 30.0),
    "1000-cap5": (1000, 1000, (None, None), False, 5.0),
    "777-2049-w128-cap30-causal": (777, 2049, (128, None), True, 30.0),
}


@needs_hopper_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256], ids=["D64", "D96", "D128", "D256"])
@pytest.mark.parametrize("case", list(BAND_CASES))
def test_gluon_kernels_with_windows_and_softcap_match_reference(case, head_dim, heads, dtype):
    """Sliding windows and soft-capping on the Gluon kernels (the forward at D = 96, 128 and 256, the backward at all
    four): out, lse, dq, dk, dv against float64; q scaled up so that the scores (about +-10) reach tanh's
    saturation."""
    seqlen_q, seqlen_k, window, causal, softcap = BAND_CASES[case]
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, dtype, seed=seqlen_q + heads[1] + head_dim)
    q = q * 3
    options = dict(window=window, softcap=softcap)
    assert (_fwd_name(q, k, v, causal, **options) == "sm90.fwd") == (head_dim in sm90.TABLE["fwd"])
    assert (_launched(q, k, v, dout, causal, **options) == ("sm90.bwd",)) == (head_dim in sm90.TABLE["bwd"])
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal, **options)
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal, **options)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what=f"gluon {case}", **options)
