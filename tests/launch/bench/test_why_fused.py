"""launch/bench/why_fused.py on the CPU at tiny sizes: the three implementations agree with each other and with
float64, the JSON and the plot it writes, the analytic memory of each, and the sweep's end where standard attention
runs out of memory."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import attn_fwd_ref

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
import why_fused  # noqa: E402 (a script beside the package, found through launch/bench/)

TINY = ["--heads", "2", "--head-dim", "8", "--block", "16", "--cpu-calls", "1"]
RECORD_KEYS = {"provider", "B", "S", "H", "D", "dtype", "ms", "tflops", "peak_bytes", "analytic_bytes", "error",
               "allowed", "oom"}  # fmt: skip


@pytest.mark.parametrize("seqlen, block", [(1, 16), (17, 16), (48, 16), (97, 32)], ids=lambda x: str(x))
def test_the_three_implementations_agree(seqlen, block):
    """Key counts that are not a multiple of the block (a short last block), and one key."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v = (torch.randn(2, seqlen, 3, 8, generator=gen) for _ in range(3))  # (B, S, H, D)
    ref, _ = attn_fwd_ref(q.double(), k.double(), v.double(), 8**-0.5, False)
    outs = {name: fn(q, k, v, block) for name, fn in why_fused.IMPLEMENTATIONS.items()}
    for name, out in outs.items():
        assert out.shape == q.shape and out.dtype == q.dtype, name
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(outs["online_softmax_loop"], outs["standard"], rtol=0, atol=1e-5)


def test_script_writes_checked_records_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert why_fused.main(["--seqlens", "16", "48", *TINY, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "why_fused_cpu.json").read_text())
    env = data["environment"]
    assert env["gpu"] is None and env["memory"] == "analytic" and env["dtype"] == "float32" and env["block"] == 16
    assert [(r["provider"], r["S"]) for r in data["records"]] == [(p, s) for s in (16, 48) for p in why_fused.PROVIDERS]
    for r in data["records"]:
        assert set(r) == RECORD_KEYS
        assert not r["oom"] and r["ms"] > 0 and r["tflops"] > 0 and r["peak_bytes"] is None
        assert 0 <= r["error"] <= r["allowed"] < 1e-4, r  # fp32 against float64, by the tolerance rule
    png = tmp_path / "why_fused_cpu.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| S | standard ms | online_softmax_loop ms | fused ms |" in capsys.readouterr().out


def test_analytic_bytes_quadratic_only_for_standard_attention():
    def grows(provider: str) -> float:  # from S to 2 S, with S past the loop's block
        small, large = (why_fused.analytic_bytes(provider, 1, s, 32, 128, 2, 256) for s in (8192, 16384))
        return large / small

    assert grows("standard") == pytest.approx(4, rel=0.02)
    assert grows("online_softmax_loop") == pytest.approx(2) and grows("fused") == pytest.approx(2)
    # B = 1, H = 32, S = 16384, bf16: the scores and probabilities alone are 2 x 32 x 16384^2 x 2 bytes = 32 GiB
    assert why_fused.analytic_bytes("standard", 1, 16384, 32, 128, 2, 256) == 32 * 2**30 + 2 * 32 * 16384 * 128 * 2


def test_a_check_off_the_reference_fails_the_script(tmp_path, monkeypatch, capsys):
    def wrong(q, k, v, block):
        return why_fused.fused_attention(q, k, v, block) * 1.01

    monkeypatch.setitem(why_fused.IMPLEMENTATIONS, "fused", wrong)
    assert why_fused.main(["--seqlens", "16", *TINY, "--out", str(tmp_path)]) == 1
    assert "fused S=16" in capsys.readouterr().err
    assert not (tmp_path / "why_fused_cpu.json").exists()


def test_sweep_ends_where_standard_attention_runs_out_of_memory(tmp_path, monkeypatch):
    """Standard attention out of memory at S = 32: recorded as OOM, the other two measured there, no longer S."""

    def standard(q, k, v, block):
        if q.shape[1] >= 32:
            raise torch.OutOfMemoryError("simulated")
        return why_fused.standard_attention(q, k, v, block)

    monkeypatch.setitem(why_fused.IMPLEMENTATIONS, "standard", standard)
    argv = ["--seqlens", "16", "32", "64", *TINY, "--providers", "standard", "online_softmax_loop", "--out"]
    assert why_fused.main([*argv, str(tmp_path)]) == 0
    records = json.loads((tmp_path / "why_fused_cpu.json").read_text())["records"]
    assert [(r["provider"], r["S"], r["oom"]) for r in records] == [
        ("standard", 16, False), ("online_softmax_loop", 16, False),
        ("standard", 32, True), ("online_softmax_loop", 32, False),
    ]  # fmt: skip
    assert records[2]["ms"] is None and records[2]["analytic_bytes"] > 0
