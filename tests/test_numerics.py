"""Numerics that must never be the reason a run goes NaN or drifts: fully masked rows, extreme
logits, fp16 in and out, non-contiguous inputs, bitwise determinism (flash and ring)."""

import pytest
import torch

import ringattn
from ringattn.ops import KERNEL_OPS, AttnOps
from ringattn.parallel import shard_indices
from ringattn.testing import (
    RESULTS,
    check_results,
    simulate_ring_attn,
    simulate_ring_backward,
    simulate_ring_forward,
)
from tests.distributed import run_ranks
from tests.utils import DEVICE, DTYPES, check_against_reference, make_qkv, reference_attention

DTYPE = DTYPES[0]


def _flash(q, k, v, dout, softmax_scale, causal, deterministic=False):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = ringattn.flash_attn_func(
        q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True, deterministic=deterministic
    )
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def test_fully_masked_rows_give_zero_output_and_grads_flash():
    """Causal with Sq > Sk: the first Sq - Sk rows see no key. out, dq are exactly 0 there, lse is -inf,
    nothing is NaN, and all five results obey the tolerance rule against float64."""
    q, k, v, dout = make_qkv(2, 75, 21, 4, 2, 40, DTYPE, seed=5)
    out, lse, dq, dk, dv = _flash(q, k, v, dout, 0.3, True)
    masked = 75 - 21
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"NaN in {name}"
    assert (out[:, :masked] == 0).all() and (dq[:, :masked] == 0).all()
    assert (lse[:, :, :masked] == float("-inf")).all() and torch.isfinite(lse[:, :, masked:]).all()
    check_against_reference(q, k, v, dout, 0.3, True, (out, lse, dq, dk, dv), "flash")


class _QueryPaddingOps(AttnOps):
    """Block ops for which some query rows see no key, as padding tokens would: the first step's block output
    (fwd, or fwd_merge_ into a fresh state) is 0 with lse -inf there, and each later step leaves their running
    state untouched (merging a block output 0 with lse -inf), so they stay (0, -inf) through every step, which the
    backward must carry. `padded_rows(q_block)` gives the rows of a block (a view of one rank's queries) to mask."""

    def __new__(cls, ops: AttnOps, padded_rows):
        def fwd(q, k, v, softmax_scale, causal, out_dtype=None, final=None):
            out, lse = ops.fwd(q, k, v, softmax_scale, causal, out_dtype, final=final)
            rows = padded_rows(q)
            out[:, rows] = 0
            lse[:, :, rows] = float("-inf")
            _keep_final(final, rows, 0.0)
            return out, lse

        def fwd_merge_(q, k, v, softmax_scale, causal, out, lse, final=None, fresh=False):
            rows = padded_rows(q)
            if fresh:  # the state's first block: as fwd's output
                ops.fwd_merge_(q, k, v, softmax_scale, causal, out, lse, final=final, fresh=True)
                out[:, rows] = 0
                lse[:, :, rows] = float("-inf")
                _keep_final(final, rows, 0.0)
                return
            kept_out, kept_lse = out[:, rows].clone(), lse[:, :, rows].clone()
            ops.fwd_merge_(q, k, v, softmax_scale, causal, out, lse, final=final)
            out[:, rows] = kept_out
            lse[:, :, rows] = kept_lse
            _keep_final(final, rows, kept_out)

        return super().__new__(cls, fwd, ops.bwd, ops.bwd_preprocess, fwd_merge_)


def _keep_final(final, rows: torch.Tensor, value) -> None:
    """Set the padded `rows` (indices of the call's rows) that `final` finishes to `value`, as out's rows."""
    if final is not None:
        mine = (rows >= final.rows.start) & (rows < final.rows.stop)
        final.out[:, rows[mine]] = value if isinstance(value, float) else value[:, mine].to(final.out.dtype)


