"""launch/bench/bench_kernel.py and launch/bench/plot_kernel_bench.py on the CPU: the output check on a slice of
query rows, a tiny run in the interpreter writing the records schema, merging a run into a record, and the plots
and table of a synthetic record."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import attn_fwd_ref

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import bench_kernel  # noqa: E402 (a script beside the package, found through launch/bench/)

ENV = dict(gpu="NVIDIA H200", torch="2.11.0+cu130", triton="3.6.0", cuda="13.0", python="3.12.3", dtype="bfloat16",
           tokens=32768, heads=32, fa4=None)  # fmt: skip
RECORD_KEYS = [
    "provider",
    "B",
    "S",
    "H",
    "Hkv",
    "D",
    "causal",
    "window",
    "softcap",
    "mode",
    "ms",
    "tflops",
    "peak_bytes",
]


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

    def spy(q_s, *args, **kwargs):
        rows_seen.append(q_s.shape[1])
        return attn_fwd_ref(q_s, *args, **kwargs)

    monkeypatch.setattr(bench_kernel, "attn_fwd_ref", spy)
    assert bench_kernel.check_output(out, q, k, v, causal) < 1e-5
    assert rows_seen == [min(seqlen, bench_kernel.CHECK_ROWS)]
    out[:, -1] += 1.0
    with pytest.raises(AssertionError, match="relative error"):
        bench_kernel.check_output(out, q, k, v, causal)


def test_check_output_applies_the_cells_window_and_softcap():
    """A windowed, soft-capped cell is checked against the reference with the same window and cap: the right
    output passes, the plain causal one does not."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 300, 2, 16, generator=gen) for _ in range(3))
    out, _ = attn_fwd_ref(q, k, v, 16**-0.5, True, window=(40, None), softcap=2.0)
    assert bench_kernel.check_output(out, q, k, v, True, [40, 0], 2.0) < 1e-5
    plain, _ = attn_fwd_ref(q, k, v, 16**-0.5, True)
    with pytest.raises(AssertionError, match="relative error"):
        bench_kernel.check_output(plain, q, k, v, True, [40, 0], 2.0)


def _record(provider, seqlen, head_dim, heads_k, causal, mode, tflops, batch=None):
    return dict(provider=provider, B=batch or 32768 // seqlen, S=seqlen, H=32, Hkv=heads_k, D=head_dim, causal=causal,
                mode=mode, ms=1.0, tflops=tflops, peak_bytes=1 << 20)  # fmt: skip


def _results(path: Path) -> list[dict]:
    """A grid over two lengths at (D, Hkv) = (64, 32) and (128, 8), one refused cell, and a --long cell."""
    records = [
        _record(provider, seqlen, head_dim, heads_k, causal, mode, 300.0 + seqlen / 1024 + (provider == "flex"))
        for head_dim, heads_k in [(64, 32), (128, 8)]
        for seqlen in (1024, 4096)
        for causal in (False, True)
        for provider in ("ringattn", "flash", "flex")
        for mode in ("fwd", "fwd+bwd")
    ]
    records += [_record(p, 131072, 128, 32, True, "fwd+bwd", 400.0, batch=1) for p in ("ringattn", "flash")]
    errors = [dict(provider="cudnn", B=32, S=1024, H=32, Hkv=32, D=64, causal=False, mode="fwd",
                   error="RuntimeError: no kernel")]  # fmt: skip
    env = dict(ENV, commands=["--seqlens 1024 4096", "--long --append"])
    path.write_text(json.dumps({"environment": env, "records": records, "errors": errors}))
    return records


