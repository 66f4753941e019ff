"""ring_attn_varlen_func on spawned ranks (gloo on CPU; NCCL on GPUs where there are enough): packed documents
vs float64 attention masked by document."""

import pytest
import torch

import ringattn
from ringattn.parallel.agreement import RingSignature, decode_header, describe_disagreement, encode_header
from ringattn.parallel.documents import document_ids
from ringattn.testing import check_close, magnitude
from tests.distributed import RING_BACKENDS, rank_device, run_ranks, skip_without_gpus
from tests.utils import make_qkv, reference_attention

# documents of length 1, documents shorter than W, documents crossing rank and chunk boundaries; at W = 2 empty
# documents (a repeated boundary, as static-shape packing pads the boundaries: first, inside and last)
CASES = {
    1: [5, 1, 12],
    2: [0, 1, 7, 3, 0, 1, 20, 4, 0, 0],
    3: [2, 1, 1, 30, 5, 1, 2],
    4: [13, 1, 1, 1, 20, 12],
}


def _check_rank(rank, ours, q, k, v, dout, ids, causal, dtype, idx, rows_of_batch, window=(None, None)):
    """This rank's (out, lse, dq, dk, dv) against the documents' float64 attention under the tolerance rule: q, k, v,
    dout (B, S, H, D) whole, ids their document ids ((S,) or (B, S)), idx the rank's positions; rows_of_batch: ours
    keep the batch dim (else they are batch 0's rows, 3-D); window: the reference's (None for no limit)."""
    docs = dict(q_doc_ids=ids, k_doc_ids=ids, window=window)
    ref = reference_attention(q, k, v, dout, 32**-0.5, causal, torch.float64, **docs)
    pt = reference_attention(q, k, v, dout, 32**-0.5, causal, dtype, **docs)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        rows = (lambda t: t[:, :, idx]) if i == 1 else (lambda t: t[:, idx])
        local = rows if rows_of_batch else (lambda t, rows=rows: rows(t)[0])
        check_close(f"rank {rank} {name}", ours[i], local(pt[i]), local(ref[i]), None if i < 2 else grad_scale)


