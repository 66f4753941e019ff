"""Weak scaling of ring attention over W GPUs against one GPU and PyTorch's context parallel.

    bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py                # W = all GPUs (8 on an x8 machine)
    NPROC=4 bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py        # W = 4; NPROC=1, 2 likewise
    bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py --longest      # longest causal sequence on W GPUs
    NPROC=1 bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py --longest  # ... and on one GPU
    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py --out /tmp/ws.json  # CPU dry run
    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py --longest --out /tmp/longest.json
    bash launch/torchrun.sh launch/bench/bench_ring_weak_scaling.py --window 4096 --kv-heads 8  # a sliding window

Sweep (defaults on GPUs; CPU ranks run the same at S_local in (8, 16, 32), H = 2, Hkv in (2, 1), D = 16, fp32):
for S_local in --seqlens-local (4096 8192 16384 32768 tokens per rank), Hkv in --kv-heads (32, 8: GQA), H = 32,
D = 128, B = 1, bf16, every rank holding S_local of one global sequence of S = W S_local tokens, cases
(layout, causal) = (zigzag, causal), (contiguous, causal), (contiguous, non-causal), modes fwd and fwd+bwd:
- ringattn: ringattn.ring_attn_func on this rank's shard of the global q, k, v in the case's layout.
- torch_cp_cudnn, torch_cp_flash: torch.distributed.tensor.experimental.context_parallel over a 1-D DeviceMesh of the
  W ranks, given the full global q, k, v, dout (transposed to (B, H, S, D)) as buffers, which it shards in place,
  then F.scaled_dot_product_attention under sdpa_kernel([CUDNN_ATTENTION]) or ([FLASH_ATTENTION]). Load balancing
  on for causal (torch's head-tail split: rank r holds chunks r and 2W - 1 - r, the zigzag layout) and off without a
  mask (torch refuses it there), so its records carry layout zigzag (causal) or contiguous (non-causal).
  GQA (--torch-cp-gqa): "repeat" (default) repeats the K/V heads to H before sharding, as torchtitan does, so H heads
  travel its ring; "native" passes Hkv heads with enable_gqa=True, which a backend may refuse. If the API is missing
  or a call fails on any rank, the records of that provider and case carry "error" and the sweep goes on. On CPU
  ranks both fail: there is no cuDNN attention, and DTensor has no rule for the CPU flash kernel (it spends ~16 s
  per shape before saying so: leave torch_cp_flash out of CPU dry runs with --providers).
- single_gpu: on rank 0 only (the others wait at a barrier), ringattn.flash_attn_func over the whole global
  sequence, same H, Hkv, causal setting and mode: T1. Above --t1-max-seqlen (131072), or when it runs out of
  memory, T1 is extrapolated from the two longest measured S of the same (Hkv, causal, mode) by t = a + b S^2 (none
  when fewer than two were measured or the longer was not slower), and the record says t1_extrapolated: true.

--window LEFT: a causal sliding window of LEFT keys back (flash-attn's window_size (LEFT, 0)) in every call, the causal
cases only, ringattn and single_gpu only (SDPA takes no window, so torch CP is left out); records carry window
[LEFT, 0], FLOPs are counted over the visible pairs, and --out defaults to ring_weak_scaling_window{LEFT}.json. Its
efficiency says whether a windowed ring costs what the window costs: the ring sends only the window's rows, one
hop (ringattn.parallel.ring_streams).

Efficiency = T1 / (W x T), T the provider's time on W ranks (the slowest rank's median), T1 of the same (S, Hkv,
causal, mode): 1 means the W GPUs together do the whole sequence as fast as one GPU alone would, i.e. perfect
weak scaling. Zigzag causal and torch CP causal share T1 with contiguous causal.

Checked before timing, on every rank (the worst rank decides): out and dq of one forward+backward against
flash_attn_func over this rank's query rows, run by contiguous runs of rows against the whole K/V (causal: the keys
up to each run's end); relative L2 error < 1e-2, else the case is recorded with "error" and not timed (the script
then exits with status 1 if it is a ringattn case). dk and dv, which gather every rank's queries, are checked by
launch/ring_check.py and the test suite instead.

Timing (every rank runs the same measurement with the same call counts, because each call is collective): one
first call (compilation; its peak memory above what was allocated before it: peak_bytes, the largest over the
ranks), one call to estimate its time (the slowest rank's; none when --warmup-ms and --rep-ms are both 0, the
CPU's default), --warmup-ms of untimed calls, a barrier, then --rep-ms of back-to-back calls (1 to 100) timed with
CUDA events; ms is the slowest rank's median. Not
triton.testing.do_bench: it picks its repetition count from each rank's own estimate, and ranks making different
numbers of ring calls would hang. fwd runs under torch.no_grad; fwd+bwd takes the gradients of q, k and v with
torch.autograd.grad. tflops: the global FLOPs (counted as docs/performance.md does) / W / ms, per GPU.

Output (rank 0): a line per measurement, a markdown table, a PNG per Hkv beside --out ({stem}_hkv{Hkv}.png:
efficiency vs S_local, a panel per mode and case, a line per provider and W; none without matplotlib), and --out
(default docs/benchmarks/ring_weak_scaling.json; _cpu on CPU ranks), written after every S_local: a JSON list of env
records (kind "env": gpu, torch, triton, cuda, nccl, W, options, skipped cells) and records with keys provider, W,
S_local, S, H, Hkv, D, layout, causal, mode, ms, efficiency, t1_extrapolated, tflops, peak_bytes, reps, check_error,
error (when it failed) or note (single_gpu, why T1 was not measured). Records of other W already in --out are kept
and this run's W replaces its own, so the runs at W = 1, 2, 4, 8 fill one file.

Time: --budget-s (420) bounds the sweep: before each block of measurements the ranks compare the elapsed time,
and past the budget the remaining blocks are skipped with a printed note (listed under "skipped" in the env record).
Measured: the whole default sweep in 104 to 137 s at W = 2 and 183 s at W = 4 (H200s), plus about 20 s of
start-up. Estimated from those: about 4 to 5 minutes at W = 8, plus start-up and compilation.

--longest: the longest global causal sequence whose forward+backward of ring_attn_func runs on
the W ranks (zigzag, B = 1, H = --heads, Hkv = the first --kv-heads, D = --head-dim), and with W = 1 also of
flash_attn_func on the one GPU (provider single_gpu): launch/bench/longest_sequence.py's search (doubling from
--start-seqlen, bisection, every rank catching torch.OutOfMemoryError and the ranks all-reducing the outcome,
caching allocator capped at --memory-fraction, --budget-s 330 shared by the providers, a trial predicted to end
past it not started, a memory-bound estimate from the peak memory of the two longest fits; the ranks allocate the
same, so they run out of memory together, not one alone inside the ring). Each trial allocates
its random inputs inside the timed step (< 1% of a step at these lengths). Output: a markdown table and --out
(default docs/benchmarks/ring_longest_{device}_w{W}.json, device cpu or the GPU's model) as longest_sequence.py
writes them. Measured at W = 4: 2M tokens at 85 s a step, then the budget; estimated: W = 8 stops on the budget
near 4M tokens.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import cache, partial
from itertools import product
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import longest_sequence as ls  # noqa: E402 (beside this script in launch/bench/)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import ringattn  # noqa: E402
from ringattn.benchmark import (  # noqa: E402
    DTYPES,
    attention_flops,
    device_tag,
    env_record,
    head_dim_problems,
    host_median_s,
    markdown_table,
    run_measuring_peak,
    write_json,
)
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.parallel import shard_indices, shard_ranges  # noqa: E402

CASES = (("zigzag", True), ("contiguous", True), ("contiguous", False))  # (layout, causal) of the ring
MODES = ("fwd", "fwd+bwd")
TORCH_CP = {"torch_cp_cudnn": SDPBackend.CUDNN_ATTENTION, "torch_cp_flash": SDPBackend.FLASH_ATTENTION}
PROVIDERS = ("single_gpu", "ringattn", *TORCH_CP)
MAX_RELATIVE_ERROR = 1e-2
MAX_CALLS = 100  # timed (and warm-up) calls per measurement at most
PROVIDER_COLORS = {"ringattn": "C0", "torch_cp_cudnn": "C1", "torch_cp_flash": "C2"}
WORLD_SIZE_STYLES = ["-o", "--s", ":^", "-.D"]  # line and marker of the 1st, 2nd, ... W in the plot
OPTIONS_RECORDED = ("seqlens_local", "kv_heads", "t1_max_seqlen", "torch_cp_gqa", "warmup_ms", "rep_ms", "budget_s",
                    "providers", "window")  # fmt: skip
LONGEST_OPTIONS_RECORDED = ("start_seqlen", "max_seqlen", "bisect_steps", "budget_s", "memory_fraction")


def parse_args(world_size: int, on_gpu: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Weak scaling of ring attention on W ranks against one GPU and PyTorch's context parallel.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    seqlens_local = [4096, 8192, 16384, 32768] if on_gpu else [8, 16, 32]
    p.add_argument("--seqlens-local", type=int, nargs="+", default=seqlens_local, help="S_local, tokens per rank")
    p.add_argument("--heads", type=int, default=32 if on_gpu else 2)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[32, 8] if on_gpu else [2, 1])
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 16)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16" if on_gpu else "fp32")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--t1-max-seqlen", type=int, default=131072 if on_gpu else 32, help="longer T1: extrapolated")
    p.add_argument("--torch-cp-gqa", choices=("repeat", "native"), default="repeat", help="torch CP with Hkv < H")
    p.add_argument("--warmup-ms", type=float, default=100.0 if on_gpu else 0.0, help="untimed calls per measurement")
    p.add_argument("--rep-ms", type=float, default=500.0 if on_gpu else 0.0, help="timed calls per measurement")
    p.add_argument("--budget-s", type=float, default=None, help="default 420 (sweep), 330 (--longest)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=None, metavar="LEFT", help="a causal sliding window (LEFT, 0)")
    p.add_argument("--out", type=Path, default=None, help="JSON (default under docs/benchmarks/, see the docstring)")
    p.add_argument("--longest", action="store_true", help="search the longest sequence instead of the sweep")
    p.add_argument("--start-seqlen", type=int, default=(65536 if on_gpu else 16) * world_size, help="--longest")
    p.add_argument("--max-seqlen", type=int, default=2**25 if on_gpu else 64 * world_size, help="--longest")
    p.add_argument("--bisect-steps", type=int, default=4, help="--longest: bisections of the bracket")
    p.add_argument("--memory-fraction", type=float, default=0.95, help="--longest: of each GPU, for the allocator")
    args = p.parse_args()
    args.dtype = DTYPES[args.dtype]
    multiple = 2 * world_size  # zigzag
    args.max_seqlen = max(args.max_seqlen // multiple * multiple, multiple)
    args.start_seqlen = min(max(args.start_seqlen // multiple * multiple, multiple), args.max_seqlen)
    if args.budget_s is None:
        args.budget_s = 330.0 if args.longest else 420.0
    if args.out is None:
        device = device_tag(torch.device("cuda" if on_gpu else "cpu"))
        sweep = "ring_weak_scaling" + ("" if args.window is None else f"_window{args.window}")
        args.out = Path(f"docs/benchmarks/ring_longest_{device}_w{world_size}.json" if args.longest else
                        f"docs/benchmarks/{sweep}" + ("" if on_gpu else "_cpu") + ".json")  # fmt: skip
    problems = []
    if min(args.seqlens_local) <= 0 or any(s % 2 for s in args.seqlens_local):
        problems.append("--seqlens-local must be positive and even (zigzag)")
    if min(args.heads, *args.kv_heads) <= 0 or any(args.heads % h for h in args.kv_heads):
        problems.append(f"--heads {args.heads} must be a positive multiple of every --kv-heads {args.kv_heads}")
    problems += head_dim_problems(args.head_dim)
    if args.dtype == torch.bfloat16 and not on_gpu:
        problems.append("--dtype bf16 needs a GPU: Triton's interpreter computes bf16 wrongly; use fp32 or fp16")
    if args.budget_s <= 0 or args.warmup_ms < 0 or args.rep_ms < 0 or args.bisect_steps < 0:
        problems.append("--budget-s must be positive; --warmup-ms, --rep-ms and --bisect-steps not negative")
    if not 0 < args.memory_fraction <= 1:
        problems.append("--memory-fraction must be in (0, 1]")
    if args.window is not None and (args.window < 0 or args.longest):
        problems.append("--window must not be negative, and is not for --longest")
    exit_on_bad_arguments(p, problems)
    return args


# ---- measurement, the same on every rank ----


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def median_ms(fn: Callable, device: torch.device, n: int) -> float:
    """Median milliseconds of n back-to-back fn() calls: CUDA events, one synchronisation at the end; on the CPU
    ringattn.benchmark.host_median_s."""
    if device.type != "cuda":
        return host_median_s(fn, n) * 1e3
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure(fn: Callable, device: torch.device, warmup_ms: float, rep_ms: float, collective: bool = True) -> dict:
    """{"ms": median of the timed calls, "peak_bytes", "reps"} of fn() (module docstring, Timing). collective: every
    rank calls it, with the same call counts, and gets the slowest rank's ms and the largest peak; else one rank."""
    reduce = partial(max_over_ranks, device=device) if collective else float
    _, peak = run_measuring_peak(fn, device)  # the first call compiles
    reps = 1
    if warmup_ms > 0 or rep_ms > 0:  # with neither, one timed call: no estimate needed
        estimate = max(reduce(median_ms(fn, device, 1)), 1e-6)
        reps = max(1, min(int(rep_ms / estimate), MAX_CALLS))
        for _ in range(min(int(warmup_ms / estimate), MAX_CALLS)):
            fn()
    if collective:
        dist.barrier()
    ms = reduce(median_ms(fn, device, reps))
    return dict(ms=ms, peak_bytes=None if peak is None else int(reduce(peak)), reps=reps)


