"""Ring attention over one long sequence split across all ranks: check it, then time it.

    bash launch/torchrun.sh launch/ring_check.py [options]
    NPROC=2 bash launch/torchrun.sh launch/ring_check.py --seqlen 256 --kv-heads 1 --no-causal

One rank per GPU over NCCL when CUDA is available, else CPU ranks over gloo with the Triton
kernels in the interpreter (TRITON_INTERPRET=1; launch/torchrun.sh sets it, and so does this
script when it finds no GPU). Defaults: on GPUs seqlen 4096 per rank, 16 heads of 128, bf16,
5 + 20 iterations; on the CPU seqlen 128 per rank, 4 heads of 64, fp32, 1 + 2 iterations (about
a minute with 4 ranks on 2 cores). `--help` lists the options.

Every rank builds the same global q, k, v, dout (batch, seqlen, heads, head_dim) from a fixed
seed and keeps its contiguous shard: rank r holds tokens [r * S / W, (r + 1) * S / W).

CHECK: each rank's out, lse, dq, dk, dv from `ringattn.ring_attn_func` must obey the tolerance
rule of ringattn.testing against the pure-PyTorch reference (ringattn.testing.reference:
ringattn.ops.attn_fwd_ref / attn_bwd_ref) run on the whole sequence in high precision (float64
on the CPU and for fp32 inputs, float32 for fp16/bf16 on the GPU): at most 2x the error of the
same reference run in the input dtype. The single-device kernel `ringattn.flash_attn_func` on
the whole sequence is held to the same rule. A failure on any rank makes every rank exit with
status 1.

Ranks join through ringattn.distributed.init_distributed: collectives time out after
$RINGATTN_TIMEOUT seconds (default 300).

TIMING: after warm-up, `--iters` forward and `--iters` forward+backward passes; rank 0 prints
each rank's median time, global tokens/s, TFLOP/s (GPU) and peak memory.
"""

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

import ringattn  # noqa: E402
from ringattn.benchmark import DTYPES, attention_flops, attention_inputs  # noqa: E402
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.ops.validation import MAX_GRID_DIM, MAX_HEAD_DIM  # noqa: E402
from ringattn.testing import check_close, max_abs_error, reference, tolerance  # noqa: E402

CHECKED = ("out", "lse", "dq", "dk", "dv")


