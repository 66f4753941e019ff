"""launch/bench/profile_backward.py: the script runs (on the CPU, fp32 under the interpreter) and says what it ran."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_script_runs_a_forward_and_backward_twice():
    args = ["--seqlen", "24", "--tokens", "48", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(ROOT / "launch/bench/profile_backward.py"), *args], env=env,
                            capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert "ringattn: forward+backward twice, q (2, 24, 4, 16), k and v (2, 24, 2, 16)" in result.stdout
