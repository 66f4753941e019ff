"""Attention kernels side by side on one GPU: ringattn, cuDNN, FlashAttention-2, FlexAttention and FlashAttention-4.

Every provider runs in the same process on the same inputs.

    PYTHONPATH=. python3 launch/bench/bench_kernel.py --out docs/benchmarks/kernel_h200.json          # the grid
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --long --append --out docs/benchmarks/kernel_h200.json
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --seqlens 4096 --head-dims 128 --out /tmp/k.json  # a subset
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --provider-only ringattn fa4 --seqlens 16384 --out /tmp/k.json
    PYTHONPATH=. python3 launch/bench/bench_kernel.py --seqlens 32768 --head-dims 128 --causal-only \
        --windows none 4096,0 --softcaps 0 30 --providers ringattn fa4 flex \
        --out docs/benchmarks/kernel_h200.json --append
    TRITON_INTERPRET=1 PYTHONPATH=. python3 launch/bench/bench_kernel.py --tiny --providers ringattn flash  # CPU

Providers (--providers, or its alias --provider-only; default: all that import):
- ringattn: ringattn.flash_attn_func, (B, S, H, D); ringattn-deterministic: the same with deterministic=True;
- cudnn, flash: F.scaled_dot_product_attention under sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) or
  ([SDPBackend.FLASH_ATTENTION]) (FlashAttention-2 inside PyTorch), (B, H, S, D), GQA by enable_gqa;
- flex: torch.compile(flex_attention), a causal (and sliding-window) create_block_mask, soft-capping as a score_mod,
  (B, H, S, D);
- fa4: flash_attn.cute.flash_attn_func (FlashAttention-4, its SM90 path on Hopper), (B, S, H, D), when
  `from flash_attn.cute import flash_attn_func` imports.
cudnn and flash take neither sliding windows nor soft-capping: such cells list them with an error.

Grid: bf16, H = --heads (32), B * S = --tokens (32768), S in --seqlens, D in --head-dims, causal and not, MHA
and (at D = 128, unless --no-gqa) GQA with Hkv = 8 (--causal-only: the causal cells alone), each with every sliding
window of --windows (flash-attn's window_size as LEFT,RIGHT, -1 for no limit; "none") and every soft-cap of
--softcaps (0: none). --long replaces the grid by one cell, B = 1, S = 131072,
D = 128, causal: extra memory must stay O(S). A provider that refuses a cell or runs out of memory is listed
with its error, not timed. Every provider's output is checked against an fp32 reference before it is timed:
the last CHECK_ROWS query rows (they see every key, causal or not) of the query heads of K/V heads 0..1, batch 0,
against all keys, so the reference holds 2 x (H / Hkv) x CHECK_ROWS x S scores, never S x S.

Timing: triton.testing.do_bench (warm-up 50 ms, 300 ms of calls), median, every provider in the same run.
TFLOP/s: forward 4 B H S^2 D (x 0.5 causal; with a window 4 B H D x the visible pairs), forward+backward 3.5 x
that. peak_bytes: the peak memory allocated
(torch.cuda.max_memory_allocated) during one call of its own above what was allocated before it (the inputs);
forward: the output and the kernel's workspace, forward+backward: also the gradients. On the CPU (--tiny: the
Triton interpreter, fp32) times are perf_counter medians and peak_bytes is null: a dry run of the script.

Writes --out as JSON: {"environment": {gpu, torch, triton, cuda, python, dtype, tokens, heads, fa4, commands},
"records": [{provider, B, S, H, Hkv, D, causal, window ([left, right], -1: no limit), softcap, mode ("fwd" |
"fwd+bwd"), ms, tflops, peak_bytes}, ...], "errors": [{provider, B, S, H, Hkv, D, causal, window, softcap, mode,
error}, ...]}, after every cell (a run cut short keeps what it measured). --append merges this run into an existing
--out: its records and errors replace those of the same cell (CELL_KEYS), the others are kept, and its command line
is added to "commands"; refused when the file was measured on another GPU or other versions. Prints a markdown
table with ratios; launch/bench/plot_kernel_bench.py draws the plots.
"""

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import ringattn
from ringattn import benchmark
from ringattn.benchmark import (
    attention_flops,
    environment,
    host_median_s,
    parse_with_tiny,
    run_measuring_peak,
    script_parser,
    write_records,
)
from ringattn.ops import attn_fwd_ref

PROVIDERS = ("ringattn", "ringattn-deterministic", "cudnn", "flash", "flex", "fa4")
# "bshd": (B, S, H, D), "bhsd": (B, H, S, D)
LAYOUTS = {"ringattn": "bshd", "ringattn-deterministic": "bshd", "cudnn": "bhsd", "flash": "bhsd", "flex": "bhsd",
           "fa4": "bshd"}  # fmt: skip
