"""What one rank computes at one ring step (parallel/steps.py), on one process: the step functions' stored and
added forms agree bit for bit, and every row is finished once."""

import pytest
import torch

from ringattn.ops import KERNEL_OPS, REFERENCE_OPS
from ringattn.parallel import LAYOUTS, BlockMode, BlockTask, ring_streams, steps
from ringattn.parallel.documents import ShardDocuments
from ringattn.parallel.steps import HeldBlock, _held_rows, _step_tasks, finishing_plan
from tests.utils import make_qkv


@pytest.mark.parametrize("overlap", ["same", "partial"])
def test_stored_share_of_tasks_sharing_key_rows_adds_the_later_ones(monkeypatch, overlap):
    """backward_step(add_dkdv=False) stores a share into a buffer that holds garbage: the first task reaching a
    K/V row stores there, later ones add (zeroing rows of theirs no task stored yet), so the share is what
    adding every task into zeros gives (tasks sharing key rows: a zigzag block under a window)."""
    half, whole = range(0, 4), range(0, 8)
    first_kv = whole if overlap == "same" else half
    two = [BlockTask(half, first_kv, BlockMode.FULL), BlockTask(range(4, 8), whole, BlockMode.FULL)]
    monkeypatch.setattr(steps, "block_tasks", lambda *args: two)
    q, k, v, dout = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, seed=1)
    out, lse = REFERENCE_OPS.fwd(q, k, v, 0.25, False)
    stats = REFERENCE_OPS.bwd_preprocess(out, dout, lse)
    added = [torch.zeros(t.shape) for t in (q, k, v)]
    stored = [added[0].clone(), *(torch.full(t.shape, torch.nan) for t in (k, v))]
    step = (REFERENCE_OPS, "contiguous", 1, 2, False, 0.25, dout, q, [HeldBlock(0, k, v, (whole,))], out, lse, stats)
    assert steps.backward_step(*step, stored[0], [stored[1:]], add_dkdv=False) == [(whole,)]
    assert steps.backward_step(*step, added[0], [added[1:]]) == [(whole,)]
    for name, got, want in zip(("dq", "dk", "dv"), stored, added, strict=True):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("ops_name", ["kernel", "reference"])
@pytest.mark.parametrize("layout,causal", [("contiguous", True), ("zigzag", True), ("contiguous", False)])
def test_own_block_step_stores_what_merging_into_the_identity_gives(layout, causal, ops_name):
    """Step 0 writes the state and stores the gradients into uninitialised buffers: the same bits as merging
    the own block into the merge's identity (out 0, lse -inf) and adding its gradients to zeros."""
    ops = KERNEL_OPS if ops_name == "kernel" else REFERENCE_OPS
    q, k, v, dout = make_qkv(1, 24, 24, 4, 2, 16, torch.float32, seed=3)
    step = (ops, layout, 1, 2, causal, 0.25)
    own = [HeldBlock(1, k, v, (range(0, 24),))]
    out, lse = steps.own_block_forward(ops, layout, 1, 2, causal, 0.25, q, k, v)
    merged = (
        torch.zeros(q.shape, device=q.device),
        torch.full(lse.shape, float("-inf"), dtype=lse.dtype, device=q.device),
    )
    steps.forward_step(*step, q, own, *merged)
    assert out.dtype == torch.float32 and torch.equal(out, merged[0]) and torch.equal(lse, merged[1])

    out_in = out.to(q.dtype)
    stats = ops.bwd_preprocess(out_in, dout, lse)
    stored = steps.own_block_backward(ops, layout, 1, 2, causal, 0.25, dout, q, k, v, out_in, lse, stats)
    added = [torch.zeros(t.shape, device=t.device) for t in (q, k, v)]
    steps.backward_step(*step, dout, q, own, out_in, lse, stats, added[0], [added[1:]])
    for s_, a_ in zip(stored, added, strict=True):
        assert s_.dtype == torch.float32 and torch.equal(s_, a_)


