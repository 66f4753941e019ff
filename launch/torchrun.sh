#!/usr/bin/env bash
# Run a Python script (or an example) on N local ranks with torch.distributed.run.
#
# Usage:
#   bash launch/torchrun.sh SCRIPT [ARGS...]
#   NPROC=2 bash launch/torchrun.sh launch/ring_check.py --seqlen 1024
#   NPROC=2 DEVICE=cpu bash launch/torchrun.sh examples/train_gpt.py --check
#   bash launch/torchrun.sh launch/ring_check.py --help   # the script's options: run once, no ranks
#   bash launch/torchrun.sh --help                        # this text
#
# N is $NPROC if set, else the number of CUDA GPUs torch sees (one rank per GPU, NCCL),
# else 4 CPU ranks (gloo, Triton kernels in the interpreter: TRITON_INTERPRET=1 and one
# OpenMP thread per rank). NVLink multicast stays off in NCCL, PyTorch and NVSHMEM.
# With -h or --help among the script's arguments, the script runs once in this process
# instead, as plain python3, to print its options.
#
# Environment:
#   NPROC             ranks to start (on GPUs at most one per GPU)
#   DEVICE=cpu        CPU ranks over gloo even where there are GPUs (hides them from the ranks)
#   LOG_RANKS         local ranks whose output is shown: "0" (default) or a list "0,1", or "all";
#                     the others' output goes to log files, whose last lines are shown if the job fails
#   TIMEOUT           how long the whole job may run before it is stopped: seconds, or a number
#                     with a suffix s, m, h or d (coreutils timeout's); default: no limit
#   RINGATTN_TIMEOUT  seconds a collective may wait in scripts that use ringattn.distributed
#                     (default 300): a hang becomes an error on every rank
#
# Exit status: 0; the exit status of the rank that failed first (2: bad arguments); 124 after TIMEOUT.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  usage
  exit 0
fi
if [[ $# -lt 1 ]]; then
  usage >&2
  exit 2
fi

# this checkout's ringattn comes first, whatever copy is installed
repo_root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "${DEVICE:-}" in
  "" | gpu | cuda) ;;
  cpu) export CUDA_VISIBLE_DEVICES="" ;;
  *) echo "torchrun.sh: DEVICE must be cpu (or unset), got '$DEVICE'" >&2; exit 2 ;;
esac

if [[ -n "${TIMEOUT:-}" ]] && ! [[ "$TIMEOUT" =~ ^[0-9]*\.?[0-9]+[smhd]?$ && "$TIMEOUT" =~ [1-9] ]]; then
  echo "torchrun.sh: TIMEOUT must be a positive duration (seconds, or with a suffix s, m, h or d), got '$TIMEOUT'" >&2
  exit 2
fi

# the script's --help needs no ranks: print it from one plain process
for arg in "${@:2}"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    echo "torchrun.sh: $arg: running $1 once, without ranks" >&2
    exec python3 "$@"
  fi
done

if [[ "${DEVICE:-}" == cpu ]]; then
  gpus=0 # no GPU is visible: CUDA_VISIBLE_DEVICES is empty (no torch import to ask)
else
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
fi
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
if ! [[ "$nproc" =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NPROC must be a positive integer, got '$nproc'" >&2
  exit 2
fi
if [[ "$gpus" -gt 0 && "$nproc" -gt "$gpus" ]]; then
  echo "torchrun.sh: NPROC=$nproc ranks but only $gpus GPU(s): one rank per GPU (DEVICE=cpu for CPU ranks)" >&2
  exit 2
fi

run=(python3 -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$nproc")

# Show only the chosen local ranks; the others write to files in a temporary log dir.
log_ranks="${LOG_RANKS:-0}"
log_dir=""
if [[ "$log_ranks" != all && "$nproc" -gt 1 ]]; then
  if ! [[ "$log_ranks" =~ ^(0|[1-9][0-9]*)(,(0|[1-9][0-9]*))*$ ]]; then  # no leading zeros: ranks match as text
    echo "torchrun.sh: LOG_RANKS must be 'all' or a comma-separated list of local ranks, got '$log_ranks'" >&2
    exit 2
  fi
  for r in ${log_ranks//,/ }; do
    if ((r >= nproc)); then
      echo "torchrun.sh: LOG_RANKS lists local rank $r, but NPROC=$nproc ranks run (0 to $((nproc - 1)))" >&2
      exit 2
    fi
  done
  redirects=""
  for ((r = 0; r < nproc; r++)); do
    if [[ ",$log_ranks," != *",$r,"* ]]; then
      redirects+="${redirects:+,}$r:3"
    fi
  done
  if [[ -n "$redirects" ]]; then
    log_dir=$(mktemp -d "${TMPDIR:-/tmp}/ringattn-logs.XXXXXX")
    run+=(--log-dir="$log_dir" --redirects="$redirects" --local-ranks-filter="$log_ranks")
  fi
fi

if [[ -n "${TIMEOUT:-}" ]]; then
  run=(timeout --signal=TERM --kill-after=30 "$TIMEOUT" "${run[@]}")
fi

# torchrun's stderr is kept in a file as well, for the exit status of the rank that failed first: torchrun itself
# exits 1, where the rank's own status (2: bad arguments) says more
err_log=$(mktemp "${TMPDIR:-/tmp}/ringattn-torchrun.XXXXXX")
trap 'rm -f "$err_log"' EXIT
status=0
{ "${run[@]}" "$@" 2>&1 1>&3 3>&- | tee "$err_log" >&2; } 3>&1 || status=$?
if [[ "$status" -eq 1 ]]; then
  # torchrun's summary: "Root Cause (first observed failure):" ... "exitcode  : 2 (pid: ...)"
  first=$(awk '/Root Cause/ { root = 1 } root && /exitcode *:/ { sub(/.*exitcode *: */, ""); print $1; exit }' "$err_log")
  if [[ "$first" =~ ^[1-9][0-9]*$ && "$first" -le 255 ]]; then
    status="$first"
  fi
fi

if [[ "$status" -eq 124 && -n "${TIMEOUT:-}" ]]; then
  echo "torchrun.sh: stopped after TIMEOUT=${TIMEOUT}" >&2
fi
if [[ -n "$log_dir" ]]; then
  if [[ "$status" -ne 0 ]]; then
    # the hidden ranks' last words: a traceback on rank 3 is the usual reason rank 0 stopped
    while IFS= read -r f; do
      if [[ -s "$f" ]]; then
        rank=$(basename "$(dirname "$f")")
        echo "--- local rank $rank, last lines of $(basename "$f") ---" >&2
        tail -n 25 "$f" >&2
      fi
    done < <(find "$log_dir" -name 'std*.log' | sort)
    echo "torchrun.sh: every hidden rank's output is in $log_dir" >&2
  else
    rm -rf "$log_dir"
  fi
fi
exit "$status"