def _varlen_ring_matches_reference(
    rank, world_size, backend, dtype, lengths, heads_q, heads_k, causal, layout, pad_to=1, window_size=(-1, -1)
):
    device = rank_device(rank, backend)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_seqlens, padding = ringattn.pad_cu_seqlens(cu_seqlens, pad_to)
    total = int(cu_seqlens[-1])
    q, k, v, dout = make_qkv(1, total, total, heads_q, heads_k, 32, dtype, device=device, seed=total)
    if padding:
        dout[:, total - padding :] = 0  # padding is left out of the loss
    idx = ringattn.shard_indices(total, rank, world_size, layout, device=device)
    q_l, k_l, v_l = (t[0, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ring_attn_varlen_func(q_l, k_l, v_l, cu_seqlens, causal=causal, window_size=window_size,
                                              layout=layout, return_lse=True)  # fmt: skip
    out.backward(dout[0, idx])
    assert out.shape == q_l.shape and lse.shape == (heads_q, len(idx))

    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    window = tuple(None if side == -1 else side for side in window_size)
    _check_rank(rank, ours, q, k, v, dout, document_ids(cu_seqlens, total), causal, dtype, idx, rows_of_batch=False,
                window=window)  # fmt: skip
    if padding:  # padding rows: finite, and no gradient reaches the padding tokens' inputs
        pad_rows = idx >= total - padding
        for g in (q_l.grad, k_l.grad, v_l.grad):
            assert torch.isfinite(g).all() and (g[pad_rows] == 0).all()


def _run_varlen(backend, dtype, world_size, *args):
    """_varlen_ring_matches_reference(rank, world_size, backend, dtype, *args) on world_size ranks of `backend`
    (skipped on NCCL without a GPU per rank)."""
    skip_without_gpus(backend, world_size)
    run_ranks(_varlen_ring_matches_reference, world_size, backend, dtype, *args, backend=backend)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("world_size", sorted(CASES), ids=[f"W{w}" for w in sorted(CASES)])
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_zigzag_matches_reference(backend, dtype, world_size, causal):
    heads = (4, 2) if world_size != 3 else (4, 1)  # GQA, and MQA at W = 3
    _run_varlen(backend, dtype, world_size, CASES[world_size], *heads, causal, "zigzag")


@pytest.mark.parametrize("world_size", [2, 3], ids=["W2", "W3"])
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_contiguous_matches_reference(backend, dtype, world_size):
    _run_varlen(backend, dtype, world_size, CASES[world_size], 4, 2, True, "contiguous")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_window_matches_reference(backend, dtype, layout):
    """Documents and a causal window of 4 keys together on 4 ranks (chunks of 6): K/V go one hop, both ways in
    zigzag, in the window's rows; documents cross rank and chunk boundaries, the window cuts the long ones."""
    _run_varlen(backend, dtype, 4, CASES[4], 4, 2, True, layout, 1, (4, 0))


@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_window_of_unequal_sides_without_a_finishing_plan_matches_reference(backend, dtype):
    """Zigzag over 3 ranks, not causal, a window of 1 key back and none forward, documents [3, 1, 8]: a task would
    finish rows of two ranges (steps.finishing_plan gives None), so the ring rounds out and dq after its last step.
    Regression: one rank raised "not one range" and its peers waited for it."""
    _run_varlen(backend, dtype, 3, [3, 1, 8], 4, 2, False, "zigzag", 1, (1, -1))
    _run_varlen(backend, dtype, 3, [3, 1, 20, 5, 1], 4, 2, False, "zigzag", 1, (-1, 4))


@pytest.mark.parametrize("world_size", [2, 4], ids=["W2", "W4"])
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_padding_gets_no_gradient(backend, dtype, world_size):
    """45 tokens padded to a multiple of 2W for zigzag: the padding is a document of its own."""
    _run_varlen(backend, dtype, world_size, [10, 1, 30, 4], 4, 2, True, "zigzag", 2 * world_size)


# a batch of packed rows, each its own documents (global row length S = 24 at W = 2, 40 at W = 4): documents of
# length 1, shorter than W, crossing rank and chunk boundaries, a row of one document; empty documents at W = 2
ROWS = {
    2: [[5, 1, 12, 6], [1, 7, 0, 3, 1, 12, 0], [24]],
    4: [[13, 1, 1, 1, 20, 4], [2, 30, 5, 1, 2], [40]],
}


def _batched_varlen_matches_reference(rank, world_size, backend, dtype, rows, causal, layout):
    """B packed rows through one ring: out, lse, dq, dk, dv against float64 attention masked by each row's
    documents, and the K/V of all rows in one transfer per step (2 (W - 1) send_recv calls forward, as a
    batch-1 ring's)."""
    from ringattn.parallel.comm import RingComm

    device = rank_device(rank, backend)
    batch, seqlen = len(rows), sum(rows[0])
    bounds = [0]
    for b, lengths in enumerate(rows):
        bounds += (b * seqlen + torch.tensor(lengths).cumsum(0)).tolist()
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)  # flattened (B * S) boundaries
    q, k, v, dout = make_qkv(batch, seqlen, seqlen, 4, 2, 32, dtype, device=device, seed=batch * seqlen)
    idx = ringattn.shard_indices(seqlen, rank, world_size, layout, device=device)
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))

    calls = []
    send_recv = RingComm.send_recv
    RingComm.send_recv = lambda self, t, *a, **kw: calls.append(tuple(t.shape)) or send_recv(self, t, *a, **kw)
    try:
        out, lse = ringattn.ring_attn_varlen_func(q_l, k_l, v_l, cu_seqlens, causal=causal, layout=layout,
                                                  return_lse=True)  # fmt: skip
        forward_calls = list(calls)
        out.backward(dout[:, idx])
    finally:
        RingComm.send_recv = send_recv
    assert forward_calls == [tuple(k_l.shape)] * (2 * (world_size - 1)), forward_calls
    assert out.shape == q_l.shape and lse.shape == (batch, 4, len(idx))

    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    ids = document_ids(cu_seqlens, batch * seqlen).reshape(batch, seqlen)
    _check_rank(rank, ours, q, k, v, dout, ids, causal, dtype, idx, rows_of_batch=True)


