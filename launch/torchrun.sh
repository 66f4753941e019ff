#!/usr/bin/env bash
# Run a Python script on N local ranks with torch.distributed.run.
#
# Usage:
#   bash launch/torchrun.sh SCRIPT [ARGS...]
#   NPROC=2 bash launch/torchrun.sh launch/ring_check.py --seqlen 1024
#
# N is $NPROC if set, else the number of CUDA GPUs torch sees (one rank per GPU, NCCL),
# else 4 CPU ranks (gloo, Triton kernels in the interpreter: TRITON_INTERPRET=1 and one
# OpenMP thread per rank). NVLink multicast stays off in NCCL, PyTorch and NVSHMEM.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  usage >&2
  exit 2
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [[ "$gpus" -eq 0 ]]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
fi
if [[ -n "${NPROC:-}" ]]; then
  nproc="$NPROC"
elif [[ "$gpus" -gt 0 ]]; then
  nproc="$gpus"
else
  nproc=4
fi

exec python3 -m torch.distributed.run --standalone --nproc-per-node="$nproc" "$@"
