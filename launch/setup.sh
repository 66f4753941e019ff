#!/usr/bin/env bash
# Install ringattn, editable from this checkout, into the python3 first on PATH, idempotently.
#
# Usage:
#   bash launch/setup.sh          # torch (if missing) + ringattn in editable mode
#   bash launch/setup.sh --test   # the same, plus the test extras (pytest, pytest-timeout, pytest-xdist,
#                                 # matplotlib, setuptools) and the Hugging Face extra (transformers, accelerate),
#                                 # so every test runs
#
# Without an active virtual environment that python3 is the system's, and the install goes into its
# site-packages; the script says which python3 and which site-packages before installing. To keep the
# system python3 untouched, make and activate a venv first (--system-site-packages reuses an installed
# torch); then this script, launch/torchrun.sh and `python3 -m pytest` all use the venv's python3:
#   python3 -m venv .venv && . .venv/bin/activate && bash launch/setup.sh
#
# A machine that already has torch (a CUDA build on a GPU machine, say) keeps it; one that
# has none gets torch==2.13.0 from pip's index (on Linux PyPI serves its CUDA build; for the CPU
# build this project is tested with, install torch from https://download.pytorch.org/whl/cpu first).
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

extras=""
if (($# > 1)); then echo "usage: bash launch/setup.sh [--test]" >&2; exit 2; fi
case "${1:-}" in
  "") ;;
  --test) extras="[test,hf]" ;;
  -h | --help) usage; exit 0 ;;
  *) echo "usage: bash launch/setup.sh [--test]" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

python3 -c "import sys, sysconfig
where = 'a venv' if sys.prefix != sys.base_prefix else 'not a venv: --help says how to use one'
site = sysconfig.get_path('purelib')
print(f'setup: installing into {sys.executable} ({where}), site-packages {site}')"
if ! python3 -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  python3 -m pip install -q torch==2.13.0
fi
echo "setup: installing ringattn${extras}, editable from this checkout ($PWD)"
python3 -m pip install -q -e ".${extras}"
python3 -c "import torch, triton, ringattn; print(f'setup: ok (torch {torch.__version__}, triton {triton.__version__}, ringattn {ringattn.__version__})')"
