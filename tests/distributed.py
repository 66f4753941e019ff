"""Run a function on W ranks under a hard timeout (gloo on CPU, forked; NCCL on GPUs, spawned).

Rendezvous goes through a file:// store in a fresh temp dir. A rank that raises reports its
traceback at once and the others are killed, so a failure shows up in seconds, not at the
timeout; a hang is killed at the timeout. Tests of failure behaviour name the ranks they make
exit (`expect_exit`): those must exit with the given code, and the others still report.
"""

import io
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# The backends the ring numerics tests run on: gloo on CPU (fp32, interpreted kernels) always; NCCL in the
# training dtypes (bf16, fp16), one rank per GPU, where there are enough GPUs (skip_without_gpus).
RING_BACKENDS = [
    pytest.param("gloo", torch.float32, id="gloo-float32"),
    pytest.param("nccl", torch.bfloat16, id="nccl-bfloat16"),
    pytest.param("nccl", torch.float16, id="nccl-float16"),
]


def rank_device(rank: int, backend: str) -> torch.device:
    """The device of a rank spawned by run_ranks: its own GPU on NCCL, the CPU on gloo."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def skip_without_gpus(backend: str, world_size: int) -> None:
    """Skip an NCCL test that needs more GPUs (one per rank) than this machine has."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"NCCL ring needs {world_size} GPUs, found {torch.cuda.device_count()}")


def _rank_entry(fn, rank, world_size, init_file, backend, results, args, barrier):
    try:
        os.environ.update(MULTICAST_OFF)
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        value = fn(rank, world_size, *args)
        if barrier:
            dist.barrier()
        payload = io.BytesIO()
        torch.save(value, payload)  # by value: tensors shared through file descriptors die with this process
        results.put((rank, True, payload.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if barrier and dist.is_initialized():
            dist.destroy_process_group()
        elif not barrier:  # peers may be dead: tearing the group down could wait for them; leave at once
            results.close()
            results.join_thread()
            os._exit(0)


def _start(process) -> None:
    process.start()


# CPython (3.11 at least) keeps Python frames in 16 KiB chunks and frees a chunk when its first frame returns, so
# a hot call crossing a chunk's edge maps and unmaps memory at every call: up to a third of a gloo rank's CPU time
# in these tests. A forked rank carries on from the frame that forked it; starting it from a frame of 512 KiB
# (its stack size) gives it a chunk of 1 MiB whose free half holds the rank's whole stack.
_start.__code__ = _start.__code__.replace(co_stacksize=2**16)


def run_ranks(
    fn,
    world_size: int,
    *args,
    backend: str = "gloo",
    timeout: float = 120.0,
    expect_exit: dict[int, int] | None = None,
    barrier: bool = True,
) -> list:
    """Call fn(rank, world_size, *args) on world_size spawned ranks; return their results by rank.

    fn must be a module-level function; its result travels by value (torch.save), tensors included.
    `expect_exit` maps ranks that fn makes leave with os._exit(code) to that code: they report nothing
    (None in the results). With expect_exit, or barrier=False (for tests that leave the group broken),
    the ranks skip the final barrier and leave without tearing the group down. Raises AssertionError
    with the failing rank's traceback, when a rank exits unexpectedly, or when the ranks do not all
    finish within `timeout` seconds.
    """
    expect_exit = dict(expect_exit or {})
    # gloo ranks fork from this process (no second import of torch: a rank starts in milliseconds, not seconds);
    # NCCL ranks spawn (CUDA does not survive a fork)
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        entry_args = (init_file, backend, results, args, barrier and not expect_exit)
        procs = [
            ctx.Process(target=_rank_entry, args=(fn, rank, world_size, *entry_args)) for rank in range(world_size)
        ]
        for p in procs:
            _start(p)
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
                    for r, p in enumerate(procs):
                        if r in done or p.exitcode is None:
                            continue
                        if r in expect_exit and p.exitcode == expect_exit[r]:
                            done[r] = None
                        elif p.exitcode != 0 or r in expect_exit:
                            want = f", expected {expect_exit[r]}" if r in expect_exit else ""
                            raise AssertionError(f"rank {r} exited with code {p.exitcode}{want}") from None
                    continue
                if rank in expect_exit:
                    raise AssertionError(f"rank {rank} was expected to exit with code {expect_exit[rank]}, got {value}")
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                done[rank] = torch.load(io.BytesIO(value), weights_only=False)
            for p in procs:
                p.join(timeout=30 if not expect_exit else 5)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return [done[r] for r in range(world_size)]


def raised_errors(cases: dict, error: type[Exception] = ValueError) -> dict:
    """{case: (message, seconds)}: each call of `cases` ({name: callable}) must raise `error`; for rank functions
    checking that every rank raises the same error, and soon."""
    results = {}
    for name, call in cases.items():
        start = time.monotonic()
        with pytest.raises(error) as err:
            call()
        results[name] = (str(err.value), time.monotonic() - start)
    return results