def agreed(fn: Callable):
    """fn() on every rank, any exception caught: (this rank's result, None) when no rank raised, else
    (None, what each rank that raised said), the same on every rank."""
    try:
        result, error = fn(), None
    except Exception as err:  # noqa: BLE001 - a provider that fails is recorded, not fatal
        result, error = None, f"{type(err).__name__}: {str(err)[:300]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
    return (None, failed) if failed else (result, None)


def over_budget(started: float, budget_s: float, device: torch.device) -> bool:
    return max_over_ranks(time.perf_counter() - started, device) > budget_s


# ---- inputs, calls and the check ----


def global_inputs(seqlen: int, kv_heads: int, args, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, dout (1, S, H, D) and k, v (1, S, Hkv, D), standard normal, from a seeded generator on the device: the
    same global tensors on every rank."""
    gen = torch.Generator(device=device).manual_seed(args.seed + seqlen + kv_heads)
    heads = (args.heads, kv_heads, kv_heads, args.heads)
    return tuple(
        torch.randn(1, seqlen, h, args.head_dim, generator=gen, device=device, dtype=args.dtype) for h in heads
    )


def attention_calls(attention: Callable, q, k, v, dout) -> dict[str, Callable]:
    """{mode: closure} over attention(q, k, v) -> out (B, S, H, D): "fwd" -> out, without autograd; "fwd+bwd" ->
    (out, dq), the gradients of q, k and v taken with torch.autograd.grad (dk, dv dropped)."""
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return attention(q, k, v)

    def fwd_bwd():
        out = attention(*leaves)
        dq, _, _ = torch.autograd.grad(out, leaves, dout)
        return out, dq

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def reference_shard(
    q, k, v, dout, rank: int, world_size: int, layout: str, causal: bool, window: int | None = None
) -> tuple[torch.Tensor, ...]:
    """(out, dq), (1, S_local, H, D): this rank's query rows (its shard in `layout`) of attention over the global
    q, k, v (1, S, ., D), by flash_attn_func per contiguous run of the shard's rows against all keys (causal: the
    keys up to the run's end; the kernel's causal mask is bottom-right aligned, so row i of a run ending at global
    position e sees the keys up to e - len(run) + i). With a causal `window` of that many keys back, the keys from
    window before the run's start, under the same window (bottom-right aligned too)."""
    seqlen = q.shape[1]
    idx = shard_indices(seqlen, rank, world_size, layout, device=q.device)
    q_local = q.index_select(1, idx).requires_grad_()  # (1, S_local, H, D)
    outs, row = [], 0
    for run in shard_ranges(seqlen, rank, world_size, layout):
        first, keys = (0, run.stop if causal else seqlen) if window is None else (max(run.start - window, 0), run.stop)
        options = dict(causal=causal) if window is None else dict(causal=True, window_size=(window, 0))
        outs.append(ringattn.flash_attn_func(q_local[:, row : row + len(run)], k[:, first:keys], v[:, first:keys],
                                             **options))  # fmt: skip
        row += len(run)
    out = torch.cat(outs, dim=1)  # (1, S_local, H, D)
    (dq,) = torch.autograd.grad(out, q_local, dout.index_select(1, idx))
    return out.detach(), dq


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of x against ref, in fp32."""
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def check_error(fwd_bwd: Callable, expected: tuple[torch.Tensor, torch.Tensor]) -> float:
    """The larger relative L2 error of out and dq from fwd_bwd() against expected (out, dq)."""
    out, dq = fwd_bwd()
    return max(relative_error(out, expected[0]), relative_error(dq, expected[1]))


# ---- providers ----


def bench_provider(provider: str, calls: dict, expected, cell: dict, layout: str, causal: bool, args, env) -> list:
    """Records of one provider in one case, a mode each: checked against `expected` (reference_shard), then timed.
    A check over MAX_RELATIVE_ERROR on any rank, or an exception on any rank, gives records with "error"."""
    base = dict(provider=provider, **cell, layout=layout, causal=causal)
    local_error, failure = agreed(partial(check_error, calls["fwd+bwd"], expected))
    failure = failure and f"check (one forward+backward): {failure}"
    error = max_over_ranks(local_error if failure is None and math.isfinite(local_error) else math.inf, env.device)
    if failure is None and not error < MAX_RELATIVE_ERROR:
        failure = f"relative L2 error of out or dq against flash_attn_func on the rank's rows: {error:.3g}"
    error = error if math.isfinite(error) else None
    if failure is not None:
        records = error_records(provider, cell, layout, causal, failure)
    else:
        records = []
        for mode in MODES:
            result, failure = agreed(partial(measure, calls[mode], env.device, args.warmup_ms, args.rep_ms))
            records.append(dict(base, mode=mode, **(result or dict(ms=None, error=failure))))
    for r in records:
        r["check_error"] = error
        log_record(r)
    return records


def bench_ringattn(cell: dict, tensors, layout: str, causal: bool, reference: Callable, args, env) -> list[dict]:
    """ringattn.ring_attn_func on this rank's shard in `layout`."""
    seqlen, world_size = cell["S"], cell["W"]
    idx = shard_indices(seqlen, env.rank, world_size, layout, device=env.device)
    q, k, v, dout = (t.index_select(1, idx) for t in tensors)  # (1, S_local, ., D)
    attention = partial(ringattn.ring_attn_func, causal=causal, layout=layout, window_size=_window_size(cell))
    calls = attention_calls(attention, q, k, v, dout)
    return bench_provider("ringattn", calls, reference(layout, causal), cell, layout, causal, args, env)


