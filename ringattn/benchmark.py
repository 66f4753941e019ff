"""Helpers shared by the benchmark and tool scripts in launch/: FLOP counts, timing, peak memory, random
inputs, the environment record, and JSON and markdown writers.

Not imported by `import ringattn`: a script imports it as `from ringattn.benchmark import ...`.
On a GPU, times are triton.testing.do_bench medians; on the CPU (the Triton interpreter, for dry runs at
tiny sizes) they are perf_counter medians and peak memory is not measured.
"""

import argparse
import json
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton
from triton.testing import do_bench

from .ops.validation import MAX_HEAD_DIM

__all__ = [
    "CPU_REPEATS",
    "DTYPES",
    "attention_flops",
    "attention_inputs",
    "device_tag",
    "env_record",
    "environment",
    "head_dim_problems",
    "host_median_s",
    "kept_records",
    "markdown_table",
    "parse_with_tiny",
    "run_measuring_peak",
    "script_parser",
    "time_ms",
    "visible_pairs",
    "write_json",
    "write_records",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # --dtype choices
CPU_REPEATS = 1  # calls per time_ms measurement in the interpreter: dry runs check that a script works, not speed


def head_dim_problems(head_dim: int) -> list[str]:
    """The scripts' complaint about --head-dim where the kernels do not take it (a multiple of 8 from 8 to
    MAX_HEAD_DIM), so that a script names it before it starts ranks or times anything; else none."""
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return [f"--head-dim must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}"]
    return []


def attention_flops(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    causal: bool,
    mode: str,
    window: tuple[int | None, int | None] = (None, None),
) -> float:
    """FLOPs of self-attention over `seqlen` queries and keys: forward 4 B H S^2 D (two matrix products of
    2 S^2 D each per head), halved when causal; with a sliding window (left, right) (None: no limit on that side;
    flash-attn's window_size with -1 as None) 4 B H D times the (query, key) pairs the window leaves visible
    (visible_pairs). Mode "bwd" is 2.5x and "fwd+bwd" 3.5x the forward.

    Returns a float; raises KeyError for another mode, ValueError for a window side below -1."""
    window = _window_sides(window)
    if window == (None, None):
        pairs = seqlen * seqlen * (0.5 if causal else 1.0)
    else:
        pairs = visible_pairs(seqlen, seqlen, causal, window)
    return 4 * batch * heads * pairs * head_dim * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int | None, int | None]) -> int:
    """How many (query, key) pairs a causal flag and a sliding window (left, right) leave visible, bottom-right
    aligned as flash-attn's: row i sees keys j with i + Sk - Sq - left <= j <= i + Sk - Sq + right (None: no limit),
    causal capping right at 0; -1 is no limit too, as in flash-attn's window_size. Counted in O(Sq).

    Raises:
        ValueError: a side below -1."""
    left, right = _window_sides(window)
    if causal:
        right = 0 if right is None else min(right, 0)
    rows = torch.arange(seqlen_q, dtype=torch.int64) + (seqlen_k - seqlen_q)
    first = (rows - left).clamp(min=0) if left is not None else torch.zeros_like(rows)
    last = (rows + right).clamp(max=seqlen_k - 1) if right is not None else torch.full_like(rows, seqlen_k - 1)
    return int((last - first + 1).clamp(min=0).sum())


def _window_sides(window: tuple[int | None, int | None]) -> tuple[int | None, int | None]:
    """(left, right) with flash-attn's -1 as None (no limit); ValueError for a side below -1."""
    if any(side is not None and side < -1 for side in window):
        raise ValueError(f"window sides must be >= 0, or -1 or None for no limit, got {tuple(window)}")
    return tuple(None if side == -1 else side for side in window)


