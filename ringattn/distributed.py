"""Process-group setup for scripts run on every rank (launch/torchrun.sh, torchrun), in one call.

    import os, torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: before ringattn is imported
    from ringattn.distributed import init_distributed, log
    env = init_distributed()  # env.rank, env.world_size, env.local_rank, env.device, env.backend
    log("printed by rank 0 only")

exit_on_bad_arguments(parser, problems) ends a script's argument checks on every rank, each saying why.

GPUs: one rank per GPU over NCCL; the rank's device is set from LOCAL_RANK before any communication.
CPUs: gloo, with the kernels in Triton's interpreter. NVLink multicast stays off in every process
(MULTICAST_OFF, set before the first communicator exists). Collectives time out after
RINGATTN_TIMEOUT seconds (default 300): a hang becomes an error instead of a silent wait.
"""

import argparse
import gc
import os
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .ops.validation import KERNELS_INTERPRETED, interpreter_hint
from .parallel.comm import GROUP_TIMEOUT_ENV, p2p_timeout_s

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: its global rank, the world size, its rank on this node, its device, the backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_high_priority(value: bool | None = None) -> bool:
    """Whether NCCL should run on high-priority streams: `value`, else $RINGATTN_NCCL_HIGH_PRIORITY ("1", the
    default, or "0"). Raises ValueError for another value of the variable."""
    if value is not None:
        return bool(value)
    setting = os.environ.get("RINGATTN_NCCL_HIGH_PRIORITY", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"RINGATTN_NCCL_HIGH_PRIORITY must be '0' or '1', got {setting!r}")
    return setting == "1"


def init_distributed(
    backend: str | None = None, timeout_s: float | None = None, high_priority: bool | None = None
) -> DistEnv:
    """Initialise the default process group for this rank and return its DistEnv.

    Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set) it joins the job; started as a plain
    `python script.py` it makes a group of one on 127.0.0.1. Calling it again returns the same DistEnv.

    Args:
        backend: "nccl" or "gloo"; default "nccl" when CUDA is available, else "gloo".
        timeout_s: collective timeout in seconds; default $RINGATTN_TIMEOUT or 300.
        high_priority: NCCL on high-priority CUDA streams (nccl_high_priority; default on), so that a ring
            transfer gets SMs as soon as a running kernel's blocks retire, rather than after the whole
            kernel: on 2 H200s it made the zigzag causal ring 3% (forward+backward) to 8% (forward) faster
            at S_local = 8k (docs/performance.md).
    Returns:
        DistEnv; device is cuda:LOCAL_RANK (already made the current device) for NCCL, cpu for gloo.
    Raises:
        RuntimeError: NCCL without enough GPUs for LOCAL_RANK; gloo while ringattn's kernels were not
            imported for the interpreter (TRITON_INTERPRET=1, or another value Triton reads as on, before ringattn
            is imported).
        ValueError: an unknown backend; a bad $RINGATTN_NCCL_HIGH_PRIORITY, $RANK, $WORLD_SIZE or $LOCAL_RANK
            (WORLD_SIZE other than 1 without RANK, a launcher's leftover, too); a
            timeout_s or $RINGATTN_TIMEOUT that is not a number of seconds from 0.001 to 1e9 (naming which).
        TypeError: a timeout_s that is not a number.
    """
    os.environ.update(MULTICAST_OFF)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    high_priority = nccl_high_priority(high_priority)
    if "RANK" not in os.environ:  # a plain `python script.py`: a group of one
        if os.environ.get("WORLD_SIZE", "1") != "1":  # a launcher's leftover, which the script may have read
            raise ValueError(
                f"WORLD_SIZE is {os.environ['WORLD_SIZE']!r} but RANK is not set: launch the ranks with torchrun "
                "(which sets both), or unset WORLD_SIZE for a plain run of one process"
            )
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(f"RANK and WORLD_SIZE must be ints with 0 <= RANK < WORLD_SIZE, got {rank!r} and {world!r}")
    local_rank = os.environ.get("LOCAL_RANK", "0")
    if not local_rank.isdigit():
        raise ValueError(f"LOCAL_RANK must be this process's rank on its node, an int >= 0, got {local_rank!r}")
    local_rank = int(local_rank)
    timeout_s = p2p_timeout_s(timeout_s, variables=(GROUP_TIMEOUT_ENV,))  # checked: seconds in TIMEOUT_RANGE_S

    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK {local_rank} needs a GPU of its own, but torch sees {torch.cuda.device_count()}; "
                "start at most one rank per GPU (launch/torchrun.sh does)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before any communication: NCCL binds the rank to this GPU
    else:
        if not KERNELS_INTERPRETED:
            raise RuntimeError(
                "gloo ranks run ringattn's kernels on the CPU, in Triton's interpreter: "
                + interpreter_hint()
                + "; launch/torchrun.sh sets it on a machine without GPUs"
            )
        device = torch.device("cpu")

    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device
            if high_priority:
                kwargs["pg_options"] = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, str(dist.get_backend()))


def exit_on_bad_arguments(parser: argparse.ArgumentParser, problems: list[str]) -> None:
    """Exit with status 2 on every rank when `problems` is not empty; else return.

    Every rank says why: rank 0 (RANK from the environment, or a plain run without it) prints the usage
    and the problems joined by "; " (parser.error), the other ranks the same error line without the
    usage. torchrun stops the job when its first rank exits, possibly before rank 0 has printed, and
    launch/torchrun.sh then shows the hidden ranks' last lines: the reason is there whichever rank
    exits first. Reads only the environment: call it before init_distributed.
    """
    if problems:
        message = "; ".join(problems)
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            parser.error(message)
        print(f"{parser.prog}: error (rank {rank}): {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def log(*parts, **print_kwargs) -> None:
    """print(*parts) on global rank 0 only (or always, before the process group exists); flushed."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*parts, flush=True, **print_kwargs)


def destroy() -> None:
    """Destroy the default process group if there is one (call at the end of a script).

    All ranks meet at a barrier first: a gloo rank that tears its connections down while a peer is
    still using them can abort ("terminate called without an active exception"), failing a job
    whose work all succeeded. Release what holds the group before (a DistributedDataParallel model,
    a Trainer, which wraps the model in one: `del trainer, model`): destroyed after the group, on
    gloo, it can hang the process at exit or abort it (the gloo thread it joins waits for the GIL it holds).
    Unreachable objects are collected here first.
    """
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
