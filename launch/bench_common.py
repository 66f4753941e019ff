"""Helpers of the launch/ scripts: timing, peak memory, FLOPs, random inputs, the env record, JSON and markdown.

Scripts in launch/ import it as a sibling module (`from bench_common import ...`): running
`python3 launch/<name>.py` puts launch/ first on sys.path.
On a GPU, times are triton.testing.do_bench medians; on the CPU (the Triton interpreter, for dry
runs at tiny sizes) they are perf_counter medians of a few calls and peak memory is not measured.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CPU_REPEATS = 1  # timed calls per measurement in the interpreter: dry runs check that a script works, not speed


def script_parser(doc: str, tiny: dict) -> argparse.ArgumentParser:
    """A parser described by doc's first line, showing defaults, with a --tiny flag for `tiny`'s CPU sizes."""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--tiny", action="store_true", help=f"CPU dry-run defaults: {tiny}")
    return parser


def parse_with_tiny(parser: argparse.ArgumentParser, tiny: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse argv (default: the command line); with --tiny, `tiny` replaces the defaults (given arguments win)."""
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**tiny)
    return parser.parse_args(argv)


def attention_inputs(
    batch: int,
    seqlen: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, dout: q and dout (B, S, H, D), k and v (B, S, Hkv, D), standard normal drawn in fp32 on the CPU
    from `seed` (the same numbers on every rank and device), then rounded to `dtype` on `device`."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(batch, seqlen, h, head_dim, generator=gen).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return q, k, v, dout


def env_record(device: torch.device, **extra) -> dict:
    """{"kind": "env", gpu, torch, triton, cuda, python, **extra}; gpu is None on the CPU."""
    return dict(
        kind="env",
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        **extra,
    )


def time_ms(fn: Callable, warmup: int, rep: int) -> float:
    """Median milliseconds of fn(): do_bench(warmup, rep) on a GPU; on the CPU the median of CPU_REPEATS
    calls (warmup, rep ignored)."""
    if torch.cuda.is_available():
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return host_median_s(fn, CPU_REPEATS) * 1e3


def host_median_s(fn: Callable, calls: int) -> float:
    """Median seconds of `calls` calls of fn(), each timed on the host by perf_counter (no device synchronisation:
    for host-side work, or work that waits for the device itself)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_measuring_peak(fn: Callable, device: torch.device):
    """(fn(), peak bytes allocated during the call above what was allocated before it); None on the CPU."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, int(torch.cuda.max_memory_allocated(device) - before)


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, mode: str) -> float:
    """FLOPs of self-attention (Sq = Sk = seqlen) by shared/BENCHMARKING.md: forward 4 B H S^2 D, halved
    for causal; "bwd" 2.5x and "fwd+bwd" 3.5x the forward."""
    fwd = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def write_json(path: str | None, env: dict, records: list[dict]) -> None:
    """Write [env, *records] to path (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump([env, *records], f, indent=1)


def markdown_table(head: list[str], rows: list[list]) -> str:
    """A markdown table; cells are printed with str()."""
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
