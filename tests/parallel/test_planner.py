"""ringattn.parallel.planner: the valid (U, R) splits, the cost model's sanity (more bandwidth or compute never
predicts slower; no ring cost at R = 1, no all-to-all at U = 1), the ring's hiding threshold against the rule
S_local >= F / (g B_link) (a block's compute against its K/V transfer), bad arguments refused by name, and the
command line.
Pure Python: no process group, no GPU."""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringattn.parallel.planner import DEFAULTS, cost, doc_tables, main, plan, ring_hiding_seqlen, valid_splits

ROOT = Path(__file__).resolve().parents[2]
LLAMA = dict(nheads=32, nheads_k=8, headdim=128)
NO_LATENCY = dict(nvlink_latency_us=0.0, internode_latency_us=0.0)


@pytest.mark.parametrize(
    "world, per_node, hq, hkv, expected",
    [
        (64, 8, 32, 8, [(1, 64), (2, 32), (4, 16), (8, 8)]),
        (16, 8, 12, 4, [(1, 16), (2, 8), (4, 4)]),  # 8 does not divide 12
        (6, 8, 6, 3, [(1, 6), (3, 2), (6, 1)]),  # Hkv 3 and U 2 do not agree; U 6 replicates each K/V head twice
        (12, 4, 12, 4, [(1, 12), (2, 6), (4, 3)]),  # U = 3 or 6 would straddle nodes of 4; 12 is over a node
        (8, 8, 32, 1, [(1, 8), (2, 4), (4, 2), (8, 1)]),  # MQA: every U replicates
        (8, 8, 24, 6, [(1, 8), (2, 4)]),  # Hkv 6: U = 4 and 8 neither divide it nor are multiples of it
        (1, 8, 32, 8, [(1, 1)]),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_valid_splits_only_u_dividing_hq_agreeing_with_hkv_and_inside_a_node(world, per_node, hq, hkv, expected):
    assert valid_splits(world, per_node, hq, hkv) == expected
    for u, r in expected:
        assert u * r == world and hq % u == 0 and (hkv % u == 0 or u % hkv == 0)
    assert [(p.u, p.r) for p in sorted(plan(world, per_node, hq, hkv, 64, 4096), key=lambda p: p.u)] == expected


def test_ulysses_across_nodes_only_when_asked_and_then_on_the_network():
    assert max(u for u, _ in valid_splits(64, 8, 32, 8)) == 8
    across = valid_splits(64, 8, 32, 8, ulysses_across_nodes=True)
    assert (16, 4) in across and (32, 2) in across and (64, 1) not in across  # 64 does not divide 32
    plans = {p.u: p for p in plan(64, 8, seqlen=1 << 20, ulysses_across_nodes=True, **LLAMA)}
    assert plans[16].a2a_link == "internode" and plans[8].a2a_link == "nvlink"
    assert plans[16].kv_replicated and plans[16].kv_heads_local == 1 and "K/V heads replicated" in plans[16].why
    assert "all-to-all crosses nodes" in plans[16].why
    assert plans[16].a2a_fwd_s > plans[8].a2a_fwd_s  # the same volume, part of it over the slower link


def test_plans_sorted_by_the_objective():
    kw = dict(seqlen=1 << 20, **LLAMA)
    train = plan(1024, 8, **kw)
    assert [p.fwd_bwd_s for p in train] == sorted(p.fwd_bwd_s for p in train)
    prefill = plan(1024, 8, objective="fwd", **kw)
    assert [p.fwd_s for p in prefill] == sorted(p.fwd_s for p in prefill)
    # at 1k tokens per GPU a pure ring over the network cannot hide its transfers; the node-wide head split can
    assert (train[0].u, train[0].r) == (8, 128) and train[-1].u == 1
    assert "ring transfer exposed over the network" in train[-1].why


def test_degree_one_has_no_ring_and_no_all_to_all():
    ulysses = cost(8, 1, 8, seqlen=65536, **LLAMA)  # pure Ulysses
    assert (
        ulysses.ring_link == "none" and ulysses.ring_bytes_per_step_fwd == 0 and ulysses.ring_step_transfer_fwd_s == 0
    )
    assert ulysses.ring_exposed_fwd_s == 0 and ulysses.ring_exposed_bwd_s == 0 and ulysses.a2a_fwd_s > 0
    ring = cost(1, 8, 8, seqlen=65536, **LLAMA)  # pure ring
    assert ring.a2a_link == "none" and ring.a2a_fwd_s == 0 and ring.a2a_bwd_s == 0 and ring.a2a_bytes_fwd == 0
    one = cost(1, 1, 8, seqlen=65536, **LLAMA)
    assert one.fwd_bwd_s == one.compute_fwd_s + one.compute_bwd_s and one.efficiency == 1.0
    assert one.why == "one GPU: compute only"


def test_compute_matches_benchmarking_flops_at_the_given_rates():
    p = cost(2, 4, 8, 32, 8, 128, 32768, batch=3, causal=True, fwd_tflops=500.0, fwd_bwd_tflops=400.0)
    flops = 4 * 3 * 32 * 32768**2 * 128 * 0.5 / 8  # per rank, causal forward
    assert p.compute_fwd_s == pytest.approx(flops / 500e12)
    assert p.compute_fwd_s + p.compute_bwd_s == pytest.approx(3.5 * flops / 400e12)
    full = cost(2, 4, 8, 32, 8, 128, 32768, batch=3, causal=False, fwd_tflops=500.0, fwd_bwd_tflops=400.0)
    assert full.compute_fwd_s == pytest.approx(2 * p.compute_fwd_s)


def test_all_to_all_bytes_count_only_the_heads_a_rank_needs():
    """Each rank sends (U - 1) / U of q and out, and of k and v Hkv_u = max(Hkv / U, 1) heads to each peer."""
    s, d, b = 65536, 128, 2
    tokens = s // 16
    even = cost(4, 4, 8, 32, 8, d, s)  # Hkv / U = 2 heads of K/V per rank
    assert even.a2a_bytes_fwd == pytest.approx(3 * tokens * d * b * (2 * 32 / 4 + 2 * 2))
    mqa = cost(4, 4, 8, 32, 1, d, s)  # one K/V head, replicated on the 4 ranks
    assert mqa.kv_replicated and mqa.kv_heads_local == 1
    assert mqa.a2a_bytes_fwd == pytest.approx(3 * tokens * d * b * (2 * 32 / 4 + 2 * 1))
    # the ring passes the local heads: S / R tokens x Hkv_u heads, K and V
    assert (
        even.ring_bytes_per_step_fwd == 2 * (s // 4) * 2 * d * b and mqa.ring_bytes_per_step_fwd == 2 * (s // 4) * d * b
    )


@pytest.mark.parametrize("name", ["nvlink_gb_s", "internode_gb_s", "nvlink_efficiency", "internode_efficiency"])
@pytest.mark.parametrize("world, seqlen", [(8, 65536), (64, 131072), (1024, 1 << 20), (48, 12 * 4096)])
def test_more_bandwidth_never_predicts_slower(name, world, seqlen):
    low = 0.3 if "efficiency" in name else 10.0
    high = 0.9 if "efficiency" in name else 900.0
    for causal in (True, False):
        slow = {(p.u, p.r): p for p in plan(world, 8, seqlen=seqlen, causal=causal, **{name: low}, **LLAMA)}
        fast = {(p.u, p.r): p for p in plan(world, 8, seqlen=seqlen, causal=causal, **{name: high}, **LLAMA)}
        assert slow.keys() == fast.keys()
        for key, p in fast.items():
            assert p.fwd_s <= slow[key].fwd_s and p.fwd_bwd_s <= slow[key].fwd_bwd_s, (key, causal)
        best_fast = min(p.fwd_bwd_s for p in fast.values())
        assert best_fast <= min(p.fwd_bwd_s for p in slow.values())


def test_faster_compute_or_lower_latency_never_predicts_slower():
    base = {(p.u, p.r): p for p in plan(256, 8, seqlen=1 << 20, **LLAMA)}
    for change in (dict(fwd_tflops=900.0, fwd_bwd_tflops=700.0), NO_LATENCY):
        other = {(p.u, p.r): p for p in plan(256, 8, seqlen=1 << 20, **change, **LLAMA)}
        assert all(other[k].fwd_bwd_s <= base[k].fwd_bwd_s and other[k].fwd_s <= base[k].fwd_s for k in base)


@pytest.mark.parametrize("hq, hkv", [(32, 32), (32, 8), (32, 1), (12, 4)])
@pytest.mark.parametrize("link", ["nvlink", "internode"])
def test_ring_hides_its_transfer_from_the_benchmarking_threshold_on(hq, hkv, link):
    """One K/V block hides behind one block of compute when S_local >= F / (g B_link), g = Hq / Hkv
    (bf16, no mask; a causal block does half the work, so twice the tokens). Checked on a pure ring (U = 1, so the
    ring's block is S_local), without latencies: no exposed forward transfer just above the threshold, some just
    below."""
    rate, bandwidth = 600.0, 450.0 if link == "nvlink" else 50.0
    world, per_node = (8, 8) if link == "nvlink" else (16, 8)
    opts = dict(fwd_tflops=rate, fwd_bwd_tflops=450.0, nvlink_gb_s=bandwidth, internode_gb_s=bandwidth,
                nvlink_efficiency=1.0, internode_efficiency=1.0, **NO_LATENCY)  # fmt: skip
    threshold = ring_hiding_seqlen(hq, hkv, bandwidth * 1e9, rate, causal=False)
    assert threshold == pytest.approx(rate * 1e12 / ((hq / hkv) * bandwidth * 1e9))
    assert ring_hiding_seqlen(hq, hkv, bandwidth * 1e9, rate, causal=True) == pytest.approx(2 * threshold)
    for causal in (False, True):
        n_star = threshold * (2 if causal else 1)
        above = cost(1, world, per_node, hq, hkv, 64, world * (int(n_star * 1.05) + 1), causal=causal, **opts)
        below = cost(1, world, per_node, hq, hkv, 64, world * int(n_star * 0.95), causal=causal, **opts)
        assert above.ring_link == below.ring_link == link
        assert above.ring_exposed_fwd_s == pytest.approx(0.0, abs=1e-12) and "hidden" in above.why
        assert below.ring_exposed_fwd_s > 0 and "exposed" in below.why
        # per step: compute against transfer on each side of n*
        assert above.ring_step_compute_fwd_s >= above.ring_step_transfer_fwd_s
        assert below.ring_step_compute_fwd_s < below.ring_step_transfer_fwd_s


def test_the_last_dkdv_hop_is_exposed_even_when_the_ring_hides_its_steps():
    p = cost(1, 8, 8, seqlen=8 * 65536, **NO_LATENCY, **LLAMA)
    assert p.ring_exposed_fwd_s == pytest.approx(0.0, abs=1e-12)
    hop = p.ring_bytes_per_step_fwd / 2 * 4 / (DEFAULTS["nvlink_gb_s"] * 1e9 * DEFAULTS["nvlink_efficiency"])
    assert p.ring_exposed_bwd_s == pytest.approx(hop)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: plan(0, 8, 32, 8, 128, 4096), "world_size"),
        (lambda: plan(8, 0, 32, 8, 128, 4096), "gpus_per_node"),
        (lambda: plan(8, 8, 32.0, 8, 128, 4096), "nheads"),
        (lambda: plan(8, 8, 32, 0, 128, 4096), "nheads_k"),
        (lambda: plan(8, 8, 32, 5, 128, 4096), "nheads_k"),  # 5 does not divide 32
        (lambda: plan(8, 8, 32, 8, -1, 4096), "headdim"),
        (lambda: plan(8, 8, 32, 8, 128, True), "seqlen"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, batch=0), "batch"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, dtype_bytes=0), "dtype_bytes"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, nvlink_gb_s=0.0), "nvlink_gb_s"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, internode_gb_s=float("inf")), "internode_gb_s"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, nvlink_efficiency=1.5), "nvlink_efficiency"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, internode_efficiency=0), "internode_efficiency"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, internode_latency_us=-1), "internode_latency_us"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, fwd_tflops=-600), "fwd_tflops"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, fwd_bwd_tflops=3000.0), "fwd_bwd_tflops"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, objective="bwd"), "objective"),
        (lambda: plan(8, 8, 32, 8, 12, 4096), "headdim"),  # not a head dim the kernels take
        (lambda: plan(8, 8, 32, 8, 128, 3), "seqlen"),  # fewer tokens than ranks
        (lambda: cost(3, 2, 8, 32, 8, 128, 4096), "u"),  # 3 does not divide 32
        (lambda: cost(0, 2, 8, 32, 8, 128, 4096), "u"),
        (lambda: cost(2, 0, 8, 32, 8, 128, 4096), "r"),
        (lambda: cost(16, 1, 8, 48, 12, 128, 4096), "u"),  # 16 neither divides 12 nor is a multiple of it
        (lambda: ring_hiding_seqlen(32, 8, 0, 600), "link_bytes_s"),
        (lambda: ring_hiding_seqlen(32, 8, 1e11, 600, dtype_bytes=-2), "dtype_bytes"),
        (lambda: ring_hiding_seqlen(8, 32, 1e11, 600), "nheads_k"),  # more K/V heads than query heads
        (lambda: ring_hiding_seqlen(32, 8, 1e11, 600, causal="no"), "causal"),
        (lambda: valid_splits(8, 8, 32, 3), "nheads_k"),  # 3 does not divide 32
        (lambda: valid_splits(8, 8, 8, 32), "nheads_k"),
        (lambda: valid_splits(8, 8, 32, 8, ulysses_across_nodes="yes"), "ulysses_across_nodes"),
        (lambda: plan(8, 8, 32, 8, 128, 4096, causal="false"), "causal"),  # a string would have read as causal
        (lambda: plan(8, 8, 32, 8, 128, 4096, ulysses_across_nodes=1), "ulysses_across_nodes"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


def test_unknown_options_are_type_errors():
    with pytest.raises(TypeError, match="unknown options"):
        plan(8, 8, 32, 8, 128, 4096, nvlink_bw=1.0)


def test_plan_is_frozen():
    p = plan(8, 8, seqlen=65536, **LLAMA)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.u = 2


def test_command_line_prints_every_split_and_the_doc_tables(capsys):
    assert main(["--world", "64", "--gpus-per-node", "8", "--seqlen", "1048576"]) == 0
    out = capsys.readouterr().out
    assert "| U | R | fwd ms |" in out and out.count("\n| ") == 2 + 4  # header, rule, four splits
    assert main(["--doc"]) == 0
    out = capsys.readouterr().out
    assert out == doc_tables() + "\n"
    assert "| 1024 | 1024k | 1k | (8, 128) |" in out
    with pytest.raises(SystemExit):
        main(["--world", "8", "--heads", "5", "--kv-heads", "2"])
    assert "--heads (5) must be a multiple of --kv-heads (2)" in capsys.readouterr().err  # the flags' names
    with pytest.raises(SystemExit):
        main(["--world", "8", "--nvlink-gb-s", "-1"])
    assert "--nvlink-gb-s must be a finite number > 0" in capsys.readouterr().err


def test_command_line_prints_the_mesh_that_builds_the_costed_grid(capsys):
    """The planner costs each Ulysses group as U consecutive ranks: the mesh it prints has "ulysses" last, whose
    groups init_device_mesh makes of consecutive ranks."""
    assert main(["--world", "512", "--seqlen", "1048576"]) == 0
    best = plan(512, 8, 32, 8, 128, 1048576)[0]
    assert best.u > 1
    mesh = f'init_device_mesh(device, ({best.r}, {best.u}), mesh_dim_names=("ring", "ulysses"))'
    assert mesh in capsys.readouterr().out


def test_why_names_the_backward_step_when_only_it_is_exposed():
    """The backward's step also carries the fp32 dK/dV accumulator: between the two thresholds only it is exposed,
    and `why` gives its numbers, not the hidden forward's."""
    opts = dict(**NO_LATENCY, **LLAMA, fwd_bwd_tflops=550.0)
    for seqlen in range(8 * 64, 8 * 65536, 8 * 16):
        p = cost(1, 8, 8, seqlen=seqlen, **opts)
        if p.ring_step_transfer_fwd_s <= p.ring_step_compute_fwd_s and (
            p.ring_step_transfer_bwd_s > p.ring_step_compute_bwd_s
        ):
            break
    else:
        pytest.fail("no length exposes the backward's step alone")
    assert "exposed" in p.why and "per backward step" in p.why
    assert (
        f"{p.ring_step_transfer_bwd_s * 1e3:.3g} ms" in p.why and f"{p.ring_step_compute_bwd_s * 1e3:.3g} ms" in p.why
    )


def test_the_module_needs_neither_torch_nor_the_package():
    """The planner is pure Python: loaded from its file with torch made unimportable."""
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.modules["torch"] = None
        spec = importlib.util.spec_from_file_location("planner", {str(ROOT / "ringattn/parallel/planner.py")!r})
        planner = importlib.util.module_from_spec(spec)
        sys.modules["planner"] = planner
        spec.loader.exec_module(planner)
        print(planner.plan(16, 8, 32, 8, 128, 1 << 18)[0].u)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().isdigit()


def test_docs_planning_holds_the_current_tables():
    """docs/planning.md pastes `python3 -m ringattn.parallel.planner --doc`: a changed model regenerates it."""
    assert doc_tables() in (ROOT / "docs" / "planning.md").read_text()


def test_the_planners_head_dim_bound_is_the_kernels():
    """The planner, which imports no torch, keeps its own copy of the kernels' largest head dim."""
    from ringattn.ops.validation import MAX_HEAD_DIM
    from ringattn.parallel import planner

    assert planner.MAX_HEADDIM == MAX_HEAD_DIM


def test_every_group_is_costed_where_groups_sit_differently_on_the_nodes():
    """Regression: Ulysses group 0 and ring group 0 stood for every group. With Ulysses groups across nodes of a
    size U does not divide, group 0 sits on one node while others span two: the all-to-all and the ring are then
    costed on the network, as the slowest group sets the pace."""
    ulysses = {p.u: p for p in plan(12, 6, 8, 8, 128, 1 << 16, ulysses_across_nodes=True)}[4]
    assert ulysses.a2a_link == "internode"  # groups {0..3} on node 0, {4..7} across nodes 0 and 1
    ring = {p.u: p for p in plan(16, 12, 8, 8, 128, 1 << 16, ulysses_across_nodes=True)}[8]
    assert ring.ring_link == "internode"  # ring {0, 8} on node 0, {4, 12} across both
