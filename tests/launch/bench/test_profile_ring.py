"""launch/bench/profile_ring.py: interval unions and intersections on synthetic intervals, the overlap summary of
synthetic GPU and CPU trace events, and the script through launch/torchrun.sh on 2 gloo ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import package_kernel_names

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import profile_ring as pr  # noqa: E402 (a script beside the package, found through launch/bench/)

SUMMARY_KEYS = {"rank", "trace", "comm_ms", "compute_ms", "overlap_ms", "overlap_fraction", "exposed_comm_ms",
                "span_ms", "comm_events", "compute_events"}  # fmt: skip


def test_merge_joins_overlapping_and_touching_intervals():
    merged = pr.merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4), (10, 11), (6, 6.5)])
    assert merged == [(0, 4), (5, 7), (10, 11)]
    assert pr.total_length(merged) == 7
    assert pr.merge_intervals([]) == [] and pr.total_length([]) == 0


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([(0, 10)], [(2, 3), (5, 12)], 1 + 5),  # b's intervals inside and across a's end
        ([(0, 1), (2, 3), (4, 5)], [(0.5, 4.5)], 0.5 + 1 + 0.5),  # one long interval over several
        ([(0, 1)], [(1, 2)], 0),  # touching only
        ([(0, 1)], [], 0),
        ([(0, 4), (6, 8)], [(0, 4), (6, 8)], 6),  # identical
    ],
)
def test_intersection_length_of_two_unions(a, b, expected):
    assert pr.intersection_length(a, b) == pytest.approx(expected)
    assert pr.intersection_length(b, a) == pytest.approx(expected)


def _event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)


def test_overlap_summary_of_gpu_kernels():
    """Two compute kernels at 0-100 and 150-250 us, NCCL send/recv at 50-200 us (twice, on two channels): 150 us
    of communication of which 100 overlap compute; other kernels (the barrier's all-reduce too) and CPU ops are
    ignored."""
    events = [
        _event("_attn_fwd_kernel", 0, 100),
        _event("_attn_bwd_dkdv_kernel", 150, 100),
        _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 50, 150),
        _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 60, 100),
        _event("void at::native::vectorized_elementwise_kernel<4>", 300, 50),  # a copy: neither
        _event("ncclDevKernel_AllReduce_Sum_u8_RING_LL(ncclDevKernelArgsStorage<4096ul>)", -900, 800),  # barrier
        _event("_attn_fwd_kernel", 400, 10, cat="cpu_op"),  # not a GPU kernel
        dict(ph="i", name="ncclDevKernel_SendRecv", ts=0),  # an instant event: no duration
    ]
    s = pr.overlap_summary(events, on_gpu=True)
    assert (s["comm_events"], s["compute_events"]) == (2, 2)
    assert s["comm_ms"] == pytest.approx(0.150) and s["compute_ms"] == pytest.approx(0.200)
    assert s["overlap_ms"] == pytest.approx(0.100) and s["overlap_fraction"] == pytest.approx(100 / 150)
    assert s["exposed_comm_ms"] == pytest.approx(0.050) and s["span_ms"] == pytest.approx(0.250)


def test_every_kernel_of_the_package_counts_as_compute():
    """The GPU summary finds ringattn's kernels by name (profile_ring.KERNEL_NAME), not by importing them: every
    Triton kernel in ringattn/kernels, in every form (warp-specialised, Gluon), must match it, and nothing else."""
    names = package_kernel_names()
    assert {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_preprocess_kernel"} <= set(
        names
    )
    for name in names:
        assert pr.is_compute(_event(f"{name}_0d1d2d", 0, 1), on_gpu=True), name
    for other in ("ncclDevKernel_SendRecv", "triton_poi_fused_add_0", "void at::native::elementwise_kernel<4>"):
        assert not pr.is_compute(_event(other, 0, 1), on_gpu=True), other


def test_overlap_summary_of_cpu_ranges():
    events = [
        _event("ringattn.ops.fwd_merge_", 0, 10, cat="user_annotation"),
        _event("gloo:send", 5, 20, cat="user_annotation"),
        _event("gloo:recv", 5, 30, cat="user_annotation"),
        _event("c10d::send", 5, 1, cat="cpu_op"),  # the enqueue, not the transfer
        _event("ringattn::ring_attn_fwd", 0, 40, cat="cpu_op"),  # the ring's custom op spans the ring: not compute
    ]
    s = pr.overlap_summary(events, on_gpu=False)
    assert (s["comm_events"], s["compute_events"]) == (2, 1)
    assert s["comm_ms"] == pytest.approx(0.030) and s["overlap_ms"] == pytest.approx(0.005)
    empty = pr.overlap_summary([], on_gpu=False)
    assert empty["overlap_fraction"] is None and empty["span_ms"] == 0 and empty["comm_ms"] == 0


@pytest.mark.timeout(90)
@pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")
def test_script_on_cpu_ranks_writes_traces_and_summary(tmp_path):
    summary = tmp_path / "summary.json"
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="120", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/profile_ring.py", "--out-dir", str(tmp_path / "traces"),
           "--summary", str(summary), "--kv-heads", "1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=130)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env_rec, *ranks = json.loads(summary.read_text())
    assert env_rec["kind"] == "env" and env_rec["W"] == 2 and env_rec["gpu"] is None and env_rec["Hkv"] == 1
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert SUMMARY_KEYS <= r.keys()
        trace = json.loads(Path(r["trace"]).read_text())
        assert Path(r["trace"]).name == f"ring_trace_rank{r['rank']}.json" and trace["traceEvents"]
        # W = 2: forward 1 batch of 4 P2P ops, backward 3 (K/V, then dK/dV after each of the 2 steps);
        # kernels: 2 forward steps, the backward's preprocess and 2 steps
        assert (r["comm_events"], r["compute_events"]) == (16, 5)
        assert r["comm_ms"] > 0 and r["compute_ms"] > 0 and r["span_ms"] > 0
        assert 0 <= r["overlap_ms"] <= min(r["comm_ms"], r["compute_ms"]) + 1e-9
        assert r["exposed_comm_ms"] == pytest.approx(r["comm_ms"] - r["overlap_ms"])
    assert "| rank | comm ms | compute ms | overlap ms |" in proc.stdout


def test_zero_kv_heads_is_refused_not_read_as_the_default(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_ring.py", "--kv-heads", "0"])
    with pytest.raises(SystemExit):
        pr.parse_args(on_gpu=False)
    assert "must be a positive multiple of --kv-heads 0" in capsys.readouterr().err


def test_head_dims_the_kernels_do_not_take_are_refused_by_name(capsys, monkeypatch):
    """Regression: --head-dim 12 reached the kernels on every rank; it is a usage error naming the argument now."""
    monkeypatch.setattr(sys, "argv", ["profile_ring.py", "--head-dim", "12"])
    with pytest.raises(SystemExit):
        pr.parse_args(on_gpu=False)
    assert "--head-dim must be a multiple of 8 from 8 to 256, got 12" in capsys.readouterr().err
