"""The longest sequence one training step of examples/train_gpt.py's model runs at: ring attention over the
W ranks of the job, and on one GPU plain PyTorch attention with the same memory.

    bash launch/torchrun.sh launch/bench/longest_sequence.py                  # all GPUs: ringattn over W ranks
    NPROC=1 bash launch/torchrun.sh launch/bench/longest_sequence.py          # one GPU: ringattn, sdpa_flash, sdpa_math
    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/longest_sequence.py --start-seqlen 8 --max-seqlen 32 \
        --out /tmp/longest_sequence.json                                # CPU ranks, tiny: the test

The model is train_gpt's at its defaults (GPUs: vocab 64, dim 512, 4 layers, 8 heads and 2 KV heads of 64,
bf16 autocast; CPU ranks: its tiny CPU model in fp32), batch 1, built by train_gpt.make_model. One step is
train_gpt's: forward, backward, gradient sync over the ranks, clipping, AdamW (train_gpt.ring_step, or
single_device_step for the baselines). Providers:
- ringattn: ringattn.nn.RingAttention, zigzag, each rank holding S / W tokens (any W);
- sdpa_flash, sdpa_math (W = 1 only): torch.nn.functional.scaled_dot_product_attention restricted to the
  flash backend (the usual baseline) or the math one (materialises the S x S scores), GQA by enable_gqa.

Search, per provider: steps at S = --start-seqlen (16384 x W), doubling until a step runs out of memory or S
reaches --max-seqlen (halving instead while it does not fit), then --bisect-steps bisections of
[longest that fits, shortest that does not]; every S a multiple of 2W (zigzag). Every rank catches
torch.OutOfMemoryError and the ranks all-reduce the outcome, so all of them agree. Memory is freed
(empty_cache) before every trial, so each starts as a fresh process would. Every rank's caching allocator is
capped at --memory-fraction of its GPU (torch.cuda.set_per_process_memory_fraction): the same budget for every
rank and provider, counted by the allocator alone, so ranks doing the same allocations (the same shapes)
run out at the same one. A rank that ran out alone inside the ring would leave its peers waiting in NCCL
until RINGATTN_TIMEOUT: this script relies on the ranks' symmetry to avoid it.

Measured at each S that fits: ms, one step's time (CUDA-synchronised wall clock, the slowest rank), after an
untimed warm step at the provider's first S that fits (kernel compilation, cuBLAS, optimizer state); as every
trial starts with an emptied allocator cache, the time includes the cudaMallocs of the step's memory (small
next to a step at these lengths); tokens/s = S / step time, all ranks together; peak_bytes, the largest
torch.cuda.max_memory_allocated over the ranks.

Time: --budget-s is shared between the providers in turn (each gets what is left / providers left; sdpa_math,
the fastest, runs first). A trial is skipped, ending the provider's search with stop "budget", when the last
fitting step's time x (S / its S)^2 (attention is quadratic) would end past the provider's share. At the
kernel benchmark's rates a step near one H200's memory limit (expected near 1M tokens) takes about a minute,
and with W ranks about W times longer at W times the length, so the budget or --max-seqlen may end a search
before memory does: estimated_seqlen extrapolates the two longest fitting steps' peak memory (a + b S for
ringattn and sdpa_flash, a + b S^2 for sdpa_math) to the allocator's cap, an estimate and labelled as one.
Defaults finish in about 6 minutes on one H200 (--budget-s 330 plus start-up).

Output (rank 0): a progress line per trial, a markdown table, and --out (default
docs/benchmarks/longest_sequence_{device}_w{W}.json, device cpu or the GPU's model, e.g. h200): a JSON list, an env
record (kind "env": gpu, torch, triton, cuda, model, memory limit, options) then one record per provider: provider,
W, longest_seqlen, ms, peak_bytes, tokens_per_s, stop ("oom": bracketed by a step that ran out of memory,
"max_seqlen", "budget"), shortest_failed, estimated_seqlen, trials (seqlen, ok, ms, peak_bytes of each).
On CPU ranks nothing runs out of memory: the search stops at --max-seqlen, and peak_bytes is null.
"""

import argparse
import functools
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import ringattn  # noqa: E402
from examples import train_gpt  # noqa: E402
from ringattn.benchmark import device_tag, env_record, markdown_table, write_json  # noqa: E402
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402

