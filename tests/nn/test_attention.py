"""ringattn.nn.RingAttention: the module is ring_attn_func with its arguments bound."""

import pytest
import torch

import ringattn
from ringattn.testing import check_close, magnitude
from tests.distributed import RING_BACKENDS, rank_device, run_ranks, skip_without_gpus
from tests.utils import DEVICE, make_qkv, reference_attention

# the gloo ranks of the CPU-only tests run the interpreted kernels: not on a GPU machine
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo ranks run the interpreted kernels on the CPU")


def test_extra_repr_and_bad_layout():
    layer = ringattn.nn.RingAttention(causal=True, softmax_scale=0.125, layout="zigzag")
    assert repr(layer) == "RingAttention(causal=True, softmax_scale=0.125, layout='zigzag', group=world)"
    assert list(layer.parameters()) == []
    with pytest.raises(ValueError, match="layout must be one of"):
        ringattn.nn.RingAttention(layout="striped")


def _layer_matches_reference(rank, world_size, backend, dtype):
    seqlen, scale = 2 * 13 * world_size, 0.2  # zigzag chunks of 13; a scale that is not the default
    device = rank_device(rank, backend)
    idx = ringattn.shard_indices(seqlen, rank, world_size, "zigzag", device=device)
    q, k, v, dout = make_qkv(2, seqlen, seqlen, 4, 2, 24, dtype, device=device, seed=3)
    layer = ringattn.nn.RingAttention(causal=True, softmax_scale=scale, layout="zigzag")
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = layer(q_l, k_l, v_l, return_lse=True)
    out.backward(dout[:, idx])
    ref = reference_attention(q, k, v, dout, scale, True, torch.float64)
    pt = reference_attention(q, k, v, dout, scale, True, dtype)
    grad_scale = max(magnitude(g) for g in ref[2:])
    check_close(f"rank {rank} out", out, pt[0][:, idx], ref[0][:, idx])
    check_close(f"rank {rank} lse", lse, pt[1][:, :, idx], ref[1][:, :, idx])
    for name, ours, i in (("dq", q_l.grad, 2), ("dk", k_l.grad, 3), ("dv", v_l.grad, 4)):
        check_close(f"rank {rank} {name}", ours, pt[i][:, idx], ref[i][:, idx], grad_scale)
    assert torch.equal(layer(q_l, k_l, v_l), out)  # return_lse=False: out only
    return True


def test_under_autocast_q_k_v_reach_the_ring_in_its_dtype(monkeypatch):
    """Regression: under fp16/bf16 autocast a RoPE kept in fp32 leaves q and k in fp32 beside a 16-bit v, which SDPA
    takes (in autocast's dtype) and the layer refused; now they reach the ring in autocast's dtype. Outside autocast
    they are passed as given."""
    import ringattn.nn.attention as attention

    seen = []
    monkeypatch.setattr(attention, "ring_attn_func", lambda q, k, v, **kw: seen.append((q.dtype, k.dtype, v.dtype)))
    layer = ringattn.nn.RingAttention(causal=True, layout="zigzag")
    q = torch.zeros(1, 8, 2, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        layer(q, q, q.half())
    layer(q, q, q)
    assert seen == [(torch.float16,) * 3, (torch.float32,) * 3]


def test_every_option_reaches_the_ring(monkeypatch):
    """The layer's window, soft-cap and deterministic, and forward's attention sinks (gpt-oss), reach ring_attn_func
    (regression: the layer took neither deterministic nor sinks)."""
    import ringattn.nn.attention as attention

    calls = []
    monkeypatch.setattr(attention, "ring_attn_func", lambda q, k, v, **kw: calls.append(kw))
    layer = ringattn.nn.RingAttention(causal=True, layout="zigzag", window_size=(8, 0), softcap=30.0,
                                      deterministic=True)  # fmt: skip
    assert "window_size=(8, 0), softcap=30.0, deterministic=True" in repr(layer)
    q, sink = torch.zeros(1, 8, 2, 16), torch.zeros(2)
    layer(q, q, q, learnable_sink=sink)
    assert calls == [dict(softmax_scale=None, causal=True, window_size=(8, 0), softcap=30.0, deterministic=True,
                          layout="zigzag", return_lse=False, learnable_sink=sink, group=None)]  # fmt: skip
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ringattn.nn.RingAttention(layout="zigzag", deterministic="yes")


def test_meta_tensors_and_non_tensors_get_the_rings_errors():
    """Regression: the autocast cast failed first on a meta tensor ("unknown device type for autocast") and on a
    list (no .device); the ring's own checks name them."""
    layer = ringattn.nn.RingAttention(causal=True, layout="zigzag")
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="q, k and v must be on one device, got q cpu, k meta"):
        layer(q, q.to("meta"), q)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        layer([[0.0]], q, q)


