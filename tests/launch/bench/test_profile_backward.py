"""launch/bench/profile_backward.py: the script runs (on the CPU, fp32 under the interpreter) and says what it ran."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(ROOT / "launch/bench/profile_backward.py"), *args], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_script_runs_a_forward_and_backward_twice():
    result = _run("--tiny", "--seqlen", "16")  # the tiny sizes, a given one winning
    assert result.returncode == 0, result.stderr
    assert "ringattn: forward+backward twice, q (3, 16, 4, 16), k and v (3, 16, 2, 16)" in result.stdout


def test_gpu_sizes_without_a_gpu_are_a_usage_error():
    """Not a run of 32k tokens through the interpreter, which would not end."""
    result = _run()
    assert result.returncode == 2 and "without a GPU, pass --tiny" in result.stderr
