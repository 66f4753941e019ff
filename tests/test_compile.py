"""torch.compile of code that calls the ring: the ring runs as the custom ops ringattn::ring_attn_fwd and
ringattn::ring_attn_bwd (functional.py), so Dynamo traces no collective and no launcher object, with fullgraph=True
and without; the compiled code equals eager on 2 gloo ranks, and the Ulysses x ring functions on a 2 x 2 grid
(interpreted kernels, fp32).

Compiling is slow on the CPU: each case compiles once, with tiny shapes, in one set of ranks.
"""

import pytest
import torch
from torch import nn

from ringattn.parallel.documents import document_ids
from ringattn.testing import check_close
from tests.distributed import run_ranks
from tests.test_sinks import sink_reference
from tests.utils import DEVICE, make_qkv

# the ranks fork as gloo ranks running the interpreted kernels: CPU only (CUDA cannot start in a forked process)
pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
DOCUMENTS = [5, 1, 14, 12]  # 32 tokens on 2 ranks: a document of one token, documents crossing ranks and chunks
SINK = [-1.0, 0.5, 2.0, 4.0]


def _packed(dtype=torch.float16):
    """The packed sequence: q, k, v, dout (S, H, D) in `dtype` and its boundaries."""
    seqlen = sum(DOCUMENTS)
    cu_seqlens = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, dout = (t[0] for t in make_qkv(1, seqlen, seqlen, HEADS, KV_HEADS, HEAD_DIM, dtype, seed=5))
    return q, k, v, dout, cu_seqlens


class _Block(nn.Module):
    """Projections around ringattn.nn.RingAttention (GQA, zigzag, causal, a window and softcap)."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.q = nn.Linear(32, HEADS * HEAD_DIM, bias=False)  # a bias's gradient is inductor's own reduction
        self.kv = nn.Linear(32, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.attention = attention

    def forward(self, x):  # x (B, S_local, 32)
        batch, seqlen, _ = x.shape
        q = self.q(x).view(batch, seqlen, HEADS, HEAD_DIM)
        k, v = self.kv(x).view(batch, seqlen, 2, KV_HEADS, HEAD_DIM).unbind(2)  # strided views
        return self.attention(q, k, v).flatten(2)  # (B, S_local, HEADS * HEAD_DIM)


def _varlen_with_sinks(q, k, v, cu_seqlens, sink):
    import ringattn

    return ringattn.ring_attn_varlen_func(q, k, v, cu_seqlens, learnable_sink=sink, deterministic=True,
                                          return_lse=True, layout="zigzag")  # fmt: skip


def _run(fn, inputs, dout, leaves):
    """fn(*inputs)'s outputs and, after backward(dout) through the first, the gradients of `leaves`."""
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    outputs[0].backward(dout)
    return [o.detach() for o in outputs] + [leaf.grad for leaf in leaves]


