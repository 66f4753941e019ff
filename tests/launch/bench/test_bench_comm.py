"""launch/bench/bench_comm.py through launch/torchrun.sh on 2 gloo ranks at --tiny sizes: every kind of record
(p2p, all_to_all, copy, attention) written with the environment, the attention checked against the reference, and
the tables and planner options printed; a bad argument refused before any rank starts work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BYTES_COUNTED = {
    "p2p": 1.0,
    "all_to_all": 0.5,
    "copy": 2.0,
}  # per byte per rank: sent, sent to others at W = 2, read + write

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux"),
]


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="120", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/bench_comm.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=140)


def test_two_gloo_ranks_write_every_kind_of_record(tmp_path):
    out = tmp_path / "comm.json"
    proc = _launch(tmp_path, "--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, *records = json.loads(out.read_text())
    assert env["kind"] == "env" and env["W"] == 2 and env["backend"] == "gloo" and env["gpu"] is None
    assert env["nccl"] is None and env["options"]["ulysses"] == [1, 2] and env["options"]["iters"] == 2
    sizes = sorted({r["bytes"] for r in records if r["kind"] == "p2p"})
    assert sizes == [4096, 65536]
    for kind in ("p2p", "all_to_all", "copy"):
        got = [r for r in records if r["kind"] == kind]
        assert sorted(r["bytes"] for r in got) == sizes and all(r["W"] == 2 for r in got)
        assert all(
            r["ms"] > 0 and r["gb_s"] == pytest.approx(r["bytes"] * BYTES_COUNTED[kind] / r["ms"] / 1e6) for r in got
        )
    attention = [r for r in records if r["kind"] == "attention"]
    got = sorted((r["U"], r["S"], r["H"], r["Hkv"], r["mode"]) for r in attention)
    expected = sorted((u, n, 4 // u, 2 // u, m) for u in (1, 2) for n in (32, 48) for m in ("fwd", "fwd+bwd"))
    assert got == expected
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["check_error"] < 1e-5 and r["causal"] for r in attention)
    assert "| kind | W | MiB per rank | ms | GB/s |" in proc.stdout and "| U | n | H | Hkv | mode |" in proc.stdout
    assert "planner options from these numbers" in proc.stdout and "--fwd-bwd-tflops" in proc.stdout


def test_bad_arguments_refused_on_every_rank_with_the_usage_once(tmp_path):
    proc = _launch(tmp_path, "--tiny", "--ulysses", "3", "--head-dim", "12", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0
    # each rank says why (rank 1's line from its log, rank 0's unless torchrun stopped it first), rank 0 the usage
    assert 1 <= proc.stderr.count("--ulysses 3 must divide --heads") <= 2, proc.stderr
    assert 1 <= proc.stderr.count("--head-dim must be a multiple of 8 from 8 to 256, got 12") <= 2, proc.stderr
    assert proc.stderr.count("usage: bench_comm.py") <= 1, proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_zero_kv_heads_is_a_usage_error_not_a_division():
    proc = subprocess.run([sys.executable, "launch/bench/bench_comm.py", "--kv-heads", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "--kv-heads must be >= 1" in proc.stderr
    assert "ZeroDivisionError" not in proc.stderr