# run in this order: the budget left by one goes to the next, so the quickest first and ours last
PROVIDERS = ("sdpa_math", "sdpa_flash", "ringattn")
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_math": SDPBackend.MATH}
MEMORY_EXPONENT = {"ringattn": 1, "sdpa_flash": 1, "sdpa_math": 2}  # peak memory ~ a + b S^p
GIB = 2**30
OPTIONS_RECORDED = ("start_seqlen", "max_seqlen", "bisect_steps", "budget_s", "providers")


class SdpaAttention(nn.Module):
    """Causal attention over the whole sequence on one device: PyTorch SDPA restricted to one backend."""

    def __init__(self, backend: SDPBackend):
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v):  # q (B, S, H, D), k and v (B, S, Hkv, D) -> (B, S, H, D)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D), (B, Hkv, S, D)
        with sdpa_kernel([self.backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, S, D)
        return out.transpose(1, 2)


@dataclass
class Trial:
    """One step's outcome at global length seqlen: ms and peak_bytes when it fit (peak_bytes None on CPUs)."""

    seqlen: int
    ok: bool
    ms: float | None = None
    peak_bytes: int | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Everything unreferenced back to the GPU, and the peak statistics restarted."""
    gc.collect()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Runner:
    """One provider's model and optimizer; trial(S) runs its training steps at global length S on every rank.

    What search() needs of a runner: provider (its name), memory_exponent (peak memory ~ a + b S^p),
    sp.world_size, sp.multiple (every S a multiple of it) and trial(S) -> Trial, the same on every rank."""

    def __init__(self, provider: str, model_args, sp: ringattn.SequenceParallel, device: torch.device):
        if provider == "ringattn":
            attention = ringattn.nn.RingAttention(causal=True, sp=sp)
        else:
            attention = SdpaAttention(SDPA_BACKENDS[provider])
        self.provider, self.args, self.sp, self.device = provider, model_args, sp, device
        self.memory_exponent = MEMORY_EXPONENT[provider]
        self.model = train_gpt.make_model(model_args, attention).to(device)
        self.optimizer = train_gpt.make_optimizer(self.model)
        self.steps, self.warm = 0, False

    def _step(self, tokens: torch.Tensor, labels: torch.Tensor) -> None:  # tokens, labels (1, S) on the CPU
        if self.provider == "ringattn":
            train_gpt.ring_step(self.model, self.optimizer, self.steps, self.args, self.sp, tokens, labels)
        else:
            train_gpt.single_device_step(self.model, self.optimizer, self.steps, self.args, tokens, labels)
        self.steps += 1

    def trial(self, seqlen: int) -> Trial:
        """A step at S (after a warm one if none fitted yet); every rank gets the same outcome."""
        tokens, labels = train_gpt.copy_task_batch(1, seqlen, self.args.vocab, self.args.seed + self.steps)  # (1, S)
        t = agreed_trial(seqlen, self.device, lambda: self._step(tokens, labels), self.warm)
        if not t.ok:  # the failed step's gradients are still referenced
            self.optimizer.zero_grad(set_to_none=True)
        self.warm = self.warm or t.ok
        return t


def agreed_trial(seqlen: int, device: torch.device, step: Callable[[], object], warm: bool) -> Trial:
    """step() timed once at global length `seqlen` (after an untimed warm call unless `warm`), from an emptied
    allocator; every rank catches torch.OutOfMemoryError and the ranks all-reduce the outcome, so all of them
    return the same Trial: failed if any rank ran out of memory, else the slowest rank's ms and largest peak."""
    free_memory(device)
    out_of_memory, ms = False, 0.0
    try:
        if not warm:
            step()
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        ms = (time.perf_counter() - start) * 1e3
    except torch.OutOfMemoryError:
        out_of_memory = True
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    outcome = torch.tensor([float(out_of_memory), ms, float(peak)], dtype=torch.float64, device=device)
    dist.all_reduce(outcome, op=dist.ReduceOp.MAX)  # any rank out of memory: failed on all
    if outcome[0].item():
        free_memory(device)
        return Trial(seqlen, ok=False)
    peak_bytes = int(outcome[2].item()) if device.type == "cuda" else None
    return Trial(seqlen, ok=True, ms=outcome[1].item(), peak_bytes=peak_bytes)


def estimate_seqlen(trials: list[Trial], exponent: int, limit: int | None, multiple: int) -> int | None:
    """S at which peak memory a + b S^exponent, through the two longest fitting trials, reaches `limit` bytes."""
    fits = sorted((t for t in trials if t.ok and t.peak_bytes is not None), key=lambda t: t.seqlen)[-2:]
    if limit is None or len(fits) < 2:
        return None
    (s1, m1), (s2, m2) = ((t.seqlen, t.peak_bytes) for t in fits)
    slope = (m2 - m1) / (s2**exponent - s1**exponent)
    if slope <= 0:
        return None
    return int((s2**exponent + (limit - m2) / slope) ** (1 / exponent)) // multiple * multiple


def search(runner: Runner, opts, deadline: float, limit: int | None, started: float) -> dict:
    """The longest S (a multiple of 2W) whose step fits, as a provider record (module docstring)."""
    trials: list[Trial] = []
    world_size, multiple = runner.sp.world_size, runner.sp.multiple

    def longest_fit() -> Trial | None:
        return max((t for t in trials if t.ok), key=lambda t: t.seqlen, default=None)

    def attempt(seqlen: int) -> bool | None:  # None: not started, it would end past the deadline
        last = longest_fit()
        if last is not None:
            predicted = last.ms / 1e3 * (seqlen / last.seqlen) ** 2
            left = deadline - time.perf_counter()
            if predicted > left:
                log(f"  {runner.provider} S={seqlen:,}: not started, predicted {predicted:.0f} s, {left:.0f} s left")
                return None
        t = runner.trial(seqlen)
        trials.append(t)
        head = (
            f"[{time.perf_counter() - started:5.0f} s] {runner.provider} S={seqlen:,} ({seqlen // world_size:,}/rank)"
        )
        if t.ok:
            peak = "" if t.peak_bytes is None else f", peak {t.peak_bytes / GIB:.2f} GiB"
            log(f"{head}: fits, {t.ms:.0f} ms{peak}, {seqlen / t.ms * 1e3:,.0f} tokens/s")
        else:
            log(f"{head}: out of memory")
        return t.ok

    def record(stop: str) -> dict:
        best = longest_fit()
        return {
            "provider": runner.provider,
            "W": world_size,
            "longest_seqlen": best and best.seqlen,
            "ms": best and best.ms,
            "peak_bytes": best and best.peak_bytes,
            "tokens_per_s": best and best.seqlen / best.ms * 1e3,
            "stop": stop,
            "shortest_failed": min((t.seqlen for t in trials if not t.ok), default=None),
            "estimated_seqlen": estimate_seqlen(trials, runner.memory_exponent, limit, multiple),
            "trials": [asdict(t) for t in trials],
        }

    longest, shortest_failed, seqlen = None, None, opts.start_seqlen
    while longest is None or shortest_failed is None:  # bracket: double while it fits, halve while it does not
        fits = attempt(seqlen)
        if fits is None:
            return record("budget")
        if fits:
            longest = seqlen
            if seqlen >= opts.max_seqlen:
                return record("max_seqlen")
            seqlen = min(2 * seqlen, opts.max_seqlen)
        else:
            shortest_failed = seqlen
            if seqlen <= multiple:
                return record("oom")
            seqlen = max(seqlen // 2 // multiple * multiple, multiple)
    for _ in range(opts.bisect_steps):
        mid = (longest + shortest_failed) // 2 // multiple * multiple
        if mid <= longest:
            break
        fits = attempt(mid)
        if fits is None:
            return record("budget")
        longest, shortest_failed = (mid, shortest_failed) if fits else (longest, mid)
    return record("oom")


def search_providers(
    make_runner: Callable[[str], object], providers: list[str], opts, limit: int | None, started: float, device
) -> list[dict]:
    """search() for each provider in turn, each given what is left of opts.budget_s / the providers left;
    make_runner(provider) builds its runner, dropped (and memory freed) before the next."""
    records = []
    for i, provider in enumerate(providers):
        left = opts.budget_s - (time.perf_counter() - started)
        deadline = time.perf_counter() + left / (len(providers) - i)
        runner = make_runner(provider)
        records.append(search(runner, opts, deadline, limit, started))
        del runner
        free_memory(device)
    return records


def cap_memory(fraction: float, device: torch.device) -> int | None:
    """Cap this rank's caching allocator at `fraction` of its GPU; the cap in bytes (None on the CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


def parse_args(world_size: int, on_gpu: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The longest sequence train_gpt's model trains at: ring attention on W ranks vs one GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--start-seqlen", type=int, default=(16384 if on_gpu else 16) * world_size, help="first S tried")
    p.add_argument("--max-seqlen", type=int, default=4 * 2**20 if on_gpu else 64 * world_size, help="S cap")
    p.add_argument("--bisect-steps", type=int, default=4, help="bisections of the bracket (4: 1/16 of it)")
    p.add_argument("--budget-s", type=float, default=330.0, help="seconds of trials, shared by the providers")
    p.add_argument("--memory-fraction", type=float, default=0.95, help="of each GPU, for the caching allocator")
    p.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, default=None, help="default: all with W = 1, else ringattn"
    )
    p.add_argument("--out", type=Path, default=None, help="default docs/benchmarks/longest_sequence_{device}_w{W}.json")
    args = p.parse_args()
    multiple = 2 * world_size
    args.max_seqlen = max(args.max_seqlen // multiple * multiple, multiple)
    args.start_seqlen = min(max(args.start_seqlen // multiple * multiple, multiple), args.max_seqlen)
    if args.providers is None:
        args.providers = list(PROVIDERS) if world_size == 1 else ["ringattn"]
    args.providers = [name for name in PROVIDERS if name in args.providers]  # the run order
    if args.out is None:
        device = device_tag(torch.device("cuda" if on_gpu else "cpu"))
        args.out = Path(f"docs/benchmarks/longest_sequence_{device}_w{world_size}.json")
    problems = []
    if world_size > 1 and args.providers != ["ringattn"]:
        problems.append("sdpa_flash and sdpa_math run on one device: start them with NPROC=1")
    if not 0 < args.memory_fraction <= 1 or args.bisect_steps < 0 or args.budget_s <= 0:
        problems.append("--memory-fraction must be in (0, 1], --bisect-steps >= 0, --budget-s > 0")
    exit_on_bad_arguments(p, problems)
    return args


TABLE_HEAD = ["provider", "W", "longest S", "S / rank", "stopped by", "shortest failed", "step ms", "tokens/s",
              "peak GiB / rank", "memory-bound estimate"]  # fmt: skip


def table_row(r: dict) -> list[str]:
    """A provider record's cells under TABLE_HEAD; "-" for what was not measured."""

    def cell(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    per_rank = r["longest_seqlen"] and r["longest_seqlen"] // r["W"]
    peak_gib = r["peak_bytes"] and r["peak_bytes"] / GIB
    return [r["provider"], str(r["W"]), cell(r["longest_seqlen"], ","), cell(per_rank, ","), r["stop"],
            cell(r["shortest_failed"], ","), cell(r["ms"], ".0f"), cell(r["tokens_per_s"], ",.0f"),
            cell(peak_gib, ".1f"), cell(r["estimated_seqlen"], ",")]  # fmt: skip


def main() -> int:
    on_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    opts = parse_args(world_size, on_gpu)
    model_args = train_gpt.parse_args(world_size, on_gpu, argv=["--batch", "1"])  # the model at its defaults
    env = init_distributed()
    started = time.perf_counter()
    limit = cap_memory(opts.memory_fraction, env.device)
    sp = ringattn.SequenceParallel(layout="zigzag")
    head_dim = model_args.dim // model_args.heads
    model = {k: getattr(model_args, k) for k in ("vocab", "dim", "layers", "heads", "kv_heads", "batch", "dtype")}
    params = sum(p.numel() for p in train_gpt.make_model(model_args, nn.Identity()).parameters())
    log(
        f"longest_sequence: {env.world_size} rank(s) ({env.backend}, {env.device.type}); model {model}, head dim "
        f"{head_dim}, {params / 1e6:.2f}M parameters; S from {opts.start_seqlen:,} to at most {opts.max_seqlen:,}; "
        f"providers {', '.join(opts.providers)}; "
        f"budget {opts.budget_s:.0f} s" + ("" if limit is None else f"; {limit / GIB:.1f} GiB per rank")
    )
    make_runner = functools.partial(Runner, model_args=model_args, sp=sp, device=env.device)
    records = search_providers(make_runner, opts.providers, opts, limit, started, env.device)

    if env.is_main:
        elapsed = time.perf_counter() - started
        env_rec = env_record(
            env.device, W=env.world_size, backend=env.backend, model={**model, "head_dim": head_dim, "params": params},
            memory_fraction=opts.memory_fraction if on_gpu else None, memory_limit_bytes=limit,
            options={k: getattr(opts, k) for k in OPTIONS_RECORDED}, elapsed_s=round(elapsed, 1),
        )  # fmt: skip
        write_json(opts.out, env_rec, records)
        log(markdown_table(TABLE_HEAD, [table_row(r) for r in records]))
        log(f"wrote {opts.out} ({elapsed:.0f} s)")
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
