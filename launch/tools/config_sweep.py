"""Time each attention kernel under a list of launch configs, to pick ops/attn.py's `_fwd_config`,
`_bwd_dkdv_config` and `_bwd_dq_config` (or, where ops/warp_spec.py takes the warp-specialised kernels,
`_fwd_ws_config`, `_bwd_dkdv_ws_config` and `_bwd_dq_ws_config`, and where ops/gluon_fwd.py takes the Gluon
forward, `_fwd_gluon_config`: num_stages is its rings' depth) for 16-bit inputs on the GPU at hand.

    PYTHONPATH=. python3 launch/tools/config_sweep.py --out docs/benchmarks/config_sweep_h200.json

    PYTHONPATH=. python3 launch/tools/config_sweep.py --kernels dkdv --head-dims 128 --kv-heads 32 8 --configs 64,64,4,2

bf16, Hq = 32, B x S = 32768 tokens (S = --seqlen), per head dim, K/V head count (--kv-heads; 8 is
GQA 32:8) and causal setting. A config is (BLOCK_M, BLOCK_N, num_warps, num_stages); --configs replaces
the candidate lists of the swept --kernels. The forward is timed alone; a dK/dV config is timed as the
whole backward with the default dQ config, and a dQ config with the default dK/dV config, so the two
backward sweeps differ only in the kernel under test (each record also holds the time of the kernel
under test alone, kernel_ms). TFLOP/s: forward 4 B H S^2 D (x 0.5 causal), backward 2.5 x that.
Every config's result is checked against the default kernels' (no warp-specialised or Gluon kernel) before timing; a
config off them is recorded with its error, as one that does not fit. Prints the best config
per kernel and head dim (least time summed over the K/V head counts and causal settings it runs in) and writes
all timings as JSON; launch/bench/bench_kernel.py --configs launches with those best configs.
"""

import argparse
import os
from functools import partial
from unittest import mock

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

import ringattn.ops.attn as attn_ops
from ringattn.benchmark import attention_flops, env_record, write_json

TOKENS, HEADS = 32768, 32
CANDIDATES = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages); the first entry of each list is the current default
    "fwd": {
        64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4)],
        128: [(128, 128, 8, 3), (128, 64, 8, 3)],
    },
    "dkdv": {  # BLOCK_M query rows per loop step, BLOCK_N keys per program
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
    },
    "dq": {
        64: [(128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3)],
        128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 1)],
    },
    "fwd_ws": {  # num_warps: the consumers' warpgroup (ops/attn.py)
        64: [(128, 128, 4, 2), (128, 64, 4, 2), (128, 128, 4, 3)],
        128: [(128, 128, 4, 2), (128, 64, 4, 2), (128, 128, 4, 3)],
    },
    "dkdv_ws": {
        64: [(64, 128, 4, 2), (64, 128, 4, 3), (128, 128, 4, 2), (32, 128, 4, 2)],
        128: [(64, 128, 4, 2), (64, 128, 4, 3), (32, 128, 4, 2), (32, 128, 4, 3)],
    },
    "dq_ws": {  # BLOCK_M rows per program (split between the consumers), BLOCK_N keys per loop step
        64: [(128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 4, 2), (64, 128, 4, 2)],
        128: [(128, 64, 4, 2), (128, 64, 4, 3), (64, 128, 4, 2), (128, 128, 4, 2)],
    },
    "fwd_gluon": {  # num_warps: the first consumer's warpgroup; num_stages: the key and value rings' depth
        64: [(128, 128, 4, 3), (128, 128, 4, 2), (128, 128, 4, 4)],
        128: [(128, 128, 4, 2), (128, 128, 4, 3)],
    },
}
CONFIG_FUNCTIONS = {"fwd": "_fwd_config", "dkdv": "_bwd_dkdv_config", "dq": "_bwd_dq_config",
                    "fwd_ws": "_fwd_ws_config", "dkdv_ws": "_bwd_dkdv_ws_config",
                    "dq_ws": "_bwd_dq_ws_config", "fwd_gluon": "_fwd_gluon_config"}  # fmt: skip


DEFAULT_FUNCTIONS = {kernel: getattr(attn_ops, name) for kernel, name in CONFIG_FUNCTIONS.items()}


def _set_config(kernel: str, config: tuple | None) -> None:
    """Make ops/attn.py's config function of `kernel` return `config` (None: restore the default)."""
    function = DEFAULT_FUNCTIONS[kernel] if config is None else (lambda *_: attn_ops.LaunchConfig(*config))
    setattr(attn_ops, CONFIG_FUNCTIONS[kernel], function)


