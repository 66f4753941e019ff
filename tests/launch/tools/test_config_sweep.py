"""launch/tools/config_sweep.py on the CPU: its candidate lists against the backends' tables, the choice of the
best config, timing a sweep's choice through use_configs (bench_kernel --configs), and which kernel a call runs."""

import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import KERNELS, LaunchConfig, Target, dispatch, launch_config

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "tools"))
import config_sweep  # noqa: E402 (a script beside the package, found through launch/tools/)

HOPPER = Target((9, 0))


def test_each_candidate_list_starts_with_the_config_launched_today():
    config_sweep._check_defaults([64, 96, 128])
    assert set(config_sweep.CANDIDATES) == set(KERNELS)


def test_check_defaults_catches_a_list_out_of_date(monkeypatch):
    dq = config_sweep.CANDIDATES["portable.dq"]
    stale = {**config_sweep.CANDIDATES, "portable.dq": {64: [(32, 32, 4, 1)], 128: dq[128]}}
    monkeypatch.setattr(config_sweep, "CANDIDATES", stale)
    with pytest.raises(AssertionError, match=r"portable.dq D64: first candidate \(32, 32, 4, 1\) != default"):
        config_sweep._check_defaults([64, 128])


def test_swept_configs_candidates_given_or_defaults():
    kernels, dims = ["portable.fwd", "sm90.dkdv"], [64, 128]
    assert config_sweep.swept_configs(kernels, dims, None, False) == {k: config_sweep.CANDIDATES[k] for k in kernels}
    given = config_sweep.swept_configs(kernels, dims, ["64,32,4,2"], False)
    assert given == {k: {64: [(64, 32, 4, 2)], 128: [(64, 32, 4, 2)]} for k in kernels}
    defaults = config_sweep.swept_configs(kernels, dims, ["64,32,4,2"], True)
    assert defaults == {k: {d: [config_sweep._default_config(k, d)] for d in dims} for k in kernels}
    assert defaults["sm90.dkdv"][128] == [
        tuple(launch_config("sm90.dkdv", 128, torch.bfloat16, HOPPER).__dict__.values())
    ]


def _record(kernel, config, causal, ms=None, head_dim=128, softcap=0.0):
    record = dict(kernel=kernel, config=list(config), D=head_dim, causal=causal, softcap=softcap)
    return {**record, "ms": ms} if ms is not None else {**record, "error": "out of resource: shared memory"}


def test_best_config_sums_both_causal_settings_and_skips_configs_that_failed_in_one():
    default, fast_once, steady = config_sweep.CANDIDATES["portable.dq"][128][0], (64, 64, 4, 1), (128, 64, 8, 4)
    records = [
        _record("portable.dq", default, False, 10.0), _record("portable.dq", default, True, 6.0),
        _record("portable.dq", fast_once, False, 1.0), _record("portable.dq", fast_once, True),  # no causal launch
        _record("portable.dq", steady, False, 9.0), _record("portable.dq", steady, True, 6.5),
    ]  # fmt: skip
    best = config_sweep.best_configs(records)["portable.dq D128"]
    assert best == dict(config=list(steady), ms=15.5, default_ms=16.0)


def test_a_soft_capped_sweep_reports_the_soft_capped_default():
    """Soft-capped, the Gluon backward at D = 64 launches ops/sm90.py's SOFTCAPPED config: the default reported."""
    table, capped = (config_sweep._default_config("sm90.bwd", 64, softcapped) for softcapped in (False, True))
    assert table != capped
    records = [_record("sm90.bwd", config, causal, ms, 64, 30.0)
               for config, ms in ((table, 5.0), (capped, 2.0)) for causal in (False, True)]  # fmt: skip
    assert config_sweep.best_configs(records)["sm90.bwd D64"] == dict(config=list(capped), ms=4.0, default_ms=4.0)
    defaults = config_sweep.swept_configs(["sm90.bwd"], [64], None, True, softcapped=True)
    assert defaults == {"sm90.bwd": {64: [capped]}}


def test_use_configs_overrides_the_swept_kernels_only_and_restores():
    before = launch_config("portable.dq", 128, torch.bfloat16, HOPPER)
    with config_sweep.use_configs({"portable.dq D128": dict(config=[128, 128, 8, 2], ms=1.0, default_ms=2.0)}):
        assert launch_config("portable.dq", 128, torch.bfloat16, HOPPER) == LaunchConfig(128, 128, 8, 2)
        assert launch_config("portable.fwd", 128, torch.bfloat16, HOPPER) != LaunchConfig(128, 128, 8, 2)
    assert launch_config("portable.dq", 128, torch.bfloat16, HOPPER) == before


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scores", [dict(window=(None, None), softcap=0.0), dict(window=(8, 0), softcap=0.0),
                                    dict(window=(None, None), softcap=30.0)])  # fmt: skip
def test_launched_asks_the_dispatch(causal, scores):
    """On the CPU the portable kernels are launched; the Hopper ones where the interpreter runs them (the split
    backward kernels, at the head dims of their table, for plain scores only), never the Gluon forward."""
    q, k, v = (torch.randn(1, 64, 2, 128) for _ in range(3))
    launched = {kernel for kernel in config_sweep.CANDIDATES if config_sweep._launched(kernel, q, k, v, causal, scores)}
    expected = {"portable.fwd", "portable.dkdv", "portable.dq"}
    if dispatch.hopper_available(Target(None)) and scores["window"] == (None, None) and not scores["softcap"]:
        expected |= {"sm90.dkdv", "sm90.dq"}
    assert launched == expected
