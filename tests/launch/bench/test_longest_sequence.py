"""launch/bench/longest_sequence.py on the CPU: the search (doubling, halving, bisection, the --max-seqlen cap, the
time budget) against a fake runner, the memory extrapolation, the SDPA baseline against the reference, the
ranks agreeing on a step that ran out of memory on one of them, and the script through launch/torchrun.sh."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ringattn
from ringattn.ops import attn_fwd_ref
from ringattn.testing import check_close
from tests.distributed import run_ranks

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import longest_sequence as ls  # noqa: E402 (a script beside the package, found through launch/bench/)


class FakeRunner:
    """Steps fit up to `fits_up_to` tokens, take `ms_per_token2` x S^2 ms and peak at 1000 + 10 S bytes."""

    def __init__(self, fits_up_to: int, world_size: int = 1, ms_per_token2: float = 1e-6):
        self.provider, self.memory_exponent = "ringattn", 1
        self.sp = SimpleNamespace(world_size=world_size, multiple=2 * world_size)
        self.fits_up_to, self.ms_per_token2, self.tried = fits_up_to, ms_per_token2, []

    def trial(self, seqlen: int) -> ls.Trial:
        self.tried.append(seqlen)
        if seqlen > self.fits_up_to:
            return ls.Trial(seqlen, ok=False)
        return ls.Trial(seqlen, ok=True, ms=self.ms_per_token2 * seqlen**2, peak_bytes=1000 + 10 * seqlen)


def _search(runner, start, max_seqlen, bisect_steps=4, budget_s=1e6, limit=None):
    opts = SimpleNamespace(start_seqlen=start, max_seqlen=max_seqlen, bisect_steps=bisect_steps)
    now = time.perf_counter()
    return ls.search(runner, opts, deadline=now + budget_s, limit=limit, started=now)


def test_doubles_until_out_of_memory_then_bisects():
    runner = FakeRunner(fits_up_to=100_000)
    r = _search(runner, 16384, 4 * 2**20, limit=1000 + 10 * 200_000)
    assert runner.tried == [16384, 32768, 65536, 131072, 98304, 114688, 106496, 102400]
    assert (r["longest_seqlen"], r["shortest_failed"], r["stop"], r["W"]) == (98304, 102400, "oom", 1)
    assert r["ms"] == pytest.approx(1e-6 * 98304**2) and r["peak_bytes"] == 1000 + 10 * 98304
    assert r["tokens_per_s"] == pytest.approx(98304 / r["ms"] * 1e3)
    assert r["estimated_seqlen"] == 200_000  # peak memory linear in S: the fit is exact
    assert [t["seqlen"] for t in r["trials"]] == runner.tried
    assert [t["ok"] for t in r["trials"]] == [True, True, True, False, True, False, False, False]


def test_halves_while_the_start_does_not_fit_keeping_multiples_of_2w():
    runner = FakeRunner(fits_up_to=5000, world_size=2)
    r = _search(runner, 16384, 2**20)
    assert runner.tried == [16384, 8192, 4096, 6144, 5120, 4608, 4864]
    assert all(s % 4 == 0 for s in runner.tried)
    assert (r["longest_seqlen"], r["shortest_failed"], r["stop"]) == (4864, 5120, "oom")


def test_stops_at_the_cap_and_when_nothing_fits():
    runner = FakeRunner(fits_up_to=10**9, world_size=2)
    r = _search(runner, 16, 100)
    assert runner.tried == [16, 32, 64, 100] and (r["longest_seqlen"], r["stop"]) == (100, "max_seqlen")
    runner = FakeRunner(fits_up_to=0)
    r = _search(runner, 8, 64)
    assert runner.tried == [8, 4, 2] and r["stop"] == "oom"
    assert r["longest_seqlen"] is None and r["ms"] is None and r["tokens_per_s"] is None
    assert r["shortest_failed"] == 2 and r["estimated_seqlen"] is None


def test_a_step_predicted_to_end_past_the_budget_is_not_started():
    """S = 16384 takes 1 s, so 32768 is predicted at 4 s and 65536 at 16 s: past a 10 s budget."""
    runner = FakeRunner(fits_up_to=10**9, ms_per_token2=1e3 / 16384**2)
    r = _search(runner, 16384, 2**20, budget_s=10.0)
    assert runner.tried == [16384, 32768]
    assert (r["longest_seqlen"], r["shortest_failed"], r["stop"]) == (32768, None, "budget")


def test_estimate_extrapolates_to_the_limit_in_the_providers_power_of_s():
    trials = [ls.Trial(s, ok=True, ms=1.0, peak_bytes=500 + 3 * s * s) for s in (64, 128, 256)]
    trials.append(ls.Trial(512, ok=False))
    assert ls.estimate_seqlen(trials, exponent=2, limit=500 + 3 * 1000**2, multiple=8) == 1000
    assert ls.estimate_seqlen(trials[:1], exponent=2, limit=10**9, multiple=8) is None  # one point: no fit
    assert ls.estimate_seqlen(trials, exponent=2, limit=None, multiple=8) is None  # CPU: no memory limit


@pytest.mark.parametrize("provider", ["sdpa_flash", "sdpa_math"])
def test_sdpa_attention_is_causal_gqa_attention(provider):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 97, 4, 16, generator=gen)  # (B, S, H, D)
    k, v = (torch.randn(2, 97, 2, 16, generator=gen) for _ in range(2))  # (B, S, Hkv, D)
    out = ls.SdpaAttention(ls.SDPA_BACKENDS[provider])(q, k, v)
    plain, _ = attn_fwd_ref(q, k, v, 16**-0.5, True)
    ref, _ = attn_fwd_ref(q.double(), k.double(), v.double(), 16**-0.5, True)
    check_close(provider, out, plain, ref)


def _one_rank_out_of_memory(rank, world_size):
    model_args = ls.train_gpt.parse_args(world_size, False, argv=["--batch", "1"])
    runner = ls.Runner("ringattn", model_args, ringattn.SequenceParallel(), torch.device("cpu"))
    real_step = runner._step

    def step(tokens, labels):  # rank 1 runs out after the step's collectives, as in the optimizer step
        real_step(tokens, labels)
        if rank == 1 and tokens.shape[1] > 8:
            raise torch.OutOfMemoryError("simulated")

    runner._step = step
    outcomes = []
    for seqlen in (8, 16, 8):
        t = runner.trial(seqlen)
        outcomes.append((t.seqlen, t.ok, t.ms is not None and t.ms > 0, runner.steps))
    return outcomes


def test_ranks_agree_when_one_runs_out_of_memory():
    """Both ranks see the step at 16 fail, and go on to the next trial; only the first fitting trial has a
    warm step (the step counts: 2, 3, 4)."""
    expected = [(8, True, True, 2), (16, False, False, 3), (8, True, True, 4)]
    assert run_ranks(_one_rank_out_of_memory, 2, timeout=90) == [expected, expected]


def _launch(tmp_path: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NPROC=str(nproc), DEVICE="cpu", TIMEOUT="120", RINGATTN_TIMEOUT="30", TMPDIR=str(tmp_path))
    cmd = ["bash", "launch/torchrun.sh", "launch/bench/longest_sequence.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.skipif(sys.platform != "linux", reason="launch/torchrun.sh is a bash script for Linux")
@pytest.mark.parametrize("nproc", [1, 2], ids=lambda n: f"W{n}")
def test_script_on_cpu_ranks_writes_records_and_table(nproc, tmp_path):
    out = tmp_path / "longest.json"
    proc = _launch(tmp_path, nproc, "--start-seqlen", "8", "--max-seqlen", "16", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env, *records = json.loads(out.read_text())
    assert env["kind"] == "env" and env["W"] == nproc and env["gpu"] is None and env["memory_limit_bytes"] is None
    assert env["model"]["batch"] == 1 and env["model"]["params"] > 0
    providers = ["sdpa_math", "sdpa_flash", "ringattn"] if nproc == 1 else ["ringattn"]
    assert [r["provider"] for r in records] == providers
    for r in records:
        assert (r["W"], r["longest_seqlen"], r["stop"], r["shortest_failed"]) == (nproc, 16, "max_seqlen", None)
        assert [(t["seqlen"], t["ok"]) for t in r["trials"]] == [(8, True), (16, True)]
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(16 / r["ms"] * 1e3) and r["peak_bytes"] is None
        assert f"| {r['provider']} | {nproc} | 16 | {16 // nproc} | max_seqlen |" in proc.stdout
    assert "| provider | W | longest S |" in proc.stdout


def test_script_refuses_single_device_baselines_on_several_ranks(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["longest_sequence.py", "--providers", "sdpa_flash", "ringattn"])
    with pytest.raises(SystemExit) as exit_:
        ls.parse_args(world_size=2, on_gpu=False)
    assert exit_.value.code == 2 and "start them with NPROC=1" in capsys.readouterr().err