def use_configs(best: dict) -> None:
    """Make ops/attn.py launch 16-bit CUDA inputs with the configs of a sweep's "best" record (keys like
    "dq D128"); other dtypes, devices and head dims keep the defaults. For timing candidates before
    committing them to ops/attn.py."""
    for kernel, name in CONFIG_FUNCTIONS.items():
        chosen = {
            int(key.split(" D")[1]): tuple(b["config"]) for key, b in best.items() if key.startswith(kernel + " ")
        }

        def function(block_d, dtype, device, default=DEFAULT_FUNCTIONS[kernel], chosen=chosen):
            if device.type == "cuda" and dtype != torch.float32 and block_d in chosen:
                return attn_ops.LaunchConfig(*chosen[block_d])
            return default(block_d, dtype, device)

        setattr(attn_ops, name, function)


def _default_config(kernel: str, head_dim: int) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that ops/attn.py launches today for bf16 on a GPU."""
    return tuple(DEFAULT_FUNCTIONS[kernel](head_dim, torch.bfloat16, torch.device("cuda")).__dict__.values())


def _check_defaults(head_dims: list[int]) -> None:
    """The first candidate of each list must be what ops/attn.py launches today (it is reported as the default)."""
    for kernel, by_dim in CANDIDATES.items():
        for head_dim in head_dims:
            current = _default_config(kernel, head_dim)
            if by_dim[head_dim][0] != current:
                raise AssertionError(
                    f"{kernel} D{head_dim}: first candidate {by_dim[head_dim][0]} != default {current}"
                )


# each swept kernel's Triton function, as the launchers name it (ops/attn.py)
KERNEL_FUNCTIONS = {"fwd": "_attn_fwd_kernel", "fwd_ws": "_attn_fwd_ws_kernel", "fwd_gluon": "_attn_fwd_gluon_kernel",
                    "dkdv": "_attn_bwd_dkdv_kernel", "dkdv_ws": "_attn_bwd_dkdv_ws_kernel", "dq": "_attn_bwd_dq_kernel",
                    "dq_ws": "_attn_bwd_dq_ws_kernel"}  # fmt: skip


def _bwd_launch(kernel: str, dout, q, k, v, lse, delta, scale: float, causal: bool):
    """The launch of the backward's dK/dV kernel (`kernel` "dkdv" or "dkdv_ws") or dQ kernel ("dq", "dq_ws"), as the
    launchers pick it, at its current config, into new gradients."""
    grads = [torch.empty_like(t) for t in (q, k, v)]
    block_d = attn_ops._padded_head_dim(q.shape[-1])
    cfgs = attn_ops._bwd_configs(block_d, q.dtype, q.device)
    launches = attn_ops._bwd_launches(
        dout, q, k, v, lse, delta, *grads, scale, causal, None, None, False, False, None, *cfgs
    )
    return launches[1] if kernel.startswith("dq") else launches[0]


def _bwd_kernel_alone(kernel: str, dout, q, k, v, out, lse, scale: float, causal: bool):
    """The launch of backward kernel `kernel` alone (_bwd_launch) on buffers of its own, delta computed once."""
    return _bwd_launch(kernel, dout, q, k, v, lse, attn_ops.attn_bwd_preprocess(out, dout), scale, causal)


def _launched(kernel: str, q, k, v, causal: bool) -> bool:
    """Whether the swept call runs `kernel`: asked of the launchers themselves (which of the default,
    warp-specialised and Gluon kernels they pick for these inputs), nothing run."""
    stats = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    if kernel.startswith("fwd"):
        out = torch.empty_like(q)
        launch = attn_ops._pick_fwd_launch(q, k, v, 1.0, causal, out, stats, None, None, False, None)
    else:
        launch = _bwd_launch(kernel, q, q, k, v, stats, stats, 1.0, causal)
    return launch.kernel.__name__ == KERNEL_FUNCTIONS[kernel]


def _default_kernels_only():
    """$RINGATTN_WS=0 and $RINGATTN_GLUON=0 inside: no warp-specialised or Gluon kernel; the settings before come
    back after."""
    return mock.patch.dict(os.environ, RINGATTN_WS="0", RINGATTN_GLUON="0")


def swept_configs(kernels: list[str], head_dims: list[int], configs: list[str] | None, defaults: bool) -> dict:
    """kernel -> head dim -> the configs to time: CANDIDATES, or `configs` ("BLOCK_M,BLOCK_N,warps,stages" each) for
    every kernel, or (defaults) each kernel's default config alone."""
    if defaults:
        return {kernel: {d: [_default_config(kernel, d)] for d in head_dims} for kernel in kernels}
    if configs:
        given = [tuple(map(int, c.split(","))) for c in configs]
        return {kernel: dict.fromkeys(head_dims, given) for kernel in kernels}
    return {kernel: CANDIDATES[kernel] for kernel in kernels}


