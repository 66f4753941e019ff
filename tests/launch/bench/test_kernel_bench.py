"""launch/bench/bench_kernel.py and launch/bench/plot_kernel_bench.py on the CPU: the output check on a slice of
query rows, appending a run to a results JSON, and the plots and table of synthetic runs."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import attn_fwd_ref

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import bench_kernel  # noqa: E402 (a script beside the package, found through launch/bench/)

ENV = dict(kind="env", gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", python="3.12.3",
           dtype="bfloat16", tokens=32768)  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_k", [4, 1], ids=["MHA", "MQA"])
@pytest.mark.parametrize("seqlen", [97, 1100], ids=lambda s: f"S{s}")
def test_check_output_uses_the_last_rows_against_all_keys(seqlen, heads_k, causal, monkeypatch):
    """A correct output passes (error ~0: the causal mask of the slice lines up with the full one),
    the reference sees at most CHECK_ROWS query rows (never S x S), and an error in them is caught."""
    gen = torch.Generator().manual_seed(seqlen)
    q = torch.randn(1, seqlen, 4, 16, generator=gen)
    k, v = (torch.randn(1, seqlen, heads_k, 16, generator=gen) for _ in range(2))
    out, _ = attn_fwd_ref(q, k, v, 16**-0.5, causal)
    rows_seen = []

    def spy(q_s, *args):
        rows_seen.append(q_s.shape[1])
        return attn_fwd_ref(q_s, *args)

    monkeypatch.setattr(bench_kernel, "attn_fwd_ref", spy)
    assert bench_kernel.check_output(out, q, k, v, causal) < 1e-5
    assert rows_seen == [min(seqlen, bench_kernel.CHECK_ROWS)]
    out[:, -1] += 1.0
    with pytest.raises(AssertionError, match="relative error"):
        bench_kernel.check_output(out, q, k, v, causal)


def _record(run, provider, seqlen, head_dim, heads_k, causal, mode, tflops):
    return dict(provider=provider, B=32768 // seqlen, S=seqlen, H=32, Hkv=heads_k, D=head_dim, causal=causal,
                mode=mode, tflops=tflops, ms=1.0, peak_bytes=1 << 20, run=run)  # fmt: skip


def _results(path: Path) -> list[dict]:
    """Run 1 spans two lengths at (D, Hkv) = (64, 32) and (128, 8), with one refused cell; run 2 is
    one --long cell."""
    records = [
        _record(1, provider, seqlen, head_dim, heads_k, causal, mode, 300.0 + seqlen / 1024 + (provider == "flex"))
        for head_dim, heads_k in [(64, 32), (128, 8)]
        for seqlen in (1024, 4096)
        for causal in (False, True)
        for provider in ("ringattn", "sdpa_flash", "flex")
        for mode in ("fwd", "fwd+bwd")
    ]
    records.append(dict(provider="sdpa_cudnn", B=32, S=1024, H=32, Hkv=32, D=64, causal=False, mode="fwd",
                        error="RuntimeError: no kernel", run=1))  # fmt: skip
    records += [_record(2, p, 131072, 128, 32, True, "fwd+bwd", 400.0) for p in ("ringattn", "sdpa_flash")]
    env = dict(ENV, runs={"1": "--seqlens 1024 4096", "2": "--long"})
    path.write_text(json.dumps([env, *records]))
    return records


def test_append_keeps_earlier_runs_and_takes_the_next_label(tmp_path):
    path = tmp_path / "kernel.json"
    records = _results(path)
    env, earlier, run = bench_kernel.start_run(ENV, str(path), "--long --append")
    assert run == 3 and earlier == records
    assert env["runs"] == {"1": "--seqlens 1024 4096", "2": "--long", "3": "--long --append"}
    assert bench_kernel.start_run(ENV, None, "--seqlens 1024") == (dict(ENV, runs={"1": "--seqlens 1024"}), [], 1)
    assert bench_kernel.start_run(ENV, str(tmp_path / "new.json"), "")[1:] == ([], 1)
    with pytest.raises(ValueError, match="other torch"):
        bench_kernel.start_run(dict(ENV, torch="2.12.0"), str(path), "")


def test_append_reads_the_committed_results():
    """docs/benchmarks/kernel_h200.json (its first runs labelled before --append existed) takes the next label."""
    path = ROOT / "docs" / "benchmarks" / "kernel_h200.json"
    old_env, records = bench_kernel.read_results(str(path))
    env = {key: value for key, value in old_env.items() if key != "runs"}
    assert bench_kernel.start_run(env, str(path), "")[1:] == (records, max(r["run"] for r in records) + 1)


def test_env_record_keeps_the_committed_keys():
    """--append compares this run's env record with the JSON's, key by key: the record main builds (through
    ringattn.benchmark.env_record) must have exactly kernel_h200.json's keys, or appending to it is refused."""
    old_env, _ = bench_kernel.read_results(str(ROOT / "docs" / "benchmarks" / "kernel_h200.json"))
    env = bench_kernel.env_record(torch.device("cpu"), dtype="bfloat16", tokens=bench_kernel.TOKENS)
    assert list(env) == [key for key in old_env if key != "runs"]


def _plot(tmp_path, monkeypatch, *args):
    pytest.importorskip("matplotlib")
    import plot_kernel_bench

    argv = ["plot_kernel_bench.py", "--json", str(tmp_path / "kernel.json"), "--out-dir", str(tmp_path / "png")]
    monkeypatch.setattr(sys, "argv", [*argv, *args])
    plot_kernel_bench.main()
    return sorted((tmp_path / "png").iterdir())


def test_plots_and_table_of_the_latest_run_with_curves(tmp_path, monkeypatch, capsys):
    _results(tmp_path / "kernel.json")
    pngs = _plot(tmp_path, monkeypatch)
    assert [p.name for p in pngs] == ["kernel_d128_hkv8.png", "kernel_d64_hkv32.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    table = capsys.readouterr().out.split("Run 1 (`--seqlens 1024 4096`)")[1].strip().splitlines()
    assert table[0] == "| D | Hkv | causal | S | mode | ringattn | sdpa_flash | flex | ours/sdpa_flash | ours/flex |"
    assert len(table) == 2 + 2 * 2 * 2 * 2  # (D, Hkv) x S x causal x mode
    assert table[2] == "| 64 | 32 | no | 1024 | fwd | 301 | 301 | 302 | 1.00 | 1.00 |"


def test_runs_drawn_together_must_not_share_a_cell(tmp_path, monkeypatch, capsys):
    records = _results(tmp_path / "kernel.json")
    pngs = _plot(tmp_path, monkeypatch, "--run", "1", "2")
    assert [p.name for p in pngs] == ["kernel_d128_hkv32.png", "kernel_d128_hkv8.png", "kernel_d64_hkv32.png"]
    assert "| 128 | 32 | yes | 131072 | fwd+bwd | 400 | 400 | - | 1.00 | - |" in capsys.readouterr().out
    env = dict(ENV, runs={"1": "--seqlens 1024 4096", "2": "--long", "3": "--seqlens 1024 --providers flex"})
    again = [dict(r, run=3) for r in records if r["S"] == 1024 and r["provider"] == "flex"]
    (tmp_path / "kernel.json").write_text(json.dumps([env, *records, *again]))
    with pytest.raises(SystemExit):
        _plot(tmp_path, monkeypatch, "--run", "1", "3")
    assert "runs [1, 3] both measured (D, Hkv, causal, S, mode) = (64, 32, False, 1024, 'fwd')" in (
        capsys.readouterr().err
    )
