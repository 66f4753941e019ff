"""launch/bench/bench_agreement.py through launch/torchrun.sh on 2 gloo ranks: a record per provider, the records of
another W kept, the env record naming the machine's CPUs and load."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux"),
]


def test_records_per_provider_keeping_other_world_sizes(tmp_path):
    out = tmp_path / "agreement.json"
    other = dict(provider="agreement", W=3, backend="gloo", us=1.0)
    out.write_text(json.dumps([dict(kind="env"), other]))
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="100", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/bench_agreement.py", "--calls", "5", "--rounds", "2"]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env_record, *records = json.loads(out.read_text())
    assert env_record["kind"] == "env" and env_record["cpus"] >= 1 and env_record["load_average"] >= 0
    assert records[-1] == other  # sorted by W
    assert [(r["provider"], r["W"], r["backend"]) for r in records[:-1]] == [
        ("agreement", 2, "gloo"), ("all_gather", 2, "gloo"), ("off", 2, "gloo"),
    ]  # fmt: skip
    assert all(r["us"] > 0 for r in records[:-1])
    assert "| agreement | 2 | gloo |" in proc.stdout
