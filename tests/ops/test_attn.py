"""The fused kernels (through flash_attn_func and the launchers) against a float64 reference."""

import itertools
import threading

import pytest
import torch
import triton
import triton.language as tl

import ringattn
from ringattn.kernels.portable.attn_bwd import _stats_plane
from ringattn.ops import (
    FwdCall,
    LaunchConfig,
    Target,
    attn_bwd,
    attn_bwd_ref,
    attn_fwd,
    attn_fwd_ref,
    override_configs,
    portable,
)
from ringattn.testing import check_close, magnitude
from tests.utils import DEVICE, DTYPES, check_against_reference, dtype_id, make_qkv, reference_attention

SEQLENS = [(1, 1), (17, 17), (97, 97), (129, 129), (17, 97), (97, 17), (129, 1)]
HEAD_DIMS = [32, 40, 64, 128]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
HEAD_IDS = ["MHA", "GQA", "MQA"]


def _grid_cases():
    """(Sq, Sk, D, Hq, Hkv, causal) of SEQLENS x HEAD_DIMS x HEADS x causal: every case on the GPU; on the CPU (the
    interpreter, about a second a case) a third of them, every (lengths, D, causal) with the heads in turn, so that
    every pair of values of any two parameters still meets in some case."""
    cases = []
    for (i, (sq, sk)), (j, d), (c, causal) in itertools.product(
        enumerate(SEQLENS), enumerate(HEAD_DIMS), enumerate([False, True])
    ):
        for h, (hq, hk) in enumerate(HEADS):
            if DEVICE.type == "cuda" or h == (i + j + c) % len(HEADS):
                ids = f"Sq{sq}-Sk{sk}-D{d}-{HEAD_IDS[h]}-{'causal' if causal else 'full'}"
                cases.append(pytest.param(sq, sk, d, hq, hk, causal, id=ids))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("seqlen_q,seqlen_k,head_dim,heads_q,heads_k,causal", _grid_cases())
def test_flash_attn_matches_reference(seqlen_q, seqlen_k, head_dim, heads_q, heads_k, causal, dtype):
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype, seed=seqlen_q + head_dim)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    assert out.dtype == dtype and q.grad.dtype == dtype and k.grad.dtype == dtype
    check_against_reference(q, k, v, dout, head_dim**-0.5, causal, (out, lse, q.grad, k.grad, v.grad))


