"""Checks of ops/validation.py that depend on how ringattn was imported: run in a fresh interpreter each."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Triton's own reading of $TRITON_INTERPRET (a kernel decorated now), then flash_attn_func on a CPU tensor
PROBE = """
import torch, triton
from triton.runtime.interpreter import InterpretedFunction

@triton.jit
def kernel():
    pass

import ringattn
print("triton interprets:", isinstance(kernel, InterpretedFunction))
try:
    ringattn.flash_attn_func(*(torch.zeros(1, 8, 2, 16) for _ in range(3)))
    print("ran on the CPU")
except RuntimeError as e:
    print(e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU path; GPUs compile the kernels")
@pytest.mark.parametrize("setting", ["true", "2"])
def test_interpreter_on_exactly_when_triton_reads_it_on(setting, tmp_path):
    """Regression: TRITON_INTERPRET=true turns Triton's interpreter on (recent Triton), but ringattn, looking for
    "1" alone, refused CPU tensors and told the user to set 1; a value Triton reads as off is now named as such."""
    probe = tmp_path / "probe.py"  # Triton compiles @jit functions from their source file
    probe.write_text(PROBE)
    env = dict(os.environ, TRITON_INTERPRET=setting, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if "triton interprets: True" in proc.stdout:
        assert "ran on the CPU" in proc.stdout, proc.stdout
    else:
        assert "triton interprets: False" in proc.stdout, proc.stdout
        hint = f"TRITON_INTERPRET=1 (when ringattn was imported, TRITON_INTERPRET was '{setting}', which this Triton"
        assert hint in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [("3.6.0", "2.4.6", True), ("3.4.0", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False),
     ("3.9.0", "2.4.6", False), ("3.6.0+git1234", "2.10.0rc1", True), ("3.10.0", "1.26.4", False)],
)  # fmt: skip
def test_interpreter_and_numpy_that_cannot_work_together_are_named(triton_version, numpy_version, refused):
    """Triton before 3.7 beside numpy 2.4 or later fails inside the interpreter (a TypeError about 0-dimensional
    arrays, deep in a kernel); ringattn names the versions and the way out instead."""
    from ringattn.ops.validation import interpreter_problem

    problem = interpreter_problem(triton_version, numpy_version)
    if refused:
        assert problem is not None and f"Triton {triton_version}'s interpreter" in problem
        assert f"numpy {numpy_version}" in problem and "triton>=3.7 or numpy<2.4" in problem
    else:
        assert problem is None


@pytest.mark.parametrize(
    "capability, rocm, refused",
    [((7, 0), False, True), ((7, 5), False, True), ((8, 0), False, False), ((8, 6), False, False),
     ((9, 0), False, False), ((10, 0), False, False), ((12, 0), False, False), ((9, 4), True, True)],
)  # fmt: skip
def test_gpus_the_kernels_cannot_run_on_are_named(capability, rocm, refused):
    """GPUs older than compute capability 8.0 (Volta, Turing: Triton compiles the kernels' products to FMA loops that
    spill and overflow their shared memory) and ROCm devices are refused with the device and the need, not left to
    fail inside Triton's compiler or to run Hopper kernels on an MI300 (which reports capability 9.4)."""
    from ringattn.ops.validation import gpu_problem

    problem = gpu_problem(capability, "cuda:0 (Some GPU)", rocm)
    if not refused:
        assert problem is None
    elif rocm:
        assert "cuda:0 (Some GPU), a ROCm device" in problem and "NVIDIA GPUs (compute capability 8.0" in problem
    else:
        assert f"of compute capability {capability[0]}.{capability[1]}" in problem and "8.0 or newer" in problem


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA tensor's call")
def test_a_call_on_a_gpu_the_kernels_cannot_run_on_raises_the_problem(monkeypatch):
    """The launchers ask check_gpu before dispatching (this GPU's problem stood in): an old GPU or a ROCm device gets
    the message, not Triton's compile or launch error."""
    import ringattn
    from ringattn.ops import validation

    monkeypatch.setattr(validation, "_device_problem", lambda index: f"device {index} cannot run them")
    with pytest.raises(RuntimeError, match="device 0 cannot run them"):
        ringattn.flash_attn_func(*(torch.zeros(1, 8, 2, 16, device="cuda", dtype=torch.float16) for _ in range(3)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU path; GPUs compile the kernels")
def test_a_call_where_the_interpreter_cannot_run_raises_the_problem(monkeypatch):
    import ringattn
    from ringattn.ops import validation

    monkeypatch.setattr(validation, "_INTERPRETER_PROBLEM", "this interpreter cannot run here")
    with pytest.raises(RuntimeError, match="this interpreter cannot run here"):
        ringattn.flash_attn_func(*(torch.zeros(1, 8, 2, 16) for _ in range(3)))
