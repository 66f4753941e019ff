"""examples/sequence_parallel_attention.py: the sharded block equals the unsharded one on 2 CPU ranks, and a bad
option is a usage error before any process group exists."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = "examples/sequence_parallel_attention.py"


@pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")
def test_sharded_block_equals_the_unsharded_one_on_two_cpu_ranks():
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="240", RINGATTN_TIMEOUT="120")
    proc = subprocess.run(["bash", "launch/torchrun.sh", EXAMPLE, "--seqlen", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("passed"), proc.stdout + proc.stderr


def test_bad_option_is_a_usage_error():
    """Regression: --seqlen 0 was refused by SystemExit(message) with status 1, after the process group was made
    (and a plain `python3` run, without torchrun's RANK, failed in init_process_group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, EXAMPLE, "--seqlen", "0"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--seqlen 0 must be a positive multiple of the number of ranks 1" in proc.stderr, proc.stderr