# long, ragged lengths at a head dim of no tile size (the kernels pad it to 128): GPU only, the interpreter's CPU run
# of these lengths would take minutes
LONG_SEQLENS = [(1000, 1000), (777, 2049), (2049, 777)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="long lengths: the GPU suite")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q,heads_k", HEADS[:2], ids=HEAD_IDS[:2])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LONG_SEQLENS, ids=[f"Sq{a}-Sk{b}" for a, b in LONG_SEQLENS])
def test_long_ragged_lengths_at_head_dim_96_match_reference(seqlen_q, seqlen_k, heads_q, heads_k, causal, dtype):
    """D = 96 (whatever backend takes it), Sq != Sk both ways, lengths that fill no tile: out, lse and the gradients
    against float64 under the tolerance rule."""
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, heads_q, heads_k, 96, dtype, seed=seqlen_q + 3 * seqlen_k)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    check_against_reference(q, k, v, dout, 96**-0.5, causal, (out, lse, q.grad, k.grad, v.grad))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="D = 256 at these lengths: the GPU suite")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LONG_SEQLENS[1:], ids=[f"Sq{a}-Sk{b}" for a, b in LONG_SEQLENS[1:]])
def test_portable_kernels_at_head_dim_256_match_reference(seqlen_q, seqlen_k, causal, dtype):
    """The portable kernels at D = 256 (their own launch configs, the 16-bit ones and fp32's; on a GPU they run
    documents and deterministic calls there, and every fp32 call), GQA, Sq != Sk both ways: out, lse and the
    gradients against float64 under the tolerance rule."""
    q, k, v, dout = make_qkv(1, seqlen_q, seqlen_k, 4, 2, 256, dtype, seed=seqlen_q + seqlen_k)
    scale = 256**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal, backend="portable")
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal, backend="portable")
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="GPU launch configs: the GPU suite")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "head_dim, dtype",
    [(128, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)],
    ids=["128-bf16", "256-bf16", "128-fp32"],
)
def test_small_shared_memory_configs_match_reference(head_dim, dtype, causal):
    """The portable kernels at the configs of GPUs whose blocks get at most 99 KiB of shared memory (compute
    capability 8.6, 8.9, 12.x: portable.SMALL_SMEM_16BIT; fp32 takes its table's there, which the D = 256 test above
    runs at 256), run on this GPU, whatever it is, so that those configs are checked against float64 somewhere: GQA,
    777 queries, 2049 keys."""
    small = Target((8, 6))
    configs = {f"portable.{kernel}": portable.launch_config(kernel, head_dim, dtype, small)
               for kernel in ("fwd", "dkdv", "dq")}  # fmt: skip
    q, k, v, dout = make_qkv(1, 777, 2049, 4, 2, head_dim, dtype, seed=head_dim + causal)
    scale = head_dim**-0.5
    with override_configs(configs):
        out, lse = attn_fwd(q, k, v, scale, causal, backend="portable")
        grads = attn_bwd(dout, q, k, v, out, lse, scale, causal, backend="portable")
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softmax_scale_is_applied(causal):
    q, k, v, dout = make_qkv(1, 33, 33, 2, 2, 64, DTYPES[0], seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, return_lse=True)
    out.backward(dout)
    check_against_reference(q, k, v, dout, 0.3, causal, (out, lse, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_any_strides_give_the_contiguous_result(deterministic):
    """q, k, v sliced out of one packed (B, S, 3, H, D) tensor, and a strided dout: the same bits as contiguous copies
    through the same kernels. The default call's dout keeps its heads packed (a (B, S, 2, H, D) slice), as the Gluon
    backward needs (it takes the call on Hopper: two kernels may round differently); a deterministic call (the
    split or portable kernels, which take any strides) gets a (B, H, S, D) transposed one."""
    dtype = DTYPES[0]
    qkv = torch.randn(2, 45, 3, 4, 64, device=DEVICE, dtype=dtype)
    q, k, v = qkv.unbind(dim=2)
    if deterministic:
        dout = torch.randn(2, 4, 45, 64, device=DEVICE, dtype=dtype).transpose(1, 2)
    else:
        dout = torch.randn(2, 45, 2, 4, 64, device=DEVICE, dtype=dtype)[:, :, 1]
    assert not q.is_contiguous() and not dout.is_contiguous()
    out, lse = attn_fwd(q, k, v, 0.125, True)
    grads = attn_bwd(dout, q, k, v, out, lse, 0.125, True, deterministic=deterministic)
    q_c, k_c, v_c, dout_c = (t.contiguous() for t in (q, k, v, dout))
    out_c, lse_c = attn_fwd(q_c, k_c, v_c, 0.125, True)
    grads_c = attn_bwd(dout_c, q_c, k_c, v_c, out_c, lse_c, 0.125, True, deterministic=deterministic)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    for g, g_c in zip(grads, grads_c, strict=True):
        assert torch.equal(g, g_c)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_broadcast_inputs_match_reference(deterministic):
    """Tensors with a dimension of stride 0: K and V of one head expanded to two (MQA written as expand) and a
    gradient pooled over the sequence (that of a mean over it): against float64, through the kernels that take them
    (the pointer paths: a TMA descriptor is not meant to hold a stride of 0)."""
    q, k, v, dout = make_qkv(2, 70, 70, 4, 1, 64, DTYPES[0], seed=8)
    k, v = (t.expand(-1, -1, 2, -1) for t in (k, v))
    dout = dout[:, :1].expand_as(dout)
    assert k.stride(2) == 0 and dout.stride(1) == 0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=True, deterministic=deterministic, return_lse=True)
    out.backward(dout)
    check_against_reference(q, k, v, dout, 64**-0.5, True, (out, lse, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(97, 97), (17, 97), (97, 17)], ids=lambda n: str(n))
def test_tma_and_pointer_kv_loads_agree_bitwise(seqlen_q, seqlen_k, causal):
    """The portable forward's K/V tiles by TMA descriptors (rows past Sk zero-filled by the copy engine) and by
    masked pointer loads (the launch built for a GPU older than Hopper): the same bits, in the public call and the
    ring's merge; GQA; Sk not a multiple of a tile."""
    q, k, v, _ = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 64, DTYPES[0], seed=seqlen_q + seqlen_k)
    state = torch.randn(2, seqlen_q, 4, 64, device=DEVICE), torch.randn(2, 4, seqlen_q, device=DEVICE)
    here = Target.of(q)
    if here.gpu and here.capability < (9, 0):
        pytest.skip("TMA loads need Hopper or newer")
    cfg = portable.launch_config("fwd", 64, q.dtype, here)
    results = {}
    for target in (here, Target((8, 0))):
        outputs = []
        for merge in (False, True):
            out, lse = (t.clone() for t in state) if merge else (torch.empty_like(q), torch.empty_like(state[1]))
            launch = portable.fwd_launch(FwdCall(q, k, v, 0.125, causal, out, lse, merge_state=merge), cfg, target)
            assert launch.kwargs["KV_TMA"] is (target == here)
            launch()
            outputs += [out, lse]
        results[target] = outputs
    for tma, pointers in zip(*results.values(), strict=True):
        assert torch.equal(tma, pointers)


