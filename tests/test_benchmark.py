"""ringattn.benchmark: FLOP counts, inputs, the environment record, the writers and the --tiny parser."""

import json

import pytest
import torch

from ringattn import benchmark

CPU = torch.device("cpu")


@pytest.mark.parametrize("batch, heads, seqlen, head_dim", [(1, 1, 1, 1), (2, 32, 4096, 128), (3, 5, 1025, 96)])
def test_attention_flops(batch, heads, seqlen, head_dim):
    """Forward 4 B H S^2 D, causal half of it, backward 2.5x and forward+backward 3.5x the forward."""
    fwd = 4 * batch * heads * seqlen**2 * head_dim
    assert benchmark.attention_flops(batch, heads, seqlen, head_dim, False, "fwd") == fwd
    assert benchmark.attention_flops(batch, heads, seqlen, head_dim, True, "fwd") == fwd / 2
    assert benchmark.attention_flops(batch, heads, seqlen, head_dim, False, "bwd") == 2.5 * fwd
    assert benchmark.attention_flops(batch, heads, seqlen, head_dim, False, "fwd+bwd") == 3.5 * fwd
    assert benchmark.attention_flops(batch, heads, seqlen, head_dim, True, "fwd+bwd") == 3.5 * fwd / 2
    with pytest.raises(KeyError):
        benchmark.attention_flops(batch, heads, seqlen, head_dim, False, "step")


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (97, 97), (17, 97), (97, 17)])
@pytest.mark.parametrize("window", [(0, 0), (5, None), (None, 3), (7, 2), (200, 200), (None, None)], ids=str)
def test_visible_pairs_counts_what_the_mask_leaves(seqlen_q, seqlen_k, window):
    """visible_pairs against the reference's own (Sq, Sk) mask, causal or not, bottom-right aligned; the windowed
    FLOPs are 4 B H D times that count."""
    from ringattn.ops.attn_ref import band_visible

    for causal in (False, True):
        mask = band_visible(causal, window, seqlen_q, seqlen_k, CPU)
        expected = seqlen_q * seqlen_k if mask is None else int(mask.sum())
        assert benchmark.visible_pairs(seqlen_q, seqlen_k, causal, window) == expected, causal
    if window != (None, None) and seqlen_q == seqlen_k:
        pairs = benchmark.visible_pairs(seqlen_q, seqlen_q, True, window)
        assert benchmark.attention_flops(2, 3, seqlen_q, 16, True, "fwd", window) == 4 * 2 * 3 * 16 * pairs


def test_flash_attn_window_convention():
    """A side of -1 is no limit, as flash-attn's window_size (regression: taken as an offset, window (-1, -1) counted
    no pair at all); a side below -1 is refused."""
    for window in ((-1, -1), (4, -1), (-1, 0), (3, 2)):
        as_none = tuple(None if side == -1 else side for side in window)
        for causal in (False, True):
            assert benchmark.visible_pairs(16, 16, causal, window) == benchmark.visible_pairs(16, 16, causal, as_none)
    assert benchmark.attention_flops(1, 1, 16, 1, False, "fwd", (-1, -1)) == 4 * 16 * 16
    with pytest.raises(ValueError, match=r"window sides must be >= 0, or -1 or None for no limit, got \(-2, 0\)"):
        benchmark.visible_pairs(16, 16, False, (-2, 0))


def test_device_tag_names_the_model():
    assert benchmark.device_tag(CPU) == "cpu"
    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200", "NVIDIA A100-SXM4-80GB": "a100"}
    for name, tag in names.items():
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
            assert benchmark.device_tag(torch.device("cuda")) == tag, name


def test_attention_flops_of_a_known_cell():
    """B = 8, H = 32, S = 4096, D = 128 (32768 tokens), causal forward+backward: 3.5 x 2 x 8 x 32 x 4096^2 x 128."""
    flops = benchmark.attention_flops(8, 32, 4096, 128, True, "fwd+bwd")
    assert flops == 3.5 * 2 * 8 * 32 * 4096**2 * 128 == pytest.approx(3.848e12, rel=1e-3)


def test_attention_inputs_shapes_dtype_and_seed():
    q, k, v, dout = benchmark.attention_inputs(2, 17, 4, 1, 8, torch.float16, CPU, seed=3)
    assert q.shape == dout.shape == (2, 17, 4, 8) and k.shape == v.shape == (2, 17, 1, 8)
    assert all(t.dtype == torch.float16 for t in (q, k, v, dout))
    again = benchmark.attention_inputs(2, 17, 4, 1, 8, torch.float16, CPU, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, dout), again, strict=True))
    other = benchmark.attention_inputs(2, 17, 4, 1, 8, torch.float16, CPU, seed=4)
    assert not torch.equal(q, other[0])


def test_environment_and_env_record_on_the_cpu():
    env = benchmark.environment(CPU, dtype="float32")
    assert env["gpu"] is None and env["torch"] == torch.__version__ and env["dtype"] == "float32"
    assert list(env) == ["gpu", "torch", "triton", "cuda", "python", "dtype"]
    assert benchmark.env_record(CPU, dtype="float32") == {"kind": "env", **env}


def test_writers(tmp_path):
    env = benchmark.env_record(CPU)
    records = [{"provider": "ringattn", "ms": 1.5}]
    benchmark.write_json(str(tmp_path / "list.json"), env, records)
    assert json.loads((tmp_path / "list.json").read_text()) == [env, *records]
    benchmark.write_records(str(tmp_path / "dict.json"), env, records, errors=[])
    assert json.loads((tmp_path / "dict.json").read_text()) == {"environment": env, "records": records, "errors": []}
    benchmark.write_json(None, env, records)  # no path: nothing written, no error
    benchmark.write_records(None, env, records)


def test_markdown_table():
    table = benchmark.markdown_table(["S", "ms"], [[1024, "0.50"], [2048, None]])
    assert table.splitlines() == ["| S | ms |", "| --- | --- |", "| 1024 | 0.50 |", "| 2048 | None |"]


def test_timing_and_peak_on_the_cpu():
    calls = []
    assert benchmark.host_median_s(lambda: calls.append(1), 5) >= 0 and len(calls) == 5
    assert benchmark.run_measuring_peak(lambda: 7, CPU) == (7, None)


def test_tiny_replaces_defaults_and_given_arguments_win():
    tiny = dict(seqlen=16)
    parser = benchmark.script_parser("A script.\n\nMore.", tiny)
    parser.add_argument("--seqlen", type=int, default=4096)
    assert parser.description == "A script."
    assert benchmark.parse_with_tiny(parser, tiny, []).seqlen == 4096
    parser = benchmark.script_parser("A script.", tiny)
    parser.add_argument("--seqlen", type=int, default=4096)
    assert benchmark.parse_with_tiny(parser, tiny, ["--tiny"]).seqlen == 16
    assert benchmark.parse_with_tiny(parser, tiny, ["--tiny", "--seqlen", "32"]).seqlen == 32
