"""examples/train_gpt.py --check through launch/torchrun.sh on 2 CPU ranks: the first training steps,
ring-sharded (zigzag) vs single-device, within the tolerance rule."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")
def test_train_gpt_check_two_steps_on_two_cpu_ranks(tmp_path):
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="240", RINGATTN_TIMEOUT="120")
    cmd = ["bash", "launch/torchrun.sh", "examples/train_gpt.py", "--check", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "check: passed" in output, output
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().endswith(" ok")]
    assert [r[0] for r in rows] == ["0", "1"], output  # one checked row per step