def torch_cp_setup(device: torch.device):
    """(context_parallel, its options object, a 1-D DeviceMesh over the world). Raises if the API is missing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options

    return context_parallel, _cp_options, init_device_mesh(device.type, (dist.get_world_size(),))


def bench_torch_cp(provider: str, cell: dict, tensors, causal: bool, reference, torch_cp, args, env) -> list[dict]:
    """PyTorch's context parallel with the provider's SDPA backend (module docstring); torch_cp: torch_cp_setup()'s
    result, or why it failed."""
    layout = "zigzag" if causal else "contiguous"  # torch's head-tail load balancing is the zigzag layout
    if isinstance(torch_cp, str):
        return error_records(provider, cell, layout, causal, torch_cp)
    context_parallel, cp_options, mesh = torch_cp
    q, k, v, dout = tensors
    native_gqa = args.torch_cp_gqa == "native"
    if not native_gqa:
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))  # (1, S, H, D)
    buffers = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]  # (1, H, S, D): sharded along dim 2

    def attention(q, k, v):  # (B, S_local, ., D) views -> out (B, S_local, H, D)
        with sdpa_kernel([TORCH_CP[provider]]):  # F.scaled_dot_product_attention is patched inside the context
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=native_gqa
            )  # (B, H, S_local, D)
        return out.transpose(1, 2)

    def run() -> list[dict]:
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
            shards = (b.transpose(1, 2) for b in buffers)  # this rank's q, k, v, dout: (1, S_local, ., D) views
            calls = attention_calls(attention, *shards)
            return bench_provider(provider, calls, reference(layout, causal), cell, layout, causal, args, env)

    previous = cp_options.enable_load_balance
    cp_options.enable_load_balance = causal  # torch refuses load balancing without a causal mask
    try:
        records, failure = agreed(run)
    finally:
        cp_options.enable_load_balance = previous
    return records if failure is None else error_records(provider, cell, layout, causal, failure)


def _window_size(cell: dict) -> tuple[int, int]:
    """flash-attn's window_size of a cell's calls: its window, or (-1, -1)."""
    return tuple(cell.get("window", (-1, -1)))


def error_records(provider: str, cell: dict, layout: str, causal: bool, error: str) -> list[dict]:
    """A record per mode of a provider that failed in one case, with no time."""
    return [dict(provider=provider, **cell, layout=layout, causal=causal, mode=m, ms=None, error=error) for m in MODES]


def bench_single_gpu(cell: dict, tensors, causal: bool, args, env) -> list[dict]:
    """T1 on rank 0: flash_attn_func over the whole sequence, each mode; ms None (and a note) above
    --t1-max-seqlen or out of memory. The other ranks wait at a barrier and return no records."""
    records = []
    if env.is_main:
        calls = attention_calls(partial(ringattn.flash_attn_func, causal=causal, window_size=_window_size(cell)),
                                *tensors)  # fmt: skip
        for mode in MODES:
            rec = dict(provider="single_gpu", **cell, layout=None, causal=causal, mode=mode, ms=None, peak_bytes=None)
            if cell["S"] > args.t1_max_seqlen:
                rec["note"] = f"S over --t1-max-seqlen {args.t1_max_seqlen}"
            else:
                try:
                    rec.update(measure(calls[mode], env.device, args.warmup_ms, args.rep_ms, collective=False))
                except torch.OutOfMemoryError:
                    rec["note"] = "out of memory"
                    ls.free_memory(env.device)
            records.append(rec)
            log_record(rec)
    dist.barrier()
    return records


# ---- T1, efficiency, output ----


def extrapolate_s2(points: dict[int, float], seqlen: int) -> float | None:
    """Time at `seqlen` by t = a + b S^2 through the two longest of `points` ({S: ms}); None with fewer than two
    points or when the longer one is not the slower."""
    if len(points) < 2:
        return None
    (s1, t1), (s2, t2) = sorted(points.items())[-2:]
    slope = (t2 - t1) / (s2**2 - s1**2)
    return t2 + slope * (seqlen**2 - s2**2) if slope > 0 else None


def with_efficiency(records: list[dict]) -> list[dict]:
    """Copies of one run's records with T1 completed and efficiencies set (module docstring): single_gpu records
    without ms get extrapolate_s2's (t1_extrapolated true); every other record with ms gets efficiency =
    T1 / (W x ms) and the t1_extrapolated of its T1 (None both when there is no T1); every record with ms gets
    tflops per GPU."""
    records = [dict(r) for r in records]

    def key(r: dict, *fields: str) -> tuple:
        return (*(r[f] for f in ("W", "H", "Hkv", "D", "causal", "mode", *fields)), tuple(r.get("window", ())))

    measured: dict[tuple, dict[int, float]] = {}
    for r in records:
        if r["provider"] == "single_gpu" and r["ms"] is not None:
            measured.setdefault(key(r), {})[r["S"]] = r["ms"]
    t1 = {}
    for r in records:
        if r["provider"] == "single_gpu":
            r["t1_extrapolated"] = r["ms"] is None
            if r["ms"] is None:
                r["ms"] = extrapolate_s2(measured.get(key(r), {}), r["S"])
            t1[key(r, "S")] = r
    for r in records:
        gpus = 1 if r["provider"] == "single_gpu" else r["W"]
        r["tflops"] = None
        if r["ms"] is not None:
            window = tuple(r.get("window", (None, None)))
            flops = attention_flops(1, r["H"], r["S"], r["D"], r["causal"], r["mode"], window)
            r["tflops"] = flops / gpus / r["ms"] / 1e9
        if r["provider"] != "single_gpu":
            base = t1.get(key(r, "S"))
            ok = base is not None and base["ms"] is not None and r["ms"] is not None
            r["efficiency"] = base["ms"] / (r["W"] * r["ms"]) if ok else None
            r["t1_extrapolated"] = base["t1_extrapolated"] if ok else None
        else:
            r["efficiency"] = None
    return records


def save(path: Path, env_rec: dict, records: list[dict]) -> list[dict]:
    """Write env_rec and this run's records (with_efficiency) to `path`, keeping the entries of other W already
    there; returns every record in the file (env records left out)."""
    others = []
    if path.exists():
        others = [r for r in json.loads(path.read_text()) if r.get("W") != env_rec["W"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(str(path), env_rec, [*others, *with_efficiency(records)])
    return [r for r in json.loads(path.read_text()) if r.get("kind") != "env"]


def log_record(r: dict) -> None:
    what = f"{r['provider']:15} S_local={r['S_local']:>6} Hkv={r['Hkv']:>3} {r['layout'] or '-':10} "
    what += f"causal={r['causal']!s:5} {r['mode']:8}"
    outcome = r.get("error") or r.get("note") or f"{r['ms']:10.3f} ms"
    log(what + " " + outcome)


TABLE_HEAD = ["S_local", "S", "Hkv", "layout", "causal", "mode", "T1 ms", "ringattn ms", "ringattn eff",
              "cp cuDNN ms", "cp cuDNN eff", "cp flash ms", "cp flash eff"]  # fmt: skip


def table(records: list[dict]) -> str:
    """A row per ringattn (S_local, Hkv, layout, causal, mode): T1 (* extrapolated), then ms and efficiency of
    ringattn and of torch CP where it ran the same layout (zigzag causal, contiguous non-causal)."""
    by_key = {(r["provider"], r["S_local"], r["Hkv"], r["layout"], r["causal"], r["mode"]): r for r in records}

    def ms(r: dict | None) -> str:
        if r is None:
            return "-"
        if r["ms"] is None:
            return "error" if "error" in r else "-"
        return f"{r['ms']:.2f}" + ("*" if r["provider"] == "single_gpu" and r["t1_extrapolated"] else "")

    def eff(r: dict | None) -> str:
        return "-" if r is None or r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"

    rows = []
    for (provider, s_local, kv_heads, layout, causal, mode), r in by_key.items():
        if provider == "ringattn":
            t1 = by_key.get(("single_gpu", s_local, kv_heads, None, causal, mode))
            cp = [by_key.get((p, s_local, kv_heads, layout, causal, mode)) for p in TORCH_CP]
            rows.append([s_local, r["S"], kv_heads, layout, "yes" if causal else "no", mode, ms(t1), ms(r), eff(r),
                         ms(cp[0]), eff(cp[0]), ms(cp[1]), eff(cp[1])])  # fmt: skip
    rows.sort(key=lambda row: (row[0], -row[2], row[3] == "contiguous", row[4] == "no", row[5]))
    return markdown_table(TABLE_HEAD, rows)


def plot(records: list[dict], out: Path) -> list[Path]:
    """A PNG per Hkv beside `out`: efficiency vs S_local, a panel per (mode, case), a line per (provider, W)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return []
    records = [r for r in records if r.get("efficiency") is not None]
    world_sizes, seqlens = sorted({r["W"] for r in records}), sorted({r["S_local"] for r in records})
    top = max(1.1, 1.05 * max((r["efficiency"] for r in records), default=1.0))
    cases = [c for c in CASES if any((r["layout"], r["causal"]) == c for r in records)]
    paths = []
    for kv_heads in sorted({r["Hkv"] for r in records}):
        fig, axes = plt.subplots(len(MODES), len(cases), figsize=(15, 7), sharex=True, sharey=True, squeeze=False)
        for (i, mode), (j, (layout, causal)) in product(enumerate(MODES), enumerate(cases)):
            lines: dict = {}
            for r in records:
                if (r["Hkv"], r["mode"], r["layout"], r["causal"]) == (kv_heads, mode, layout, causal):
                    lines.setdefault((r["provider"], r["W"]), []).append((r["S_local"], r["efficiency"]))
            ax = axes[i][j]
            for (provider, world_size), points in sorted(lines.items()):
                xs, ys = zip(*sorted(points), strict=True)
                style = WORLD_SIZE_STYLES[world_sizes.index(world_size) % len(WORLD_SIZE_STYLES)]
                ax.plot(xs, ys, style, color=PROVIDER_COLORS[provider], label=f"{provider} W={world_size}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_ylim(0, top)
            ax.axhline(1.0, color="gray", linewidth=0.5)
            ax.set_title(f"{mode}, {layout}, {'causal' if causal else 'non-causal'}", fontsize=9)
            if lines:
                ax.legend(fontsize=7)
            axes[-1][j].set_xlabel("S_local (tokens per rank)")
            axes[i][0].set_ylabel("efficiency T1 / (W T)")
        r = records[0]
        window = f", window ({r['window'][0]}, 0)" if "window" in r else ""
        fig.suptitle(f"Ring attention weak scaling: H = {r['H']}, Hkv = {kv_heads}, D = {r['D']}{window}")
        fig.tight_layout()
        path = out.with_name(f"{out.stem}_hkv{kv_heads}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---- the two modes ----


def bench_cell(cell: dict, torch_cp, args, env, started: float, skipped: list[str]) -> list[dict]:
    """Records of one (S_local, Hkv) cell, measured in blocks: T1 per causal setting, ringattn per case, torch CP
    per provider and causal setting (sharing one cache of reference_shard per (layout, causal)). A block that
    would start past the budget is skipped, with a note and its name appended to `skipped`."""
    tensors = global_inputs(cell["S"], cell["Hkv"], args, env.device)
    reference = cache(partial(reference_shard, *tensors, env.rank, env.world_size, window=args.window))
    cases = cases_of(args)
    blocks = [(f"single_gpu causal={c}", partial(bench_single_gpu, cell, tensors, c, args, env))
              for c in sorted({c for _, c in cases}, reverse=True) if "single_gpu" in args.providers]  # fmt: skip
    blocks += [(f"ringattn {lay} causal={c}", partial(bench_ringattn, cell, tensors, lay, c, reference, args, env))
               for lay, c in cases if "ringattn" in args.providers]  # fmt: skip
    blocks += [(f"{p} causal={c}", partial(bench_torch_cp, p, cell, tensors, c, reference, torch_cp, args, env))
               for p, c in product(TORCH_CP, (True, False)) if p in args.providers]  # fmt: skip
    records = []
    for name, block in blocks:
        what = f"S_local={cell['S_local']} Hkv={cell['Hkv']} {name}"
        if over_budget(started, args.budget_s, env.device):
            skipped.append(what)
            log(f"budget of {args.budget_s:.0f} s spent: skipping {what}")
        else:
            records += block()
    return records


def cases_of(args) -> tuple[tuple[str, bool], ...]:
    """The (layout, causal) cases of a sweep: CASES, or with --window the causal ones."""
    return CASES if args.window is None else tuple(c for c in CASES if c[1])


def weak_scaling(args, env, started: float) -> int:
    if args.window is not None and any(p in TORCH_CP for p in args.providers):
        args.providers = [p for p in args.providers if p not in TORCH_CP]
        log("--window: torch CP left out (SDPA takes no sliding window)")
    torch_cp = None
    if any(p in TORCH_CP for p in args.providers):
        torch_cp, failure = agreed(partial(torch_cp_setup, env.device))
        torch_cp = failure if failure is not None else torch_cp
    env_rec = env_record(
        env.device, W=env.world_size, backend=env.backend, nccl=nccl_version(env),
        dtype=str(args.dtype).removeprefix("torch."), H=args.heads, D=args.head_dim,
        options={k: getattr(args, k) for k in OPTIONS_RECORDED}, skipped=[],
    )  # fmt: skip
    window = "" if args.window is None else f", window ({args.window}, 0)"
    log(
        f"weak scaling: W = {env.world_size} ({env.backend}, {env.device.type}), S_local {args.seqlens_local}, H "
        f"{args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, {env_rec['dtype']}{window}; "
        f"budget {args.budget_s:.0f} s"
    )
    records: list[dict] = []
    for s_local in args.seqlens_local:
        for kv_heads in args.kv_heads:
            cell = dict(W=env.world_size, S_local=s_local, S=env.world_size * s_local, H=args.heads, Hkv=kv_heads,
                        D=args.head_dim, **({} if args.window is None else dict(window=[args.window, 0])))  # fmt: skip
            records += bench_cell(cell, torch_cp, args, env, started, env_rec["skipped"])
            ls.free_memory(env.device)  # the cell's global tensors
        if env.is_main:
            env_rec["elapsed_s"] = round(time.perf_counter() - started, 1)
            saved = save(args.out, env_rec, records)
    if env.is_main:
        log(table(with_efficiency(records)))
        if env_rec["skipped"]:
            log(f"{len(env_rec['skipped'])} blocks skipped (budget); see 'skipped' in the env record")
        paths = plot(saved, args.out)
        log(f"wrote {args.out}" + "".join(f", {p}" for p in paths) + f" ({env_rec['elapsed_s']:.0f} s)")
    failed = [r for r in records if r["provider"] == "ringattn" and "error" in r]
    if failed:
        log(f"{len(failed)} ringattn records failed their check or raised: not timed")
    return 1 if failed else 0


class AttentionRunner:
    """longest_sequence.search's runner for bare attention: trial(S) times one forward+backward at global length S,
    B = 1, causal: of ring_attn_func (zigzag, each rank S / W tokens) or, for single_gpu, of flash_attn_func."""

    memory_exponent = 1  # peak memory ~ a + b S: no S x S matrix

    def __init__(self, provider: str, args, sp: ringattn.SequenceParallel, device: torch.device):
        self.provider, self.args, self.sp, self.device, self.warm = provider, args, sp, device, False

    def _step(self, seqlen_local: int) -> None:
        shape = (1, seqlen_local, self.args.heads, self.args.head_dim)  # (B, S_local, H, D); k, v with Hkv heads
        kv_shape = (*shape[:2], self.args.kv_heads[0], shape[3])
        q, k, v, dout = (
            torch.randn(s, device=self.device, dtype=self.args.dtype) for s in (shape, kv_shape, kv_shape, shape)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if self.provider == "ringattn":
            out = ringattn.ring_attn_func(q, k, v, causal=True, layout="zigzag")
        else:
            out = ringattn.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    def trial(self, seqlen: int) -> ls.Trial:
        t = ls.agreed_trial(seqlen, self.device, partial(self._step, seqlen // self.sp.world_size), self.warm)
        self.warm = self.warm or t.ok
        return t


def longest(args, env, started: float) -> int:
    limit = ls.cap_memory(args.memory_fraction, env.device)
    sp = ringattn.SequenceParallel(layout="zigzag")
    providers = ["single_gpu", "ringattn"] if env.world_size == 1 else ["ringattn"]
    log(
        f"longest: W = {env.world_size} ({env.backend}, {env.device.type}), H {args.heads}, Hkv {args.kv_heads[0]}, "
        f"D {args.head_dim}; S from {args.start_seqlen:,} to at most {args.max_seqlen:,}; budget {args.budget_s:.0f} s"
    )
    make_runner = partial(AttentionRunner, args=args, sp=sp, device=env.device)
    records = ls.search_providers(make_runner, providers, args, limit, started, env.device)
    if env.is_main:
        env_rec = env_record(
            env.device, W=env.world_size, backend=env.backend, nccl=nccl_version(env), H=args.heads,
            Hkv=args.kv_heads[0], D=args.head_dim, dtype=str(args.dtype).removeprefix("torch."),
            memory_limit_bytes=limit, options={k: getattr(args, k) for k in LONGEST_OPTIONS_RECORDED},
            elapsed_s=round(time.perf_counter() - started, 1),
        )  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(str(args.out), env_rec, records)
        log(markdown_table(ls.TABLE_HEAD, [ls.table_row(r) for r in records]))
        log(f"wrote {args.out} ({env_rec['elapsed_s']:.0f} s)")
    return 0


def nccl_version(env) -> str | None:
    return ".".join(map(str, torch.cuda.nccl.version())) if env.backend == "nccl" else None


def main() -> int:
    on_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(world_size, on_gpu)
    env = init_distributed()
    status = (longest if args.longest else weak_scaling)(args, env, time.perf_counter())
    destroy()
    return status


if __name__ == "__main__":
    sys.exit(main())
