"""Why a fused kernel: standard attention, online softmax in a Python loop and ringattn's fused kernel over S.

    PYTHONPATH=. python3 launch/bench/why_fused.py --out docs/benchmarks       # GPU: why_fused_h200.json, .png
    OMP_NUM_THREADS=1 PYTHONPATH=. python3 launch/bench/why_fused.py --cpu-calls 5 --out docs/benchmarks  # CPU

Three implementations of the same exact attention forward, softmax(q k^T / sqrt(D)) v, not causal, H = Hkv,
each taking q, k, v (B, S, H, D) and returning out (B, S, H, D) in their dtype:
- standard: two matrix products and a softmax, the (B, H, S, S) scores and probabilities in memory;
- online_softmax_loop: a Python loop over blocks of --block keys keeping a running row max, denominator and
  output in fp32, rescaled at every block, the block's probabilities rounded to the inputs' dtype for their
  product with V (as the fused kernel does): (B, H, S, block) scores at a time, never S x S;
- fused: ringattn.flash_attn_func, one Triton kernel (tiles of q, k, v on chip, scores never in memory).

Every implementation is checked against a float64 reference first, at every S: the last --check-rows query
rows of heads 0..1 against all keys, by ringattn.testing.check_close (the tolerance rule: at most 2x the error of
ringattn.ops.attn_fwd_ref run in the inputs' dtype, plus a floor); a failing check stops the script (status 1).

GPU (defaults): bf16, B = 1, H = 32, D = 128, S = 1024, 2048, ... doubling (or --seqlens) until standard
attention runs out of memory: torch.OutOfMemoryError is caught and recorded ("oom": true), that S is measured
for the other two, and the sweep stops there (or at --max-seqlen). Time: triton.testing.do_bench median;
peak_bytes: torch.cuda.max_memory_allocated during one call above what was allocated before it (the inputs).
CPU: fp32, B = 1, H = 2, D = 32, S in 128 ... 1024, the fused kernel in the Triton interpreter (TRITON_INTERPRET=1,
set by this script when there is no GPU): the times are perf_counter medians of --cpu-calls calls (one thread,
OMP_NUM_THREADS=1, for steadier times on a shared machine), and the interpreter emulates the GPU program in
NumPy, so the fused kernel's CPU time says nothing of its speed. The CPU
has no peak-memory counter for tensors (tracemalloc does not see torch's allocator): peak_bytes is null there.
Every record also holds analytic_bytes, the bytes of the intermediates each implementation holds at its peak,
the output included and the inputs not (e = the inputs' element size):
- standard: 2 B H S^2 e (scores, probabilities) + 2 B H S D e (the scaled q, the output);
- online_softmax_loop: B H S block (4 + e) (a block's fp32 scores, turned into probabilities in place, and their
  rounded copy, none when e = 4) + B H S D (4 + e) (the fp32 output, and the block's product with V or the
  rounded output) + 3 B H S 4 (running max, denominator, the block's row max);
- fused: B H S D e + B H S 4 (the output, the fp32 log-sum-exp the kernel writes for the backward).

Writes --out/why_fused_{tag}.json ({"environment", "records": [{provider, B, S, H, D, dtype, ms, tflops,
peak_bytes, analytic_bytes, error, allowed, oom}, ...]}; tag: "cpu", or the GPU's name, e.g. "h200") and
--out/why_fused_{tag}.png (time and memory against S, log scales; peak_bytes where measured, else
analytic_bytes), and prints a markdown table.
"""

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused kernel on the CPU: the interpreter; before ringattn

import ringattn  # noqa: E402
from ringattn.benchmark import (  # noqa: E402
    attention_flops,
    device_tag,
    environment,
    host_median_s,
    markdown_table,
    run_measuring_peak,
    write_records,
)
from ringattn.ops import attn_fwd_ref  # noqa: E402
from ringattn.testing import check_close  # noqa: E402