def parse_args(world_size: int, on_gpu: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check and time ring attention over all ranks (defaults depend on GPU / CPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    default_seqlen = (4096 if on_gpu else 128) * world_size
    parser.add_argument(
        "--seqlen",
        type=int,
        default=default_seqlen,
        help="global sequence length: 4096 x the ranks W on GPUs, 128 x W on CPUs (%(default)s for this process)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16 if on_gpu else 4, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16" if on_gpu else "fp32")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--iters", type=int, default=20 if on_gpu else 2, help="timed iterations per phase")
    parser.add_argument("--warmup", type=int, default=5 if on_gpu else 1, help="untimed iterations per phase")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    problems = []
    if args.seqlen <= 0 or args.seqlen % world_size:
        problems.append(f"--seqlen {args.seqlen} must be a positive multiple of the world size {world_size}")
    if not 0 < args.batch <= MAX_GRID_DIM:
        problems.append(f"--batch {args.batch} must be from 1 to {MAX_GRID_DIM}")
    if args.heads <= 0 or args.kv_heads <= 0 or args.heads % args.kv_heads or args.heads > MAX_GRID_DIM:
        problems.append(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}, at most "
                        f"{MAX_GRID_DIM}")  # fmt: skip
    if args.head_dim % 8 or not 8 <= args.head_dim <= MAX_HEAD_DIM:
        problems.append(f"--head-dim {args.head_dim} must be a multiple of 8 from 8 to {MAX_HEAD_DIM}")
    if args.iters <= 0 or args.warmup < 0:
        problems.append("--iters must be positive and --warmup non-negative")
    if args.dtype == "bf16" and not on_gpu:
        problems.append("--dtype bf16 needs a GPU: Triton's interpreter computes bf16 wrongly; use fp32 or fp16")
    exit_on_bad_arguments(parser, problems)
    return args


def progress(phase: str, i: int, n: int) -> None:
    """Rank 0 rewrites one stderr line per iteration."""
    log(f"\r  {phase}: {i}/{n}", end="\n" if i == n else "", file=sys.stderr)


def make_inputs(args, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Global q, dout (B, S, H, D) and k, v (B, S, Hkv, D), the same on every rank."""
    return attention_inputs(
        args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device, args.seed
    )


def local_slice(name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous shard of a global tensor: ringattn.shard along the sequence dim (2 for lse, else 1)."""
    return ringattn.shard(t, dim=2 if name == "lse" else 1, layout="contiguous")


def check(args, device: torch.device, ref_dtype: torch.dtype) -> list[dict]:
    """Run ring and flash attention fwd + bwd once and hold both to the tolerance rule.

    Returns one row per checked tensor: name, ring error, flash error, allowed error, failure messages.
    """
    rank = dist.get_rank()
    scale = args.head_dim**-0.5
    q, k, v, dout = make_inputs(args, device)

    shards = [local_slice("q", t).requires_grad_() for t in (q, k, v)]
    out, lse = ringattn.ring_attn_func(*shards, causal=args.causal, return_lse=True, layout="contiguous")
    out.backward(local_slice("out", dout))
    ring = {"out": out, "lse": lse, "dq": shards[0].grad, "dk": shards[1].grad, "dv": shards[2].grad}

    full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out_f, lse_f = ringattn.flash_attn_func(*full, causal=args.causal, return_lse=True)
    out_f.backward(dout)
    flash = {"out": out_f, "lse": lse_f, "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}

    ref = reference(q, k, v, dout, scale, args.causal, ref_dtype)
    plain = reference(q, k, v, dout, scale, args.causal, q.dtype)

    rows = []
    for name in CHECKED:
        ref_s, plain_s = (local_slice(name, t[name]) for t in (ref, plain))
        flash_s = local_slice(name, flash[name].detach())
        row = {"name": name, "failures": []}
        for label, ours in (("ring", ring[name]), ("flash", flash_s)):
            try:
                check_close(f"rank {rank} {label} {name}", ours, plain_s, ref_s)
            except AssertionError as e:
                row["failures"].append(str(e))
            row[label] = max_abs_error(ours, ref_s)
        row["plain"], row["allowed"] = max_abs_error(plain_s, ref_s), tolerance(plain_s, ref_s)
        rows.append(row)
    return rows


def time_phase(phase: str, step: Callable[[], None], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls of step() after `warmup` untimed calls."""
    for i in range(warmup):
        step()
        progress(f"{phase} warm-up", i + 1, warmup)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type == "cuda":  # events only: no host sync until the loop is done
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for i, (start, end) in enumerate(events):
            start.record()
            step()
            end.record()
            progress(phase, i + 1, iters)
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        progress(phase, i + 1, iters)
    return times


def benchmark(args, device: torch.device) -> dict:
    """Median ms of ring forward and forward+backward on this rank's shard, and its peak memory."""
    q, k, v, dout = (local_slice("q", t) for t in make_inputs(args, device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            ringattn.ring_attn_func(q, k, v, causal=args.causal, layout="contiguous")

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        ringattn.ring_attn_func(q, k, v, causal=args.causal, layout="contiguous").backward(dout)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    result = {
        "fwd_ms": statistics.median(time_phase("forward", fwd, args.iters, args.warmup, device)),
        "fwd_bwd_ms": statistics.median(time_phase("forward+backward", fwd_bwd, args.iters, args.warmup, device)),
    }
    if device.type == "cuda":
        result["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:  # the process's lifetime peak RSS, the check included (KiB on Linux)
        result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return result


def main() -> int:
    on_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(world_size, on_gpu)
    device = init_distributed().device
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references stay fp32

    dtype = DTYPES[args.dtype]
    ref_dtype = torch.float64 if device.type == "cpu" or dtype == torch.float32 else torch.float32
    local = args.seqlen // world_size
    log(
        f"ring_check: {world_size} rank(s), {dist.get_backend()} on "
        f"{torch.cuda.get_device_name(device) if on_gpu else 'cpu (Triton interpreter)'}; "
        f"torch {torch.__version__}, triton {triton.__version__}, ringattn {ringattn.__version__}\n"
        f"  seqlen {args.seqlen} global ({local} per rank), batch {args.batch}, heads {args.heads}, "
        f"kv heads {args.kv_heads}, head dim {args.head_dim}, {args.dtype}, "
        f"{'causal' if args.causal else 'not causal'}\n"
        f"  reference in {str(ref_dtype).removeprefix('torch.')}; timing: {args.warmup} warm-up + "
        f"{args.iters} timed iterations per phase"
    )

    t0 = time.perf_counter()
    log("[1/2] check: ring_attn_func and flash_attn_func fwd + bwd vs the reference")
    rows = check(args, device, ref_dtype)
    failed = torch.tensor([float(any(r["failures"] for r in rows))], device=device)
    dist.all_reduce(failed)
    all_rows = [None] * world_size
    dist.all_gather_object(all_rows, rows)
    log(f"  {'rank':>4} {'tensor':>6} {'ring err':>10} {'flash err':>10} {'plain err':>10} {'allowed':>10}")
    for r, rank_rows in enumerate(all_rows):
        for row in rank_rows:
            status = "FAIL" if row["failures"] else "ok"
            log(
                f"  {r:>4} {row['name']:>6} {row['ring']:>10.3e} {row['flash']:>10.3e} "
                f"{row['plain']:>10.3e} {row['allowed']:>10.3e}  {status}"
            )
    log(f"  (errors are max |x - reference| on each rank's shard; check took {time.perf_counter() - t0:.1f} s)")
    if failed.item():
        log(f"FAILED: {int(failed.item())} rank(s) outside the tolerance rule:")
        for rank_rows in all_rows:
            for row in rank_rows:
                for message in row["failures"]:
                    log(f"  {message}")
        destroy()
        return 1
    log("  all checks passed")

    log(f"[2/2] timing ring_attn_func on {world_size} rank(s)")
    result = benchmark(args, device)
    results = [None] * world_size
    dist.all_gather_object(results, result)
    tokens = args.batch * args.seqlen
    fwd_flops, fwd_bwd_flops = (
        attention_flops(args.batch, args.heads, args.seqlen, args.head_dim, args.causal, mode)
        for mode in ("fwd", "fwd+bwd")
    )
    header = f"  {'rank':>4} {'fwd ms':>10} {'fwd+bwd ms':>11} {'fwd tok/s':>11} {'f+b tok/s':>11}"
    log(header + (f" {'fwd TFLOP/s':>12} {'f+b TFLOP/s':>12}" if on_gpu else "") + f" {'peak MiB':>9}")
    for r, res in enumerate(results):
        fwd_s, fwd_bwd_s = res["fwd_ms"] / 1e3, res["fwd_bwd_ms"] / 1e3
        line = (
            f"  {r:>4} {res['fwd_ms']:>10.2f} {res['fwd_bwd_ms']:>11.2f} "
            f"{tokens / fwd_s:>11.4g} {tokens / fwd_bwd_s:>11.4g}"
        )
        if on_gpu:
            line += f" {fwd_flops / fwd_s / 1e12:>12.1f} {fwd_bwd_flops / fwd_bwd_s / 1e12:>12.1f}"
        log(line + f" {res['peak_mib']:>9.1f}")
    if on_gpu:
        log("  (global tokens and FLOPs per pass, backward as 2.5x forward; peak: max_memory_allocated while timing)")
    else:
        log("  (global tokens per pass; peak: the process's max RSS, the check included)")
    log(f"ring_check: passed, {time.perf_counter() - t0:.1f} s after the configuration")
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