@pytest.mark.parametrize("ops_name", ["kernel", "reference"])
@pytest.mark.parametrize("rank,world_size,window", [(1, 4, (2, None)), (0, 2, (20, None))], ids=["bands", "across"])
def test_own_block_split_by_a_window_stores_what_merging_into_the_identity_gives(rank, world_size, window, ops_name):
    """A zigzag block under a window (S_local = 16, chunks of 8) is several tasks: a band per chunk, and where the
    window reaches across the gap between the chunks, the second chunk against the first (rows it shares with the
    second chunk's band). Each row's first task stores into the uninitialised state and the later ones merge or add:
    the same bits as merging every task into the identity and adding every gradient into zeros."""
    ops = KERNEL_OPS if ops_name == "kernel" else REFERENCE_OPS
    q, k, v, dout = make_qkv(1, 16, 16, 4, 2, 16, torch.float32, seed=rank)
    args = (ops, "zigzag", rank, world_size, True, 0.25)
    own = [HeldBlock(rank, k, v, (range(0, 16),))]
    out, lse = steps.own_block_forward(*args, q, k, v, window=window)
    merged = (torch.zeros(q.shape), torch.full(lse.shape, float("-inf"), dtype=lse.dtype))
    steps.forward_step(*args, q, own, *merged, window=window)
    assert torch.equal(out, merged[0]) and torch.equal(lse, merged[1])
    stats = ops.bwd_preprocess(out, dout, lse)
    stored = steps.own_block_backward(*args, dout, q, k, v, out, lse, stats, window=window)
    added = [torch.zeros(t.shape) for t in (q, k, v)]
    steps.backward_step(*args, dout, q, own, out, lse, stats, added[0], [added[1:]], window=window)
    for name, s_, a_ in zip(("dq", "dk", "dv"), stored, added, strict=True):
        assert torch.equal(s_, a_), name


