"""launch/bench/bench_simulated_ring.py (the pure ring, and Ulysses x ring grids with --ulysses) and
launch/bench/ring_error_growth.py end to end on the CPU (Triton interpreter, --tiny sizes): exit status, the env record
and every expected record with its keys in the JSON they write."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringattn.benchmark import kept_records
from tests.utils import package_kernel_names

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import bench_simulated_ring  # noqa: E402 (scripts beside the package, found through launch/bench/)
import ring_error_growth  # noqa: E402

ENV_KEYS = {"kind", "gpu", "torch", "triton", "cuda", "python"}


def _run(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, f"launch/bench/{script}", "--tiny", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert ENV_KEYS <= data[0].keys() and data[0]["kind"] == "env" and data[0]["gpu"] is None
    return proc, data[1:]


def test_bench_simulated_ring_tiny(tmp_path):
    proc, records = _run(tmp_path, "bench_simulated_ring.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [r for r in records if "error" in r]
    keys = {"provider", "W", "S_local", "S", "H", "Hkv", "D", "layout", "causal", "mode", "ms", "tflops", "peak_bytes"}
    for r in records:
        assert keys <= r.keys(), r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["peak_bytes"] is None  # no peak memory on the CPU
        assert ("overhead" in r) == (r["provider"] in ("simulated_ring", "block_step")), r
    got = sorted((r["provider"], r["W"] or 0, r["layout"] or "", r["causal"], r["mode"]) for r in records)
    expected = sorted(
        [(p, w, "", causal, mode) for p in ["fused"] for w in (2, 3) for causal in (True, False)
         for mode in ("fwd", "fwd+bwd")]
        + [("simulated_ring", w, layout, causal, mode) for w in (2, 3)
           for layout, causal in (("contiguous", True), ("zigzag", True), ("contiguous", False))
           for mode in ("fwd", "fwd+bwd")]
        + [(p, 0, "", False, mode) for p in ("block_public", "block_step") for mode in ("fwd", "bwd")]
    )  # fmt: skip
    assert got == expected
    assert all(r["S"] == r["W"] * r["S_local"] for r in records if r["W"])
    assert "| S_local | W | S | layout | causal |" in proc.stdout and "| S_local | mode | public ms |" in proc.stdout


def test_bench_simulated_ring_never_times_a_wrong_result(tmp_path, monkeypatch, capsys):
    """A ring whose gradients are off is recorded with an error, is not timed, and the script exits with 1."""
    backward = bench_simulated_ring.simulate_ring_backward

    def wrong_backward(*args, **kwargs):
        return [(dq, 2 * dk, dv) for dq, dk, dv in backward(*args, **kwargs)]

    monkeypatch.setattr(bench_simulated_ring, "simulate_ring_backward", wrong_backward)
    out = tmp_path / "out.json"
    argv = ["--tiny", "--world-sizes", "2", "--layouts", "contiguous", "--full-cells", "--no-block", "--out", str(out)]
    assert bench_simulated_ring.main(argv) == 1
    _, *records = json.loads(out.read_text())
    assert [r["provider"] for r in records] == ["fused", "fused", "simulated_ring"]
    assert "ms" not in records[-1] and "relative L2 error" in records[-1]["error"]
    assert "failed the check" in capsys.readouterr().out


def test_bench_simulated_ring_ulysses_grids_tiny(tmp_path):
    """--ulysses: the 2x2, 2x4 and 4x2 grids (K/V heads split, and one K/V head copied to two Ulysses ranks) pass the
    check against the fused call and are timed in the same rounds as the pure ring, whose ms they carry; U = 4 at
    W = 4 (a ring of one) is left out."""
    argv = ["--world-sizes", "4", "8", "--seqlens-local", "8", "--heads", "4", "--kv-heads", "2", "--ulysses", "2", "4",
            "--layouts", "zigzag", "--full-cells", "--no-block", "--rounds", "1"]  # fmt: skip
    proc, records = _run(tmp_path, "bench_simulated_ring.py", *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [r for r in records if "error" in r]
    grids = [r for r in records if r["provider"] == "simulated_ulysses_ring"]
    got = sorted((r["W"], r["U"], r["R"], r["mode"]) for r in grids)
    assert got == sorted((w, u, w // u, m) for w, u in ((4, 2), (8, 2), (8, 4)) for m in ("fwd", "fwd+bwd"))
    rings = {(r["W"], r["mode"]): r for r in records if r["provider"] == "simulated_ring"}
    assert sorted(rings) == sorted((w, m) for w in (4, 8) for m in ("fwd", "fwd+bwd"))
    for r in grids:
        assert r["S"] == r["W"] * r["S_local"] == r["R"] * r["ring_S_local"] and r["layout"] == "zigzag", r
        assert r["ring_ms"] == rings[r["W"], r["mode"]]["ms"] and r["ratio_to_ring"] == r["ms"] / r["ring_ms"], r
        assert r["overhead"] == r["ms"] / r["fused_ms"] - 1 and r["fused_ms"] == rings[r["W"], r["mode"]]["fused_ms"]
        assert r["steps_computed"] == r["U"] * r["R"] ** 2 and r["forward_steps"] == r["R"], r  # zigzag: every step
        assert "all-to-alls" in r["untimed"] and r["tflops"] > 0 and r["peak_bytes"] is None
    assert "W=4: no 4 x R grid with R >= 2, left out" in proc.stdout
    assert "| U x R |" in proc.stdout and "| 2-D / pure ring fwd | 2-D / pure ring f+b |" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 8 | 8 | 64 | zigzag | yes |")]
    assert [row.split(" | ")[5] for row in rows] == ["1 x 8", "2 x 4", "4 x 2"]


def test_grid_error_sums_the_copies_of_a_kv_head():
    """One K/V head copied to U = 2 Ulysses ranks: their gradients are shares of the head's, and only their sum is
    compared with the fused call's (as the inverse exchange sums them); distinct heads are compared as they are."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(1, 8, 2, 4, generator=gen, dtype=torch.float64)  # (B, S, H, D)
    idx = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]  # zigzag over R = 2
    split = [range(0, 1), range(1, 2)]  # H = 2 over U = 2: one head each
    parts = [[full.index_select(1, i)[:, :, h.start : h.stop] for i in idx] for h in split]
    assert bench_simulated_ring.grid_error(parts, full, idx, split) == 0
    assert bench_simulated_ring.grid_error(parts[::-1], full, idx, split) > 0.5  # heads swapped
    kv = full[:, :, :1]  # Hkv = 1, copied to both ranks
    shares = [[w * kv.index_select(1, i) for i in idx] for w in (0.25, 0.75)]
    assert bench_simulated_ring.grid_error(shares, kv, idx, [range(0, 1)] * 2) < 1e-6  # compared in fp32
    assert bench_simulated_ring.grid_error(shares[:1], kv, idx, [range(0, 1)]) > 0.5  # one share is not the head's