def device_tag(device: torch.device) -> str:
    """The device as record file names carry it: "cpu", or the GPU's model in lower case ("NVIDIA H100 80GB HBM3" ->
    "h100", "NVIDIA H200" -> "h200"; a name without a letters-then-digits word: its last word)."""
    if device.type != "cuda":
        return "cpu"
    words = torch.cuda.get_device_name(device).split()
    model = next((w for w in words if re.fullmatch(r"[A-Za-z]+\d+\w*", w)), words[-1])
    return re.sub(r"[^a-z0-9]+", "_", model.split("-")[0].lower())


def kept_records(path: str | None, env: dict) -> list[dict]:
    """The records of the [env, *records] JSON at `path` that a run appending to it keeps (none if it does not
    exist). Raises ValueError when it was measured in another environment (its env record differs from `env`):
    one file holds one environment's measurements."""
    if path is None:
        return []
    try:
        with open(path) as f:
            old_env, *records = json.load(f)
    except FileNotFoundError:
        return []
    if old_env != env:
        raise ValueError(f"{path} was measured with another environment ({old_env}): write this run to a new file")
    return records


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
    """Returns q, k, v, dout: q and dout (B, S, H, D), k and v (B, S, Hkv, D), standard normal drawn in fp32
    on the CPU from `seed` (the same numbers on every rank and device), then rounded to `dtype` on `device`."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (
        torch.randn(batch, seqlen, h, head_dim, generator=gen).to(device=device, dtype=dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return q, k, v, dout


def environment(device: torch.device, **extra) -> dict:
    """Returns {gpu, torch, triton, cuda, python, **extra}: what a measurement ran on; gpu is None on the CPU."""
    return dict(
        gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        **extra,
    )


def env_record(device: torch.device, **extra) -> dict:
    """Returns {"kind": "env", **environment(device, **extra)}: the first entry of a write_json list."""
    return dict(kind="env", **environment(device, **extra))


def time_ms(fn: Callable, warmup: int, rep: int) -> float:
    """Returns the median milliseconds of fn(): do_bench(fn, warmup, rep) on a GPU; on the CPU the median of
    CPU_REPEATS calls timed by host_median_s (warmup and rep ignored)."""
    if torch.cuda.is_available():
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return host_median_s(fn, CPU_REPEATS) * 1e3


def host_median_s(fn: Callable, calls: int) -> float:
    """Returns the median seconds of `calls` calls of fn(), each timed on the host by perf_counter, with no
    device synchronisation: for host-side work, or work that waits for the device itself."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_measuring_peak(fn: Callable, device: torch.device) -> tuple[object, int | None]:
    """Returns (fn(), peak bytes allocated on `device` during the call above what was allocated before it);
    the peak is None on the CPU."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    result = fn()
    torch.cuda.synchronize(device)
    return result, int(torch.cuda.max_memory_allocated(device) - before)


def write_json(path: str | None, env: dict, records: list[dict]) -> None:
    """Write the list [env, *records] to `path` as JSON (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump([env, *records], f, indent=1)


def write_records(path: str | None, env: dict, records: list[dict], **sections) -> None:
    """Write {"environment": env, "records": records, **sections} to `path` as JSON (nothing when path is None)."""
    if path:
        with open(path, "w") as f:
            json.dump({"environment": env, "records": records, **sections}, f, indent=1)


def markdown_table(head: list[str], rows: list[list]) -> str:
    """Returns a markdown table with header `head` and one line per row; cells are printed with str()."""
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def script_parser(doc: str, tiny: dict) -> argparse.ArgumentParser:
    """Returns a parser described by the first line of `doc`, showing defaults, with a --tiny flag that
    switches to `tiny`'s defaults (CPU dry-run sizes; see parse_with_tiny)."""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--tiny", action="store_true", help=f"CPU dry-run defaults: {tiny}")
    return parser


def parse_with_tiny(parser: argparse.ArgumentParser, tiny: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """Returns parser.parse_args(argv) (argv None: the command line); with --tiny in argv, `tiny` replaces the
    defaults first (arguments given still win)."""
    if "--tiny" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**tiny)
    return parser.parse_args(argv)