PROVIDERS = ("standard", "online_softmax_loop", "fused")
CHECK_HEADS = 2


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v by two matrix products and a softmax in the inputs' dtype; q, k, v, out
    (B, S, H, D). Holds the (B, H, S, S) scores and probabilities at once. `block` is unused."""
    scale = q.shape[-1] ** -0.5
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views
    probs = torch.softmax((qh * scale) @ kh.transpose(-2, -1), dim=-1)  # (B, H, S, S)
    return (probs @ vh).transpose(1, 2)  # (B, S, H, D)


def online_softmax_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """The same attention by online softmax over blocks of `block` keys, a Python loop: the running row max m,
    denominator l and output acc in fp32, rescaled by exp(m_old - m_new) at every block, each block's probabilities
    rounded to v's dtype for their product with v; q, k, v, out (B, S, H, D). Holds (B, H, S, block) scores at a
    time, never S x S."""
    scale = q.shape[-1] ** -0.5
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views
    batch, heads, seqlen, head_dim = qh.shape
    f32 = dict(dtype=torch.float32, device=q.device)
    m = torch.full((batch, heads, seqlen, 1), float("-inf"), **f32)  # running row max
    l = torch.zeros((batch, heads, seqlen, 1), **f32)  # running denominator
    acc = torch.zeros((batch, heads, seqlen, head_dim), **f32)  # running numerator: sum_j exp(s_j - m) v_j
    for start in range(0, kh.shape[2], block):
        s = (qh @ kh[:, :, start : start + block].transpose(-2, -1)).float().mul_(scale)  # (B, H, S, block)
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # finite: every block has a finite score
        alpha = torch.exp(m - m_new)  # rescales what was summed under the old max (0 at the first block)
        p = s.sub_(m_new).exp_()  # (B, H, S, block) fp32, in place of the scores
        l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        acc.mul_(alpha).add_(p.to(v.dtype) @ vh[:, :, start : start + block])  # (B, H, S, D)
        m = m_new
        del s, p
    return acc.div_(l).to(q.dtype).transpose(1, 2)  # (B, S, H, D)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """ringattn.flash_attn_func: one fused Triton kernel; q, k, v, out (B, S, H, D). `block` is unused (the kernel
    picks its tiles)."""
    return ringattn.flash_attn_func(q, k, v)


IMPLEMENTATIONS: dict[str, Callable] = {
    "standard": standard_attention,
    "online_softmax_loop": online_softmax_loop,
    "fused": fused_attention,
}


def analytic_bytes(provider: str, batch: int, seqlen: int, heads: int, head_dim: int, elem: int, block: int) -> int:
    """Bytes of the intermediates `provider` holds at its peak, output included, inputs not (module docstring)."""
    rows = batch * heads * seqlen
    if provider == "standard":
        return 2 * rows * seqlen * elem + 2 * rows * head_dim * elem
    if provider == "online_softmax_loop":
        rounded = 0 if elem == 4 else elem  # p.to(v.dtype) is p itself in fp32
        return rows * min(block, seqlen) * (4 + rounded) + rows * head_dim * (4 + elem) + 3 * rows * 4
    return rows * head_dim * elem + rows * 4


def check(name: str, out: torch.Tensor, q, k, v, rows: int) -> tuple[float, float]:
    """(error, allowed) of out's last `rows` query rows of heads 0..CHECK_HEADS-1 against a float64 reference over
    all keys; raises AssertionError past the tolerance rule (ringattn.testing.check_close, the plain implementation
    being ringattn.ops.attn_fwd_ref in the inputs' dtype)."""
    heads = slice(0, CHECK_HEADS)
    q_s, k_s, v_s = q[:, -rows:, heads], k[:, :, heads], v[:, :, heads]
    scale = q.shape[-1] ** -0.5
    ref, _ = attn_fwd_ref(q_s.double(), k_s.double(), v_s.double(), scale, False)
    plain, _ = attn_fwd_ref(q_s, k_s, v_s, scale, False)
    return check_close(name, out[:, -rows:, heads], plain, ref)


def measure(fn: Callable, device: torch.device, cpu_calls: int) -> tuple[float, int | None]:
    """(median ms, peak bytes above what was allocated before the call; None on the CPU) of fn()."""
    _, peak = run_measuring_peak(fn, device)
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median"), peak
    return host_median_s(fn, cpu_calls) * 1e3, peak


def free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_seqlen(seqlen: int, args, device: torch.device, dtype: torch.dtype, skip: set[str]) -> list[dict]:
    """One record per implementation at `seqlen`: checked, then timed; {"oom": true} for one that ran out of
    memory (or, listed in `skip`, did at a shorter S)."""
    gen = torch.Generator(device=device).manual_seed(seqlen)
    q, k, v = (torch.randn(args.batch, seqlen, args.heads, args.head_dim, generator=gen, device=device, dtype=dtype)
               for _ in range(3))  # fmt: skip
    elem = q.element_size()
    records = []
    for provider in args.providers:
        fn = IMPLEMENTATIONS[provider]
        rec = dict(provider=provider, B=args.batch, S=seqlen, H=args.heads, D=args.head_dim,
                   dtype=str(dtype).removeprefix("torch."), ms=None, tflops=None, peak_bytes=None,
                   analytic_bytes=analytic_bytes(provider, args.batch, seqlen, args.heads, args.head_dim, elem,
                                                 args.block), error=None, allowed=None, oom=False)  # fmt: skip
        records.append(rec)
        if provider in skip:
            rec["oom"] = True
            continue
        try:
            with torch.no_grad():
                out = fn(q, k, v, args.block)
                rec["error"], rec["allowed"] = check(
                    f"{provider} S={seqlen}", out, q, k, v, min(args.check_rows, seqlen)
                )
                del out
                free(device)
                rec["ms"], rec["peak_bytes"] = measure(lambda fn=fn: fn(q, k, v, args.block), device, args.cpu_calls)
        except torch.OutOfMemoryError:
            rec["oom"] = True
        if rec["oom"]:  # after the except clause: its traceback held the failed call's tensors
            skip.add(provider)
            free(device)
            print(f"{provider:20} S={seqlen:>7}: out of memory", flush=True)
            continue
        rec["tflops"] = attention_flops(args.batch, args.heads, seqlen, args.head_dim, False, "fwd") / rec["ms"] / 1e9
        peak = "-" if rec["peak_bytes"] is None else f"{rec['peak_bytes'] / 2**20:.1f} MiB"
        print(f"{provider:20} S={seqlen:>7}: {rec['ms']:10.3f} ms, peak {peak}, analytic "
              f"{rec['analytic_bytes'] / 2**20:.1f} MiB, error {rec['error']:.2e} (allowed {rec['allowed']:.2e})",
              flush=True)  # fmt: skip
    return records


def table(records: list[dict]) -> str:
    """A row per S: each implementation's ms and memory (measured peak, else analytic), OOM where it ran out."""
    by_s: dict[int, dict] = {}
    for r in records:
        by_s.setdefault(r["S"], {})[r["provider"]] = r
    providers = [p for p in PROVIDERS if any(p in row for row in by_s.values())]

    def memory(r: dict) -> int:
        return r["analytic_bytes"] if r["peak_bytes"] is None else r["peak_bytes"]

    def number(x: float) -> str:  # three significant digits, no exponent
        return f"{x:.0f}" if x >= 100 else f"{x:.3g}"

    rows = []
    for seqlen, row in sorted(by_s.items()):
        cells = [seqlen]
        cells += ["OOM" if row[p]["oom"] else number(row[p]["ms"]) for p in providers]
        cells += ["OOM" if row[p]["oom"] else number(memory(row[p]) / 2**20) for p in providers]
        rows.append(cells)
    head = ["S", *(f"{p} ms" for p in providers), *(f"{p} MiB" for p in providers)]
    return markdown_table(head, rows)


def plot(records: list[dict], env: dict, path: Path) -> Path | None:
    """Time and memory against S, log scales, a line per implementation, OOM marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    measured = env["memory"] == "measured"
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for provider in PROVIDERS:
        mine = [r for r in records if r["provider"] == provider]
        if not mine:
            continue
        ok = [r for r in mine if not r["oom"]]
        memory = [(r["S"], (r["peak_bytes"] if measured else r["analytic_bytes"]) / 2**20) for r in ok]
        (line,) = ax_t.plot([r["S"] for r in ok], [r["ms"] for r in ok], marker="o", label=provider)
        if memory:
            ax_m.plot(*zip(*memory, strict=True), marker="o", color=line.get_color(), label=provider)
        for r in mine:
            if r["oom"]:
                ax_m.axvline(r["S"], color=line.get_color(), linestyle=":", linewidth=1)
                ax_m.annotate(f"{provider}: OOM", (r["S"], 0.02), xycoords=("data", "axes fraction"), rotation=90,
                              fontsize=8, color=line.get_color())  # fmt: skip
    seqlens = sorted({r["S"] for r in records})
    for ax, ylabel in ((ax_t, "time (ms)"), (ax_m, "peak memory (MiB)" if measured else "intermediates (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
        ax.set_yscale("log")
        ax.set_xlabel("S")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    ax_t.set_title(f"forward, {env['timing']}")
    ax_m.set_title("peak memory above the inputs" if measured else "analytic bytes of the intermediates")
    r = records[0]
    fig.suptitle(f"{env['gpu'] or 'CPU (fused: Triton interpreter)'}: B = {r['B']}, H = {r['H']}, D = {r['D']}, "
                 f"{r['dtype']}, key block {env['block']}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None, on_gpu: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="default: 1024 doubling to --max-seqlen on a GPU, 128 256 512 1024 on the CPU")  # fmt: skip
    p.add_argument("--max-seqlen", type=int, default=2**20, help="GPU: the doubling's cap")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32 if on_gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 32)
    p.add_argument("--block", type=int, default=256, help="keys per step of online_softmax_loop")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    p.add_argument("--check-rows", type=int, default=512, help="query rows checked against float64, at every S")
    p.add_argument("--cpu-calls", type=int, default=3, help="CPU: timed calls per measurement")
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="folder of the JSON and PNG")
    args = p.parse_args(argv)
    if args.seqlens is None:
        args.seqlens = ([1024 * 2**i for i in range(int(math.log2(max(args.max_seqlen, 1024) // 1024)) + 1)] if on_gpu
                        else [128, 256, 512, 1024])  # fmt: skip
    if args.heads < CHECK_HEADS or min(args.seqlens) <= 0 or min(args.block, args.check_rows, args.cpu_calls) <= 0:
        p.error(f"--heads must be at least {CHECK_HEADS}; --seqlens, --block, --check-rows and --cpu-calls positive")
    return args


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    args = parse_args(argv, on_gpu)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter computes bf16 wrongly
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parts stay fp32
    env = environment(
        device, dtype=str(dtype).removeprefix("torch."), block=args.block, check_rows=args.check_rows,
        timing="do_bench median" if on_gpu else f"perf_counter median of {args.cpu_calls} calls",
        memory="measured" if on_gpu else "analytic", triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
        threads=torch.get_num_threads(),
    )  # fmt: skip
    records: list[dict] = []
    skip: set[str] = set()
    try:
        for seqlen in sorted(args.seqlens):
            records += bench_seqlen(seqlen, args, device, dtype, skip)
            if "standard" in skip:  # standard attention ran out of memory: the sweep's end
                break
    except AssertionError as exc:
        print(f"why_fused.py: check failed: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"why_fused_{device_tag(device)}"
    write_records(str(stem.with_suffix(".json")), env, records)
    png = plot(records, env, stem.with_suffix(".png"))
    print(table(records))
    print(f"wrote {stem.with_suffix('.json')}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