def test_own_block_step_of_part_of_the_block_merges_into_the_identity(monkeypatch):
    """A step 0 that is not one task over the whole block (a zigzag block under a window) starts from the merge's
    identity and zeroed gradients: rows no task computes stay out 0, lse -inf, and add nothing to dK, dV."""
    monkeypatch.setattr(steps, "block_tasks", lambda *args: [BlockTask(range(0, 4), range(0, 8), BlockMode.FULL)])
    q, k, v, dout = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, seed=1)
    out, lse = steps.own_block_forward(REFERENCE_OPS, "contiguous", 1, 2, False, 0.25, q, k, v)
    top_out, top_lse = REFERENCE_OPS.fwd(q[:, :4], k, v, 0.25, False)
    torch.testing.assert_close(out[:, :4], top_out, rtol=1e-6, atol=0)
    torch.testing.assert_close(lse[:, :, :4], top_lse, rtol=1e-6, atol=0)
    assert torch.equal(out[:, 4:], torch.zeros_like(out[:, 4:])) and bool((lse[:, :, 4:] == -torch.inf).all())
    stats = REFERENCE_OPS.bwd_preprocess(out, dout, lse)
    dq, dk, dv = steps.own_block_backward(REFERENCE_OPS, "contiguous", 1, 2, False, 0.25, dout, q, k, v, out, lse,
                                         stats)  # fmt: skip
    want = REFERENCE_OPS.bwd(dout[:, :4], q[:, :4], k, v, top_out, top_lse, 0.25, False)
    torch.testing.assert_close(dq[:, :4], want[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(dq[:, 4:], torch.zeros_like(dq[:, 4:]))
    torch.testing.assert_close(dk, want[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dv, want[2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [[], [range(0, 8)], [range(2, 5)]], ids=["none", "whole", "part"])
def test_last_share_is_added_and_rounded_in_one_pass(rows):
    """add_share_rounded gives bitwise what add_share_ then .to(dtype) give, over any rows the last step covered."""
    acc = [torch.randn(2, 8, 3, 16) for _ in range(2)]
    share = [torch.randn(2, 8, 3, 16) for _ in range(2)]
    expected = [a.clone() for a in acc]
    steps.add_share_(*expected, *share, rows)
    got = steps.add_share_rounded(*acc, *share, rows, torch.bfloat16)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(g, e.to(torch.bfloat16))


def _check_finishing_plan(layout, world_size, causal, seqlen_local, docs=None, window=(None, None)):
    streams = ring_streams(layout, world_size, causal, seqlen_local, window)
    steps = max((s.steps for s in streams), default=0) + 1
    for rank in range(world_size):
        plan = finishing_plan(layout, rank, world_size, causal, seqlen_local, docs, window)
        touched = [
            [t.q_rows for _, t, _ in _step_tasks(layout, rank, world_size, causal, seqlen_local, docs, window,
                                                 _held_rows(streams, rank, step, world_size, seqlen_local))]
            for step in range(steps)
        ]  # fmt: skip
        assert [len(p) for p in plan] == [len(t) for t in touched]
        finisher = {}  # row -> (step, task) that finishes it
        for step, (finished, rows) in enumerate(zip(plan, touched, strict=True)):
            for i, (f, r) in enumerate(zip(finished, rows, strict=True)):
                assert set(f) <= set(r)
                for row in f:
                    assert row not in finisher, f"rank {rank}: row {row} finished twice"
                    finisher[row] = (step, i)
        assert sorted(finisher) == list(range(seqlen_local)), f"rank {rank}: rows left unfinished"
        for row, (step, i) in finisher.items():  # no task after the finishing one touches the row
            later = [r for s in range(step, steps) for j, r in enumerate(touched[s]) if (s, j) > (step, i)]
            assert all(row not in r for r in later), f"rank {rank}: row {row} touched after it was finished"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_finishing_plan_finishes_every_row_once_at_its_last_task(layout, causal):
    """Every row of every rank's shard is finished (written rounded) by exactly one task, the last that touches
    it: W = 1 ... 6, with packed documents whose blocks are skipped where they do not meet, and with windows (K/V
    going one way or both, a step holding two blocks)."""
    for world_size in range(1, 7):
        _check_finishing_plan(layout, world_size, causal, 12)
        for window in [(3, None), (3, 3), (8, 1), (20, 20)]:
            _check_finishing_plan(layout, world_size, causal, 12, window=window)
    cu = torch.tensor([0, 1, 2, 9, 10, 17, 24], dtype=torch.int32)
    _check_finishing_plan(layout, 3, causal, 8, ShardDocuments(cu, 8, 3, layout, "cpu"))


def test_finishing_plan_of_zigzag_finishes_the_first_chunk_at_the_last_step_that_sees_it():
    """Zigzag causal, W = 4, rank 2: its first chunk is last touched at step 2 (kv block 0, all queries against
    the block's first chunk); its second chunk at step 3 (kv block 3, the second chunk against the whole block)."""
    plan = finishing_plan("zigzag", 2, 4, True, 8)
    assert plan == [[range(0, 0)], [range(0, 0)], [range(0, 4)], [range(4, 8)]]


def test_no_finishing_plan_where_a_task_would_finish_rows_of_two_ranges():
    """Zigzag over 3 ranks, documents [3, 1, 8], not causal, window (1, unlimited): rank 1's first task leaves rows 0,
    1 and 3 to no later task, two ranges (a kernel finishes one), so there is no plan (the ring rounds after its
    last step; this raised on one rank, and its peers waited for it); with the window (1, 1) there is one."""
    docs = ShardDocuments(torch.tensor([0, 3, 4, 12], dtype=torch.int32), 4, 3, "zigzag", "cpu")
    assert finishing_plan("zigzag", 1, 3, False, 4, docs, (1, None)) is None
    _check_finishing_plan("zigzag", 3, False, 4, docs, (1, 1))
