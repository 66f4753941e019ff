"""launch/tools/kernel_resources.py on the CPU: it compiles the launchers' own launches for Hopper, without a GPU,
and reports what ptxas and the compiler say. Run in a subprocess: the test session interprets the kernels
(TRITON_INTERPRET=1), and an interpreted kernel cannot be compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringattn.ops import Target, capabilities, launch_config

HOPPER_TRITON = capabilities().gluon_hopper and capabilities().split_kernels

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "launch" / "tools"))

from kernel_resources import product_loop_spills  # noqa: E402

# SASS as nvdisasm prints it: a persistent walk (.L_x_1) around a key loop (.L_x_2) with one spill load in it, a
# spill store once a walk step, and the out-of-line retry of a barrier wait (.L_x_3), which spills but issues no
# product
SASS = """
.L_x_1:
        /*0100*/                   STL [R1+0x8], R184 ;
.L_x_2:
        /*0200*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0210*/                   LDL R233, [R1] ;
        /*0220*/              @P5 BRA `(.L_x_2) ;
        /*0230*/                   HGMMA.64x128x16.F32.BF16 R88, R48, gdesc[UR8].tnspB, R88, gsb0 ;
        /*0240*/              @!P4 BRA `(.L_x_1) ;
        /*0250*/                   EXIT ;
.L_x_3:
        /*0260*/                   LDL R2, [R1+0x10] ;
        /*0270*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P4, [UR50+0x30120], R0 ;
        /*0280*/              @!P4 BRA `(.L_x_3) ;
        /*0290*/                   BRA `(.L_x_2) ;
