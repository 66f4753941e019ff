"""Side-by-side attention kernel benchmark on one GPU: ringattn vs PyTorch SDPA (flash, cuDNN) and
compiled FlexAttention, same inputs, same process (protocol: shared/BENCHMARKING.md).

    PYTHONPATH=. python3 launch/bench/bench_kernel.py --append --out docs/benchmarks/kernel_h200.json  # the grid
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --long --append --out docs/benchmarks/kernel_h200.json
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --seqlens 4096 --head-dims 128 --out /tmp/k.json  # a subset

bf16, H = 32, B * S = 32768 tokens. --long replaces the grid by one cell, B = 1, S = 131072,
D = 128, causal: extra memory must stay O(S) (issue #3); a provider that runs out of memory or
refuses is recorded with its error, as everywhere. Every provider's output is checked against
an fp32 reference before it is timed: the last CHECK_ROWS query rows (they see every key,
causal or not) of the query heads of K/V heads 0..1, batch 0, against all keys, so the
reference holds 2 x (Hq / Hkv) x CHECK_ROWS x S scores, never S x S.
Timing: triton.testing.do_bench, median. TFLOP/s: forward 4 B Hq S^2 D (x 0.5 causal),
forward+backward 3.5 x that. peak_bytes is the peak memory allocated by one call of its own
(forward: the output; forward+backward: also the gradients) above what was allocated before it
(the inputs). Runs 1 and 2 of kernel_h200.json took it over the do_bench calls instead, which
counts do_bench's 256 MiB L2-flush buffer: their peak_bytes are not comparable with later runs'.

Writes a JSON list: an env record (GPU and versions, and "runs": label -> the command line's
arguments) followed by the records, each labelled with its "run" (1, 2, ...). --append adds this
run as the next label to an existing --out, keeping the earlier runs (refused if the GPU or the
versions differ); a grid too long for one command runs in parts (--head-dims, --seqlens), each
appended as its own run. Prints a markdown table with ratios; launch/bench/plot_kernel_bench.py draws the
plots (of one run, or of parts that measured different cells).
"""

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import ringattn
from ringattn import benchmark
from ringattn.benchmark import attention_flops, env_record, run_measuring_peak, write_json
from ringattn.ops import attn_fwd_ref

TOKENS = 32768
HEADS = 32
LONG_CELL = (1, 131072, HEADS, 128, True)  # (B, S, Hkv, D, causal) of --long
CHECK_ROWS = 1024


def _sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _flex() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}
    cell: list = [None]

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def run(q, k, v, causal):
        if cell[0] != (q.shape, k.shape, causal):
            # Compile each cell afresh: past dynamo's recompile limit (8; the grid's 24 cells compile
            # twice each, with and without grad) flex_attention would silently run unfused, S x S.
            cell[0] = (q.shape, k.shape, causal)
            torch._dynamo.reset()
        block_mask = None
        if causal:
            key = (q.shape[2], k.shape[2])
            if key not in masks:
                masks[key] = create_block_mask(causal_mask, None, None, key[0], key[1], device=q.device)
            block_mask = masks[key]
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _ringattn(q, k, v, causal):
    return ringattn.flash_attn_func(q, k, v, causal=causal)


# provider -> (function, layout): "bshd" is (B, S, H, D), "bhsd" is (B, H, S, D)
PROVIDERS = {
    "ringattn": (_ringattn, "bshd"),
    "sdpa_flash": (_sdpa(SDPBackend.FLASH_ATTENTION), "bhsd"),
    "sdpa_cudnn": (_sdpa(SDPBackend.CUDNN_ATTENTION), "bhsd"),
    "flex": (None, "bhsd"),  # compiled lazily
}


