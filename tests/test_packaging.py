"""What a user installs. The package needs nothing beyond its declared dependencies: it imports and runs where only
they are installed. The wheel as users get it: built from the repository's pyproject.toml, README.md, LICENSE and
ringattn/ (copied to a temporary folder, so no build/ or egg-info lands in the checkout), without license deprecation
warnings; installed into a fresh venv that sees the system's torch and triton; imported there from outside the
repository. The installed package is the wheel's (not the checkout nor an editable install), has its version, py.typed
and LICENSE, and runs flash_attn_func in Triton's interpreter."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib.metadata import PackageNotFoundError, distribution, requires, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60

# run by the venv's python from a folder outside the repository; prints what the parent asserts
CHECK_INSTALLED = textwrap.dedent(
    """
    import json, sysconfig
    from importlib.metadata import distribution
    from pathlib import Path
    import torch
    import ringattn
    from ringattn.testing import check_close, reference

    q, k, v = (torch.randn(1, 17, 2, 24) for _ in range(3))  # (batch, seqlen, nheads, headdim), fp32
    out, lse = ringattn.flash_attn_func(q, k, v, causal=True, return_lse=True)
    scale = 24**-0.5
    ref, pt = (reference(q, k, v, torch.zeros_like(q), scale, True, dtype) for dtype in (torch.float64, torch.float32))
    check_close("out", out, pt["out"], ref["out"])
    check_close("lse", lse, pt["lse"], ref["lse"])
    dist = distribution("ringattn")
    print(json.dumps({
        "file": ringattn.__file__,
        "purelib": sysconfig.get_paths()["purelib"],
        "version": ringattn.__version__,
        "py_typed": (Path(ringattn.__file__).parent / "py.typed").is_file(),
        "license_files": [str(f) for f in dist.files if f.name == "LICENSE"],
        "license_expression": dist.metadata["License-Expression"],
    }))
    """
)


def _setuptools_major() -> int:
    try:
        return int(version("setuptools").split(".")[0])
    except PackageNotFoundError:
        return 0


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.skipif(
    _setuptools_major() < 77,
    reason="the wheel is built offline (no build isolation) by the installed setuptools: none, or older than 77",
)
def test_wheel_installs_into_a_venv_and_runs(tmp_path):
    project_version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    src = tmp_path / "src"
    shutil.copytree(ROOT / "ringattn", src / "ringattn", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)

    # -v shows the build backend's output, where setuptools prints its deprecation warnings
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", str(tmp_path / "dist"), str(src)])  # fmt: skip
    for warning in ("License classifiers are deprecated", "`project.license` as a TOML table is deprecated"):
        assert warning not in build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("ringattn-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        license_in_wheel = zf.read(f"ringattn-{project_version}.dist-info/licenses/LICENSE")
        assert "ringattn/py.typed" in zf.namelist()
    assert license_in_wheel == (ROOT / "LICENSE").read_bytes()

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    # pip comes from the system site-packages; --ignore-installed leaves a ringattn there (an editable install, say)
    # alone rather than trying to uninstall it
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)])

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    found = json.loads(_run([python, "-c", CHECK_INSTALLED], cwd=outside, env=env).stdout.splitlines()[-1])

    installed = Path(found["file"]).resolve()
    assert installed.is_relative_to(Path(found["purelib"]).resolve()) and installed.is_relative_to(venv.resolve())
    assert found["version"] == project_version
    assert found["py_typed"]
    assert found["license_files"] == [f"ringattn-{project_version}.dist-info/licenses/LICENSE"]
    assert found["license_expression"] == "Apache-2.0"


# run with TRITON_INTERPRET=1 by a python that sees no site-packages, only the package and its declared dependencies
WITH_DECLARED_ONLY = textwrap.dedent(
    """
    import torch
    import ringattn, ringattn.benchmark, ringattn.distributed, ringattn.nn, ringattn.sequence_parallel
    import ringattn.testing, ringattn.ulysses
    q = torch.randn(1, 17, 2, 16, requires_grad=True)
    ringattn.flash_attn_func(q, q, q, causal=True).sum().backward()
    print("ok")
    """
)


def _declared_closure(requirements: list[str]) -> set[str]:
    """The installed distributions `requirements` name and everything they require in turn (extras left out)."""
    seen, todo = set(), list(requirements)
    while todo:
        name = re.split(r"[\s;<>=!~\[(]", todo.pop().strip(), maxsplit=1)[0].lower().replace("_", "-")
        if name not in seen:
            seen.add(name)
            try:
                todo += [r for r in requires(name) or [] if "extra ==" not in r]
            except PackageNotFoundError:
                pass
    return seen


def _site_of(names: set[str], folder: Path) -> Path:
    """A site folder holding links to the installed files of the distributions `names` alone."""
    folder.mkdir()
    for name in names:
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if not (folder / top).exists():
                (folder / top).symlink_to(Path(dist.locate_file(top)))
    return folder


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_the_core_package_runs_with_its_declared_dependencies_alone(tmp_path):
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    site = _site_of(_declared_closure(declared), tmp_path / "site")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{site}:{ROOT}"}
    # -S: no site-packages (nor their .pth files); the package from the checkout, its dependencies from `site`
    proc = subprocess.run([sys.executable, "-S", "-c", WITH_DECLARED_ONLY], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
