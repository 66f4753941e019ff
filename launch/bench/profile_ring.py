"""One ring forward+backward under torch.profiler: a Chrome trace per rank and how much of the communication
overlaps compute.

    bash launch/torchrun.sh launch/bench/profile_ring.py                                  # all GPUs, NCCL
    NPROC=2 bash launch/torchrun.sh launch/bench/profile_ring.py --seqlen-local 32768 --kv-heads 8
    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/profile_ring.py --out-dir /tmp/prof \
        --summary /tmp/prof/s.json

Every rank draws its own shard of q, k, v, dout (1, S_local, H or Hkv, D) (defaults on GPUs: S_local = 8192, H =
Hkv = 32, D = 128, bf16, zigzag, causal; on CPU ranks 32 tokens, 2 heads of 16, fp32), runs --warmup forward+backward
passes of ringattn.ring_attn_func (the gradients of q, k and v by torch.autograd.grad), then one untraced pass
under a first torch.profiler (its start-up differs between ranks), a barrier, and one traced pass under a
second profiler (CPU and, on GPUs, CUDA activities), whose Chrome trace goes to --out-dir/ring_trace_rank{r}.json
(open it in https://ui.perfetto.dev or chrome://tracing). Each call of the ring's block ops (attn_fwd_merge_, attn_bwd,
attn_bwd_preprocess) runs inside a profiler range named "ringattn.ops.<op>": the trace shows which step launched what.

Overlap summary, from the exported trace's complete ("X") events, per rank:
- communication: on GPUs NCCL's point-to-point kernels (names containing "SendRecv": the barrier's all-reduce
  is not a ring transfer); on CPU ranks the gloo send and receive spans ("gloo:send", "gloo:recv": from a
  batch's start to the end of that transfer, on gloo's threads);
- compute: on GPUs ringattn's Triton kernels, by name (KERNEL_NAME: _attn_<what>_kernel, the forward and the
  backward's preprocess, dK/dV and dQ kernels in every form); on CPU ranks the "ringattn.ops." ranges (the
  interpreter runs the kernels on the host; the custom ops' "ringattn::ring_attn_fwd" ranges span the whole ring
  and are not compute);
- comm_ms and compute_ms, the lengths of the unions of their intervals; overlap_ms, the length of the intersection
  of the two unions; overlap_fraction = overlap_ms / comm_ms; exposed_comm_ms = comm_ms - overlap_ms; span_ms, from
  the first to the last event of either kind.
On GPUs a NCCL kernel's interval includes the time it waits for its peer, so comm_ms is an upper bound on transfer
time. On CPU ranks the interpreter and gloo share the cores: the numbers show that the script works, not overlap.

Output (rank 0): a markdown table, a line per rank, and --summary (default docs/benchmarks/ring_overlap_profile.json,
_cpu on CPU ranks): a JSON list, an env record (kind "env": gpu, torch, triton, cuda, nccl, W, shapes) then one
record per rank (rank, trace, comm_ms, compute_ms, overlap_ms, overlap_fraction, exposed_comm_ms, span_ms,
comm_events, compute_events). Under a minute on GPUs (warm-up compiles the kernels; the trace is a few MB per rank).
"""

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import ringattn  # noqa: E402
import ringattn.functional  # noqa: E402
from ringattn.benchmark import DTYPES, env_record, head_dim_problems, markdown_table, write_json  # noqa: E402
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.ops import AttnOps  # noqa: E402
from ringattn.parallel import LAYOUTS  # noqa: E402

# the names the profiler gives ringattn's Triton kernels: every kernel ringattn/kernels launches is called
# _attn_<what>_kernel (tests/launch/bench/test_profile_ring.py holds the package to it)
KERNEL_NAME = re.compile(r"_attn_\w+_kernel")
OP_RANGE_PREFIX = "ringattn.ops."  # not "ringattn::", the custom ops' namespace: the ring's own op spans the ring
Interval = tuple[float, float]  # (start, end), microseconds


