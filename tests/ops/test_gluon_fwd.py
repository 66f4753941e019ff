"""The Gluon forward (kernels/attn_fwd_gluon.py) and when the public forward takes it (ops/gluon_fwd.py).

The interpreter cannot run Gluon: on the CPU these tests check the choice and $RINGATTN_GLUON; the kernel itself
runs in the GPU tests (a Hopper GPU with triton 3.9), against float64 under the tolerance rule, at every shape
that needs a mask (ragged tiles, Sq != Sk both ways, rows that see no key), and compiles offline in
tests/launch/test_kernel_resources.py.
"""

import pytest
import torch

from ringattn.ops import attn as attn_ops
from ringattn.ops import attn_bwd, attn_fwd, attn_fwd_merge_, gluon_fwd
from ringattn.ops.warp_spec import _triton_version
from ringattn.testing import RESULTS, check_results
from tests.utils import DEVICE, DTYPES, check_against_reference, dtype_id, make_qkv, reference_attention

GLUON_GPU = (
    DEVICE.type == "cuda"
    and torch.cuda.get_device_capability() == (9, 0)
    and _triton_version() == gluon_fwd.GLUON_TRITON
)
needs_gluon_gpu = pytest.mark.skipif(not GLUON_GPU, reason="the Gluon forward runs on Hopper GPUs with triton 3.9")
# ragged tiles; Sq != Sk both ways (Sq > Sk causal: rows that see no key, and Q tiles with no key tile at all)
SEQLENS = [(4, 4), (300, 300), (1000, 1000), (200, 456), (512, 136)]
HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA


def _gluon_kernel():
    from ringattn.kernels.attn_fwd_gluon import _attn_fwd_gluon_kernel  # as ops/attn.py: once triton 3.9 is there

    return _attn_fwd_gluon_kernel


def _fwd_kernel(q, k, v, causal, out_dtype=None, merge_state=False, **kwargs):
    """The kernel the forward of q, k, v into an out of out_dtype (default q's) launches."""
    out = torch.empty(q.shape, device=q.device, dtype=out_dtype or q.dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    args = dict(q_doc_ids=None, k_doc_ids=None, final=None) | kwargs
    launch = attn_ops._pick_fwd_launch(
        q, k, v, 0.125, causal, out, lse, args["q_doc_ids"], args["k_doc_ids"], merge_state, args["final"]
    )
    return launch.kernel


def test_bad_gluon_mode_raises(monkeypatch):
    monkeypatch.setenv("RINGATTN_GLUON", "yes")
    with pytest.raises(ValueError, match=r"\$RINGATTN_GLUON must be one of 0, 1 \(or unset\), got 'yes'"):
        gluon_fwd.gluon_mode()


@pytest.mark.parametrize("mode", [None, "1"], ids=["unset", "1"])
def test_cpu_calls_never_take_it(mode, monkeypatch):
    """The interpreter cannot run Gluon, whatever $RINGATTN_GLUON says."""
    if mode is None:
        monkeypatch.delenv("RINGATTN_GLUON", raising=False)
    else:
        monkeypatch.setenv("RINGATTN_GLUON", mode)
    q, k, v, _ = make_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, device=torch.device("cpu"))
    assert not gluon_fwd.fwd_gluon_ready(q, k, v, torch.empty_like(q), torch.empty(1, 2, 64), False, False, False)


def test_faster_head_dims_have_a_config():
    assert set(gluon_fwd.FASTER_HEAD_DIMS) <= set(gluon_fwd.GLUON_HEAD_DIMS)
    for head_dim in gluon_fwd.GLUON_HEAD_DIMS:
        cfg = attn_ops._fwd_gluon_config(head_dim, torch.bfloat16, torch.device("cuda"))
        assert cfg.block_m == 128 and cfg.num_warps == 4 and cfg.num_stages >= 2  # two 64-row consumers, a ring