def check_output(out_bshd: torch.Tensor, q, k, v, causal) -> float:
    """Relative L2 error of the last CHECK_ROWS query rows of K/V heads 0..1 (their query heads) of
    batch 0 against an fp32 reference over all keys; raises AssertionError above 1e-2.

    out_bshd, q: (B, S, Hq, D); k, v: (B, S, Hkv, D). The reference's causal mask is bottom-right
    aligned, so the last rows of a causal problem are checked against exactly the keys they see.
    """
    group = q.shape[2] // k.shape[2]
    q_s, k_s, v_s = q[:1, -CHECK_ROWS:, : 2 * group].float(), k[:1, :, :2].float(), v[:1, :, :2].float()
    ref, _ = attn_fwd_ref(q_s, k_s, v_s, q.shape[-1] ** -0.5, causal)
    got = out_bshd[:1, -CHECK_ROWS:, : 2 * group].float()
    err = ((got - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"output off the fp32 reference: relative error {err:.2e}")
    return err


def measure(fn: Callable, layout: str, q, k, v, dout, causal: bool, mode: str) -> dict:
    """Time one provider on one shape; returns ms and the extra peak bytes of one call."""
    if layout == "bhsd":
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    q, k, v = (t.detach().requires_grad_(mode == "fwd+bwd") for t in (q, k, v))
    if mode == "fwd":

        def step():
            return fn(q, k, v, causal)

    else:

        def step():
            fn(q, k, v, causal).backward(dout)

    step()  # compile / warm caches
    q.grad = k.grad = v.grad = None
    peak = run_measuring_peak(step, q.device)[1]
    ms = do_bench(step, warmup=50, rep=300, grad_to_none=[q, k, v] if mode == "fwd+bwd" else None,
                  return_mode="median")  # fmt: skip
    return dict(ms=ms, peak_bytes=peak)


def shapes(args) -> list[tuple[int, int, int, int, bool]]:
    """(B, S, Hkv, D, causal) cells: the MHA grid plus GQA (Hkv = 8) at D = 128."""
    cells = []
    for head_dim in args.head_dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                cells.append((TOKENS // seqlen, seqlen, HEADS, head_dim, causal))
    if 128 in args.head_dims and not args.no_gqa:
        for seqlen in args.seqlens:
            for causal in (False, True):
                cells.append((TOKENS // seqlen, seqlen, 8, 128, causal))
    return cells


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--no-gqa", action="store_true")
    parser.add_argument("--long", action="store_true", help="only the cell B=1, S=131072, D=128, causal")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--append", action="store_true", help="add this run to --out as the next run label")
    parser.add_argument(
        "--configs", default=None, help="launch ringattn with the best configs of a config_sweep.py JSON"
    )
    args = parser.parse_args()
    if args.append and not args.out:
        parser.error("--append needs --out")
    if args.configs:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
        from config_sweep import use_configs  # launch/tools/config_sweep.py

        with open(args.configs) as f:
            use_configs(next(r for r in json.load(f) if r.get("kind") == "best"))

    env = env_record(torch.device("cuda"), dtype="bfloat16", tokens=TOKENS)
    try:
        env, earlier, run = start_run(env, args.out if args.append else None, shlex.join(sys.argv[1:]))
    except ValueError as exc:
        parser.error(str(exc))
    records = []
    fns = {name: fn for name, (fn, _) in PROVIDERS.items()}
    if "flex" in args.providers:
        fns["flex"] = _flex()
    for batch, seqlen, heads_k, head_dim, causal in [LONG_CELL] if args.long else shapes(args):
        gen = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
        q, dout = (torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                   for _ in range(2))  # fmt: skip
        k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
                for _ in range(2))  # fmt: skip
        for provider in args.providers:
            fn, layout = fns[provider], PROVIDERS[provider][1]
            base = dict(provider=provider, B=batch, S=seqlen, H=HEADS, Hkv=heads_k, D=head_dim, causal=causal, run=run)
            try:
                qq, kk, vv = (t.transpose(1, 2).contiguous() for t in (q, k, v)) if layout == "bhsd" else (q, k, v)
                out = fn(qq, kk, vv, causal)
                check_output(out.transpose(1, 2) if layout == "bhsd" else out, q, k, v, causal)
                del out
            except Exception as exc:  # a backend that refuses the shape is recorded, not fatal
                records.append(dict(base, mode="fwd", error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                print(f"{provider:10} S{seqlen:>6} D{head_dim} Hkv{heads_k} causal={causal}: {records[-1]['error']}")
                continue
            for mode in args.modes:
                try:
                    result = measure(fn, layout, q, k, v, dout, causal, mode)
                except Exception as exc:
                    records.append(dict(base, mode=mode, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    continue
                tflops = attention_flops(batch, HEADS, seqlen, head_dim, causal, mode) / result["ms"] / 1e9
                records.append(dict(base, mode=mode, tflops=tflops, **result))
                print(f"{provider:10} S{seqlen:>6} D{head_dim} Hkv{heads_k:>2} causal={causal!s:5} {mode:8} "
                      f"{result['ms']:8.3f} ms {tflops:6.1f} TFLOP/s peak +{result['peak_bytes'] / 2**20:8.1f} MiB",
                      flush=True)  # fmt: skip
            torch.cuda.empty_cache()
        write_json(args.out, env, [*earlier, *records])  # after every cell: a run cut short keeps what it measured
    print(markdown_table(records))


def read_results(path: str) -> tuple[dict, list[dict]]:
    """The env record and the records (of every run) of a JSON written by main."""
    with open(path) as f:
        env, *records = json.load(f)
    return env, records


def start_run(env: dict, append_to: str | None, command: str) -> tuple[dict, list[dict], int]:
    """(env record with this run's command under its label, earlier records to keep, this run's label).

    Appending to an existing JSON takes the label after its runs' and keeps them; otherwise the run
    is 1 alone. Raises ValueError when that JSON was measured on another GPU or other versions.
    """
    earlier: list[dict] = []
    runs: dict[str, str] = {}
    if append_to is not None and os.path.exists(append_to):
        old_env, earlier = read_results(append_to)
        changed = sorted(key for key in env if old_env.get(key) != env[key])
        if changed:
            raise ValueError(f"{append_to} was measured with other {', '.join(changed)}: write this run to a new file")
        runs = old_env["runs"]
    run = max(map(int, runs), default=0) + 1
    return dict(env, runs={**runs, str(run): command}), earlier, run


def markdown_table(records: list[dict]) -> str:
    """One row per (D, Hkv, causal, S, mode): TFLOP/s of each provider and ringattn's ratio to each."""
    timed = [r for r in records if "tflops" in r]
    providers = sorted({r["provider"] for r in timed}, key=list(PROVIDERS).index)
    others = [p for p in providers if p != "ringattn"]
    head = ["D", "Hkv", "causal", "S", "mode", *providers, *(f"ours/{p}" for p in others)]
    cells: dict = {}
    for r in timed:
        cells.setdefault((r["D"], r["Hkv"], r["causal"], r["S"], r["mode"]), {})[r["provider"]] = r["tflops"]
    rows = []
    for key in sorted(cells):
        row = cells[key]
        vals = [f"{row[p]:.0f}" if p in row else "-" for p in providers]
        ratios = [f"{row['ringattn'] / row[p]:.2f}" if "ringattn" in row and p in row else "-" for p in others]
        d, hkv, causal, s, mode = key
        rows.append([d, hkv, "yes" if causal else "no", s, mode, *vals, *ratios])
    return benchmark.markdown_table(head, rows)


if __name__ == "__main__":
    main()
