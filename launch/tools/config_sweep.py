"""Time each attention kernel under a list of launch configs, to pick the tables of ops/portable.py and ops/sm90.py
(ringattn.ops.KERNELS names the kernels) for 16-bit inputs on the GPU at hand.

    PYTHONPATH=. python3 launch/tools/config_sweep.py --out docs/benchmarks/config_sweep_h200.json

    PYTHONPATH=. python3 launch/tools/config_sweep.py --kernels portable.dkdv --head-dims 128 \
        --kv-heads 32 8 --configs 64,64,4,2

bf16, Hq = 32, B x S = 32768 tokens (S = --seqlen), per head dim, K/V head count (--kv-heads; 8 is
GQA 32:8) and causal setting. A config is (BLOCK_M, BLOCK_N, num_warps, num_stages); --configs replaces
the candidate lists of the swept --kernels. The forward is timed alone; a dK/dV config is timed as the
whole backward with the default dQ config, and a dQ config with the default dK/dV config, so the two
backward sweeps differ only in the kernel under test (each record also holds the time of the kernel
under test alone, kernel_ms). TFLOP/s: forward 4 B H S^2 D (x 0.5 causal; a window: over the pairs it leaves),
backward 2.5 x that. --window LEFT RIGHT and --softcap time the sliding-window and soft-capped forms.
Every config's result is checked against the portable kernels' before timing; a
config off them is recorded with its error, as one that does not fit. Prints the best config
per kernel and head dim (least time summed over the K/V head counts and causal settings it runs in) and writes
all timings as JSON; launch/bench/bench_kernel.py --configs launches with those best configs.
"""

import argparse
from functools import partial

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from ringattn.benchmark import attention_flops, env_record, write_json
from ringattn.ops import (
    BwdCall,
    FwdCall,
    LaunchConfig,
    Target,
    attn_bwd,
    attn_bwd_preprocess,
    attn_fwd,
    bwd_launches,
    fwd_launch,
    launch_config,
    override_configs,
)

TOKENS, HEADS = 32768, 32
CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages); the first entry of each list is the current default
    "portable.fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4)],
        128: [(128, 128, 8, 3), (128, 64, 8, 3)],
        256: [(64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    },
    "portable.dkdv": {  # BLOCK_M query rows per loop step, BLOCK_N keys per program
        64: [(64, 64, 4, 3), (64, 64, 4, 4), (32, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3)],
        128: [
            (64, 64, 4, 2),
            (64, 64, 4, 1),
            (64, 32, 4, 2),
            (128, 64, 8, 2),
            (32, 32, 4, 2),
            (64, 64, 8, 2),  # these two spill no registers where the default does (launch/tools/kernel_resources.py)
            (64, 64, 8, 3),
        ],
        256: [(64, 64, 8, 1), (32, 32, 4, 1), (64, 32, 4, 1), (64, 32, 8, 2)],  # 32 x 64 spills kilobytes
    },
    "portable.dq": {
        64: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 1)],
        256: [(64, 32, 4, 1), (32, 32, 4, 1), (64, 64, 8, 1), (128, 32, 8, 1)],
    },
    "sm90.bwd": {  # BLOCK_M query rows a step, BLOCK_N keys a program (half each consumer's), Q and dO ring depth
        64: [(128, 128, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3)],
        128: [(64, 128, 4, 2), (64, 128, 4, 3)],
        256: [(64, 64, 4, 1)],  # the consumers split the columns; a second Q and dO slot exceeds shared memory
    },
    "sm90.dkdv": {
        64: [(64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 4, 2), (32, 128, 4, 2)],
        128: [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2), (32, 128, 4, 3)],
    },
    "sm90.dq": {  # BLOCK_M rows per program (split between the consumers), BLOCK_N keys per loop step
        64: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (64, 128, 4, 2)],
        128: [(128, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 4, 2)],
    },
    "sm90.fwd": {  # num_warps: the first consumer's warpgroup; num_stages: the key and value rings' depth
        64: [(128, 128, 4, 3), (128, 128, 4, 2), (128, 128, 4, 4)],
        128: [(128, 128, 4, 2), (128, 128, 4, 3)],
        256: [(128, 64, 4, 2)],  # three slots of 64 keys would need 256 KiB of shared memory
    },
}
# D = 96 runs in 128-column tiles (padded_head_dim) on every kernel that takes it: D = 128's candidates
CANDIDATES = {kernel: {**by_dim, 96: by_dim[128]} for kernel, by_dim in CANDIDATES.items()}
GPU = Target((9, 0))  # the configs the tables give a Hopper GPU


