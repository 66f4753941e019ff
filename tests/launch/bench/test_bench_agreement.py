"""launch/bench/bench_agreement.py through launch/torchrun.sh on 2 gloo ranks: a record per provider with the load it
ran under, the records of another W kept when measured in the same environment and refused otherwise, the env record
naming the machine's CPUs and the protocol."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringattn.benchmark import env_record

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux"),
]


def _run(tmp_path: Path, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="100", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/bench_agreement.py", "--calls", "5", "--rounds", "2"]
    return subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)


def test_records_per_provider_keeping_other_world_sizes(tmp_path):
    out = tmp_path / "agreement.json"
    other = dict(provider="agreement", W=3, backend="gloo", us=1.0, load_average=0.5)
    same = env_record(torch.device("cpu"), calls=5, rounds=2, cpus=os.cpu_count())
    out.write_text(json.dumps([same, other]))
    proc = _run(tmp_path, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, *records = json.loads(out.read_text())
    assert header == same and header["cpus"] >= 1
    assert records[-1] == other  # sorted by W
    assert all(r["load_average"] >= 0 for r in records)
    assert [(r["provider"], r["W"], r["backend"]) for r in records[:-1]] == [
        ("agreement", 2, "gloo"), ("all_gather", 2, "gloo"), ("off", 2, "gloo"),
    ]  # fmt: skip
    assert all(r["us"] > 0 for r in records[:-1])
    assert "| agreement | 2 | gloo |" in proc.stdout
    # records of another environment are not relabelled with this run's (regression: they were kept under it)
    out.write_text(json.dumps([dict(same, rounds=7), other]))
    proc = _run(tmp_path, out)
    assert proc.returncode != 0 and "was measured with another environment" in proc.stderr, proc.stderr
    assert json.loads(out.read_text()) == [dict(same, rounds=7), other]


@pytest.mark.parametrize("flag", ["--calls", "--rounds"])
def test_no_calls_or_rounds_is_a_usage_error(flag):
    proc = subprocess.run([sys.executable, "launch/bench/bench_agreement.py", flag, "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and f"{flag} must be >= 1" in proc.stderr