MODES = ("fwd", "fwd+bwd")
CELL_KEYS = ("provider", "B", "S", "H", "Hkv", "D", "causal", "window", "softcap", "mode")  # one measurement
NO_WINDOW = [-1, -1]  # flash-attn's window_size for none, as records hold it
IDENTITY = ("gpu", "torch", "triton", "cuda", "dtype", "fa4")  # what --append requires to be the same
LONG_CELL = (1, 131072, 128, True)  # (B, S, D, causal) of --long, Hkv = H
GQA_KV_HEADS = 8
CHECK_ROWS = 1024
CPU_CALLS = 3  # timed calls per measurement on the CPU
TINY = dict(seqlens=[32], head_dims=[16], heads=2, tokens=64)


def fa4_function() -> Callable | None:
    """FlashAttention-4's flash_attn_func, or None when `from flash_attn.cute import flash_attn_func` fails."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # noqa: BLE001 - not installed, or built for another GPU or CUDA: no fa4 provider
        return None
    return flash_attn_func


def fa4_version() -> str | None:
    """The installed FlashAttention-4's version (the flash-attn-4 distribution, else flash_attn's own), or None
    when flash_attn.cute does not import."""
    if fa4_function() is None:
        return None
    try:
        return metadata.version("flash-attn-4")
    except metadata.PackageNotFoundError:
        import flash_attn

        return getattr(flash_attn, "__version__", "unknown")


def _window(window: list[int]) -> tuple[int | None, int | None]:
    """flash-attn's window_size (-1: no limit) as (left, right) with None for no limit."""
    return tuple(None if side < 0 else side for side in window)