def _default_config(kernel: str, head_dim: int, softcapped: bool = False) -> tuple | None:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that the tables give `kernel` for bf16 on a Hopper GPU, soft-capped
    or not (None where the Hopper table does not take the head dim)."""
    config = launch_config(kernel, head_dim, torch.bfloat16, GPU, softcapped)
    return None if config is None else tuple(config.__dict__.values())


def _check_defaults(head_dims: list[int]) -> None:
    """The first candidate of each list must be what the tables give today (it is reported as the default)."""
    for kernel, by_dim in CANDIDATES.items():
        for head_dim in head_dims:
            current = _default_config(kernel, head_dim)
            if current is not None and by_dim[head_dim][0] != current:
                raise AssertionError(
                    f"{kernel} D{head_dim}: first candidate {by_dim[head_dim][0]} != default {current}"
                )


def use_configs(best: dict):
    """A context in which 16-bit launches take the configs of a sweep's "best" record (keys like "portable.dq
    D128"), at every head dim the kernel is taken at; for timing candidates before committing them to the tables."""
    chosen = {key.split(" D")[0]: LaunchConfig(*b["config"]) for key, b in best.items()}
    return override_configs(chosen)


def _backend(kernel: str) -> str:
    return kernel.split(".")[0]


def _bwd_call(dout, q, k, v, stats, scale: float, causal: bool, scores: dict) -> BwdCall:
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return BwdCall(dout, q, k, v, stats, *grads, scale, causal, **scores)


def _launched(kernel: str, q, k, v, causal: bool, scores: dict) -> bool:
    """Whether the swept call, on `kernel`'s backend, runs `kernel`: asked of the dispatch, nothing run."""
    if kernel.endswith(".fwd"):
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float64, device=q.device)
        launch = fwd_launch(FwdCall(q, k, v, 1.0, causal, torch.empty_like(q), lse, **scores), _backend(kernel))
        return launch.name == kernel
    stats = torch.empty(3, q.shape[0], q.shape[2], q.shape[1], device=q.device)
    call = _bwd_call(q, q, k, v, stats, 1.0, causal, scores)
    return kernel in [launch.name for launch in bwd_launches(call, _backend(kernel))]


def _bwd_kernel_alone(kernel: str, dout, q, k, v, out, lse, scale: float, causal: bool, scores: dict):
    """The launch of backward kernel `kernel` alone, on buffers of its own, the row stats computed once."""
    call = _bwd_call(dout, q, k, v, attn_bwd_preprocess(out, dout, lse), scale, causal, scores)
    return next(launch for launch in bwd_launches(call, _backend(kernel)) if launch.name == kernel)


def swept_configs(
    kernels: list[str], head_dims: list[int], configs: list[str] | None, defaults: bool, softcapped: bool = False
) -> dict:
    """kernel -> head dim -> the configs to time: CANDIDATES, or `configs` ("BLOCK_M,BLOCK_N,warps,stages" each) for
    every kernel, or (defaults) each kernel's default config alone, soft-capped or not."""
    if defaults:
        return {kernel: {d: [_default_config(kernel, d, softcapped)] for d in head_dims} for kernel in kernels}
    if configs:
        given = [tuple(map(int, c.split(","))) for c in configs]
        return {kernel: dict.fromkeys(head_dims, given) for kernel in kernels}
    return {kernel: CANDIDATES[kernel] for kernel in kernels}


def _time_config(kernel, q, k, v, dout, out, lse, want_bwd, scale, causal, scores, rep, flops) -> dict:
    """ms, tflops and kernel_ms of the swept call at the config in force, or its error: one that does not fit the
    GPU, or a result off the portable kernels'."""
    fwd = kernel.endswith(".fwd")
    try:
        if fwd:
            run = partial(attn_fwd, q, k, v, scale, causal, backend=_backend(kernel), **scores)
            got, want = run()[0], out
        else:
            run = partial(attn_bwd, dout, q, k, v, out, lse, scale, causal, backend=_backend(kernel), **scores)
            got, want = torch.cat([g.flatten() for g in run()]), torch.cat([g.flatten() for g in want_bwd])
    except OutOfResources as exc:  # e.g. more shared memory than the GPU has: not a candidate here
        return dict(error=str(exc)[:200])
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    if not err < 1e-2:  # a wrong result is no candidate either
        return dict(error=f"result off the portable kernels' by {err:.2e}")
    ms = do_bench(run, warmup=10, rep=rep, return_mode="median")
    kernel_ms = ms  # the forward is one kernel
    if not fwd:
        alone = _bwd_kernel_alone(kernel, dout, q, k, v, out, lse, scale, causal, scores)
        kernel_ms = do_bench(alone, warmup=10, rep=rep, return_mode="median")
    return dict(ms=ms, tflops=flops[fwd] / ms / 1e9, kernel_ms=kernel_ms)