def test_fully_masked_rows_give_zero_output_and_grads_ring():
    """Ring (simulated, W = 3, zigzag causal, the kernels) with padded query rows that see no key in
    any block: out and dq are exactly 0 there, lse is -inf, nothing is NaN, every other row's out and dq
    are bitwise those of the ring without padding, and dk, dv those of the ring with dout = 0 at the
    padded rows."""
    world_size, seqlen_local, layout = 3, 16, "zigzag"
    seqlen = world_size * seqlen_local
    padded = torch.tensor([0, 1, 9, 30, 31, 47], device=DEVICE)  # global positions: every rank, both zigzag chunks
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 2, 1, 16, DTYPE, seed=8)
    idx = [shard_indices(seqlen, r, world_size, layout, device=DEVICE) for r in range(world_size)]
    q_s, k_s, v_s, dout_s = ([t.index_select(1, i) for i in idx] for t in (q, k, v, dout))
    local_padded = {q_r.untyped_storage().data_ptr(): torch.isin(i, padded) for q_r, i in zip(q_s, idx, strict=True)}

    def padded_rows(q_block):  # q_block is a row range of one rank's (contiguous) q shard
        start = q_block.storage_offset() // q_block.stride(1)
        mask = local_padded[q_block.untyped_storage().data_ptr()][start : start + q_block.shape[1]]
        return torch.nonzero(mask).flatten()

    ops = _QueryPaddingOps(KERNEL_OPS, padded_rows)
    states = simulate_ring_forward(ops, q_s, k_s, v_s, 0.25, True, layout)
    outs, lses = [s[0] for s in states], [s[1] for s in states]
    grads = simulate_ring_backward(ops, dout_s, q_s, k_s, v_s, [o.to(DTYPE) for o in outs], lses, 0.25, True, layout)
    dout_unpadded = dout.clone()
    dout_unpadded[:, padded] = 0
    clean = simulate_ring_attn(KERNEL_OPS, q, k, v, 0.25, True, world_size, layout, dout=dout_unpadded)
    for rank in range(world_size):
        pad = torch.isin(idx[rank], padded)
        (out, lse), (dq, dk, dv) = states[rank], grads[rank]
        for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert not torch.isnan(t).any(), f"rank {rank}: NaN in {name}"
        assert (out[:, pad] == 0).all() and (dq[:, pad] == 0).all() and (lse[:, :, pad] == float("-inf")).all()
        keep = idx[rank][~pad]
        assert torch.equal(out[:, ~pad], clean[0][:, keep]) and torch.equal(dq[:, ~pad], clean[2][:, keep])
        torch.testing.assert_close(dk, clean[3][:, idx[rank]], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dv, clean[4][:, idx[rank]], rtol=1e-6, atol=1e-6)


def _check_extreme(ours, q, k, v, dout, softmax_scale, causal, what, names=RESULTS):
    """The tolerance rule for `names` of (out, lse, dq, dk, dv) against float64, with the plain implementation in
    q's dtype."""
    ref = reference_attention(q, k, v, dout, softmax_scale, causal, torch.float64)
    pt = reference_attention(q, k, v, dout, softmax_scale, causal, q.dtype)
    ref, pt = (dict(zip(RESULTS, r, strict=True)) for r in (ref, pt))
    ours = {name: t for name, t in zip(RESULTS, ours, strict=True) if name in names}
    check_results(what, ours, pt, ref)


