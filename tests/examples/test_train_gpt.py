"""examples/train_gpt.py --check through launch/torchrun.sh on 2 CPU ranks: the first training steps,
ring-sharded (zigzag) vs single-device, within the tolerance rule."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import load_script

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


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kv-heads", "0"], "--kv-heads 0 must be positive"),
        (["--heads", "0"], "--heads 0 must be positive"),
        (["--log-every", "0"], "--log-every 0 must be positive"),
        (["--batch", "0"], "--batch 0 must be positive"),
        (["--warmup", "-1"], "--warmup -1 must be at least 0"),
        (["--dim", "512", "--heads", "1", "--kv-heads", "1"], "--dim / --heads must be a multiple of 8 from 8 to 256"),
        (["--lr", "inf"], "--lr inf positive and finite"),
    ],
    ids=["kv-heads", "heads", "log-every", "batch", "warmup", "head-dim-512", "lr-inf"],
)
def test_train_gpt_bad_arguments_are_named(argv, message, capsys, monkeypatch):
    """Regression: --kv-heads 0 or --heads 0 divided by zero in the check, --log-every 0 after the first step, and
    --batch 0 and a head dim of 512 reached the kernels' checks, --lr inf trained to NaN; each is now a usage error
    naming the argument."""
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        load_script("examples/train_gpt.py").parse_args(2, False, argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