def parse_args(on_gpu: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Profile one ring forward+backward: Chrome traces and the communication/compute overlap.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seqlen-local", type=int, default=8192 if on_gpu else 32, help="S_local, tokens per rank")
    p.add_argument("--heads", type=int, default=32 if on_gpu else 2)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 16)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16" if on_gpu else "fp32")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=3 if on_gpu else 1, help="forward+backward passes before the trace")
    p.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks/ring_profile"), help="Chrome traces")
    summary = "docs/benchmarks/ring_overlap_profile" + ("" if on_gpu else "_cpu") + ".json"
    p.add_argument("--summary", type=Path, default=Path(summary), help="JSON summary")
    args = p.parse_args()
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    problems = []
    if args.seqlen_local <= 0 or (args.layout == "zigzag" and args.seqlen_local % 2):
        problems.append("--seqlen-local must be positive (and even for zigzag)")
    if min(args.heads, args.kv_heads) <= 0 or args.heads % args.kv_heads:
        problems.append(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    problems += head_dim_problems(args.head_dim)
    if args.dtype == "bf16" and not on_gpu:
        problems.append("--dtype bf16 needs a GPU: Triton's interpreter computes bf16 wrongly; use fp32 or fp16")
    if args.warmup < 0:
        problems.append("--warmup must not be negative")
    exit_on_bad_arguments(p, problems)
    args.dtype = DTYPES[args.dtype]
    return args


# ---- intervals ----


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` as sorted, disjoint intervals (touching ones joined)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(merged: list[Interval]) -> float:
    return sum(end - start for start, end in merged)


def intersection_length(a: list[Interval], b: list[Interval]) -> float:
    """Length of the intersection of two unions, each given as sorted disjoint intervals (merge_intervals)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---- the trace ----


def is_communication(event: dict, on_gpu: bool) -> bool:
    if on_gpu:
        return event.get("cat") == "kernel" and "sendrecv" in event["name"].lower()
    return event["name"] in ("gloo:send", "gloo:recv")


def is_compute(event: dict, on_gpu: bool) -> bool:
    if on_gpu:
        return event.get("cat") == "kernel" and KERNEL_NAME.match(event["name"]) is not None
    return event["name"].startswith(OP_RANGE_PREFIX)


def overlap_summary(events: list[dict], on_gpu: bool) -> dict:
    """comm_ms, compute_ms, overlap_ms, overlap_fraction, exposed_comm_ms, span_ms and event counts of a Chrome
    trace's events (module docstring); overlap_fraction None without communication, span_ms 0 without events."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in spans if is_communication(e, on_gpu)]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in spans if is_compute(e, on_gpu)]
    comm_union, compute_union = merge_intervals(comm), merge_intervals(compute)
    comm_us, overlap_us = total_length(comm_union), intersection_length(comm_union, compute_union)
    both = comm_union + compute_union
    span_us = max(end for _, end in both) - min(start for start, _ in both) if both else 0.0
    return dict(
        comm_ms=comm_us / 1e3,
        compute_ms=total_length(compute_union) / 1e3,
        overlap_ms=overlap_us / 1e3,
        overlap_fraction=overlap_us / comm_us if comm_us else None,
        exposed_comm_ms=(comm_us - overlap_us) / 1e3,
        span_ms=span_us / 1e3,
        comm_events=len(comm),
        compute_events=len(compute),
    )


def annotated(ops: AttnOps) -> AttnOps:
    """ops with every call inside a profiler range "ringattn.ops.<field>" (attn_fwd_merge_ is fwd_merge_, ...)."""

    def wrap(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            with record_function(OP_RANGE_PREFIX + name):
                return fn(*args, **kwargs)

        return call

    return AttnOps(*(wrap(name, fn) for name, fn in zip(ops._fields, ops, strict=True)))


# ---- main ----


def main() -> int:
    on_gpu = torch.cuda.is_available()
    args = parse_args(on_gpu)
    env = init_distributed()
    gen = torch.Generator(device=env.device).manual_seed(env.rank)
    shapes = [(1, args.seqlen_local, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
    q, k, v, dout = (torch.randn(s, generator=gen, device=env.device, dtype=args.dtype) for s in shapes)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        out = ringattn.ring_attn_func(q, k, v, causal=args.causal, layout=args.layout)
        torch.autograd.grad(out, (q, k, v), dout)
        if on_gpu:
            torch.cuda.synchronize(env.device)

    for _ in range(args.warmup):
        step()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    trace = args.out_dir / f"ring_trace_rank{env.rank}.json"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # The profiler's first start takes different times on different ranks, and a rank that starts the traced
    # pass late shows up as its peers' NCCL kernels waiting for it: a first profiler, around one untraced pass,
    # absorbs that start-up; the ranks then meet at a barrier and trace the next pass together. (A barrier
    # inside a profiler made gloo ranks abort at exit now and then.)
    with profile(activities=activities):
        step()
    dist.barrier()
    # the ring's autograd Function takes its block ops from this module global: the same ops, labelled
    with mock.patch.object(ringattn.functional, "KERNEL_OPS", annotated(ringattn.functional.KERNEL_OPS)):
        with profile(activities=activities) as prof:
            step()
    prof.export_chrome_trace(str(trace))
    summary = dict(rank=env.rank, trace=str(trace), **overlap_summary(json.loads(trace.read_text())["traceEvents"],
                                                                     on_gpu))  # fmt: skip
    summaries = [None] * env.world_size
    dist.all_gather_object(summaries, summary)
    if env.is_main:
        env_rec = env_record(
            env.device, W=env.world_size, backend=env.backend,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if env.backend == "nccl" else None,
            S_local=args.seqlen_local, H=args.heads, Hkv=args.kv_heads, D=args.head_dim,
            dtype=str(args.dtype).removeprefix("torch."), layout=args.layout, causal=args.causal, warmup=args.warmup,
        )  # fmt: skip
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        write_json(str(args.summary), env_rec, summaries)
        head = ["rank", "comm ms", "compute ms", "overlap ms", "overlap", "exposed comm ms", "span ms"]
        rows = [[s["rank"], f"{s['comm_ms']:.3f}", f"{s['compute_ms']:.3f}", f"{s['overlap_ms']:.3f}",
                 "-" if s["overlap_fraction"] is None else f"{100 * s['overlap_fraction']:.0f}%",
                 f"{s['exposed_comm_ms']:.3f}", f"{s['span_ms']:.3f}"] for s in summaries]  # fmt: skip
        log(markdown_table(head, rows))
        log(f"wrote {args.summary} and {env.world_size} trace(s) in {args.out_dir}")
    destroy()
    return 0


if __name__ == "__main__":
    status = main()
    # Every output is written and closed by now. Leave without running C++ destructors at interpreter exit: on
    # gloo ranks one of torch.profiler's threads is now and then still joinable when they run, and the process
    # aborts ("terminate called without an active exception"; 1 of 12 local runs, and in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