def test_kernel_groups_of_the_breakdown():
    """--breakdown groups GPU kernels by name: each of the package's kernels into its attention group (the forwards,
    the backward's row stats, the other backward kernels), PyTorch's and NCCL's into "other"."""
    names = package_kernel_names()
    assert {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_attn_bwd_preprocess_kernel"} <= set(
        names
    )
    for name in names:
        expected = ("row stats" if "preprocess" in name else "attention forward" if name.startswith("_attn_fwd")
                    else "attention backward")  # fmt: skip
        assert bench_simulated_ring.kernel_group(f"{name}_0d1d2d") == expected, name
    for other in ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
                  "ncclDevKernel_SendRecv", "triton_poi_fused_add_0"):  # fmt: skip
        assert bench_simulated_ring.kernel_group(other) == "other", other


def test_breakdown_table_gives_each_group_and_the_total():
    kernels = {"attention forward": dict(ms=2.0, launches=8), "other": dict(ms=0.5, launches=3)}
    record = dict(provider="simulated_ring", W=4, S_local=8, S=32, layout="zigzag", causal=True, kernels=kernels)
    table = bench_simulated_ring.breakdown_table([record, dict(record, provider="fused", layout=None, kernels={})])
    rows = [line for line in table.splitlines() if line.startswith("| 8 | 4 | 32 |")]
    assert rows == ["| 8 | 4 | 32 | fused | - | yes | - | - | - | - | 0.00 |",
                    "| 8 | 4 | 32 | simulated_ring | zigzag | yes | 2.00 (8) | - | - | 0.50 (3) | 2.50 |"]  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_bench_simulated_ring_breakdown_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_simulated_ring.parse_args(["--tiny", "--breakdown"])
    assert "--breakdown profiles GPU kernels: it needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("ulysses", ["3", "0"])
def test_bench_simulated_ring_refuses_a_ulysses_degree_the_heads_do_not_allow(ulysses, capsys):
    """--ulysses 3 with 2 query heads and 1 K/V head (3 does not divide 2), and a degree below 1, are usage errors
    before anything runs."""
    with pytest.raises(SystemExit):
        bench_simulated_ring.parse_args(["--tiny", "--ulysses", ulysses])
    assert "--ulysses" in capsys.readouterr().err