@pytest.mark.parametrize("backend,dtype", RING_BACKENDS)
def test_layer_matches_reference_on_2_ranks(backend, dtype):
    """Zigzag, causal, GQA (4 q heads, 2 kv heads), head dim 24, an explicit softmax_scale."""
    skip_without_gpus(backend, 2)
    assert run_ranks(_layer_matches_reference, 2, backend, dtype, backend=backend) == [True, True]


def _layer_with_boundaries_matches_reference(rank, world_size):
    """A non-causal layer given the boundaries of a padded batch (shard_batch's: the padding a document of its own):
    the real rows against float64 attention over the real tokens alone; a padding row sees only the padding."""
    seqlen, real = 4 * world_size, 4 * world_size - 3  # zigzag chunks of 2; 3 padding tokens
    sp = ringattn.SequenceParallel(layout="zigzag")
    batch = sp.shard_batch(torch.zeros(2, real, dtype=torch.int64))
    assert batch.seqlen == seqlen and batch.cu_seqlens.tolist() == [0, real, seqlen, seqlen + real, 2 * seqlen]
    q, k, v, dout = make_qkv(2, seqlen, seqlen, 4, 2, 16, torch.float32, device="cpu", seed=7)
    idx = ringattn.shard_indices(seqlen, rank, world_size, "zigzag")
    layer = ringattn.nn.RingAttention(causal=False, layout="zigzag")
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out = layer(q_l, k_l, v_l, cu_seqlens=batch.cu_seqlens)
    rows = idx < real
    (out[:, rows] * dout[:, idx][:, rows]).sum().backward()
    args = (q[:, :real], k[:, :real], v[:, :real], dout[:, :real], 0.25, False)
    ref, pt = reference_attention(*args, torch.float64), reference_attention(*args, torch.float32)
    check_close(f"rank {rank} out", out[:, rows], pt[0][:, idx[rows]], ref[0][:, idx[rows]])
    grad_scale = max(magnitude(g) for g in ref[2:])
    check_close(f"rank {rank} dq", q_l.grad[:, rows], pt[2][:, idx[rows]], ref[2][:, idx[rows]], grad_scale)
    # the padding's keys get no gradient from the real rows: they were never seen
    assert not k_l.grad[:, ~rows].any() and not v_l.grad[:, ~rows].any()
    with pytest.raises(TypeError):
        layer(q_l, k_l, v_l, True)  # everything after q, k, v is keyword-only
    return True


@cpu_only
def test_layer_takes_the_boundaries_of_a_padded_batch():
    """RingAttention(..., causal=False) with cu_seqlens: an encoder's real tokens never attend to the padding."""
    assert run_ranks(_layer_with_boundaries_matches_reference, 2) == [True, True]


def _layer_from_sequence_parallel_matches_reference(rank, world_size):
    """Each rank a sequence of its own (data parallel over the world, sequence parallel over a group of one): the
    layer built from the SequenceParallel runs over its group, not over the world that a layer built with a layout
    alone would mix both sequences in."""
    own = [torch.distributed.new_group([r]) for r in range(world_size)][rank]  # every process creates every group
    sp = ringattn.SequenceParallel(group=own, layout="zigzag")
    layer = ringattn.nn.RingAttention(causal=True, sp=sp)
    assert layer.group is own and layer.layout == "zigzag"
    q, k, v, dout = make_qkv(1, 8, 8, 2, 2, 16, torch.float32, device="cpu", seed=11 + rank)
    q_l, k_l, v_l = (sp.shard(t).detach().requires_grad_() for t in (q, k, v))
    out = layer(q_l, k_l, v_l)
    out.backward(sp.shard(dout))
    args = (q, k, v, dout, 0.25, True)
    ref, pt = reference_attention(*args, torch.float64), reference_attention(*args, torch.float32)
    check_close(f"rank {rank} out", out, pt[0], ref[0])
    grad_scale = max(magnitude(g) for g in ref[2:])
    for name, ours, i in (("dq", q_l.grad, 2), ("dk", k_l.grad, 3), ("dv", v_l.grad, 4)):
        check_close(f"rank {rank} {name}", ours, pt[i], ref[i], grad_scale)
    with pytest.raises(ValueError, match="from sp: pass sp without layout, group"):
        ringattn.nn.RingAttention(sp=sp, layout="zigzag", group=own)
    with pytest.raises(TypeError, match="sp must be a ringattn.SequenceParallel or None, got ProcessGroup"):
        ringattn.nn.RingAttention(sp=own)
    with pytest.raises(TypeError, match="needs sp= .* or layout="):
        ringattn.nn.RingAttention(causal=True)
    return True


