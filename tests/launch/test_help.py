"""Every script in launch/, launch/bench/ and launch/tools/ answers --help: exit status 0 and its usage, without
starting ranks or measuring anything. The scripts are found by listing the folders, so a new one is covered.

The Python scripts run one after another in one child process (runpy, each as __main__ with its own folder first
on sys.path, as `python3 SCRIPT --help` runs it), so torch is imported once rather than once per script; the shell
scripts, and a script's --help through launch/torchrun.sh, run as their own commands."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for folder in ("launch", "launch/bench", "launch/tools")
                 for p in (ROOT / folder).iterdir() if p.suffix in (".py", ".sh"))  # fmt: skip
# a script's --help through the launcher: the script once, in the launcher's process, no ranks
THROUGH_TORCHRUN = "launch/torchrun.sh launch/ring_check.py"
CASES = [*SCRIPTS, THROUGH_TORCHRUN]
TIMEOUT_S = 120

RUN_ALL_HELP = textwrap.dedent(
    """
    import contextlib, io, json, runpy, sys
    results = {}
    for script in sys.argv[1:]:
        out, err, code = io.StringIO(), io.StringIO(), 0
        sys.argv, path = [script, "--help"], list(sys.path)
        sys.path.insert(0, script.rsplit("/", 1)[0])
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_path(script, run_name="__main__")
            code = "returned without exiting"
        except SystemExit as exc:
            code = exc.code or 0
        except BaseException as exc:
            code = f"{type(exc).__name__}: {exc}"
        sys.path[:] = path
        results[script] = [code, out.getvalue(), err.getvalue()]
    print(json.dumps(results))
    """
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the launch/ shell scripts are bash scripts for Linux")


@pytest.fixture(scope="module")
def answers() -> dict[str, tuple]:
    """case -> (exit status, stdout, stderr) of its --help."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NPROC="4", DEVICE="cpu")
    python = [case for case in SCRIPTS if case.endswith(".py")]
    proc = subprocess.run([sys.executable, "-c", RUN_ALL_HELP, *python], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = {case: tuple(r) for case, r in json.loads(proc.stdout.splitlines()[-1]).items()}
    for case in CASES:
        if case not in results:
            shell = subprocess.run(["bash", *case.split(), "--help"], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=TIMEOUT_S)  # fmt: skip
            results[case] = (shell.returncode, shell.stdout, shell.stderr)
    return results


def test_the_folders_hold_the_scripts_expected():
    assert {"launch/torchrun.sh", "launch/ring_check.py", "launch/bench/bench_kernel.py",
            "launch/tools/config_sweep.py", "launch/tools/pack_triton.sh"} <= set(SCRIPTS)  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_help_prints_usage_and_exits_0(case, answers):
    code, stdout, stderr = answers[case]
    assert code == 0, f"{code}\n{stdout}{stderr}"
    assert "usage" in stdout.lower(), stdout + stderr
    if case.endswith(".py"):
        assert f"usage: {Path(case.split()[-1]).name}" in stdout, stdout
    if case == "launch/setup.sh":
        assert "python3 -m venv .venv && . .venv/bin/activate && bash launch/setup.sh" in stdout, stdout
    if case == THROUGH_TORCHRUN:
        assert "running launch/ring_check.py once, without ranks" in stderr
        assert stdout.count("usage: ring_check.py") == 1, stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the answer on a machine without a GPU")
@pytest.mark.parametrize(
    "script, message",
    [("launch/bench/kernel_accuracy.py", "measures the GPU kernels' errors: it needs a GPU"),
     ("launch/tools/config_sweep.py", "times the kernels on a GPU: it needs one")],
)  # fmt: skip
def test_gpu_only_scripts_say_so_on_a_cpu(script, message):
    """A usage error (status 2) naming the need, not CUDA's own error from deep inside (regression)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
