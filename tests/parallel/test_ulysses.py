"""Ulysses x ring attention (ulysses_ring_attn_func, its varlen form, shard / unshard with ulysses_group) on U x R
grids of spawned gloo ranks against float64 attention on the whole sequence; the 2-D layout's index map and the
head split as pure functions; bad grids and bad inputs refused on every rank alike."""

import functools
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ringattn
import ringattn.ulysses as ulysses_impl
from ringattn.parallel import LAYOUTS, grid_shard_ranges, shard_indices
from ringattn.parallel.documents import document_ids
from ringattn.parallel.grid import _grid_problem
from ringattn.parallel.ulysses import heads_per_rank, rank_heads
from ringattn.testing import check_close, magnitude
from tests.distributed import raised_errors, run_ranks
from tests.test_sinks import sink_reference
from tests.utils import make_qkv, reference_attention

GRIDS = [(2, 2), (1, 4), (4, 1), (2, 3), (3, 2)]  # (U, R)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ulysses_size,ring_size", GRIDS + [(3, 1), (1, 1)])
def test_grid_shards_are_pieces_of_ring_shards(ulysses_size, ring_size, layout):
    """Rank (u, r) holds the u-th of U equal pieces of ring shard r: the pieces in Ulysses order are ring shard r, in
    increasing global order; every position is on exactly one rank; with U = 1 it is shard_indices."""
    seqlen = 2 * ulysses_size * ring_size * 3
    for r in range(ring_size):
        pieces = [ringattn.grid_shard_indices(seqlen, u, ulysses_size, r, ring_size, layout)
                  for u in range(ulysses_size)]  # fmt: skip
        ring_shard = shard_indices(seqlen, r, ring_size, layout)
        assert torch.equal(torch.cat(pieces), ring_shard)
        assert all(p.numel() == seqlen // (ulysses_size * ring_size) for p in pieces)
        assert all(bool((p[1:] > p[:-1]).all()) for p in pieces)


def test_zigzag_piece_spanning_both_chunks():
    """U = 3 pieces of a zigzag ring shard of 2 chunks of 3: the middle piece takes the end of the first chunk and
    the start of the second."""
    # R = 2, S = 12: ring shard 0 = c_0 + c_3 = [0, 1, 2] + [9, 10, 11]
    assert grid_shard_ranges(12, 1, 3, 0, 2, "zigzag") == [range(2, 3), range(9, 10)]
    assert ringattn.grid_shard_indices(12, 2, 3, 0, 2, "zigzag").tolist() == [10, 11]
    with pytest.raises(ValueError, match=r"seqlen = 8 must be a multiple of the Ulysses degree 3 x the ring degree 2"):
        ringattn.grid_shard_indices(8, 0, 3, 0, 2, "zigzag")
    with pytest.raises(ValueError, match="ulysses_rank must be in"):
        ringattn.grid_shard_indices(12, 3, 3, 0, 2, "zigzag")


def test_head_split():
    """Query heads and K/V heads split over U ranks: 1 / U each, or one K/V head copied to U / Hkv ranks."""
    assert [rank_heads(8, u, 4) for u in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [rank_heads(2, u, 4) for u in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [rank_heads(1, u, 3) for u in range(3)] == [range(0, 1)] * 3
    assert heads_per_rank(6, 3) == 2 and heads_per_rank(3, 6) == 1
    with pytest.raises(ValueError, match="3 heads cannot be split over 2 Ulysses ranks"):
        heads_per_rank(3, 2)


def test_grid_problem_names_the_rank_placed_twice():
    """8 ranks as 2 x 2 grids whose rings were crossed ({0, 1} and {2, 3} Ulysses groups, rings {0, 2} and {1, 7}):
    each rank's field checks pass (the same ring rank across a Ulysses group, the same Ulysses rank across a ring),
    but rank 0 sees the ring of its Ulysses mate 1 hold rank 7 where its ring mate's Ulysses group holds 3."""
    rows = [[0, 2], [1, 7]]  # the rings of Ulysses ranks 0 and 1, as rank 0 gathers them
    columns = [[0, 1], [2, 3]]  # the Ulysses groups of ring ranks 0 and 1
    problem = _grid_problem(rows, columns)
    assert "do not tile their ranks as a grid" in problem and "holds global rank 7 at ring rank 1" in problem
    assert _grid_problem([[0, 2], [1, 3]], columns) is None


def _mesh(ulysses_size, ring_size):
    return init_device_mesh("cpu", (ulysses_size, ring_size), mesh_dim_names=("ulysses", "ring"))


def _check_against_reference(what, ours, q, k, v, dout, idx, causal, **docs):
    """ours = (out, lse, dq, dk, dv) of this rank's tokens idx, against float64 attention of the whole sequence under
    the tolerance rule."""
    scale = q.shape[-1] ** -0.5
    ref = reference_attention(q, k, v, dout, scale, causal, torch.float64, **docs)
    pt = reference_attention(q, k, v, dout, scale, causal, q.dtype, **docs)
    grad_scale = max(magnitude(g) for g in ref[2:])
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        local = (lambda t: t[:, :, idx]) if i == 1 else (lambda t: t[:, idx])
        check_close(f"{what} {name}", ours[i], local(pt[i]), local(ref[i]), None if i < 2 else grad_scale)
    return ref, pt


def _dense_grid_matches_reference(rank, world_size, ulysses_size, ring_size, cases):
    """Each case (layout, causal, heads_q, heads_k, seqlen_local, groups): ulysses_ring_attn_func on this grid, forward
    and backward, against float64; shard / unshard / position_ids of the 2-D layout alike."""
    mesh = _mesh(ulysses_size, ring_size)
    u, r = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")
    for index, (layout, causal, heads_q, heads_k, seqlen_local, groups, *options) in enumerate(cases):
        options = options[0] if options else {}
        seqlen = seqlen_local * ulysses_size * ring_size
        q, k, v, dout = make_qkv(2, seqlen, seqlen, heads_q, heads_k, 16, torch.float32, "cpu", seed=seqlen + heads_k)
        idx = ringattn.grid_shard_indices(seqlen, u, ulysses_size, r, ring_size, layout)
        where = dict(mesh=mesh) if groups == "mesh" else dict(ulysses_group=mesh["ulysses"], ring_group=mesh["ring"])
        place = dict(group=mesh["ring"], ulysses_group=mesh["ulysses"], layout=layout)
        q_l, k_l, v_l = (ringattn.shard(t, **place).requires_grad_() for t in (q, k, v))
        assert torch.equal(q_l, q[:, idx]) and torch.equal(ringattn.position_ids(seqlen, **place), idx)
        out, lse = ringattn.ulysses_ring_attn_func(q_l, k_l, v_l, causal=causal, layout=layout, return_lse=True,
                                                   **where, **options)  # fmt: skip
        out.backward(dout[:, idx])
        what = f"U{ulysses_size} x R{ring_size} rank ({u}, {r}) {layout} causal={causal} Hq{heads_q} Hkv{heads_k}"
        ref_options = {}
        if options:
            ref_options = dict(window=tuple(None if w == -1 else w for w in options["window_size"]),
                               softcap=options["softcap"])  # fmt: skip
        ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
        ref, pt = _check_against_reference(what, ours, q, k, v, dout, idx, causal, **ref_options)
        check_close(f"{what} unshard(out)", ringattn.unshard(out, dim=1, **place), pt[0], ref[0])
        check_close(f"{what} unshard(lse)", ringattn.unshard(lse, dim=2, **place), pt[1], ref[1])
        if index == 0:
            # without return_lse: the same bits, and the output's all-to-all the only one back (none for U = 1,
            # which is ring_attn_func)
            back = mock.patch.object(ulysses_impl, "heads_to_seq", wraps=ulysses_impl.heads_to_seq)
            with torch.no_grad(), back as counted:
                alone = ringattn.ulysses_ring_attn_func(q_l, k_l, v_l, causal=causal, layout=layout, **where, **options)
            assert torch.equal(alone, out) and counted.call_count == int(ulysses_size > 1), (what, counted.call_count)
    return True


# (U, R) -> cases: GQA with Hkv = U, Hkv < U and Hkv = 1 among them; zigzag and contiguous, causal and not
DENSE_CASES = {
    (2, 2): [
        ("zigzag", True, 4, 2, 6, "mesh"),
        ("contiguous", True, 4, 1, 5, "groups"),
        ("contiguous", True, 4, 2, 4, "groups", {"window_size": (5, 0), "softcap": 3.0}),
    ],
    (1, 4): [("zigzag", True, 4, 2, 6, "groups"), ("contiguous", False, 2, 1, 5, "mesh")],
    (4, 1): [("zigzag", True, 8, 2, 3, "mesh"), ("contiguous", True, 4, 4, 5, "groups")],
    (2, 3): [("zigzag", True, 4, 1, 5, "groups"), ("contiguous", False, 2, 2, 4, "mesh")],
    (3, 2): [("zigzag", True, 6, 3, 4, "mesh"), ("contiguous", True, 3, 1, 3, "groups")],
}


@pytest.mark.parametrize(
    "ulysses_size,ring_size",
    list(DENSE_CASES),
    ids=[f"U{u}xR{r}" for u, r in DENSE_CASES],
)
def test_ulysses_ring_matches_reference(ulysses_size, ring_size):
    cases = DENSE_CASES[(ulysses_size, ring_size)]
    world_size = ulysses_size * ring_size
    assert (
        run_ranks(_dense_grid_matches_reference, world_size, ulysses_size, ring_size, cases, timeout=300)
        == [True] * world_size
    )


def _varlen_grid_matches_reference(rank, world_size, ulysses_size, ring_size, lengths, heads_q, heads_k, layout):
    mesh = _mesh(ulysses_size, ring_size)
    u, r = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seqlen = int(cu_seqlens[-1])
    q, k, v, dout = make_qkv(1, seqlen, seqlen, heads_q, heads_k, 16, torch.float32, "cpu", seed=seqlen)
    idx = ringattn.grid_shard_indices(seqlen, u, ulysses_size, r, ring_size, layout)
    q_l, k_l, v_l = (t[0, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ulysses_ring_attn_varlen_func(q_l, k_l, v_l, cu_seqlens, layout=layout, return_lse=True,
                                                      mesh=mesh)  # fmt: skip
    out.backward(dout[0, idx])
    ids = document_ids(cu_seqlens, seqlen)
    ours = (out[None], lse[None], q_l.grad[None], k_l.grad[None], v_l.grad[None])
    _check_against_reference(f"U{ulysses_size} x R{ring_size} rank ({u}, {r}) varlen", ours, q, k, v, dout, idx, True,
                             q_doc_ids=ids, k_doc_ids=ids)  # fmt: skip
    return True


# documents crossing Ulysses pieces and ring shards, documents of one token, shorter than a piece, empty ones
VARLEN_CASES = {
    (2, 2): ([5, 1, 0, 9, 3, 6, 0], 4, 2, "zigzag"),  # S = 24, pieces of 6
    (4, 1): ([0, 7, 1, 1, 0, 11, 4], 4, 1, "zigzag"),  # pure Ulysses: the fused varlen kernel on the whole sequence
    (1, 4): ([3, 10, 1, 10], 4, 2, "zigzag"),  # ring_attn_varlen_func
    (3, 2): ([2, 13, 1, 5, 3], 6, 1, "contiguous"),  # S = 24, pieces of 4; MQA, Hkv < U
}


@pytest.mark.parametrize(
    "ulysses_size,ring_size",
    list(VARLEN_CASES),
    ids=[f"U{u}xR{r}" for u, r in VARLEN_CASES],
)
def test_ulysses_ring_varlen_matches_reference(ulysses_size, ring_size):
    world_size = ulysses_size * ring_size
    args = VARLEN_CASES[(ulysses_size, ring_size)]
    results = run_ranks(_varlen_grid_matches_reference, world_size, ulysses_size, ring_size, *args, timeout=300)
    assert results == [True] * world_size


def _sinks_match_reference(rank, world_size):
    mesh = _mesh(2, 2)
    u, r = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")
    q, k, v, dout = make_qkv(1, 24, 24, 4, 2, 16, torch.float32, "cpu", seed=11)
    sink = torch.tensor([-1.0, 0.5, 2.0, 6.0], requires_grad=True)
    idx = ringattn.grid_shard_indices(24, u, 2, r, 2, "zigzag")
    q_l, k_l, v_l = (t[:, idx].requires_grad_() for t in (q, k, v))
    out, lse = ringattn.ulysses_ring_attn_func(q_l, k_l, v_l, causal=True, mesh=mesh, return_lse=True,
                                               learnable_sink=sink, layout="zigzag")  # fmt: skip
    out.backward(dout[:, idx])
    dsink = sink.grad.clone()
    dist.all_reduce(dsink)  # each rank's share: its rows, its Ulysses heads
    ref = sink_reference(q, k, v, dout, sink, 16**-0.5, True, torch.float64)
    pt = sink_reference(q, k, v, dout, sink, 16**-0.5, True, torch.float32)
    grad_scale = max(magnitude(g) for g in ref[2:5])
    ours = (out, lse, q_l.grad, k_l.grad, v_l.grad)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        local = (lambda t: t[:, :, idx]) if i == 1 else (lambda t: t[:, idx])
        check_close(f"rank ({u}, {r}) {name}", ours[i], local(pt[i]), local(ref[i]), None if i < 2 else grad_scale)
    check_close("dsink summed over the grid", dsink, pt[5], ref[5])
    return True


def test_ulysses_ring_sinks_match_reference():
    """learnable_sink on a 2 x 2 grid: each rank's Ulysses heads take their sinks; the gradient summed over the grid
    is the whole sequence's."""
    assert run_ranks(_sinks_match_reference, 4) == [True] * 4


def _ulysses_of_one_is_the_ring(rank, world_size):
    mesh = _mesh(1, world_size)
    q, k, v, dout = make_qkv(1, 24, 24, 4, 2, 16, torch.float32, "cpu", seed=3)
    results = []
    for attn in (
        lambda *a: ringattn.ring_attn_func(*a, causal=True, layout="zigzag", group=mesh["ring"], return_lse=True),
        lambda *a: ringattn.ulysses_ring_attn_func(*a, causal=True, mesh=mesh, return_lse=True, layout="zigzag"),
        lambda *a: ringattn.ulysses_ring_attn_func(
            *a, causal=True, ring_group=mesh["ring"], return_lse=True, layout="zigzag"
        ),
    ):
        q_l, k_l, v_l = (ringattn.shard(t, group=mesh["ring"]).requires_grad_() for t in (q, k, v))
        out, lse = attn(q_l, k_l, v_l)
        out.backward(ringattn.shard(dout, group=mesh["ring"]))
        results.append((out, lse, q_l.grad, k_l.grad, v_l.grad))
    for other in results[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results[0], other, strict=True):
            assert torch.equal(a, b), name
    return True


def test_ulysses_degree_one_is_ring_attn_func():
    """U = 1 (a mesh's "ulysses" dimension of size 1, or no ulysses_group): the same bits as ring_attn_func."""
    assert run_ranks(_ulysses_of_one_is_the_ring, 2) == [True, True]


def _grid_beside_plain_call(rank, world_size):
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    ringattn.shard(x, ulysses_group=dist.group.WORLD)  # the grid's first call, agreed
    try:
        ringattn.shard(x, ulysses_group=dist.group.WORLD) if rank == 0 else ringattn.shard(x)
    except ValueError as err:
        return str(err)
    return None


def test_a_grid_call_beside_a_plain_one_is_refused_on_both_ranks():
    """One rank shards over a Ulysses group, the other over the plain group: both raise, the plain rank naming the
    call's form (a regression: its message read "disagree on ." with nothing named)."""
    grid_message, plain_message = run_ranks(_grid_beside_plain_call, 2)
    assert "disagree on Ulysses degree (ulysses_group's size) (rank 0: 2, rank 1: 0)" in grid_message
    assert "disagree on the call's form (some ranks call it over a Ulysses x ring grid, some not" in plain_message


def _grid_beside_plain_call_at_first(rank, world_size):
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).reshape(2, 8, 3)
    start = time.monotonic()
    try:
        ringattn.shard(x, ulysses_group=dist.group.WORLD) if rank == 0 else ringattn.shard(x)
    except ValueError as err:
        return str(err), time.monotonic() - start
    return None


def test_a_grid_call_beside_a_plain_one_at_the_grids_first_call_is_refused_at_once(monkeypatch):
    """As above at the grid's first call, whose exchanges check the grid's topology: both ranks raise within seconds
    (a regression: the grid rank went on to the topology check's exchanges, which the plain rank, having raised,
    never joined, and waited out the P2P timeout)."""
    monkeypatch.setenv("RINGATTN_P2P_TIMEOUT_S", "60")
    (grid_message, grid_s), (plain_message, plain_s) = run_ranks(_grid_beside_plain_call_at_first, 2)
    assert "disagree on Ulysses degree (ulysses_group's size) (rank 0: 2, rank 1: 0)" in grid_message
    assert "disagree on the call's form" in plain_message
    assert grid_s < 5.0 and plain_s < 5.0, (grid_s, plain_s)


def _bad_grids_and_inputs(rank, world_size):
    """Each case raises on every rank; returns {case: (message, seconds)}."""
    mesh = _mesh(2, 2)  # rank = 2 u + r
    u_group, ring = mesh["ulysses"], mesh["ring"]
    world = dist.group.WORLD
    crossed_ulysses = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every process creates every group
    crossed_rings = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    named_wrong = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    # the crossed groups as a mesh: its row [3, 2] is Ulysses group {2, 3}, where rank 3 is group rank 1
    out_of_order = DeviceMesh("cpu", torch.tensor([[0, 1], [3, 2]]), mesh_dim_names=("ulysses", "ring"))

    def attn(heads_q=4, heads_k=2, **kw):
        q = torch.zeros(1, 6, heads_q, 16)
        k = torch.zeros(1, 6, heads_k, 16)
        grids = {} if {"ulysses_group", "ring_group", "mesh"} & kw.keys() else {"mesh": mesh}
        return lambda: ringattn.ulysses_ring_attn_func(q, k, k, causal=True, layout="zigzag", **grids, **kw)

    cases = {
        "u-not-dividing-hq": attn(heads_q=3, heads_k=1),
        "u-and-hkv": attn(heads_q=6, heads_k=3),
        "overlapping": attn(ulysses_group=world, ring_group=world),
        "not-a-grid": attn(ulysses_group=crossed_ulysses[rank // 2], ring_group=crossed_rings[rank in (1, 2)]),
        "mesh-names": attn(mesh=named_wrong),
        "mesh-out-of-order": attn(mesh=out_of_order),
        # rank 0 passes the mesh's groups the other way round
        "swapped-on-one-rank": attn(
            ulysses_group=ring if rank == 0 else u_group, ring_group=u_group if rank == 0 else ring
        ),  # fmt: skip
        "one-rank-dtype": lambda: ringattn.ulysses_ring_attn_func(
            *(torch.zeros(1, 6, 4, 16, dtype=torch.float64 if rank == 3 else torch.float32),) * 3,
            mesh=mesh,
            layout="zigzag",
        ),
        "one-rank-causal": lambda: ringattn.ulysses_ring_attn_func(
            *(torch.zeros(1, 6, 4, 16),) * 3, causal=rank != 2, mesh=mesh, layout="zigzag"
        ),  # fmt: skip
        "one-rank-return-lse": lambda: ringattn.ulysses_ring_attn_func(
            *(torch.zeros(1, 6, 4, 16),) * 3, return_lse=rank != 3, mesh=mesh, layout="zigzag"
        ),  # fmt: skip
        "shard-length": lambda: ringattn.shard(
            torch.zeros(1, 6), group=ring, ulysses_group=u_group, layout="contiguous"
        ),
        "unshard-one-rank": lambda: ringattn.unshard(
            torch.zeros(1, 6 if rank == 1 else 4), group=ring, ulysses_group=u_group
        ),  # fmt: skip
    }
    errors = raised_errors({n: c for n, c in cases.items() if n != "one-rank-dtype"})
    start = time.monotonic()
    with pytest.raises(TypeError) as err:
        cases["one-rank-dtype"]()
    errors["one-rank-dtype"] = (str(err.value), time.monotonic() - start)
    return errors


BAD_GRID_EXPECTED = {
    "u-not-dividing-hq": "ulysses_group's size 2 must divide q's head count 3 (q.shape[2])",
    "u-and-hkv": "ulysses_group's size 2 and k's head count 3 (k.shape[2]) must divide one another",
    "overlapping": "ulysses_group and ring_group must share only this rank",
    "not-a-grid": "disagree on rank in the other group",
    "mesh-names": "mesh must have dimensions named 'ulysses' and 'ring', got ('dp', 'cp')",
    "mesh-out-of-order": "A DeviceMesh whose rank tensor does not increase along each dimension",
    # regression: the exchanges paired and agreed; the ranks then waited out the P2P timeout in the data's
    "swapped-on-one-rank": "disagree on the group's dimension (passed as ulysses_group or as ring_group)",
    # the refusing rank by its global rank too: a group rank does not say which rank of the grid it is
    "one-rank-dtype": "refused on group rank 1 of 2 (global rank 3): q must be float16, bfloat16 or float32, got "
    "torch.float64",
    "one-rank-causal": "disagree on causal (rank 0: True, rank 1: False)",
    "one-rank-return-lse": "disagree on return_lse (rank 0: True, rank 1: False)",
    "shard-length": "x.shape[1] = 6 must be a multiple of the Ulysses degree 2 x the ring degree 2",
    "unshard-one-rank": "disagree on x_local.shape",
}


def test_bad_grids_and_inputs_raise_on_every_rank():
    """U not dividing the query heads, U and the K/V heads not dividing one another, overlapping groups, groups that
    do not form a grid, a mesh without the dimension names, groups swapped on one rank, one rank's bad dtype,
    different causal or return_lse, bad lengths for shard / unshard: the same error on every rank of the 2 x 2 grid
    (groups that are no grid: an error of the kind on every rank), naming the argument (a refusal described once),
    within seconds."""
    results = run_ranks(_bad_grids_and_inputs, 4)
    for name, expected in BAD_GRID_EXPECTED.items():
        messages = {r[name][0] for r in results}
        # groups that are no grid: each ring says what its ranks disagree on
        different = name in ("not-a-grid", "mesh-out-of-order", "swapped-on-one-rank")
        assert len(messages) == 1 or different, f"{name}: ranks raised different errors: {messages}"
        assert all(expected in m for m in messages), f"{name}: {messages}"
        # shared on the Ulysses group, then on the ring: described once, not nested
        assert all(m.count("(raised on every rank of the group)") <= 1 for m in messages), f"{name}: {messages}"
        assert all(r[name][1] < 5.0 for r in results), f"{name}: {[r[name][1] for r in results]}"


def _refusals_at_a_grids_first_call(rank, world_size):
    from ringattn.parallel.grid import GridSignature, agree_across_grid, grid_groups, shared_grid_refusals

    def bad_mask():
        raise ValueError("bad mask")

    messages = []
    for refusing in (3, 0):  # a fresh grid each: ranks of other Ulysses groups and rings
        grid = grid_groups(mesh=_mesh(2, 2))
        with pytest.raises(ValueError) as err:
            if rank == refusing:  # its own call's checks refuse, as the model's mask does in a layer
                with shared_grid_refusals("hf attention mask", grid):
                    bad_mask()
            else:  # the others' next collective: another call's agreement, the grid's first
                agree_across_grid("ulysses_ring_attn_func", grid, lambda: (), GridSignature)
        messages.append(str(err.value))
        # the ranks stay in step: the next call agrees and checks the grid
        assert agree_across_grid("ulysses_ring_attn_func", grid, lambda: (), GridSignature).ulysses_size == 2
    return messages


def test_a_refusal_at_a_grids_first_call_reaches_every_rank_in_step():
    """A rank that refuses its own call (shared_grid_refusals) while the others make a grid's first agreement of
    another call: every rank raises that refusal, the same message (the first call's two exchanges more run under a
    name of their own, not the calls'), and the next call on the grid runs. Regression: the extra exchanges ran under
    each rank's own call name; the ranks then raised different errors, and the refusal reached its own rank only."""
    results = run_ranks(_refusals_at_a_grids_first_call, 4, timeout=60)
    for case in range(2):
        messages = {r[case] for r in results}
        assert len(messages) == 1, messages
        assert messages.pop().startswith("hf attention mask refused on group rank")


def _a_late_rank(rank, world_size):
    from ringattn.parallel.comm import CommunicationError

    q, mesh = torch.zeros(1, 8, 4, 16), _mesh(2, 2)
    if rank == 3:
        time.sleep(3.0)  # past the P2P timeout: its peers' first exchange fails while it is away
    with pytest.raises(CommunicationError, match=r"did not complete within 1\.5 s|failed"):
        ringattn.ulysses_ring_attn_func(q, q, q, causal=True, mesh=mesh, layout="zigzag")
    time.sleep(3.0)  # no rank leaves before the others are done: no error from a peer's exit
    return True


def test_a_rank_past_the_timeout_gets_a_timeout_on_every_rank_not_an_abort(monkeypatch):
    """Regression: on a 2 x 2 grid a rank arriving after its peers' timeout made gloo abort a process ("op.preamble.
    length <= op.nbytes", SIGABRT): after the failed exchange the others went on to the grid's next exchanges on the
    same groups, whose sizes the late rank's pending one did not match. A failed exchange now ends the call on each
    rank (CommunicationError, a RuntimeError), with no exchange after it."""
    monkeypatch.setenv("RINGATTN_P2P_TIMEOUT_S", "1.5")
    assert run_ranks(_a_late_rank, 4, timeout=90, barrier=False) == [True] * 4


def _grid_of_one_rank(rank, world_size):
    own = [dist.new_group([r]) for r in range(world_size)][rank]  # every process creates every group
    q, k, v, _ = make_qkv(1, 8, 8, 4, 2, 16, torch.float32, "cpu", seed=rank)  # each rank its own sequence
    out = ringattn.ulysses_ring_attn_func(q, k, v, causal=True, ulysses_group=own, layout="zigzag")
    assert torch.equal(out, ringattn.flash_attn_func(q, k, v, causal=True))
    return True


def test_a_ulysses_group_of_one_rank_without_a_ring_is_a_grid_of_one():
    """Regression: ulysses_ring_attn_func with a Ulysses group of one rank and no ring_group (a 1 x 1 grid) ran the
    world's ring, attending across the ranks' sequences; now it attends over this rank's sequence alone."""
    assert run_ranks(_grid_of_one_rank, 2) == [True, True]


def _backwards_in_another_order(rank, world_size, lengths, ring_size, checkpointed=False, reversed_ranks=None):
    """Two Ulysses calls agreed forward (pure Ulysses over the world, or U = 2 x R = 2; checkpointed: each under
    torch.utils.checkpoint without reentry); `reversed_ranks` (default: the second half of the ranks, one rank of each
    Ulysses group; in the grid, a whole ring) run their backwards in the other order."""
    reversed_ranks = range(world_size // 2, world_size) if reversed_ranks is None else reversed_ranks
    grid = dict(mesh=_mesh(2, 2)) if ring_size == 2 else dict(ulysses_group=dist.group.WORLD, ring_group=None)
    attention = functools.partial(ringattn.ulysses_ring_attn_func, causal=True, layout="zigzag", **grid)
    losses = []
    for seqlen in lengths:
        q, k, v, _ = make_qkv(1, seqlen, seqlen, 4, 2, 16, torch.float32, "cpu", seed=seqlen)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if checkpointed:
            losses.append(torch.utils.checkpoint.checkpoint(attention, q, k, v, use_reentrant=False).sum())
        else:
            losses.append(attention(q, k, v).sum())
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        for loss in losses[::-1] if rank in reversed_ranks else losses:
            loss.backward()
    return str(err.value), time.monotonic() - start


@pytest.mark.parametrize("lengths", [(8, 8), (8, 16)], ids=["same-shapes", "other-shapes"])
@pytest.mark.parametrize("ring_size", [1, 2], ids=["pure-ulysses", "grid"])
def test_backwards_in_another_order_on_some_ranks_raise_on_every_rank(lengths, ring_size):
    """Regression: the backward's first all-to-all (the output's) exchanged no header, so ranks differentiating two
    calls in another order traded one call's gradients for the other's (equal shapes) or aborted gloo. Now it agrees
    on the number of the exchange it differentiates: the same ValueError on every rank, within a second."""
    world_size = 2 * ring_size
    results = run_ranks(_backwards_in_another_order, world_size, lengths, ring_size)
    assert len({message for message, _ in results}) == 1, results
    assert "Ulysses backward: the ranks of the group disagree on the forward call whose backward this" in results[0][0]
    assert all(elapsed < 1.0 for _, elapsed in results)


def test_one_rank_of_a_grid_backwarding_in_another_order_raises_on_every_rank():
    """Regression: with one rank of a 2 x 2 grid reversed, only its Ulysses group's check failed; the other group's
    ranks went on into the ring's backward and waited there for the P2P timeout. Those that fail now share the error
    over their rings, where the others meet it in the ring backward's agreement: a ValueError on every rank, at
    once."""
    results = run_ranks(_backwards_in_another_order, 4, (8, 8), 2, False, (3,))
    for message, elapsed in results:
        assert "Ulysses backward: the ranks of the group disagree on the forward call whose backward this" in message
        assert elapsed < 1.0, results


def test_checkpointed_backwards_in_another_order_raise_on_every_rank():
    """Under torch.utils.checkpoint (without reentry) each backward recomputes its call first, a new exchange the
    ranks agree on by shapes alone: the backward agrees on the first forward's number, not the recomputation's.
    Regression: pure Ulysses paired the recomputations of different calls, without an error."""
    results = run_ranks(_backwards_in_another_order, 2, (8, 8), 1, True)
    assert len({message for message, _ in results}) == 1, results
    assert "Ulysses backward: the ranks of the group disagree on the forward call whose backward this" in results[0][0]