def test_tiny_run_writes_the_records_schema_and_appends(tmp_path, capsys):
    """Every provider asked for in one run, each record with exactly the schema's keys; a provider that refuses (cuDNN
    has no CPU kernel) listed under errors; --append replaces the cells it measures again and keeps the others."""
    out = tmp_path / "kernel.json"
    assert bench_kernel.main(["--tiny", "--providers", "ringattn", "flash", "cudnn", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data) == ["environment", "records", "errors"]
    env = data["environment"]
    assert env["gpu"] is None and env["dtype"] == "float32" and env["tokens"] == 64 and env["heads"] == 2
    assert env["commands"] == ["--tiny --providers ringattn flash cudnn --out " + str(out)]
    cells = [(p, c, m) for p in ("ringattn", "flash") for c in (False, True) for m in ("fwd", "fwd+bwd")]
    assert sorted((r["provider"], r["causal"], r["mode"]) for r in data["records"]) == sorted(cells)
    for r in data["records"]:
        assert list(r) == RECORD_KEYS
        assert (r["B"], r["S"], r["H"], r["Hkv"], r["D"]) == (2, 32, 2, 2, 16)
        assert r["ms"] > 0 and r["peak_bytes"] is None
        flops = bench_kernel.attention_flops(2, 2, 32, 16, r["causal"], r["mode"])
        assert r["tflops"] == pytest.approx(flops / r["ms"] / 1e9)
    assert sorted((e["provider"], e["causal"], e["mode"]) for e in data["errors"]) == sorted(
        ("cudnn", c, m) for _, c, m in cells[:4]
    )
    assert all(e["error"].startswith("RuntimeError") for e in data["errors"])
    assert "| D | Hkv | causal | S | mode | ringattn | flash | ours/flash |" in capsys.readouterr().out

    first = {bench_kernel.cell_key(r): r for r in data["records"]}
    argv = ["--tiny", "--providers", "ringattn", "--modes", "fwd", "--append", "--out", str(out)]
    assert bench_kernel.main(argv) == 0
    again = json.loads(out.read_text())
    assert len(again["environment"]["commands"]) == 2 and len(again["records"]) == len(cells)
    changed = [k for k, r in ((bench_kernel.cell_key(r), r) for r in again["records"]) if r != first[k]]
    assert sorted(changed) == sorted(k for k in first if k[0] == "ringattn" and k[-1] == "fwd")
    assert again["errors"] == data["errors"]


def test_merge_replaces_the_cells_measured_again():
    old = [_record("ringattn", 1024, 64, 32, False, "fwd", 300.0), _record("flash", 1024, 64, 32, False, "fwd", 200.0)]
    old_errors = [dict(old[0], provider="cudnn", error="RuntimeError: no kernel")]
    new = [_record("ringattn", 1024, 64, 32, False, "fwd", 310.0), dict(old_errors[0], error="RuntimeError: again"),
           dict(old[1], error="OutOfMemoryError: out")]  # fmt: skip
    records, errors = bench_kernel.merge(old, old_errors, new)
    assert records == [new[0]] and errors == [new[1], new[2]]
    assert bench_kernel.merge(old, old_errors, []) == (old, old_errors)


def test_append_keeps_the_record_and_refuses_other_versions(tmp_path):
    path = tmp_path / "kernel.json"
    records = _results(path)
    env, kept, errors = bench_kernel.start(ENV, str(path), "--long --append")
    assert kept == records and errors[0]["provider"] == "cudnn"
    assert env["commands"] == ["--seqlens 1024 4096", "--long --append", "--long --append"]
    assert bench_kernel.start(ENV, None, "--seqlens 1024") == (dict(ENV, commands=["--seqlens 1024"]), [], [])
    assert bench_kernel.start(ENV, str(tmp_path / "new.json"), "")[1:] == ([], [])
    with pytest.raises(ValueError, match="other torch"):
        bench_kernel.start(dict(ENV, torch="2.12.0"), str(path), "")
    with pytest.raises(ValueError, match="other fa4"):
        bench_kernel.start(dict(ENV, fa4="4.0.0"), str(path), "")
    assert bench_kernel.start(dict(ENV, python="3.13.0"), str(path), "")[1] == records  # not a measured quantity
    path.write_text(json.dumps([dict(ENV, kind="env"), *records]))  # a list: not this schema
    with pytest.raises(ValueError, match="is not a .environment, records, errors. record"):
        bench_kernel.start(ENV, str(path), "")


def test_environment_has_what_append_compares():
    env = bench_kernel.environment(torch.device("cpu"), dtype="bfloat16", tokens=32768, heads=32, fa4=None)
    assert set(bench_kernel.IDENTITY) <= set(env)


def test_provider_only_is_an_alias_and_fa4_needs_flash_attn_cute():
    assert bench_kernel.parse_args(["--provider-only", "ringattn", "fa4"]).providers == ["ringattn", "fa4"]
    if bench_kernel.fa4_function() is None:
        with pytest.raises(ValueError, match="fa4"):
            bench_kernel.provider_functions(["ringattn", "fa4"])
    assert set(bench_kernel.provider_functions(["ringattn", "flash"])) == {"ringattn", "flash"}


def _plot(tmp_path, *args):
    pytest.importorskip("matplotlib")
    import plot_kernel_bench

    plot_kernel_bench.main(["--json", str(tmp_path / "kernel.json"), "--out-dir", str(tmp_path / "png"), *args])
    return sorted((tmp_path / "png").iterdir())


def test_plots_and_table_of_a_record(tmp_path, capsys):
    """A figure per (D, Hkv) of the grid (the --long cell, another B * S, is in the table only), the table with
    every cell, and the errors after it."""
    _results(tmp_path / "kernel.json")
    pngs = _plot(tmp_path)
    assert [p.name for p in pngs] == ["kernel_d128_hkv8.png", "kernel_d64_hkv32.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    out = capsys.readouterr().out
    assert "`bench_kernel.py --seqlens 1024 4096`" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0] == "| D | Hkv | causal | S | mode | ringattn | flash | flex | ours/flash | ours/flex |"
    assert len(table) == 2 + 2 * 2 * 2 * 2 + 1  # (D, Hkv) x S x causal x mode, and the --long cell
    assert table[2] == "| 64 | 32 | no | 1024 | fwd | 301 | 301 | 302 | 1.00 | 1.00 |"
    assert "| 128 | 32 | yes | 131072 | fwd+bwd | 400 | 400 | - | 1.00 | - |" in table
    assert "- cudnn B=32 S=1024 Hkv=32 D=64 causal=False fwd: RuntimeError: no kernel" in out
