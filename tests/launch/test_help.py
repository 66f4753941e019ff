"""Every script in launch/, launch/bench/ and launch/tools/ answers --help: exit status 0 and its usage, without
starting ranks or measuring anything. The scripts are found by listing the folders, so a new one is covered."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for folder in ("launch", "launch/bench", "launch/tools")
                 for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh"))  # fmt: skip
# a script's --help through the launcher: the script once, in the launcher's process, no ranks
THROUGH_TORCHRUN = "launch/torchrun.sh launch/ring_check.py"
CASES = [*SCRIPTS, THROUGH_TORCHRUN]
TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the launch/ shell scripts are bash scripts for Linux")


def _command(case: str) -> list[str]:
    script, *rest = case.split()
    return [sys.executable if script.endswith(".py") else "bash", script, *rest, "--help"]


@pytest.fixture(scope="module")
def started() -> dict[str, subprocess.Popen]:
    """Every case's --help started at once (each mostly waits for `import torch`), collected by the tests."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NPROC="4", DEVICE="cpu")
    procs = {
        case: subprocess.Popen(
            _command(case), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )  # fmt: skip
        for case in CASES
    }
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_folders_hold_the_scripts_expected():
    assert {"launch/torchrun.sh", "launch/ring_check.py", "launch/bench/bench_kernel.py",
            "launch/tools/config_sweep.py", "launch/tools/pack_triton.sh"} <= set(SCRIPTS)  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_help_prints_usage_and_exits_0(case, started):
    proc = started[case]
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{case} --help still running after {TIMEOUT_S} s")
    assert proc.returncode == 0, stdout + stderr
    assert "usage" in stdout.lower(), stdout + stderr
    if case.endswith(".py"):
        assert f"usage: {Path(case.split()[-1]).name}" in stdout, stdout
    if case == THROUGH_TORCHRUN:
        assert "running launch/ring_check.py once, without ranks" in stderr
        assert stdout.count("usage: ring_check.py") == 1, stdout