@cpu_only
def test_layer_takes_its_group_and_layout_from_a_sequence_parallel():
    """RingAttention(sp=sp): the SequenceParallel's group and layout, so that the two cannot disagree; sp beside a
    layout or group, an sp of another type, and neither sp nor layout are refused at construction."""
    assert run_ranks(_layer_from_sequence_parallel_matches_reference, 2) == [True, True]


def _grid_layer_matches_reference(rank, world_size):
    """2 x 2 (a mesh) and 4 x 1 (ulysses_group the world, no ring: pure Ulysses, K/V heads 2 < U = 4)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))  # as the docs build it
    # "ulysses" last: each Ulysses group consecutive ranks, inside a node, as the planner costs it
    assert torch.distributed.get_process_group_ranks(mesh.get_group("ulysses")) == [rank // 2 * 2, rank // 2 * 2 + 1]
    grids = {
        "U2xR2-mesh": (dict(mesh=mesh), (mesh.get_local_rank("ulysses"), 2, mesh.get_local_rank("ring"), 2)),
        "U4xR1-groups": (dict(ulysses_group=torch.distributed.group.WORLD), (rank, 4, 0, 1)),
        "U2xR2-sp": (dict(sp=ringattn.SequenceParallel(mesh=mesh, layout="zigzag")),
                     (mesh.get_local_rank("ulysses"), 2, mesh.get_local_rank("ring"), 2)),
    }  # fmt: skip
    seqlen, scale = 2 * 3 * world_size, 0.2  # pieces of 6 tokens; a scale that is not the default
    q, k, v, dout = make_qkv(2, seqlen, seqlen, 4, 2, 24, torch.float32, device="cpu", seed=5)
    ref = reference_attention(q, k, v, dout, scale, True, torch.float64)
    pt = reference_attention(q, k, v, dout, scale, True, torch.float32)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for where, (groups, (u, size_u, r, size_r)) in grids.items():
        groups = groups if "sp" in groups else dict(groups, layout="zigzag")
        layer = ringattn.nn.RingAttention(causal=True, softmax_scale=scale, **groups)
        idx = ringattn.grid_shard_indices(seqlen, u, size_u, r, size_r, "zigzag")
        q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
        out, lse = layer(q_l, k_l, v_l, return_lse=True)
        out.backward(dout[:, idx])
        check_close(f"{where} rank {rank} out", out, pt[0][:, idx], ref[0][:, idx])
        check_close(f"{where} rank {rank} lse", lse, pt[1][:, :, idx], ref[1][:, :, idx])
        for name, ours, i in (("dq", q_l.grad, 2), ("dk", k_l.grad, 3), ("dv", v_l.grad, 4)):
            check_close(f"{where} rank {rank} {name}", ours, pt[i][:, idx], ref[i][:, idx], grad_scale)
    assert "ulysses_group=2 ranks" in repr(ringattn.nn.RingAttention(mesh=mesh, layout="contiguous"))
    with pytest.raises(ValueError, match="mesh must have dimensions named 'ulysses' and 'ring'"):
        ringattn.nn.RingAttention(
            mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")), layout="contiguous"
        )
    with pytest.raises(ValueError, match="pass either mesh or process groups"):
        ringattn.nn.RingAttention(mesh=mesh, group=mesh["ring"], layout="contiguous")
    # the ring is `group` here (ring_group is ulysses_ring_attn_func's name for it)
    with pytest.raises(TypeError, match="^group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None"):
        ringattn.nn.RingAttention(ulysses_group=torch.distributed.group.WORLD, group="ring", layout="contiguous")
    return True


@cpu_only
def test_layer_over_a_ulysses_ring_grid_matches_reference():
    """RingAttention(mesh=...) and RingAttention(ulysses_group=...) run ulysses_ring_attn_func: causal zigzag, GQA,
    head dim 24, an explicit softmax_scale; out, lse, dq, dk, dv against float64 (tolerance rule); bad meshes raise
    at construction."""
    assert run_ranks(_grid_layer_matches_reference, 4, timeout=240) == [True] * 4