def sweep(seqlen: int, head_dim: int, kv_heads: int, causal: bool, rep: int, candidates: dict) -> list[dict]:
    """Time each candidate config of each kernel in `candidates` (kernel -> head dim -> configs)."""
    batch = TOKENS // seqlen
    scale = head_dim**-0.5
    q, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fwd_flops, bwd_flops = (attention_flops(batch, HEADS, seqlen, head_dim, causal, mode) for mode in ("fwd", "bwd"))
    with _default_kernels_only():  # the reference: the default kernels, checked everywhere
        out, lse = attn_ops.attn_fwd(q, k, v, scale, causal)
        want_bwd = attn_ops.attn_bwd(dout, q, k, v, out, lse, scale, causal)
    records = []
    for kernel, by_dim in candidates.items():
        if not _launched(kernel, q, k, v, causal):
            continue
        for config in by_dim[head_dim]:
            _set_config(kernel, config)
            base = dict(kernel=kernel, config=list(config), S=seqlen, B=batch, H=HEADS, Hkv=kv_heads, D=head_dim,
                        causal=causal)  # fmt: skip
            label = f"D{head_dim} Hkv{kv_heads} causal={causal!s:5} {kernel:4} {config}"
            try:
                if kernel.startswith("fwd"):
                    run = partial(attn_ops.attn_fwd, q, k, v, scale, causal)
                    got, want, flops = run()[0], out, fwd_flops
                else:
                    run = partial(attn_ops.attn_bwd, dout, q, k, v, out, lse, scale, causal)
                    got, want, flops = (
                        torch.cat([g.flatten() for g in run()]),
                        torch.cat([g.flatten() for g in want_bwd]),
                        bwd_flops,
                    )
            except OutOfResources as exc:  # e.g. more shared memory than the GPU has: not a candidate here
                _set_config(kernel, None)
                records.append(dict(base, error=str(exc)[:200]))
                print(f"{label}: {exc}", flush=True)
                continue
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            if not err < 1e-2:  # a wrong result is no candidate either
                _set_config(kernel, None)
                records.append(dict(base, error=f"result off the default kernels' by {err:.2e}"))
                print(f"{label}: result off the default kernels' by {err:.2e}", flush=True)
                continue
            ms = do_bench(run, warmup=10, rep=rep, return_mode="median")
            kernel_ms = ms  # the forward is one kernel
            if not kernel.startswith("fwd"):
                alone = _bwd_kernel_alone(kernel, dout, q, k, v, out, lse, scale, causal)
                kernel_ms = do_bench(alone, warmup=10, rep=rep, return_mode="median")
            _set_config(kernel, None)
            records.append(dict(base, ms=ms, tflops=flops / ms / 1e9, kernel_ms=kernel_ms))
            print(f"{label}: {ms:7.3f} ms {records[-1]['tflops']:5.0f} TFLOP/s; kernel alone {kernel_ms:7.3f} ms",
                  flush=True)  # fmt: skip
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
            default_ms = totals.get(_default_config(kernel, head_dim))
            best[f"{kernel} D{head_dim}"] = dict(config=list(winner), ms=totals[winner], default_ms=default_ms)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[HEADS], help="8 for GQA 32:8")
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=None,
        choices=list(CANDIDATES),
        help="default: all; each is timed where the backward launches it (dkdv_ws and dq_ws where ops/warp_spec.py "
        "takes them, dkdv and dq elsewhere)",
    )
    parser.add_argument("--configs", nargs="+", default=None, help="BLOCK_M,BLOCK_N,warps,stages each: these only")
    parser.add_argument("--defaults", action="store_true",
                        help="each kernel at its default config only, --configs ignored (with $RINGATTN_WS: a split "
                        "kernel against the default one, per form)")  # fmt: skip
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    _check_defaults(args.head_dims)
    args.kernels = args.kernels or list(CANDIDATES)
    candidates = swept_configs(args.kernels, args.head_dims, args.configs, args.defaults)
    records = []
    for head_dim in args.head_dims:
        for kv_heads in args.kv_heads:
            for causal in (False, True):
                records += sweep(args.seqlen, head_dim, kv_heads, causal, args.rep, candidates)
    best = best_configs(records)
    for name, b in best.items():
        default = "could not run" if b["default_ms"] is None else f"{b['default_ms']:.3f} ms"
        print(f"best {name}: {tuple(b['config'])} {b['ms']:.3f} ms (default {default})")
    env = env_record(torch.device("cuda"), dtype="bfloat16", tokens=TOKENS)
    write_json(args.out, env, [*records, dict(kind="best", **best)])


if __name__ == "__main__":
    main()