def _compiled_equals_eager(rank, world_size):
    import ringattn

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    results = {}

    # default mode: a module holding ringattn.nn.RingAttention, forward and backward
    torch.manual_seed(0)
    attention = ringattn.nn.RingAttention(causal=True, layout="zigzag", window_size=(9, 0), softcap=5.0)
    block = _Block(attention)
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1 + rank))
    dout = torch.randn(1, 16, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3 + rank))
    runs = []
    for fn in (block, torch.compile(block)):
        block.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        runs.append(_run(fn, (leaf,), dout, [leaf, *block.parameters()]))
    results["module"] = runs
    graph_breaks = dict(torch._dynamo.utils.counters["graph_break"])

    # fullgraph=True: packed documents in fp16 with learnable sinks (the op keeps the fp32 out for their gradient),
    # deterministic, return_lse
    *tensors, cu_seqlens = _packed()
    q, k, v, dout = (t[ringattn.shard_indices(len(t), rank, world_size, "zigzag")] for t in tensors)
    sink = torch.tensor(SINK)
    runs = []
    for fn in (_varlen_with_sinks, torch.compile(_varlen_with_sinks, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        runs.append(_run(fn, (*leaves[:3], cu_seqlens, leaves[3]), dout, leaves))
    results["varlen sinks"] = runs

    # fullgraph=True: the sequence-parallel loss, forward and backward; eager in fp32 and float64 beside it
    from ringattn import sequence_parallel as sp

    logits = torch.randn(2, 8, 11, generator=torch.Generator().manual_seed(5 + rank))
    labels = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(7 + rank))
    labels[0, :3] = sp.IGNORE_INDEX
    losses = {}
    for loss_fn in (sp.cross_entropy, ringattn.SequenceParallel(layout="zigzag").cross_entropy):
        runs = []
        for fn, dtype in ((loss_fn, torch.float32), (torch.compile(loss_fn, fullgraph=True), torch.float32),
                          (loss_fn, torch.float64)):  # fmt: skip
            leaf = logits.to(dtype, copy=True).requires_grad_()
            loss = fn(leaf, labels, grad_reduction="mean")
            loss.backward()
            runs.append((loss.detach(), leaf.grad))
        losses[loss_fn.__qualname__] = runs

    # a check that fails while tracing, on rank 1 only: that frame runs eagerly and shares the refusal
    def refused(q, dropout_p):
        return ringattn.ring_attn_func(q, q, q, causal=True, dropout_p=dropout_p, layout="contiguous")

    with pytest.raises(ValueError) as refusal:
        torch.compile(refused, backend="aot_eager")(q[None, :, :KV_HEADS].float(), 0.1 if rank == 1 else 0.0)
    return results, graph_breaks, str(refusal.value), losses


@pytest.mark.timeout(120)
def test_compiled_ring_equals_eager_on_2_ranks():
    """Regression: torch.compile of anything calling the ring failed (fullgraph=True: "async_op=True for distributed
    collectives"; default: Dynamo's "'KernelLaunch' object has no attribute 'kernel'"). Now, with inductor:

    - torch.compile(module) of projections around ringattn.nn.RingAttention (zigzag, causal, GQA, a sliding window,
      softcap; q, k, v strided views): no graph break, and the output, the input's gradient and the weights'
      gradients bitwise eager's (the same kernels run, inside the custom ops; the projections are extern matmuls);
    - torch.compile(fullgraph=True) of ring_attn_varlen_func in fp16 with learnable sinks, deterministic=True and
      return_lse: out, lse, dq, dk, dv bitwise eager's; the sinks' gradient, which inductor compiles from plain
      tensor ops on the op's fp32 output, summed over the ranks within the tolerance rule (eager's error against
      the float64 reference as the plain implementation's);
    - torch.compile(fullgraph=True) of sequence_parallel.cross_entropy and SequenceParallel.cross_entropy (their
      agreement and all-reduce in the custom op ringattn::cross_entropy_totals; they failed on the agreement's header
      encoding before): the loss and the logits' gradient within the tolerance rule of float64 (eager fp32 the
      plain implementation);
    - a check that fails while torch.compile traces, on one rank (dropout_p), is raised by both ranks, the same
      error: Dynamo runs that frame eagerly, whose refusal meets the other rank's compiled call's agreement."""
    ranks = run_ranks(_compiled_equals_eager, 2, timeout=110)
    dsinks = [sum(results["varlen sinks"][run].pop() for results, *_ in ranks) for run in (0, 1)]  # eager, compiled
    for rank, (results, graph_breaks, refusal, losses) in enumerate(ranks):
        assert len(losses) == 2
        for name, ((eager, eager_grad), (compiled, compiled_grad), (ref, ref_grad)) in losses.items():
            check_close(f"rank {rank} compiled {name}", compiled, eager, ref)
            check_close(f"rank {rank} compiled {name}'s gradient", compiled_grad, eager_grad, ref_grad)
        assert graph_breaks == {}, f"rank {rank}: graph breaks under torch.compile(module): {graph_breaks}"
        for case, (eager, compiled) in results.items():
            assert len(eager) == len(compiled)
            for i, (e, c) in enumerate(zip(eager, compiled, strict=True)):
                assert torch.equal(e, c), f"rank {rank} {case}: result {i} differs, {(e - c).abs().max():.3g}"
        assert refusal == ranks[0][2] and refusal.startswith("ring_attn_func refused on group rank 1 of 2: dropout_p")
    q, k, v, dout, cu_seqlens = _packed()  # the fp16 inputs, taken in float64 by the reference
    ids = document_ids(cu_seqlens, len(q))
    ref = sink_reference(q[None], k[None], v[None], dout[None], torch.tensor(SINK), HEAD_DIM**-0.5, True,
                         torch.float64, q_doc_ids=ids, k_doc_ids=ids)  # fmt: skip
    check_close("compiled dsink", dsinks[1], dsinks[0], ref[5])


def _compiled_grid_equals_eager(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    import ringattn

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses", "ring"))
    u, r = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")

    def dense(q, k, v, sink):  # rows of one sequence each, GQA, a window, learnable sinks
        return ringattn.ulysses_ring_attn_func(q, k, v, causal=True, window_size=(11, 0), learnable_sink=sink,
                                               return_lse=True, mesh=mesh, layout="zigzag")  # fmt: skip

    def packed(q, k, v, cu_seqlens):  # documents crossing the pieces of ring shards and the ring shards
        return ringattn.ulysses_ring_attn_varlen_func(q, k, v, cu_seqlens, deterministic=True, return_lse=True,
                                                      mesh=mesh, layout="zigzag")  # fmt: skip

    *tensors, cu_seqlens = _packed(torch.float32)
    idx = ringattn.grid_shard_indices(len(tensors[0]), u, 2, r, 2, "zigzag")
    q, k, v, dout = (t[idx] for t in tensors)  # (8, H, D) of the 32 tokens
    sink = torch.tensor(SINK)
    results = {}
    for name, fn, inputs in (("dense", dense, (q[None], k[None], v[None], sink)),
                             ("packed", packed, (q, k, v, cu_seqlens))):  # fmt: skip
        runs = []
        for run in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
            runs.append(_run(run, leaves, dout.view_as(leaves[0]), [t for t in leaves if t.requires_grad]))
        results[name] = runs
    return results


@pytest.mark.timeout(150)
def test_compiled_grid_equals_eager_on_4_ranks():
    """Regression: the Ulysses x ring functions broke Dynamo's graph at their agreement (fullgraph=True raised
    Unsupported on the header's encoding), and their backward read the exchange's number while AOTAutograd traced
    it. Now their agreement across the grid and the backward's check run in custom ops
    (ringattn::ulysses_ring_agreement, ringattn::ulysses_backward_check) whose outputs the exchanges take, and
    torch.compile(fullgraph=True) of ulysses_ring_attn_func (GQA, a window, learnable sinks) and of
    ulysses_ring_attn_varlen_func (packed documents) on a 2 x 2 grid gives eager's out, lse and gradients bitwise
    (aot_eager: Dynamo and AOTAutograd, the same kernels)."""
    for rank, results in enumerate(run_ranks(_compiled_grid_equals_eager, 4, timeout=140)):
        for case, (eager, compiled) in results.items():
            assert len(eager) == len(compiled) == (6 if case == "dense" else 5)  # out, lse, the gradients
            for i, (e, c) in enumerate(zip(eager, compiled, strict=True)):
                assert torch.equal(e, c), f"rank {rank} {case}: result {i} differs, {(e - c).abs().max():.3g}"


def _ring_ops_pass_opcheck(rank, world_size):
    import torch.distributed as dist

    from ringattn.functional import ring_attn_bwd_op, ring_attn_fwd_op
    from ringattn.parallel.ulysses import backward_check_op, heads_to_seq_op, seq_to_heads_op
    from ringattn.ulysses import ulysses_ring_agreement_op

    q, k, v, dout = make_qkv(1, 8, 8, HEADS, KV_HEADS, HEAD_DIM, torch.float16, seed=rank)  # the fp32 out kept
    q, k, v, sink = (t.requires_grad_() for t in (q, k, v, torch.tensor(SINK)))
    cu_seqlens = torch.tensor([0, 3, 16], dtype=torch.int32)
    options = (HEAD_DIM**-0.5, True, None, None, 0.0, False, dist.group.WORLD.group_name, "zigzag")
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # AOT dispatch: the compiled tests
    fwd_args = (q, k, v, cu_seqlens, sink, *options, "q,k,v,sink", "ring")  # every input requires grad
    torch.library.opcheck(ring_attn_fwd_op, fwd_args, test_utils=checks)
    no_sink = (q, k, v, cu_seqlens, None, *options, "q,k,v", "ring")  # an empty fp32 state
    torch.library.opcheck(ring_attn_fwd_op, no_sink, test_utils=checks)
    out, lse, _, number = ring_attn_fwd_op(*fwd_args)
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    bwd_args = (dout, q, k, v, out, lse, number, cu_seqlens, *options)
    torch.library.opcheck(ring_attn_bwd_op, bwd_args, test_utils=checks)
    # the Ulysses exchanges over the 2 ranks, of 2 heads (one a rank: the exchanges' reshapes can be views) and of 1
    # (each rank a copy); the 2-D call's agreement and the backward's check
    world = dist.group.WORLD.group_name
    for heads in (2, 1):
        x = torch.randn(3, 4, heads, 8, requires_grad=True)
        torch.library.opcheck(seq_to_heads_op, (x, world, None), test_utils=checks)
        y = torch.randn(3, 8, 1, 8, requires_grad=True)
        torch.library.opcheck(heads_to_seq_op, (y, world, heads, ""), test_utils=checks)
    q, k, v = (t.detach() for t in (q, k, v))
    agreement = (q, k, v, cu_seqlens, *options[:5], True, "zigzag", "none", False, "ulysses", world, None)
    torch.library.opcheck(ulysses_ring_agreement_op, agreement, test_utils=checks)
    torch.library.opcheck(backward_check_op, (heads_to_seq_op(y, world, 1)[1], world, ""), test_utils=checks)
    return True


@pytest.mark.timeout(60)
def test_ring_custom_ops_pass_opcheck_on_2_ranks():
    """ringattn::ring_attn_fwd (fp16, with documents and sinks that need their gradient: the op also returns the fp32
    out; and without sinks: an empty fp32 state, where the real op's was fp16), ringattn::ring_attn_bwd, the
    Ulysses exchanges, the 2-D call's agreement and the Ulysses backward's check pass torch.library.opcheck's schema,
    autograd-registration and fake-tensor checks: the fake implementations give the real shapes, dtypes and strides
    (AOT dispatch is what the compiled tests run; a regression: the exchange back to the sequence split returned a
    view of other strides with one head a rank, and a compiled backward failed). Every rank runs the same checks, so
    the collectives pair up."""
    assert run_ranks(_ring_ops_pass_opcheck, 2, timeout=50) == [True, True]