def sweep(seqlen: int, head_dim: int, kv_heads: int, causal: bool, scores: dict, rep: int, candidates: dict) -> list:
    """Time each candidate config of each kernel in `candidates` (kernel -> head dim -> configs), the scores
    windowed and soft-capped as `scores` (window, softcap) says."""
    batch = TOKENS // seqlen
    scale = head_dim**-0.5
    q, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = {
        fwd: attention_flops(batch, HEADS, seqlen, head_dim, causal, "fwd" if fwd else "bwd", scores["window"])
        for fwd in (True, False)
    }
    out, lse = attn_fwd(q, k, v, scale, causal, backend="portable", **scores)  # the reference: the portable kernels
    want_bwd = attn_bwd(dout, q, k, v, out, lse, scale, causal, backend="portable", **scores)
    records = []
    for kernel, by_dim in candidates.items():
        if not _launched(kernel, q, k, v, causal, scores):
            continue
        for config in by_dim[head_dim]:
            base = dict(kernel=kernel, config=list(config), S=seqlen, B=batch, H=HEADS, Hkv=kv_heads, D=head_dim,
                        causal=causal, window=list(scores["window"]), softcap=scores["softcap"])  # fmt: skip
            label = f"D{head_dim} Hkv{kv_heads} causal={causal!s:5} {kernel:13} {config}"
            with override_configs({kernel: LaunchConfig(*config)}):
                record = _time_config(kernel, q, k, v, dout, out, lse, want_bwd, scale, causal, scores, rep, flops)
            records.append(dict(base, **record))
            print(f"{label}: {record}", flush=True)
    return records


def best_configs(records: list[dict]) -> dict:
    """Per swept (kernel, D): the config with the least total time over the causal settings and K/V head
    counts, among configs that ran in all of them, and the default's total (None if the default could not
    run or was not swept)."""
    best = {}
    for kernel, head_dim in sorted({(r["kernel"], r["D"]) for r in records}):
        mine = [r for r in records if r["kernel"] == kernel and r["D"] == head_dim]
        failed = {tuple(r["config"]) for r in mine if "ms" not in r}
        totals: dict = {}
        for r in mine:
            if tuple(r["config"]) not in failed:
                totals[tuple(r["config"])] = totals.get(tuple(r["config"]), 0.0) + r["ms"]
        if totals:
            winner = min(totals, key=totals.get)
            softcapped = any(r["softcap"] for r in mine)
            default_ms = totals.get(_default_config(kernel, head_dim, softcapped))
            best[f"{kernel} D{head_dim}"] = dict(config=list(winner), ms=totals[winner], default_ms=default_ms)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 96, 128, 256])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[HEADS], help="8 for GQA 32:8")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=None,
        choices=list(CANDIDATES),
        help="default: all; each is timed on its backend where the dispatch launches it",
    )
    parser.add_argument("--configs", nargs="+", default=None, help="BLOCK_M,BLOCK_N,warps,stages each: these only")
    parser.add_argument("--defaults", action="store_true",
                        help="each kernel at its default config only, --configs ignored")  # fmt: skip
    parser.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                        help="time the sliding-window form (-1: no limit on that side)")  # fmt: skip
    parser.add_argument("--softcap", type=float, default=0.0, help="time the soft-capped form")
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it times the kernels on a GPU: it needs one (kernel_resources.py compiles them without)")
    _check_defaults(args.head_dims)
    args.kernels = args.kernels or list(CANDIDATES)
    candidates = swept_configs(args.kernels, args.head_dims, args.configs, args.defaults, bool(args.softcap))
    window = (None, None) if args.window is None else tuple(None if side < 0 else side for side in args.window)
    scores = dict(window=window, softcap=args.softcap)
    records = []
    for head_dim in args.head_dims:
        for kv_heads in args.kv_heads:
            for causal in (False, True):
                records += sweep(args.seqlen, head_dim, kv_heads, causal, scores, args.rep, candidates)
    best = best_configs(records)
    for name, b in best.items():
        default = "could not run" if b["default_ms"] is None else f"{b['default_ms']:.3f} ms"
        print(f"best {name}: {tuple(b['config'])} {b['ms']:.3f} ms (default {default})")
    env = env_record(torch.device("cuda"), dtype="bfloat16", tokens=TOKENS)
    write_json(args.out, env, [*records, dict(kind="best", **best)])


if __name__ == "__main__":
    main()