# Regression: the backward kernels exponentiated masked scores before zeroing them, so exp2 overflowed
# to inf there (numpy warned in the interpreter); they now mask the scores with -inf first.
@pytest.mark.filterwarnings("error:overflow encountered in exp2:RuntimeWarning")
def test_extreme_logits_do_not_overflow():
    """Inputs scaled x5 and softmax_scale = 10: scores reach ~5e3, far past exp's fp32 range (88). Flash and
    the ring (simulated, W = 3, zigzag causal) must stay finite and match float64 (_check_extreme)."""
    q, k, v, dout = make_qkv(1, 66, 66, 2, 1, 32, DTYPE, seed=13)
    q, k = q * 5, k * 5
    scale = 10.0
    assert (torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale).abs().max() > 1e3
    for causal in (False, True):
        flash = _flash(q, k, v, dout, scale, causal)
        for name, t in zip(RESULTS, flash, strict=True):
            assert not torch.isnan(t).any() and not torch.isinf(t).any(), f"flash {name} not finite"
        _check_extreme(flash, q, k, v, dout, scale, causal, f"flash causal={causal}")
    ring = simulate_ring_attn(KERNEL_OPS, q, k, v, scale, True, 3, "zigzag", dout=dout)
    for name, t in zip(RESULTS, ring, strict=True):
        assert torch.isfinite(t).all(), f"ring {name} not finite"
    _check_extreme(ring, q, k, v, dout, scale, True, "ring")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_saturated_softmax_recomputes_p_exactly(causal):
    """q x 1e4: scores of 1e4 and more, every row's softmax one-hot to fp32. The backward recomputes P from the
    forward's float64 lse split into an fp32 hi + lo pair, so P of a row's top key is 1 to an ulp, as in plain
    PyTorch (one fp32 lse, off by half an ulp of |lse|, put dv at 3.4x the rule's bound): out, lse, dq and dv
    follow the tolerance rule for flash and the simulated ring (W = 3 zigzag, W = 2 contiguous). dk is not claimed
    here: its exact value is ~1e-17 and FlashAttention's dS = P (dP - delta), with dP and delta = rowsum(dO O) two
    differently rounded fp32 dot products, leaves |dP| eps |q| in it (1e-2), even with P and delta exact."""
    q, k, v, dout = make_qkv(1, 132, 132, 2, 1, 32, DTYPE, seed=5)
    q = q * 1e4
    scale = 32**-0.5
    assert (torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale).abs().max() > 1e4
    names = ("out", "lse", "dq", "dv")
    _check_extreme(_flash(q, k, v, dout, scale, causal), q, k, v, dout, scale, causal, "flash", names)
    if causal:
        for world_size, layout in ((3, "zigzag"), (2, "contiguous")):
            ring = simulate_ring_attn(KERNEL_OPS, q, k, v, scale, True, world_size, layout, dout=dout)
            _check_extreme(ring, q, k, v, dout, scale, True, f"ring W={world_size} {layout}", names)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the GPU suite checks fp16 and bf16 in every kernel test")
def test_fp16_in_gives_fp16_out_and_grads_flash():
    q, k, v, dout = make_qkv(2, 45, 45, 4, 2, 32, torch.float16, seed=21)
    ours = _flash(q, k, v, dout, 32**-0.5, True)
    assert ours[0].dtype == torch.float16 and ours[1].dtype == torch.float32
    assert all(g.dtype == torch.float16 for g in ours[2:])
    check_against_reference(q, k, v, dout, 32**-0.5, True, ours, "flash fp16")