BATCHED = [  # (W, B, layout, causal)
    (2, 2, "zigzag", True),
    (2, 3, "contiguous", True),
    (2, 2, "contiguous", False),
    (4, 3, "zigzag", True),
    (4, 2, "contiguous", True),
]


@pytest.mark.parametrize("world_size,batch,layout,causal", BATCHED,
                         ids=[f"W{w}-B{b}-{lay}-{'causal' if c else 'full'}" for w, b, lay, c in BATCHED])  # fmt: skip
@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_varlen_batch_of_packed_rows_matches_reference(backend, dtype, world_size, batch, layout, causal):
    skip_without_gpus(backend, world_size)
    args = (ROWS[world_size][:batch], causal, layout)
    run_ranks(_batched_varlen_matches_reference, world_size, backend, dtype, *args, backend=backend)


def _bad_cu_seqlens_raise(rank, world_size):
    q = torch.zeros(8, 2, 32)
    with pytest.raises(ValueError, match="must end at the global length 16"):
        ringattn.ring_attn_varlen_func(q, q, q, torch.tensor([0, 5, 12], dtype=torch.int32), layout="zigzag")
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64, got torch.float32"):
        ringattn.ring_attn_varlen_func(q, q, q, torch.tensor([0.0, 5.0, 16.0]), layout="zigzag")
    with pytest.raises(TypeError, match="causal must be a bool, got 'no'"):
        ringattn.ring_attn_varlen_func(q, q, q, torch.tensor([0, 5, 16]), causal="no", layout="zigzag")
    with pytest.raises(ValueError, match=r"q, k and v must all be 3-D .* or all 4-D .*; got q shape \(1, 8, 2, 32\)"):
        ringattn.ring_attn_varlen_func(q[None], q, q, torch.tensor([0, 16], dtype=torch.int32), layout="zigzag")
    rows = q.expand(2, 8, 2, 32)  # 2 rows of 16 global tokens: every row start (16) a boundary
    with pytest.raises(ValueError, match=r"must end at the global length 32 \(2 rows of 16 tokens\), got 16"):
        ringattn.ring_attn_varlen_func(rows, rows, rows, torch.tensor([0, 16], dtype=torch.int32), layout="zigzag")
    with pytest.raises(ValueError, match=r"every row start .* missing \[16\]"):
        ringattn.ring_attn_varlen_func(
            rows, rows, rows, torch.tensor([0, 10, 20, 32], dtype=torch.int32), layout="zigzag"
        )
    return True


def test_varlen_bad_inputs_raise_on_every_rank():
    assert run_ranks(_bad_cu_seqlens_raise, 2) == [True, True]


def _ranks_disagree_on_cu_seqlens(rank, world_size):
    q = torch.zeros(8, 2, 32)
    cu = torch.tensor([0, 5 + rank, 16], dtype=torch.int32)  # each rank its own boundaries
    with pytest.raises(ValueError, match=r"^ring_attn_varlen_func: the ranks of the group disagree on cu_seqlens"):
        ringattn.ring_attn_varlen_func(q, q, q, cu, layout="zigzag")
    return True


def test_cu_seqlens_that_differ_across_ranks_raise_on_every_rank():
    """Ranks with different document boundaries would compute with different masks: caught before the ring."""
    assert run_ranks(_ranks_disagree_on_cu_seqlens, 2) == [True, True]


def test_disagreement_in_a_varlen_call_names_ring_attn_varlen_func():
    """Regression: ranks that disagreed in a ring_attn_varlen_func call were told "ring_attn_func: the ranks of
    the group disagree on ...", naming a function they did not call."""
    sig = RingSignature(1, 8, 2, 2, 32, torch.float32, True, 32**-0.5, "zigzag", "none", documents=7)

    def message(call, signatures):
        return describe_disagreement([decode_header(encode_header(call, s)) for s in signatures], RingSignature)

    got = message("ring_attn_varlen_func", [sig, sig._replace(causal=False)])
    assert got.startswith("ring_attn_varlen_func: the ranks of the group disagree on causal"), got
    dense = sig._replace(documents=0)
    assert message("ring_attn_func", [dense, dense._replace(causal=False)]).startswith("ring_attn_func: ")