def test_ring_error_growth_tiny(tmp_path):
    proc, records = _run(tmp_path, "ring_error_growth.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *errors, gate = records
    assert gate["kind"] == "gate" and gate["ok"] and gate["W"] == 4 and gate["failures"] == []
    keys = {"dtype", "layout", "W", "S", "H", "Hkv", "D", "causal", "tensor", "error", "error_cast", "ratio", "pt"}
    assert all(keys <= r.keys() for r in errors)
    got = sorted((r["layout"], r["W"], r["tensor"]) for r in errors)
    assert got == sorted(
        (lay, w, t) for lay in ("contiguous", "zigzag") for w in (1, 2, 3, 4) for t in ring_error_growth.NAMES
    )
    for r in errors:  # fp32 in the interpreter against float64: errors of a few fp32 ulps, never exact zero
        assert 0 < r["error"] < 1e-5 and 0 < r["pt"] < 1e-5, r
        assert r["ratio"] == 1.0 if r["W"] == 1 else r["ratio"] > 0
    assert "gate PASS" in proc.stdout


@pytest.mark.parametrize("ratio, ok", [(2.0, True), (2.5, False)])
def test_error_growth_gate_looks_at_the_backward_of_the_largest_ring(ratio, ok):
    """The gate fails on a dq, dk or dv error at the largest W over max_ratio x W = 1's, and only there."""
    records = [dict(dtype="bfloat16", layout="zigzag", W=w, tensor=t, error=1.0, ratio=1.0) for w in (1, 4, 8)
               for t in ring_error_growth.NAMES]  # fmt: skip
    records.append(dict(records[0], W=4, tensor="dk", ratio=9.0))  # a middle W is not gated
    records.append(dict(records[0], W=8, tensor="lse", ratio=9.0))  # neither is the forward
    records.append(dict(records[0], W=8, tensor="dv", ratio=ratio))
    result = ring_error_growth.gate(records, max_ratio=2.0)
    assert result["W"] == 8 and result["ok"] == ok and len(result["failures"]) == (0 if ok else 1)


def test_bench_simulated_ring_append_replaces_only_the_cells_measured_again(tmp_path):
    """--append keeps the record's other cells (a windowed run beside the plain grid, a GQA run beside an MHA one:
    the heads are part of a cell) and refuses a record of another environment."""
    env = {"kind": "env", "gpu": "H200"}
    cell = dict(provider="simulated_ring", W=8, S_local=8192, H=32, Hkv=32, D=128, layout="zigzag", causal=True,
                mode="fwd")  # fmt: skip
    plain, windowed = dict(cell, ms=1.0), dict(cell, window=[4096, 0], ms=2.0)
    path = tmp_path / "ring.json"
    path.write_text(json.dumps([env, plain, windowed]))
    kept = kept_records(str(path), env)
    again = dict(windowed, ms=3.0)
    assert bench_simulated_ring.merged(kept, [again]) == [plain, again]
    gqa = dict(plain, Hkv=8, ms=4.0)
    assert bench_simulated_ring.merged(kept, [gqa]) == [plain, windowed, gqa]
    assert kept_records(str(tmp_path / "none.json"), env) == []
    with pytest.raises(ValueError, match="another environment"):
        kept_records(str(path), dict(env, gpu="H100"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--world-sizes", "0"], "--world-sizes, --seqlens-local, --rounds"),
        (["--rounds", "0"], "--rounds, --warmup and --rep must be positive"),
        (["--head-dim", "12"], "--head-dim must be a multiple of 8"),
        (["--heads", "3", "--kv-heads", "2"], "--heads 3 must be a positive multiple of --kv-heads 2"),
        (["--window", "-5"], "--window must be -1 (none) or >= 0, got -5"),
        (["--full-cells", "9x9"], "are not among the cells measured"),
    ],
    ids=["world-0", "rounds-0", "head-dim", "heads", "window", "full-cells"],
)
def test_bench_simulated_ring_names_bad_arguments(argv, message, capsys):
    """Regression: these reached the library once timing had started (or --window -5 and unmeasured --full-cells
    were ignored); each is a usage error naming the argument now."""
    with pytest.raises(SystemExit):
        bench_simulated_ring.parse_args(["--tiny", *argv])
    assert message in capsys.readouterr().err


def test_default_records_are_named_for_the_device():
    """On the CPU the default --out is a _cpu record, never the committed GPU one (regression: a CPU run without
    --tiny overwrote docs/benchmarks/*_h200.json)."""
    assert bench_simulated_ring.parse_args([]).out == "docs/benchmarks/simulated_ring_cpu.json"
    assert ring_error_growth.parse_args([]).out == "docs/benchmarks/ring_error_growth_cpu.json"
    assert bench_simulated_ring.parse_args(["--tiny"]).out is None
