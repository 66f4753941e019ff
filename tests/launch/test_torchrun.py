"""launch/torchrun.sh and ringattn.distributed on CPU ranks: rank 0's output shown, the others' kept in
files and shown when the job fails, NVLink multicast off and the process group made in every rank; bad
arguments refused on every rank, each saying why; a script's --help run once, without ranks."""

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringattn.distributed import exit_on_bad_arguments

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    from ringattn.distributed import MULTICAST_OFF, destroy, init_distributed, log

    env = init_distributed()
    assert all(os.environ[k] == v for k, v in MULTICAST_OFF.items())
    assert env.backend == "gloo" and env.device.type == "cpu" and env.world_size == int(os.environ["WORLD_SIZE"])
    total = torch.tensor([env.rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {env.rank} says hello", flush=True)
    log(f"sum {total.item():.0f} over {env.world_size} ranks")
    if env.rank == int(sys.argv[1]):
        raise RuntimeError(f"rank {env.rank} fails on purpose")
    destroy()
    """
)


def _launch(tmp_path, fail_rank, **env_vars):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, **{"TIMEOUT": "120", **env_vars})
    cmd = ["bash", "launch/torchrun.sh", str(script), str(fail_rank)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_only_rank_0_is_shown(tmp_path):
    proc = _launch(tmp_path, -1, NPROC="3", DEVICE="cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["rank 0 says hello", "sum 6 over 3 ranks"]


def test_failing_hidden_rank_shows_its_traceback(tmp_path):
    proc = _launch(tmp_path, 1, NPROC="2", DEVICE="cpu", TMPDIR=str(tmp_path))
    assert proc.returncode == 1  # the failing rank's status
    assert "rank 1 says hello" not in proc.stdout
    assert "RuntimeError: rank 1 fails on purpose" in proc.stderr, proc.stderr
    assert f"output is in {tmp_path}" in proc.stderr


def test_all_ranks_shown_and_bad_settings_refused(tmp_path):
    proc = _launch(tmp_path, -1, NPROC="2", DEVICE="cpu", LOG_RANKS="all")
    assert proc.returncode == 0, proc.stderr
    # both ranks write to one stream at the same moment: their lines may interleave, so count the messages
    assert proc.stdout.count("rank 0 says hello") == 1 and proc.stdout.count("rank 1 says hello") == 1
    for bad, message in (({"NPROC": "0"}, "NPROC must be a positive integer"), ({"DEVICE": "tpu"}, "DEVICE must"),
                         ({"LOG_RANKS": "0,5"}, "LOG_RANKS lists local rank 5, but NPROC=2 ranks run"),
                         # a leading zero matched no rank (every rank hidden, status 0), "08" was bash's octal error
                         ({"LOG_RANKS": "01"}, "LOG_RANKS must be 'all' or a comma-separated list"),
                         ({"LOG_RANKS": "08"}, "LOG_RANKS must be 'all' or a comma-separated list"),
                         # regression: coreutils' error (status 125), pointing at an empty log directory
                         ({"TIMEOUT": "abc"}, "TIMEOUT must be a positive duration"),
                         ({"TIMEOUT": "-1"}, "TIMEOUT must be a positive duration")):  # fmt: skip
        proc = _launch(tmp_path, -1, **{"NPROC": "2", **bad})
        assert proc.returncode == 2 and message in proc.stderr


def test_plain_python_makes_a_group_of_one(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(script), "-1"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["rank 0 says hello", "sum 1 over 1 ranks"]


def test_bad_arguments_say_why_when_a_hidden_rank_exits_before_rank_0_has_printed(tmp_path):
    """torchrun stops rank 0 as soon as rank 1 exits: the reason must come from rank 1's log."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import argparse, os, time
            from ringattn.distributed import exit_on_bad_arguments
            if os.environ["RANK"] == "0":
                time.sleep(60)  # stopped by torchrun long before it wakes
            exit_on_bad_arguments(argparse.ArgumentParser(prog="job"), ["--x must be positive"])
            """
        )
    )
    env = dict(os.environ, NPROC="2", DEVICE="cpu", TIMEOUT="120", TMPDIR=str(tmp_path))
    proc = subprocess.run(
        ["bash", "launch/torchrun.sh", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert "job: error (rank 1): --x must be positive" in proc.stderr, proc.stderr
    assert proc.returncode == 2  # the rank's status, not torchrun's 1


@pytest.mark.parametrize("rank", ["0", "1"])
def test_bad_arguments_exit_2_on_every_rank_and_every_rank_says_why(rank, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    parser = argparse.ArgumentParser(prog="job")
    exit_on_bad_arguments(parser, [])  # nothing wrong: returns
    with pytest.raises(SystemExit) as exc:
        exit_on_bad_arguments(parser, ["--a is bad", "--b too"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("usage: job" in err) == (rank == "0")  # the usage once, from rank 0
    assert err.rstrip().endswith("--a is bad; --b too") and "job: error" in err


def test_nccl_high_priority_setting(monkeypatch):
    """High-priority NCCL streams by default; RINGATTN_NCCL_HIGH_PRIORITY=0 turns them off, an argument wins."""
    from ringattn.distributed import nccl_high_priority

    monkeypatch.delenv("RINGATTN_NCCL_HIGH_PRIORITY", raising=False)
    assert nccl_high_priority() is True
    monkeypatch.setenv("RINGATTN_NCCL_HIGH_PRIORITY", "0")
    assert nccl_high_priority() is False and nccl_high_priority(True) is True
    monkeypatch.setenv("RINGATTN_NCCL_HIGH_PRIORITY", "yes")
    with pytest.raises(ValueError, match="RINGATTN_NCCL_HIGH_PRIORITY must be '0' or '1', got 'yes'"):
        nccl_high_priority()


def test_help_of_the_script_runs_it_once_without_ranks(tmp_path):
    """`torchrun.sh SCRIPT --help` runs SCRIPT once as plain python3 (no torch.distributed.run, so no WORLD_SIZE),
    with its arguments as given; `torchrun.sh --help` prints the launcher's usage and exits 0."""
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nprint('WORLD_SIZE', os.environ.get('WORLD_SIZE'), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    cmd = ["bash", "launch/torchrun.sh", str(script), "--seqlen", "8", "--help"]
    env.update(NPROC="4", DEVICE="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["WORLD_SIZE None ['--seqlen', '8', '--help']"]
    assert "without ranks" in proc.stderr
    proc = subprocess.run(
        ["bash", "launch/torchrun.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "bash launch/torchrun.sh SCRIPT [ARGS...]" in proc.stdout
    proc = subprocess.run(["bash", "launch/torchrun.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Usage:" in proc.stderr
