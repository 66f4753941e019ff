#!/usr/bin/env bash
# Install ringattn into the system python3 (no venv), idempotently.
#
# Usage:
#   bash launch/setup.sh          # torch (if missing) + ringattn in editable mode
#   bash launch/setup.sh --test   # the same, plus the test extras (pytest, pytest-timeout, pytest-xdist) and the
#                                 # Hugging Face extra (transformers), so its integration tests run
#
# A machine that already has torch (a CUDA build on a GPU machine, say) keeps it; one that
# has none gets torch==2.13.0, the CPU build this project is tested with.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

extras=""
case "${1:-}" in
  "") ;;
  --test) extras="[test,hf]" ;;
  -h | --help) usage; exit 0 ;;
  *) echo "usage: bash launch/setup.sh [--test]" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if ! python3 -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  python3 -m pip install -q torch==2.13.0
fi
echo "setup: installing ringattn${extras} (editable)"
python3 -m pip install -q -e ".${extras}"
python3 -c "import torch, triton, ringattn; print(f'setup: ok (torch {torch.__version__}, triton {triton.__version__}, ringattn {ringattn.__version__})')"
