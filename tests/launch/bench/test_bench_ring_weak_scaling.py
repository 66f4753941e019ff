"""launch/bench/bench_ring_weak_scaling.py on the CPU: the T1 extrapolation and efficiency arithmetic, the reference
of a rank's rows, torch's head-tail split being the zigzag layout, and the script through launch/torchrun.sh on 2 gloo
ranks (the sweep with torch CP failing on the CPU and recorded as errors, the budget, --longest)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import attn_fwd_ref
from ringattn.parallel import shard_indices

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import bench_ring_weak_scaling as ws  # noqa: E402 (a script beside the package, found through launch/bench/)

pytestmark = pytest.mark.timeout(90)
KEYS = {"provider", "W", "S_local", "S", "H", "Hkv", "D", "layout", "causal", "mode", "ms", "efficiency"}


def test_extrapolation_fits_a_plus_b_s2_through_the_two_longest_points():
    def t(s):
        return 3.0 + 2e-6 * s * s

    points = {1024: 999.0, 4096: t(4096), 8192: t(8192)}  # the shortest point is off the curve: not used
    assert ws.extrapolate_s2(points, 32768) == pytest.approx(t(32768))
    assert ws.extrapolate_s2({4096: 5.0}, 8192) is None  # one point: no fit
    assert ws.extrapolate_s2({4096: 5.0, 8192: 5.0}, 16384) is None  # not slower at the longer length


def _record(provider, seqlen, ms, mode="fwd+bwd", world_size=4, **extra):
    layout = None if provider == "single_gpu" else "zigzag"
    shape = dict(W=world_size, S_local=seqlen // world_size, S=seqlen, H=8, Hkv=2, D=64)
    return dict(provider=provider, **shape, layout=layout, causal=True, mode=mode, ms=ms, **extra)


def test_efficiency_is_t1_over_w_times_t_with_measured_or_extrapolated_t1():
    records = [
        _record("single_gpu", 1024, 10.0),
        _record("single_gpu", 2048, 34.0),
        _record("single_gpu", 4096, None, note="S over --t1-max-seqlen 2048"),
        _record("single_gpu", 4096, 7.0, mode="fwd"),  # another mode: its own T1
        _record("ringattn", 2048, 10.0),
        _record("ringattn", 4096, 40.0),
        _record("ringattn", 4096, 2.0, mode="fwd"),
        _record("torch_cp_flash", 4096, None, error="RuntimeError: no"),
        _record("ringattn", 8192, 100.0),  # no T1 at all
    ]
    out = ws.with_efficiency(records)
    assert records[2]["ms"] is None and "efficiency" not in records[4]  # the input is not modified
    t1 = {(r["S"], r["mode"]): r for r in out if r["provider"] == "single_gpu"}
    assert t1[2048, "fwd+bwd"]["t1_extrapolated"] is False and t1[2048, "fwd+bwd"]["efficiency"] is None
    extrapolated = 34.0 + (34.0 - 10.0) / (2048**2 - 1024**2) * (4096**2 - 2048**2)  # 130 ms
    assert t1[4096, "fwd+bwd"]["t1_extrapolated"] is True and t1[4096, "fwd+bwd"]["ms"] == pytest.approx(extrapolated)
    ring = {(r["provider"], r["S"], r["mode"]): r for r in out if r["provider"] != "single_gpu"}
    assert ring["ringattn", 2048, "fwd+bwd"]["efficiency"] == pytest.approx(34.0 / (4 * 10.0))
    assert ring["ringattn", 2048, "fwd+bwd"]["t1_extrapolated"] is False
    assert ring["ringattn", 4096, "fwd+bwd"]["efficiency"] == pytest.approx(extrapolated / (4 * 40.0))
    assert ring["ringattn", 4096, "fwd+bwd"]["t1_extrapolated"] is True
    assert ring["ringattn", 4096, "fwd"]["efficiency"] == pytest.approx(7.0 / (4 * 2.0))
    for key in (("torch_cp_flash", 4096, "fwd+bwd"), ("ringattn", 8192, "fwd+bwd")):
        assert ring[key]["efficiency"] is None and ring[key]["t1_extrapolated"] is None
    # TFLOP/s per GPU: causal fwd+bwd FLOPs = 3.5 x 2 B H S^2 D, shared by the W ranks
    assert ring["ringattn", 2048, "fwd+bwd"]["tflops"] == pytest.approx(3.5 * 2 * 8 * 2048**2 * 64 / 4 / 10.0 / 1e9)
    assert ring["torch_cp_flash", 4096, "fwd+bwd"]["tflops"] is None


@pytest.mark.parametrize("layout, causal", ws.CASES, ids=lambda c: str(c))
def test_reference_shard_is_the_rank_rows_of_whole_sequence_attention(layout, causal):
    gen = torch.Generator().manual_seed(0)
    seqlen, world_size = 36, 3
    q, dout = (torch.randn(1, seqlen, 4, 16, generator=gen) for _ in range(2))  # (B, S, H, D)
    k, v = (torch.randn(1, seqlen, 2, 16, generator=gen) for _ in range(2))  # (B, S, Hkv, D)
    q_full = q.double().requires_grad_()
    full, _ = attn_fwd_ref(q_full, k.double(), v.double(), 16**-0.5, causal)
    (dq_full,) = torch.autograd.grad(full, q_full, dout.double())
    for rank in range(world_size):
        idx = shard_indices(seqlen, rank, world_size, layout)
        out, dq = ws.reference_shard(q, k, v, dout, rank, world_size, layout, causal)
        torch.testing.assert_close(out.double(), full[:, idx], rtol=0, atol=1e-5)
        torch.testing.assert_close(dq.double(), dq_full[:, idx], rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_reference_shard_with_a_window_is_the_rank_rows_of_windowed_attention(layout):
    """--window 5 (causal, window_size (5, 0)) over S = 36 on 3 ranks: runs of rows shorter and longer than it."""
    gen = torch.Generator().manual_seed(1)
    seqlen, world_size = 36, 3
    q, dout = (torch.randn(1, seqlen, 4, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, seqlen, 2, 16, generator=gen) for _ in range(2))
    q_full = q.double().requires_grad_()
    full, _ = attn_fwd_ref(q_full, k.double(), v.double(), 16**-0.5, True, window=(5, 0))
    (dq_full,) = torch.autograd.grad(full, q_full, dout.double())
    for rank in range(world_size):
        idx = shard_indices(seqlen, rank, world_size, layout)
        out, dq = ws.reference_shard(q, k, v, dout, rank, world_size, layout, True, window=5)
        torch.testing.assert_close(out.double(), full[:, idx], rtol=0, atol=1e-5)
        torch.testing.assert_close(dq.double(), dq_full[:, idx], rtol=0, atol=1e-5)


def test_windowed_records_count_the_visible_pairs():
    """TFLOP/s of a windowed record: 4 B H D x the visible pairs (x 3.5 forward+backward), not the causal half."""
    (r,) = ws.with_efficiency([_record("ringattn", 64, 2.0, window=[5, 0])])
    pairs = sum(min(i, 5) + 1 for i in range(64))
    assert r["tflops"] == pytest.approx(3.5 * 4 * 8 * pairs * 64 / 4 / 2.0 / 1e9)


def test_torch_head_tail_split_is_the_zigzag_layout():
    """torch CP records carry layout "zigzag" for causal: its default load balancer must give rank r the chunks
    r and 2W - 1 - r, in that order (a private torch API: skipped where it moved)."""
    lb = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for seqlen, world_size in ((16, 4), (48, 3)):
        indices = lb._HeadTailLoadBalancer(seqlen, world_size, torch.device("cpu"))._generate_indices()
        zigzag = torch.cat([shard_indices(seqlen, r, world_size, "zigzag") for r in range(world_size)])
        assert indices.flatten().tolist() == zigzag.tolist()


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="150", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/bench_ring_weak_scaling.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=160)


linux_only = pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")


@linux_only
def test_windowed_sweep_on_cpu_ranks_runs_the_causal_cases_without_torch_cp(tmp_path):
    """--window 3 at W = 2, S_local 8 and 16: T1 and the ring with window_size (3, 0), the causal cases only; torch
    CP (no window in SDPA) left out with a note; every record carries the window."""
    out = tmp_path / "ws.json"
    proc = _launch(tmp_path, "--window", "3", "--seqlens-local", "8", "16", "--kv-heads", "1", "--providers",
                   "single_gpu", "ringattn", "torch_cp_cudnn", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch CP left out" in proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    (env,) = [r for r in data if r.get("kind") == "env"]
    assert env["options"]["window"] == 3 and env["options"]["providers"] == ["single_gpu", "ringattn"]
    records = [r for r in data if r.get("kind") != "env"]
    got = sorted((r["provider"], r["S_local"], str(r["layout"]), r["causal"], r["mode"]) for r in records)
    expected = sorted(
        [("single_gpu", s, "None", True, m) for s in (8, 16) for m in ws.MODES]
        + [("ringattn", s, lay, True, m) for s in (8, 16) for lay in ("zigzag", "contiguous") for m in ws.MODES]
    )  # fmt: skip
    assert got == expected
    for r in records:
        assert r["window"] == [3, 0] and r["ms"] > 0, r
        assert r["efficiency"] is None if r["provider"] == "single_gpu" else r["efficiency"] > 0, r
    assert all(r["check_error"] < ws.MAX_RELATIVE_ERROR for r in records if r["provider"] == "ringattn")


@linux_only
def test_sweep_on_cpu_ranks_records_every_provider_and_torch_cp_errors(tmp_path):
    """W = 2, S_local 4, 8, 16 (S = 8, 16, 32), MQA; T1 measured up to S = 16 and extrapolated at 32. torch CP has
    no CPU path: cuDNN attention does not exist there, so its records carry the error and the run goes on (the
    flash backend fails too, in its backward, but spends ~16 s per shape in DTensor first: left out here). Records
    of another W already in --out are kept."""
    out = tmp_path / "ws.json"
    other_w = [dict(kind="env", W=3), _record("ringattn", 48, 1.0, world_size=3)]
    out.write_text(json.dumps(other_w))
    proc = _launch(tmp_path, "--seqlens-local", "4", "8", "16", "--kv-heads", "1", "--t1-max-seqlen", "16",
                   "--providers", "single_gpu", "ringattn", "torch_cp_cudnn", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert [r for r in data if r.get("W") == 3] == other_w
    (env,) = [r for r in data if r.get("kind") == "env" and r["W"] == 2]
    assert env["gpu"] is None and env["nccl"] is None and env["backend"] == "gloo" and env["skipped"] == []
    records = [r for r in data if r.get("kind") != "env" and r["W"] == 2]
    assert all(KEYS <= r.keys() for r in records)
    assert all((r["H"], r["Hkv"], r["D"], r["S"]) == (2, 1, 16, 2 * r["S_local"]) for r in records)
    got = sorted((r["provider"], r["S_local"], str(r["layout"]), r["causal"], r["mode"]) for r in records)
    cp_cases = (("zigzag", True), ("contiguous", False))  # torch's load balancing on with causal, off without
    expected = sorted(
        [("single_gpu", s, "None", c, m) for s in (4, 8, 16) for c in (True, False) for m in ws.MODES]
        + [("ringattn", s, lay, c, m) for s in (4, 8, 16) for lay, c in ws.CASES for m in ws.MODES]
        + [("torch_cp_cudnn", s, lay, c, m) for s in (4, 8, 16) for lay, c in cp_cases for m in ws.MODES]
    )  # fmt: skip
    assert got == expected
    t1 = {(r["S"], r["causal"], r["mode"]): r for r in records if r["provider"] == "single_gpu"}
    for r in t1.values():
        assert r["t1_extrapolated"] == (r["S"] == 32)
        assert r["ms"] > 0 if r["S"] <= 16 else "--t1-max-seqlen" in r["note"]
        if r["S"] == 32:  # the fit through S = 8 and 16 (None when the CPU's noise made 16 no slower than 8)
            points = {s: t1[s, r["causal"], r["mode"]]["ms"] for s in (8, 16)}
            assert r["ms"] == ws.extrapolate_s2(points, 32)
    for r in records:
        if r["provider"] == "ringattn":
            assert r["ms"] > 0 and "error" not in r and r["check_error"] < 1e-5, r
            base = t1[r["S"], r["causal"], r["mode"]]
            if base["ms"] is not None:
                assert r["efficiency"] == pytest.approx(base["ms"] / (2 * r["ms"]))
                assert r["t1_extrapolated"] == (r["S"] == 32)
        elif r["provider"] == "torch_cp_cudnn":
            assert r["ms"] is None and r["efficiency"] is None and "rank 0: RuntimeError" in r["error"], r
    assert "| S_local | S | Hkv | layout | causal | mode | T1 ms |" in proc.stdout
    assert "| 16 | 32 | 1 | zigzag | yes | fwd+bwd |" in proc.stdout
    pytest.importorskip("matplotlib")
    assert (tmp_path / "ws_hkv1.png").stat().st_size > 0


@linux_only
def test_budget_skips_the_remaining_blocks_with_a_note(tmp_path):
    out = tmp_path / "ws.json"
    proc = _launch(tmp_path, "--seqlens-local", "4", "--kv-heads", "2", "--providers", "ringattn", "--budget-s",
                   "1e-9", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, *records = json.loads(out.read_text())
    assert records == [] and env["skipped"] == [f"S_local=4 Hkv=2 ringattn {lay} causal={c}" for lay, c in ws.CASES]
    assert proc.stdout.count("budget of 0 s spent: skipping") == 3 and "3 blocks skipped" in proc.stdout


@linux_only
def test_longest_on_cpu_ranks_stops_at_the_cap(tmp_path):
    out = tmp_path / "longest.json"
    proc = _launch(tmp_path, "--longest", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, record = json.loads(out.read_text())
    assert env["kind"] == "env" and env["W"] == 2 and env["memory_limit_bytes"] is None
    assert (record["provider"], record["W"], record["longest_seqlen"], record["stop"]) == ("ringattn", 2, 128,
                                                                                         "max_seqlen")  # fmt: skip
    assert [(t["seqlen"], t["ok"]) for t in record["trials"]] == [(32, True), (64, True), (128, True)]
    assert record["ms"] > 0 and record["peak_bytes"] is None
    assert "| ringattn | 2 | 128 | 64 | max_seqlen |" in proc.stdout


def test_head_dims_the_kernels_do_not_take_are_refused_by_name(capsys, monkeypatch):
    """Regression: --head-dim 12 reached the kernels on every rank; it is a usage error naming the argument now."""
    monkeypatch.setattr(sys, "argv", ["bench_ring_weak_scaling.py", "--head-dim", "12"])
    with pytest.raises(SystemExit):
        ws.parse_args(world_size=2, on_gpu=False)
    assert "--head-dim must be a multiple of 8 from 8 to 256, got 12" in capsys.readouterr().err