def test_tma_is_used_only_where_it_can_load():
    """A padded head dim or a base address off 16 bytes takes the pointer loads; contiguous and packed-qkv
    views take TMA (where the device has it: Hopper or newer, and the interpreter)."""
    dtype = DTYPES[0]
    hopper = Target((9, 0))
    packed = torch.randn(2, 9, 3, 4, 64, device=DEVICE, dtype=dtype).unbind(dim=2)[1]
    assert portable._kv_descriptors(packed, packed, 32, hopper) is not None
    assert portable._kv_descriptors(packed, packed, 32, Target(None)) is not None
    assert portable._kv_descriptors(packed, packed, 32, Target((8, 0))) is None
    padded = torch.randn(2, 9, 4, 40, device=DEVICE, dtype=dtype)
    assert portable._kv_descriptors(padded, padded, 32, hopper) is None
    unaligned = torch.randn(2 * 9 * 4 * 64 + 1, device=DEVICE, dtype=dtype)[1:].view(2, 9, 4, 64)
    assert portable._kv_descriptors(unaligned, unaligned, 32, hopper) is None
    q = torch.randn(2, 9, 4, 64, device=DEVICE, dtype=dtype)
    out, lse = attn_fwd(q, unaligned, unaligned, 0.125, True)
    out_c, lse_c = attn_fwd(q, unaligned.contiguous(), unaligned.contiguous(), 0.125, True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_rows_that_see_no_key_give_zeros_not_nan():
    """Causal with Sq > Sk: the first Sq - Sk rows see no key (bottom-right alignment)."""
    q, k, v, dout = make_qkv(1, 70, 20, 2, 1, 32, DTYPES[0], seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    out.backward(dout)
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert (out[:, :50] == 0).all() and (q.grad[:, :50] == 0).all()
    assert (lse[:, :, :50] == float("-inf")).all() and torch.isfinite(lse[:, :, 50:]).all()


@triton.jit
def _stats_plane_kernel(Out, stride_stat):
    tl.store(Out + tl.arange(0, 4), _stats_plane(stride_stat, 2) + tl.arange(0, 4))


def test_row_stats_planes_are_reached_in_64_bits():
    """The backward's row stats are 3 planes of B Hq Sq rows: from 2^30 rows on, plane 2 (delta) lies past 2^31
    elements, where a 32-bit offset wraps negative (a GPU of 141 GB holds such stats at small head dims). The
    kernels' offset, computed as they compute it (a stride under 2^31 arrives as a 32-bit int)."""
    out = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    stride = 2**30 + 5
    _stats_plane_kernel[(1,)](out, stride)
    assert out.tolist() == [2 * stride + i for i in range(4)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16_backward_with_large_lse_meets_the_rule(causal):
    """16-bit backwards recompute P from the fp32 lse2_hi alone (the portable kernels too, in the interpreter
    on the CPU): with scores in the thousands (|lse| ~ 2300, where hi's rounding is 2^-24 |lse|, a fifth of
    fp16's half ulp) every result still meets the tolerance rule."""
    q, k, v, dout = make_qkv(2, 48, 48, 2, 1, 64, torch.float16, seed=96)
    q = (q.float() * 600).half()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    out.backward(dout)
    assert lse.abs().max() > 2000
    check_against_reference(q, k, v, dout, 64**-0.5, causal, (out, lse, q.grad, k.grad, v.grad))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_bwd_accumulates_into_given_buffers(causal):
    """The ring relies on attn_bwd adding to its fp32 accumulators rather than overwriting them."""
    q, k, v, dout = make_qkv(1, 40, 50, 4, 2, 32, DTYPES[0], seed=7)
    out, lse = attn_fwd(q, k, v, 0.2, causal)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, 0.2, causal)
    accs = [torch.randn(t.shape, device=DEVICE, dtype=torch.float32) for t in (q, k, v)]
    start = [a.clone() for a in accs]
    returned = attn_bwd(dout, q, k, v, out, lse, 0.2, causal, dq_acc=accs[0], dk_acc=accs[1], dv_acc=accs[2])
    for acc, s, g, r in zip(accs, start, (dq, dk, dv), returned, strict=True):
        assert r is acc
        torch.testing.assert_close(acc, s + g.float(), rtol=0, atol=4 * torch.finfo(g.dtype).eps * g.abs().max())


@pytest.mark.parametrize("bwd", [attn_bwd, attn_bwd_ref], ids=["kernel", "reference"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("add_dq,add_dkdv", [(True, False), (False, False), (False, True)],
                         ids=["store-dkdv", "store-all", "store-dq"])  # fmt: skip
def test_bwd_stores_gradients_without_reading_them_when_asked(add_dq, add_dkdv, causal, bwd):
    """add_dkdv=False (the ring's share of a block in transit) and add_dq=False (with both: the ring's first
    step): those gradients are stored into their buffers, which hold NaN before and are never read; the
    others are still added; the same bits as adding to zeros."""
    q, k, v, dout = make_qkv(1, 40, 50, 4, 2, 32, DTYPES[0], seed=8)
    out, lse = attn_fwd(q, k, v, 0.2, causal)
    starts = [torch.randn(t.shape, device=DEVICE) for t in (q, k, v)]
    stores = (not add_dq, not add_dkdv, not add_dkdv)
    added = [torch.zeros_like(s_) if store else s_.clone() for s_, store in zip(starts, stores, strict=True)]
    bwd(dout, q, k, v, out, lse, 0.2, causal, None, *added)
    stored = [
        torch.full_like(s_, float("nan")) if store else s_.clone() for s_, store in zip(starts, stores, strict=True)
    ]
    bwd(dout, q, k, v, out, lse, 0.2, causal, None, *stored, add_dq=add_dq, add_dkdv=add_dkdv)
    for s_, a_ in zip(stored, added, strict=True):
        assert torch.equal(s_, a_)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_bwd_matches_autograd(causal):
    """attn_bwd_ref's closed-form gradients equal autograd through attn_fwd_ref (float64)."""
    q, k, v, dout = make_qkv(2, 23, 31, 6, 2, 16, torch.float64, seed=11)
    out, lse, dq, dk, dv = reference_attention(q, k, v, dout, 0.25, causal, torch.float64)
    for g, g_ref in zip(attn_bwd_ref(dout, q, k, v, out, lse, 0.25, causal), (dq, dk, dv), strict=True):
        torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)


def test_reference_fwd_rows_without_keys():
    q, k, v, _ = make_qkv(1, 5, 2, 1, 1, 8, torch.float64, seed=1)
    out, lse = attn_fwd_ref(q, k, v, 1.0, True)
    assert (out[:, :3] == 0).all() and (lse[:, :, :3] == float("-inf")).all()


def _bad(**over):
    shapes = dict(q=(1, 8, 4, 32), k=(1, 8, 2, 32), v=(1, 8, 2, 32))
    dtypes = dict(q=DTYPES[0], k=DTYPES[0], v=DTYPES[0])
    for name, value in over.items():
        if isinstance(value, torch.dtype):
            dtypes[name] = value
        else:
            shapes[name] = value
    return [torch.zeros(shapes[n], dtype=dtypes[n], device=DEVICE) for n in ("q", "k", "v")]


@pytest.mark.parametrize(
    "inputs,error,match",
    [
        (_bad(q=(8, 4, 32)), ValueError, "q must have 4 dimensions"),
        (_bad(k=(1, 8, 2, 32, 1)), ValueError, "k must have 4 dimensions"),
        (_bad(q=torch.int32), TypeError, "q must be float16, bfloat16 or float32"),
        (_bad(v=torch.float64), TypeError, "v must be float16, bfloat16 or float32"),
        (_bad(k=torch.float16 if DTYPES[0] != torch.float16 else torch.bfloat16), TypeError, "share one dtype"),
        (_bad(q=(1, 8, 3, 32), k=(1, 8, 2, 32), v=(1, 8, 2, 32)), ValueError, "divisible"),
        (_bad(q=(1, 8, 4, 36), k=(1, 8, 2, 36), v=(1, 8, 2, 36)), ValueError, "multiple of 8"),
        (_bad(q=(1, 8, 4, 264), k=(1, 8, 2, 264), v=(1, 8, 2, 264)), ValueError, "multiple of 8"),
        (_bad(q=(1, 8, 4, 64)), ValueError, "head dim 64"),
        (_bad(k=(2, 8, 2, 32), v=(2, 8, 2, 32)), ValueError, "batch size"),
        (_bad(v=(1, 9, 2, 32)), ValueError, "same shape"),
        (_bad(q=(1, 0, 4, 32)), ValueError, "positive"),
    ],
    ids=["q-3d", "k-5d", "int", "fp64", "mixed", "heads", "dim36", "dim264", "dim-mismatch", "batch", "kv", "empty"],
)
def test_bad_inputs_raise_clear_errors(inputs, error, match):
    with pytest.raises(error, match=match):
        ringattn.flash_attn_func(*inputs)


def test_bad_softmax_scale_raises():
    with pytest.raises(ValueError, match="softmax_scale must be a positive finite number"):
        ringattn.flash_attn_func(*_bad(), softmax_scale=-1.0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs compiled kernels")
def test_cpu_tensors_with_compiled_kernels_raise():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ringattn.flash_attn_func(*(t.cpu() for t in _bad()))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter runs on the CPU")
def test_bfloat16_in_the_interpreter_raises():
    """Regression: the Triton interpreter computed bfloat16 attention wrongly (lse ~ 1e10), silently."""
    with pytest.raises(TypeError, match="bfloat16 is not supported by the Triton interpreter"):
        ringattn.flash_attn_func(*_bad(q=torch.bfloat16, k=torch.bfloat16, v=torch.bfloat16))


def _doc_ids(lengths, device=DEVICE):
    """int32 (sum(lengths),) document ids: document i repeated lengths[i] times."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)).to(device)


DOC_CASES = {
    # name: (query document lengths, key document lengths); ids are shared between q and k
    "one-doc": ([70], [70]),
    "many": ([1, 17, 5, 40, 1, 33], [1, 17, 5, 40, 1, 33]),
    "tile-crossing": ([31, 2, 64, 3], [31, 2, 64, 3]),
    "short-q-block": ([0, 0, 9, 30], [12, 20, 9, 30]),  # q rows are a later slice of the packed sequence
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(DOC_CASES))
def test_document_masking_matches_reference(case, causal):
    """Packed documents: a row sees only keys of its own document (and, causal, not after itself)."""
    q_lengths, k_lengths = DOC_CASES[case]
    q_ids, k_ids = _doc_ids(q_lengths), _doc_ids(k_lengths)
    q, k, v, dout = make_qkv(1, q_ids.numel(), k_ids.numel(), 4, 2, 40, DTYPES[0], seed=len(q_ids) + len(case))
    scale = 40**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal, q_doc_ids=q_ids, k_doc_ids=k_ids)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale, causal, q_doc_ids=q_ids, k_doc_ids=k_ids)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, dq, dk, dv), q_doc_ids=q_ids, k_doc_ids=k_ids)


ROW_DOCS = [[1, 17, 5, 40, 1, 33], [97], [31, 2, 64]]  # each batch row its own documents, padded to 97 rows
ROW_DOCS[2].append(97 - sum(ROW_DOCS[2]))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_document_ids_per_batch_row_match_reference_and_each_row_alone(causal):
    """Document ids (B, S), each batch row its own documents, passed as column views of a wider (B, S + 12) tensor
    (a row stride, as the ring's shards of a batch pass them): against the float64 reference, and each row
    against the same call on that row alone with (S,) ids."""
    wide = torch.stack([_doc_ids([5, *lengths, 7]) + 10 * b for b, lengths in enumerate(ROW_DOCS)])  # (3, 109)
    ids = wide[:, 5:-7]  # (3, 97), row stride 109
    assert ids.stride() == (109, 1)
    q, k, v, dout = make_qkv(3, 97, 97, 4, 2, 40, DTYPES[0], seed=3)
    scale = 40**-0.5
    docs = dict(q_doc_ids=ids, k_doc_ids=ids)
    out, lse = attn_fwd(q, k, v, scale, causal, **docs)
    dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale, causal, **docs)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, dq, dk, dv), "per-row documents", **docs)
    for b in range(3):
        row = (t[b : b + 1] for t in (q, k, v))
        one_out, one_lse = attn_fwd(*row, scale, causal, q_doc_ids=ids[b].contiguous(), k_doc_ids=ids[b].contiguous())
        assert torch.equal(one_out[0], out[b]) and torch.equal(one_lse[0], lse[b]), f"row {b}"


def test_document_ids_are_validated():
    q, k, v, _ = make_qkv(1, 8, 8, 2, 2, 32, DTYPES[0])
    ids = _doc_ids([8])
    with pytest.raises(ValueError, match="together"):
        attn_fwd(q, k, v, 1.0, False, q_doc_ids=ids)
    with pytest.raises(TypeError, match="q_doc_ids must be an int32 tensor"):
        attn_fwd(q, k, v, 1.0, False, q_doc_ids=ids.long(), k_doc_ids=ids)
    with pytest.raises(ValueError, match=r"k_doc_ids must have shape \(8,\) or \(1, 8\)"):
        attn_fwd(q, k, v, 1.0, False, q_doc_ids=ids, k_doc_ids=ids[:5])
    with pytest.raises(ValueError, match=r"q_doc_ids must have shape \(8,\) or \(1, 8\), got \(2, 8\)"):
        attn_fwd(q, k, v, 1.0, False, q_doc_ids=ids.expand(2, 8), k_doc_ids=ids)


UNEQUAL_BWD_TILES = {  # (dK/dV rows x keys, dQ rows x keys); the GPU's dQ tile is 128 x 64
    "dkdv16x64-dq64x16": ((16, 64), (64, 16)),
    "dkdv64x32-dq32x64": ((64, 32), (32, 64)),
}
UNEQUAL_TILE_SHAPES = {  # name: (seqlen_q, seqlen_k, DOC_CASES entry or None)
    "97-97": (97, 97, None),
    "17-97": (17, 97, None),
    "97-17": (97, 17, None),
    "docs": (100, 100, "tile-crossing"),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", list(UNEQUAL_BWD_TILES))
@pytest.mark.parametrize("shape", list(UNEQUAL_TILE_SHAPES))
def test_bwd_with_unequal_tile_sides_matches_reference(shape, tiles, causal):
    """The interpreter's tiles are square, the GPU's are not: the causal diagonal crossing a tile of unequal
    sides, ragged ends of both sequences and GQA must hold for any pair of tile sides, with and without
    documents."""
    seqlen_q, seqlen_k, doc_case = UNEQUAL_TILE_SHAPES[shape]
    (dkdv_m, dkdv_n), (dq_m, dq_n) = UNEQUAL_BWD_TILES[tiles]
    configs = {"portable.dkdv": LaunchConfig(dkdv_m, dkdv_n, 4, 1), "portable.dq": LaunchConfig(dq_m, dq_n, 4, 1)}
    docs = {}
    if doc_case is not None:
        lengths = DOC_CASES[doc_case][0]
        assert sum(lengths) == seqlen_q == seqlen_k
        docs = dict(q_doc_ids=_doc_ids(lengths), k_doc_ids=_doc_ids(lengths))
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 40, DTYPES[0], seed=seqlen_q + 3 * seqlen_k)
    scale = 40**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal, **docs)
    with override_configs(configs):
        dq, dk, dv = attn_bwd(dout, q, k, v, out, lse, scale, causal, backend="portable", **docs)
    ref = reference_attention(q, k, v, dout, scale, causal, torch.float64, **docs)
    pt = reference_attention(q, k, v, dout, scale, causal, q.dtype, **docs)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for name, ours, p, r in zip(("dq", "dk", "dv"), (dq, dk, dv), pt[2:], ref[2:], strict=True):
        check_close(name, ours, p, r, grad_scale)


def test_calls_from_two_threads_at_once_match_reference():
    """Two threads, each its own inputs, forward and backward at the same time (the interpreter on the CPU: its
    launches take turns), every result under the tolerance rule."""
    failures, barrier = [], threading.Barrier(2)

    def run(seed):
        try:
            barrier.wait(timeout=60)
            for causal in (True, False, True):
                q, k, v, dout = make_qkv(1, 48, 48, 2, 2, 32, DTYPES[0], seed=seed)
                q, k, v = (t.requires_grad_() for t in (q, k, v))
                out, lse = ringattn.flash_attn_func(q, k, v, causal=causal, return_lse=True)
                out.backward(dout)
                check_against_reference(q, k, v, dout, 32**-0.5, causal, (out, lse, q.grad, k.grad, v.grad))
        except Exception as error:  # reported by the main thread
            failures.append(f"thread {seed}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert not failures, "\n".join(failures)
