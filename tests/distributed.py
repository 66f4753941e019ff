"""Run a function on W spawned ranks under a hard timeout (gloo on CPU, NCCL on GPUs).

Rendezvous goes through a file:// store in a fresh temp dir. A rank that raises reports its
traceback at once and the others are killed, so a failure shows up in seconds, not at the
timeout; a hang is killed at the timeout.
"""

import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank_entry(fn, rank, world_size, init_file, backend, results, args):
    try:
        os.environ.update(MULTICAST_OFF)
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        value = fn(rank, world_size, *args)
        dist.barrier()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0) -> list:
    """Call fn(rank, world_size, *args) on world_size spawned ranks; return their results by rank.

    fn must be a module-level function. Raises AssertionError with the failing rank's
    traceback, or when the ranks do not all finish within `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_rank_entry, args=(fn, rank, world_size, init_file, backend, results, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        done: dict[int, object] = {}
        try:
            while len(done) < world_size:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"ranks {sorted(set(range(world_size)) - set(done))} timed out after {timeout}s"
                    )
                try:
                    rank, ok, value = results.get(timeout=0.5)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                    if dead:
                        raise AssertionError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                    continue
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                done[rank] = value
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [done[r] for r in range(world_size)]