@needs_gluon_gpu
def test_gluon_is_taken_only_where_it_applies(monkeypatch):
    monkeypatch.delenv("RINGATTN_GLUON", raising=False)
    gluon = _gluon_kernel()
    q, k, v, _ = make_qkv(1, 256, 256, 4, 2, 128, torch.bfloat16, seed=1)
    assert _fwd_kernel(q, k, v, False) is gluon and _fwd_kernel(q, k, v, True) is gluon
    assert _fwd_kernel(*make_qkv(1, 256, 256, 4, 2, 128, torch.float16, seed=1)[:3], True) is gluon
    ids = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    assert _fwd_kernel(q, k, v, False, q_doc_ids=ids, k_doc_ids=ids) is not gluon  # documents
    assert _fwd_kernel(q, k, v, False, out_dtype=torch.float32) is not gluon  # fp32 out
    assert _fwd_kernel(q, k, v, True, out_dtype=torch.float32, merge_state=True) is gluon  # the ring's step
    final = attn_ops.FinalRows(torch.empty_like(q), range(0, 128))
    assert _fwd_kernel(q, k, v, False, final=final) is not gluon  # rows finished elsewhere
    offset = torch.randn(k.numel() + 1, device=DEVICE, dtype=k.dtype)[1:].view(k.shape)  # off 16 bytes
    assert _fwd_kernel(q, offset, v, False) is not gluon
    q64, k64, v64, _ = make_qkv(1, 256, 256, 4, 2, 64, torch.bfloat16, seed=1)
    assert _fwd_kernel(q64, k64, v64, False) is not gluon  # D = 64: timed slower
    monkeypatch.setenv("RINGATTN_GLUON", "1")
    assert _fwd_kernel(q64, k64, v64, False) is gluon
    monkeypatch.setenv("RINGATTN_GLUON", "0")
    assert _fwd_kernel(q, k, v, False) is not gluon
    monkeypatch.delenv("RINGATTN_GLUON")
    monkeypatch.setenv("RINGATTN_FWD_TMA", "0")  # no descriptors at all
    assert _fwd_kernel(q, k, v, False) is attn_ops._attn_fwd_kernel
    monkeypatch.delenv("RINGATTN_FWD_TMA")
    monkeypatch.setattr(gluon_fwd, "_triton_version", lambda: (3, 6))
    assert _fwd_kernel(q, k, v, False) is not gluon


@needs_gluon_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS, ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS])
@pytest.mark.parametrize("head_dim", gluon_fwd.GLUON_HEAD_DIMS, ids=lambda d: f"D{d}")
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS, ids=[f"Sq{a}-Sk{b}" for a, b in SEQLENS])
def test_gluon_forward_and_backward_match_reference(seqlen_q, seqlen_k, head_dim, heads, causal, dtype, monkeypatch):
    """The forward by the Gluon kernel (the same bits twice), and the backward from its lse, against float64."""
    monkeypatch.setenv("RINGATTN_GLUON", "1")
    q, k, v, dout = make_qkv(2, seqlen_q, seqlen_k, *heads, head_dim, dtype, seed=seqlen_q + head_dim)
    assert _fwd_kernel(q, k, v, causal) is _gluon_kernel()
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    again = attn_fwd(q, k, v, scale, causal)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
    grads = attn_bwd(dout, q, k, v, out, lse, scale, causal)
    check_against_reference(q, k, v, dout, scale, causal, (out, lse, *grads), what="gluon")


@needs_gluon_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", HEADS[:2], ids=[f"Hq{a}-Hkv{b}" for a, b in HEADS[:2]])
@pytest.mark.parametrize("head_dim", gluon_fwd.GLUON_HEAD_DIMS, ids=lambda d: f"D{d}")
def test_gluon_forward_merges_into_the_ring_state(head_dim, heads, causal, dtype, monkeypatch):
    """The ring's step by the Gluon kernel: keys 400 to 1000 (causal, bottom-right: a block whose last rows see
    all of it) merged into the fp32 state of keys 0 to 400 (which every row sees) give the whole call's out and lse
    against float64, Sq = 300."""
    monkeypatch.setenv("RINGATTN_GLUON", "1")
    q, k, v, dout = make_qkv(1, 300, 1000, *heads, head_dim, dtype, seed=head_dim + heads[1])
    first, rest = slice(0, 400), slice(400, 1000)
    assert _fwd_kernel(q, k[:, rest], v[:, rest], causal, torch.float32, merge_state=True) is _gluon_kernel()
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k[:, first], v[:, first], scale, False, out_dtype=torch.float32)
    attn_fwd_merge_(q, k[:, rest], v[:, rest], scale, causal, out, lse)
    ref, plain = (dict(zip(RESULTS, reference_attention(q, k, v, dout, scale, causal, t), strict=True))
                  for t in (torch.float64, q.dtype))  # fmt: skip
    check_results("gluon step", {"out": out, "lse": lse}, plain, ref)