"""


def test_loop_spills_count_the_innermost_product_loop_only():
    assert product_loop_spills(SASS) == 1
    assert product_loop_spills(SASS.replace("LDL R233, [R1] ;", "FADD R2, R2, R3 ;")) == 0
    assert product_loop_spills(SASS.replace("@P5 BRA `(.L_x_2)", "FADD R2, R2, R3")) == 2  # the walk is innermost


@pytest.mark.timeout(600)
def test_reports_the_dq_kernel_at_its_gpu_config(tmp_path):
    out = tmp_path / "resources.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch" / "tools"), str(ROOT)])
    cmd = [
        sys.executable,
        str(ROOT / "launch/tools/kernel_resources.py"),
        "--kernels",
        "portable.dq",
        "--head-dims",
        "64",
    ]
    result = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    env_record, *records = json.loads(out.read_text())
    assert env_record["arch"] == "sm_90a"
    assert [r["causal"] for r in records] == [False, True]
    gpu_config = list(launch_config("portable.dq", 64, torch.bfloat16, Target((9, 0))).__dict__.values())
    for r in records:
        assert "error" not in r, r
        assert r["config"] == gpu_config
        assert 0 < r["regs"] <= 255 and r["smem_bytes"] > 0 and r["ctas_per_sm"] >= 1
        assert r["spill_store_bytes"] >= 0 and r["spill_load_bytes"] >= 0
    assert "| portable.dq | 64 | 32 | yes |" in result.stdout


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HOPPER_TRITON, reason="this triton lacks the Hopper kernels' features")
def test_split_kernels_partition_without_known_hazards(tmp_path):
    """Every split kernel, causal or not (as deterministic calls take them), GQA (the dK/dV kernel's grouped
    loop), in the ring's forms: split into a producer and two consumers (12 warps), no spills, within a CTA's shared
    memory, and none of the ops the partitioner was seen to split wrong (a tl.arange range, a reshaped
    shared-memory tile) in a region."""
    out = tmp_path / "resources.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch" / "tools"), str(ROOT)])
    kernels = ["sm90.dq", "sm90.dkdv"]
    cmd = [sys.executable, str(ROOT / "launch/tools/kernel_resources.py"), "--kernels", *kernels, "--head-dims", "128",
           "--kv-heads", "8", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    _, *records = json.loads(out.read_text())
    assert [(r["kernel"], r["causal"]) for r in records] == [(k, c) for k in kernels for c in (False, True)]
    for r in records:
        assert "error" not in r, r
        assert (r["ws_partitions"], r["warps"], r["ws_hazards"]) == (1, 12, 0), r
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0 and r["smem_bytes"] <= 227 * 1024, r


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "dtype, head_dims", [("bfloat16", ["64", "128", "256"]), ("float32", ["256"])], ids=["bfloat16", "float32"]
)
def test_portable_kernels_fit_a_99_kib_gpu(tmp_path, dtype, head_dims):
    """Every portable kernel, causal or not, the forward also as the ring's merging step, compiled for compute
    capability 8.6 (blocks of at most 99 KiB of shared memory, as 8.9 and 12.x): each at its table's config for that
    GPU and dtype fits, one CTA an SM or more (the Hopper-swept 16-bit configs need up to 160 KiB, the fp32 ones at
    D = 256 up to 132; fp32 at D <= 128 takes at most 72 KiB, and its spilling compiles take half a minute)."""
    out = tmp_path / "resources.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch" / "tools"), str(ROOT)])
    kernels = ["portable.fwd", "portable.fwd-merge", "portable.dkdv", "portable.dq"]
    cmd = [sys.executable, str(ROOT / "launch/tools/kernel_resources.py"), "--kernels", *kernels,
           "--head-dims", *head_dims, "--arch", "86", "--dtype", dtype, "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    env_record, *records = json.loads(out.read_text())
    assert env_record["arch"] == "sm_86" and len(records) == 4 * len(head_dims) * 2
    for r in records:
        assert r["dtype"] == dtype, r
        config = launch_config(r["kernel"].removesuffix("-merge"), r["D"], getattr(torch, dtype), Target((8, 6)))
        assert "error" not in r and r["config"] == list(config.__dict__.values()), r
        assert r["smem_bytes"] <= 99 * 1024 and r["ctas_per_sm"] >= 1, r


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HOPPER_TRITON, reason="this triton lacks the Hopper kernels' features")
def test_gluon_backward_compiles_for_hopper(tmp_path):
    """The Gluon backward in the ring's form (dQ added into fp32, dK and dV stored as fp32 shares), GQA, at D = 64 and
    128, causal or not (four compiles). One warp-specialised region of 12 warps, one CTA an SM, within a CTA's shared
    memory, at most a few bytes of spills at D = 128 (at D = 64 its 128-row steps spill up to 148 bytes, and ran
    1.02x to 1.07x the spill-free 64-row steps' speed: docs/performance.md, decisions), and its products overlapping:
    ptxas did not serialise the wgmma (it does when an instruction touches a pending product's registers, as a
    product issued across the loop's back edge did)."""
    out = tmp_path / "resources.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch" / "tools"), str(ROOT)])
    cmd = [sys.executable, str(ROOT / "launch/tools/kernel_resources.py"), "--kernels", "sm90.bwd",
           "--head-dims", "64", "128", "--kv-heads", "8", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    _, *records = json.loads(out.read_text())
    assert [(r["D"], r["causal"]) for r in records] == [(d, c) for d in (64, 128) for c in (False, True)]
    for r in records:
        assert "error" not in r, r
        assert (r["ws_partitions"], r["warps"], r["ctas_per_sm"], r["wgmma_serialized"]) == (1, 12, 1, False), r
        assert r["spill_store_bytes"] <= (8 if r["D"] == 128 else 160) and r["smem_bytes"] <= 227 * 1024, r


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HOPPER_TRITON, reason="this triton lacks the Hopper kernels' features")
def test_gluon_forward_compiles_for_hopper(tmp_path):
    """The Gluon forward, public and the ring's step, at D = 128 (the default's head dim) and GQA, causal or not (four
    compiles: each takes seconds): one warp-specialised region of 12 warps (two consumer warpgroups, a producer warp
    rounded up to a warpgroup), within a CTA's shared memory, at most a few bytes of spills and none in the key loop,
    the wgmma not serialised."""
    out = tmp_path / "resources.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "launch" / "tools"), str(ROOT)])
    cmd = [sys.executable, str(ROOT / "launch/tools/kernel_resources.py"), "--kernels", "sm90.fwd", "sm90.fwd-merge",
           "--head-dims", "128", "--kv-heads", "8", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-2000:]
    _, *records = json.loads(out.read_text())
    kernels = ("sm90.fwd", "sm90.fwd-merge")
    assert [(r["kernel"], r["causal"]) for r in records] == [(k, c) for k in kernels for c in (False, True)]
    for r in records:
        assert "error" not in r, r
        assert (r["ws_partitions"], r["warps"], r["ctas_per_sm"], r["wgmma_serialized"]) == (1, 12, 1, False), r
        assert r["spill_store_bytes"] <= 8 and r["loop_spills"] == 0 and r["smem_bytes"] <= 227 * 1024, r