def _ring_results(rank, world_size, dtype, layout, seqlen_local, strides=("contiguous",), deterministic=False):
    """ring_attn_func on this rank's shard of one problem (GQA, causal), once per entry of `strides`:
    "contiguous" shards, or "strided": the same values as views into buffers twice as wide in the head dim
    (q, k, v and dout non-contiguous, last dim contiguous). Returns [(out, lse, dq, dk, dv)] per run."""
    seqlen = seqlen_local * world_size
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 2, 1, 16, dtype, device="cpu", seed=17)
    idx = shard_indices(seqlen, rank, world_size, layout)
    runs = []
    for stride in strides:
        shards = [t[:, idx] for t in (q, k, v, dout)]
        if stride == "strided":
            shards = [torch.cat([t, torch.full_like(t, float("nan"))], dim=-1)[..., : t.shape[-1]] for t in shards]
            assert not any(t.is_contiguous() for t in shards)
        q_l, k_l, v_l = (t.detach().requires_grad_() for t in shards[:3])
        out, lse = ringattn.ring_attn_func(q_l, k_l, v_l, causal=True, layout=layout, return_lse=True,
                                           deterministic=deterministic)  # fmt: skip
        out.backward(shards[3])
        runs.append((out.detach(), lse, q_l.grad, k_l.grad, v_l.grad))
    return runs


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the NCCL ring tests run fp16 and bf16 on GPUs")
def test_fp16_in_gives_fp16_out_and_grads_ring():
    """gloo, W = 2, zigzag causal: out and the gradients come back in fp16 (lse fp32) and obey the tolerance
    rule against float64 (the ring merges and accumulates in fp32, rounding once at the end)."""
    world_size, seqlen_local = 2, 22
    seqlen = seqlen_local * world_size
    q, k, v, dout = make_qkv(1, seqlen, seqlen, 2, 1, 16, torch.float16, device="cpu", seed=17)
    full = [torch.empty(q.shape, dtype=torch.float16), torch.empty(1, 2, seqlen)]
    full += [torch.empty(t.shape, dtype=torch.float16) for t in (q, k, v)]
    for rank, ((results,)) in enumerate(run_ranks(_ring_results, world_size, torch.float16, "zigzag", seqlen_local)):
        assert [t.dtype for t in results] == [torch.float16, torch.float32] + [torch.float16] * 3
        idx = shard_indices(seqlen, rank, world_size, "zigzag")
        for i, t in enumerate(results):
            full[i][(slice(None), slice(None), idx) if i == 1 else (slice(None), idx)] = t
    check_against_reference(q, k, v, dout, 16**-0.5, True, full, "ring fp16")


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")
def test_non_contiguous_inputs_give_the_contiguous_result_ring():
    """gloo, W = 2, zigzag causal: q, k, v and dout that are views with gaps (NaN-filled, so reading them would
    show) give bitwise the results of contiguous ones."""
    for rank, (a, b) in enumerate(run_ranks(_ring_results, 2, DTYPE, "zigzag", 20, ("contiguous", "strided"))):
        for name, x, y in zip(RESULTS, a, b, strict=True):
            assert torch.equal(x, y), f"rank {rank} {name}: non-contiguous inputs changed the result"


@pytest.mark.parametrize("head_dim", [40, 128])
def test_backward_is_bitwise_deterministic_flash(head_dim):
    """deterministic=True: repeated runs are bitwise identical (D = 40: the portable kernels; D = 128 on Hopper:
    the split kernels, not the Gluon backward that adds dQ atomically)."""
    seqlen = 777 if DEVICE.type == "cuda" else 77
    q, k, v, dout = make_qkv(2, seqlen, seqlen, 4, 1, head_dim, DTYPE, seed=23)
    first = _flash(q, k, v, dout, 0.2, True, deterministic=True)
    for _ in range(2):
        again = _flash(q, k, v, dout, 0.2, True, deterministic=True)
        for name, x, y in zip(RESULTS, first, again, strict=True):
            assert torch.equal(x, y), f"flash {name} differs between runs"


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")
def test_backward_is_bitwise_deterministic_ring():
    """gloo, W = 3, contiguous causal, deterministic=True, two runs in a row on every rank: bitwise identical
    results (the dK/dV accumulators always visit the ranks in the same order)."""
    for rank, runs in enumerate(run_ranks(_ring_results, 3, DTYPE, "contiguous", 19, ("contiguous",) * 2, True)):
        for again in runs[1:]:
            for name, x, y in zip(RESULTS, runs[0], again, strict=True):
                assert torch.equal(x, y), f"rank {rank} {name} differs between runs"


def test_backward_is_bitwise_deterministic_simulated_ring():
    """The simulated ring (W = 4, zigzag causal) on this device, the kernels the GPU ring runs: two runs give
    bitwise identical results (no atomics, a fixed accumulation order)."""
    q, k, v, dout = make_qkv(1, 96, 96, 4, 2, 32, DTYPE, seed=29)
    first = simulate_ring_attn(KERNEL_OPS, q, k, v, 0.2, True, 4, "zigzag", dout=dout)
    again = simulate_ring_attn(KERNEL_OPS, q, k, v, 0.2, True, 4, "zigzag", dout=dout)
    for name, x, y in zip(RESULTS, first, again, strict=True):
        assert torch.equal(x, y), f"simulated ring {name} differs between runs"
