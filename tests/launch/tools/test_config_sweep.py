"""launch/tools/config_sweep.py on the CPU: its candidate lists against the configs ops/attn.py launches, the
choice of the best config, timing a sweep's choice through use_configs (bench_kernel --configs), and its reference."""

import os
import sys
from pathlib import Path

import pytest
import torch

import ringattn.ops.attn as attn_ops

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "tools"))
import config_sweep  # noqa: E402 (a script beside the package, found through launch/tools/)

CUDA = torch.device("cuda")  # a device object only: nothing runs on it


def test_each_candidate_list_starts_with_the_config_launched_today():
    """The sweep reports its first candidate as the default: a config changed in ops/attn.py without the
    sweep's lists would mislabel every 'default' timing."""
    config_sweep._check_defaults([64, 128])


def test_check_defaults_catches_a_list_out_of_date(monkeypatch):
    stale = {**config_sweep.CANDIDATES, "dq": {64: [(32, 32, 4, 1)], 128: config_sweep.CANDIDATES["dq"][128]}}
    monkeypatch.setattr(config_sweep, "CANDIDATES", stale)
    with pytest.raises(AssertionError, match=r"dq D64: first candidate \(32, 32, 4, 1\)"):
        config_sweep._check_defaults([64, 128])


def test_swept_configs_candidates_given_or_defaults():
    kernels, dims = ["dq", "fwd_ws"], [64, 128]
    assert config_sweep.swept_configs(kernels, dims, None, False) == {k: config_sweep.CANDIDATES[k] for k in kernels}
    given = config_sweep.swept_configs(kernels, dims, ["64,64,4,1", "128,64,8,3"], False)
    assert given == {k: {d: [(64, 64, 4, 1), (128, 64, 8, 3)] for d in dims} for k in kernels}
    defaults = config_sweep.swept_configs(kernels, dims, ["64,64,4,1"], True)
    assert defaults == {k: {d: [config_sweep._default_config(k, d)] for d in dims} for k in kernels}
    assert defaults["fwd_ws"][128] == [tuple(attn_ops._fwd_ws_config(128, torch.bfloat16, CUDA).__dict__.values())]


def _record(kernel, config, causal, ms=None):
    record = dict(kernel=kernel, config=list(config), D=128, causal=causal)
    return {**record, "ms": ms} if ms is not None else {**record, "error": "out of resource: shared memory"}


def test_best_config_sums_both_causal_settings_and_skips_configs_that_failed_in_one():
    default, fast_once, steady = config_sweep.CANDIDATES["dq"][128][0], (64, 64, 4, 1), (128, 64, 8, 4)
    records = [
        _record("dq", default, False, 10.0), _record("dq", default, True, 6.0),
        _record("dq", fast_once, False, 1.0), _record("dq", fast_once, True),  # could not launch causal
        _record("dq", steady, False, 9.0), _record("dq", steady, True, 6.5),
    ]  # fmt: skip
    best = config_sweep.best_configs(records)["dq D128"]
    assert best == dict(config=list(steady), ms=15.5, default_ms=16.0)


def test_use_configs_changes_16bit_cuda_launches_only(monkeypatch):
    for name in config_sweep.CONFIG_FUNCTIONS.values():
        monkeypatch.setattr(attn_ops, name, getattr(attn_ops, name))  # restored after the test
    config_sweep.use_configs({"kind": "best", "dq D128": {"config": [128, 128, 8, 2]}})
    assert attn_ops._bwd_dq_config(128, torch.bfloat16, CUDA) == attn_ops.LaunchConfig(128, 128, 8, 2)
    assert attn_ops._bwd_dq_config(128, torch.float16, CUDA) == attn_ops.LaunchConfig(128, 128, 8, 2)
    unchanged = [
        (attn_ops._bwd_dq_config, 64, torch.bfloat16, CUDA),
        (attn_ops._bwd_dq_config, 128, torch.float32, CUDA),
        (attn_ops._bwd_dq_config, 128, torch.bfloat16, torch.device("cpu")),
        (attn_ops._fwd_config, 128, torch.bfloat16, CUDA),
    ]
    for function, block_d, dtype, device in unchanged:
        kernel = {attn_ops._bwd_dq_config: "dq", attn_ops._fwd_config: "fwd"}[function]
        assert function(block_d, dtype, device) == attn_ops._launch_config(kernel, block_d, dtype, device)


@pytest.mark.parametrize("before", [None, "1"], ids=["unset", "1"])
def test_reference_runs_without_the_split_or_gluon_kernels(before, monkeypatch):
    """The sweep's reference results come from the default kernels ($RINGATTN_WS=0, $RINGATTN_GLUON=0), and the
    settings are restored."""
    for name in ("RINGATTN_WS", "RINGATTN_GLUON"):
        if before is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, before)
    with config_sweep._default_kernels_only():
        assert os.environ["RINGATTN_WS"] == os.environ["RINGATTN_GLUON"] == "0"
    assert os.environ.get("RINGATTN_WS") == os.environ.get("RINGATTN_GLUON") == before


@pytest.mark.parametrize("mode", [None, "1"], ids=["ws-unset", "ws-1"])
def test_launched_asks_the_launchers(mode, monkeypatch):
    """The sweep times a kernel where the launchers pick it: in the interpreter the default kernels, and with
    $RINGATTN_WS=1 the split ones (the interpreter takes every form then); never the Gluon forward there."""
    if mode is None:
        monkeypatch.delenv("RINGATTN_WS", raising=False)
    else:
        monkeypatch.setenv("RINGATTN_WS", mode)
    assert set(config_sweep.CANDIDATES) == set(config_sweep.KERNEL_FUNCTIONS)
    q, k, v = (torch.randn(1, 64, 2, 64) for _ in range(3))
    for causal in (False, True):
        launched = {kernel for kernel in config_sweep.CANDIDATES if config_sweep._launched(kernel, q, k, v, causal)}
        assert launched == ({"fwd_ws", "dkdv_ws", "dq_ws"} if mode else {"fwd", "dkdv", "dq"}), causal