def _sdpa(backend: SDPBackend) -> Callable:
    def run(q, k, v, causal, window, softcap):  # (B, H, S, D), (B, Hkv, S, D) -> (B, H, S, D)
        if window != NO_WINDOW or softcap:
            raise ValueError("SDPA takes neither sliding windows nor soft-capping")
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _flex() -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks: dict = {}
    cell: list = [None]

    def band_mask(causal: bool, window: tuple[int | None, int | None], shift: int) -> Callable:
        left, right = window
        if causal:
            right = 0 if right is None else min(right, 0)

        def mask(b, h, q_idx, kv_idx):  # bottom-right: row i sees keys from i + shift - left to i + shift + right
            diagonal = q_idx + shift
            visible = kv_idx >= 0
            if left is not None:
                visible = visible & (kv_idx >= diagonal - left)
            if right is not None:
                visible = visible & (kv_idx <= diagonal + right)
            return visible

        return mask

    def run(q, k, v, causal, window, softcap):  # (B, H, S, D), (B, Hkv, S, D) -> (B, H, S, D)
        if cell[0] != (q.shape, k.shape, causal, window, softcap):
            # Compile each cell afresh: past dynamo's recompile limit (8; the grid's 24 cells compile
            # twice each, with and without grad) flex_attention would silently run unfused, S x S.
            cell[0] = (q.shape, k.shape, causal, window, softcap)
            torch._dynamo.reset()
        block_mask = None
        if causal or window != NO_WINDOW:
            key = (q.shape[2], k.shape[2], causal, tuple(window))
            if key not in masks:
                mask = band_mask(causal, _window(window), key[1] - key[0])
                masks[key] = create_block_mask(mask, None, None, key[0], key[1], device=q.device)
            block_mask = masks[key]
        score_mod = None
        if softcap:

            def score_mod(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)

        return compiled(q, k, v, block_mask=block_mask, score_mod=score_mod, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _fa4(flash_attn_func: Callable) -> Callable:
    def run(q, k, v, causal, window, softcap):  # (B, S, H, D), (B, S, Hkv, D) -> (B, S, H, D)
        options = {}
        if window != NO_WINDOW:
            options["window_size"] = _window(window)
        if softcap:
            options["softcap"] = softcap
        result = flash_attn_func(q, k, v, causal=causal, **options)
        return result[0] if isinstance(result, tuple) else result  # (out, lse)

    return run


def _ringattn(deterministic: bool) -> Callable:
    def run(q, k, v, causal, window, softcap):  # (B, S, H, D), (B, S, Hkv, D) -> (B, S, H, D)
        return ringattn.flash_attn_func(q, k, v, causal=causal, window_size=tuple(window), softcap=softcap,
                                        deterministic=deterministic)  # fmt: skip

    return run


def provider_functions(names: list[str]) -> dict[str, Callable]:
    """name -> fn(q, k, v, causal, window, softcap) -> out, in the provider's layout (LAYOUTS), window flash-attn's
    [left, right] (-1: no limit), softcap 0 for none. Raises ValueError for fa4 when
    flash_attn.cute does not import."""
    fns: dict[str, Callable] = {}
    for name in names:
        if name in ("ringattn", "ringattn-deterministic"):
            fns[name] = _ringattn(name == "ringattn-deterministic")
        elif name in ("cudnn", "flash"):
            fns[name] = _sdpa(SDPBackend.CUDNN_ATTENTION if name == "cudnn" else SDPBackend.FLASH_ATTENTION)
        elif name == "flex":
            fns[name] = _flex()
        else:
            fa4 = fa4_function()
            if fa4 is None:
                raise ValueError("provider fa4: `from flash_attn.cute import flash_attn_func` does not import")
            fns[name] = _fa4(fa4)
    return fns


def check_output(out_bshd: torch.Tensor, q, k, v, causal, window=NO_WINDOW, softcap=0.0) -> float:
    """Relative L2 error of the last CHECK_ROWS query rows of K/V heads 0..1 (their query heads) of
    batch 0 against an fp32 reference over all keys (with the cell's window and softcap); raises AssertionError
    above 1e-2.

    out_bshd, q: (B, S, Hq, D); k, v: (B, S, Hkv, D). The reference's causal mask is bottom-right
    aligned, so the last rows of a causal problem are checked against exactly the keys they see.
    """
    group = q.shape[2] // k.shape[2]
    q_s, k_s, v_s = q[:1, -CHECK_ROWS:, : 2 * group].float(), k[:1, :, :2].float(), v[:1, :, :2].float()
    ref, _ = attn_fwd_ref(q_s, k_s, v_s, q.shape[-1] ** -0.5, causal, window=_window(window), softcap=softcap)
    got = out_bshd[:1, -CHECK_ROWS:, : 2 * group].float()
    err = ((got - ref).norm() / ref.norm()).item()
    if not err < 1e-2:
        raise AssertionError(f"output off the fp32 reference: relative error {err:.2e}")
    return err


def measure(fn: Callable, layout: str, q, k, v, dout, options: tuple, mode: str) -> dict:
    """{"ms": median time of one call, "peak_bytes": extra peak memory of one call (None on the CPU)} of one
    provider on one cell; q, dout (B, S, H, D), k, v (B, S, Hkv, D), transposed here for a "bhsd" provider;
    options (causal, window, softcap)."""
    if layout == "bhsd":
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    q, k, v = (t.detach().requires_grad_(mode == "fwd+bwd") for t in (q, k, v))
    if mode == "fwd":

        def step():
            return fn(q, k, v, *options)

    else:

        def step():
            fn(q, k, v, *options).backward(dout)

    step()  # compile / warm caches
    q.grad = k.grad = v.grad = None
    peak = run_measuring_peak(step, q.device)[1]
    if q.device.type != "cuda":
        return dict(ms=host_median_s(step, CPU_CALLS) * 1e3, peak_bytes=peak)
    ms = do_bench(step, warmup=50, rep=300, grad_to_none=[q, k, v] if mode == "fwd+bwd" else None,
                  return_mode="median")  # fmt: skip
    return dict(ms=ms, peak_bytes=peak)


def shapes(args) -> list[tuple[int, int, int, int, bool, list[int], float]]:
    """(B, S, Hkv, D, causal, window, softcap) cells: --long's one, or the MHA grid plus GQA (Hkv = 8) at D = 128,
    each with every window of --windows and soft-cap of --softcaps."""
    if args.long:
        batch, seqlen, head_dim, causal = LONG_CELL
        return [(batch, seqlen, args.heads, head_dim, causal, NO_WINDOW, 0.0)]
    masks = (True,) if args.causal_only else (False, True)
    cells = [(args.tokens // s, s, args.heads, d, c) for d in args.head_dims for s in args.seqlens for c in masks]
    if 128 in args.head_dims and not args.no_gqa:
        cells += [(args.tokens // s, s, GQA_KV_HEADS, 128, c) for s in args.seqlens for c in masks]
    return [(*cell, w, cap) for cell in cells for w in args.windows for cap in args.softcaps]


def _window_arg(text: str) -> list[int]:
    """--windows item: "none" or LEFT,RIGHT (flash-attn's window_size, -1 for no limit)."""
    if text == "none":
        return NO_WINDOW
    left, right = (int(side) for side in text.split(","))
    if left < -1 or right < -1:
        raise ValueError(text)
    return [left, right]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, TINY)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=32, help="query heads H")
    parser.add_argument("--tokens", type=int, default=32768, help="B * S of every grid cell")
    parser.add_argument("--providers", "--provider-only", nargs="+", default=None, choices=PROVIDERS, metavar="NAME",
                        help=f"providers to time, of {', '.join(PROVIDERS)} (default: all, fa4 when flash_attn.cute "
                        "imports)")  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--no-gqa", action="store_true", help="no Hkv = 8 cells")
    parser.add_argument("--causal-only", action="store_true", help="only the causal cells")
    parser.add_argument("--windows", nargs="+", type=_window_arg, default=[NO_WINDOW], metavar="LEFT,RIGHT",
                        help='sliding windows, flash-attn\'s window_size with -1 for no limit, or "none"')  # fmt: skip
    parser.add_argument("--softcaps", nargs="+", type=float, default=[0.0], help="soft-caps, 0 for none")
    parser.add_argument("--long", action="store_true", help="only the cell B=1, S=131072, D=128, causal")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--append", action="store_true", help="merge this run into --out (module docstring)")
    parser.add_argument("--configs", default=None, help="ringattn at the best configs of a config_sweep.py JSON")
    args = parse_with_tiny(parser, TINY, argv)
    if args.append and not args.out:
        parser.error("--append needs --out")
    if bad := [s for s in args.seqlens if s <= 0 or args.tokens % s]:
        parser.error(f"--seqlens {bad}: each must divide --tokens {args.tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.configs:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
        from config_sweep import use_configs  # launch/tools/config_sweep.py

        with open(args.configs) as f:
            use_configs(next(r for r in json.load(f) if r.get("kind") == "best"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
    if args.providers is None:
        args.providers = [p for p in PROVIDERS if p != "fa4" or fa4_function() is not None]
    command = shlex.join(sys.argv[1:] if argv is None else argv)
    env = environment(device, dtype=str(dtype).removeprefix("torch."), tokens=args.tokens, heads=args.heads,
                      fa4=fa4_version())  # fmt: skip
    try:
        fns = provider_functions(args.providers)
        env, records, errors = start(env, args.out if args.append else None, command)
    except ValueError as exc:
        print(f"bench_kernel.py: error: {exc}", file=sys.stderr)
        return 2
    for batch, seqlen, heads_k, head_dim, causal, window, softcap in shapes(args):
        options = (causal, window, softcap)
        new = bench_cell(fns, batch, seqlen, args.heads, heads_k, head_dim, options, args.modes, dtype, device)
        records, errors = merge(records, errors, new)
        write_records(args.out, env, records, errors=errors)  # after every cell: a run cut short keeps what it measured
    print(markdown_table(records))
    return 0


def bench_cell(fns: dict, batch: int, seqlen: int, heads: int, heads_k: int, head_dim: int, options: tuple,
               modes: list[str], dtype: torch.dtype, device: torch.device) -> list[dict]:  # fmt: skip
    """Records and errors (those with an "error" key) of every provider and mode on one cell; options (causal,
    window, softcap)."""
    causal, window, softcap = options
    gen = torch.Generator(device=device).manual_seed(seqlen + head_dim)
    q, dout = (torch.randn(batch, seqlen, heads, head_dim, device=device, generator=gen, dtype=dtype)
               for _ in range(2))  # fmt: skip
    k, v = (torch.randn(batch, seqlen, heads_k, head_dim, device=device, generator=gen, dtype=dtype)
            for _ in range(2))  # fmt: skip
    results = []
    for provider, fn in fns.items():
        layout = LAYOUTS[provider]
        base = dict(provider=provider, B=batch, S=seqlen, H=heads, Hkv=heads_k, D=head_dim, causal=causal,
                    window=window, softcap=softcap)  # fmt: skip
        what = f"{provider:8} S{seqlen:>6} D{head_dim} Hkv{heads_k:>2} causal={causal!s:5}"
        what += "" if window == NO_WINDOW else f" window={window}"
        what += f" softcap={softcap:g}" if softcap else ""
        try:
            qq, kk, vv = (t.transpose(1, 2).contiguous() for t in (q, k, v)) if layout == "bhsd" else (q, k, v)
            out = fn(qq, kk, vv, *options)
            check_output(out.transpose(1, 2) if layout == "bhsd" else out, q, k, v, *options)
            del out
        except Exception as exc:  # noqa: BLE001 - a provider that refuses the cell is listed, not fatal
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
            results += [dict(base, mode=mode, error=error) for mode in modes]
            print(f"{what}: {error}", flush=True)
            continue
        for mode in modes:
            try:
                result = measure(fn, layout, q, k, v, dout, options, mode)
            except Exception as exc:  # noqa: BLE001 - out of memory in the backward, say
                results.append(dict(base, mode=mode, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                print(f"{what} {mode:8}: {results[-1]['error']}", flush=True)
                continue
            flops = attention_flops(batch, heads, seqlen, head_dim, causal, mode, _window(window))
            tflops = flops / result["ms"] / 1e9
            results.append(dict(base, mode=mode, ms=result["ms"], tflops=tflops, peak_bytes=result["peak_bytes"]))
            peak = "" if result["peak_bytes"] is None else f" peak +{result['peak_bytes'] / 2**20:8.1f} MiB"
            print(f"{what} {mode:8} {result['ms']:8.3f} ms {tflops:6.1f} TFLOP/s{peak}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def cell_key(r: dict) -> tuple:
    """CELL_KEYS of a record or error; window and softcap default to none (records written before they existed)."""
    defaults = dict(window=NO_WINDOW, softcap=0.0)
    key = [r[k] if k in r else defaults[k] for k in CELL_KEYS]
    key[CELL_KEYS.index("window")] = tuple(key[CELL_KEYS.index("window")])
    return tuple(key)


def merge(records: list[dict], errors: list[dict], new: list[dict]) -> tuple[list[dict], list[dict]]:
    """(records, errors) with `new`'s results (records, and errors: those with "error") replacing those of the
    same cell (CELL_KEYS), the others kept in their order, then the new ones."""
    replaced = {cell_key(r) for r in new}
    records = [r for r in records if cell_key(r) not in replaced] + [r for r in new if "error" not in r]
    errors = [r for r in errors if cell_key(r) not in replaced] + [r for r in new if "error" in r]
    return records, errors


def read_results(path: str) -> tuple[dict, list[dict], list[dict]]:
    """(environment, records, errors) of a JSON written by main; raises ValueError for a JSON of another form."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not {"environment", "records"} <= data.keys():
        raise ValueError(f"{path} is not a {{environment, records, errors}} record (bench_kernel.py's docstring)")
    return data["environment"], data["records"], data.get("errors", [])


def start(env: dict, append_to: str | None, command: str) -> tuple[dict, list[dict], list[dict]]:
    """(environment with this run's command added to "commands", records to keep, errors to keep).

    Appending to an existing JSON keeps its records, errors and commands; otherwise there are none. Raises
    ValueError when that JSON was measured on another GPU or with other versions (IDENTITY)."""
    if append_to is None or not os.path.exists(append_to):
        return dict(env, commands=[command]), [], []
    old_env, records, errors = read_results(append_to)
    if changed := [key for key in IDENTITY if old_env.get(key) != env.get(key)]:
        raise ValueError(f"{append_to} was measured with other {', '.join(changed)}: write this run to a new file")
    return dict(env, commands=[*old_env.get("commands", []), command]), records, errors


def markdown_table(records: list[dict]) -> str:
    """One row per (D, Hkv, causal, window, softcap, S, mode): TFLOP/s of each provider and ringattn's ratio to
    each (the window and softcap columns only where some record has one)."""
    providers = sorted({r["provider"] for r in records}, key=PROVIDERS.index)
    others = [p for p in providers if p != "ringattn"]
    cells: dict = {}
    for r in records:
        _, _, s, _, hkv, d, causal, window, softcap, mode = cell_key(r)
        cells.setdefault((d, hkv, causal, window, softcap, s, mode), {})[r["provider"]] = r["tflops"]
    banded = any(key[3] != tuple(NO_WINDOW) or key[4] for key in cells)
    head = ["D", "Hkv", "causal", *(("window", "softcap") if banded else ()), "S", "mode", *providers]
    rows = []
    for key in sorted(cells, key=lambda c: (c[0], -c[1], c[2], c[3], c[4], c[5], MODES.index(c[6]))):
        row = cells[key]
        vals = [f"{row[p]:.0f}" if p in row else "-" for p in providers]
        ratios = [f"{row['ringattn'] / row[p]:.2f}" if "ringattn" in row and p in row else "-" for p in others]
        d, hkv, causal, window, softcap, s, mode = key
        band = (("-" if window == tuple(NO_WINDOW) else f"({window[0]}, {window[1]})"), f"{softcap:g}")
        rows.append([d, hkv, "yes" if causal else "no", *(band if banded else ()), s, mode, *vals, *ratios])
    return benchmark.markdown_table([*head, *(f"ours/{p}" for p in others)], rows)


if __name__ == "__main__":
    sys.exit(main())
