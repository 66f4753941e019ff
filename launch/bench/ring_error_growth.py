"""Error of the ring against float64 as it grows from W = 1 to 8 virtual ranks, on the GPU in bf16.

    PYTHONPATH=. python3 launch/bench/ring_error_growth.py
    PYTHONPATH=. python3 launch/bench/ring_error_growth.py --dtypes bf16 fp16 --out /tmp/ring_error_growth.json
    TRITON_INTERPRET=1 PYTHONPATH=. python3 launch/bench/ring_error_growth.py --tiny  # CPU dry run (fp32), no JSON

Claim measured: on the GPU in bf16, the backward error at W = 8 (simulated ring) is within 2x of W = 1.

One causal problem, S = 6720 (a multiple of 2 lcm(1 ... 8) = 1680, so both layouts split it for every
W), H = 8, Hkv = 2, D = 128, inputs drawn in fp32 and rounded to bf16, runs through
testing/simulate.py::simulate_ring_attn with KERNEL_OPS for W = 1 ... 8, contiguous and zigzag. W = 1
takes the ring's code path too (fp32 running state and merge, fp32 gradient accumulators), so the
ratios show what more ranks add. For each of out, lse, dq, dk, dv, against a float64 reference
(ringattn.testing.reference: ringattn.ops.attn_fwd_ref / attn_bwd_ref on float64 copies of the same rounded
inputs, whole sequence), the max abs error (ringattn.testing.max_abs_error) of:
- error: the simulated ring's result, fp32 (its state and accumulators, before any rounding);
- error_cast: that result rounded to the input dtype, as ring_attn_func returns it (lse stays fp32);
and ratio = error / error at W = 1 (same dtype, layout, tensor); pt = the error of the same reference
ops run in the input dtype (plain PyTorch), for context.

Exits with status 1 if, for any dtype and layout, the error of dq, dk or dv at the largest W exceeds
--max-ratio (2) x its W = 1 error. Writes [env, *records, gate] to --out (records: one per dtype,
layout, W and tensor; default grid 2 x 8 x 5 = 80) and prints a markdown table. About 30 s on an H200.
"""

import argparse
import sys

import torch

from ringattn.benchmark import (
    DTYPES,
    attention_inputs,
    device_tag,
    env_record,
    markdown_table,
    parse_with_tiny,
    script_parser,
    write_json,
)
from ringattn.ops import KERNEL_OPS
from ringattn.parallel import LAYOUTS, check_seqlen
from ringattn.testing import max_abs_error, reference, simulate_ring_attn

NAMES = ("out", "lse", "dq", "dk", "dv")
GATED = ("dq", "dk", "dv")
TINY = dict(seqlen=48, world_sizes=[1, 2, 3, 4], heads=2, kv_heads=1, head_dim=16, dtypes=["fp32"], out=None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, TINY)
    parser.add_argument("--seqlen", type=int, default=6720, help="global S, a multiple of 2W for every W")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=list(range(1, 9)), help="1 is always added")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=["bf16"], help="fp32 on the CPU")
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-ratio", type=float, default=2.0, help="gate: largest-W over W = 1 error, dq dk dv")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/benchmarks/ring_error_growth_{device}.json",
                        help="JSON path ({device}: cpu, or the GPU's model, e.g. h200)")  # fmt: skip
    args = parse_with_tiny(parser, TINY, argv)
    args.world_sizes = sorted(set(args.world_sizes) | {1})
    try:
        for world_size in args.world_sizes:
            for layout in args.layouts:
                check_seqlen(args.seqlen, world_size, layout, name="--seqlen")
    except ValueError as exc:
        parser.error(str(exc))
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out = args.out and args.out.replace("{device}", device_tag(args.device))
    return args


def ring_errors(args, dtype: torch.dtype) -> list[dict]:
    """Records of one input dtype: every layout and W, every tensor."""
    q, k, v, dout = attention_inputs(
        1, args.seqlen, args.heads, args.kv_heads, args.head_dim, dtype, args.device, args.seed
    )
    scale = args.head_dim**-0.5
    ref = reference(q, k, v, dout, scale, args.causal, torch.float64)
    pt = reference(q, k, v, dout, scale, args.causal, dtype)
    pt_error = {name: max_abs_error(pt[name], ref[name]) for name in NAMES}
    del pt
    shape = dict(dtype=str(dtype).removeprefix("torch."), S=args.seqlen, H=args.heads, Hkv=args.kv_heads,
                 D=args.head_dim, causal=args.causal)  # fmt: skip
    records = []
    for layout in args.layouts:
        base = {}
        for world_size in args.world_sizes:  # ascending from 1: base is set first
            ours = simulate_ring_attn(KERNEL_OPS, q, k, v, scale, args.causal, world_size, layout, dout=dout)
            for name, x in zip(NAMES, ours, strict=True):
                error = max_abs_error(x, ref[name])
                base.setdefault(name, error)
                cast = x if name == "lse" else x.to(dtype)
                records.append(dict(shape, layout=layout, W=world_size, tensor=name, error=error,
                                    error_cast=max_abs_error(cast, ref[name]), ratio=_ratio(error, base[name]),
                                    pt=pt_error[name]))  # fmt: skip
            del ours
            row = " ".join(f"{r['tensor']} {r['error']:.2e} ({r['ratio']:.2f})" for r in records[-len(NAMES) :])
            print(f"{shape['dtype']} {layout:10} W={world_size}: {row}", flush=True)
    return records


def _ratio(error: float, base: float) -> float:
    if base > 0:
        return error / base
    return 1.0 if error == 0 else float("inf")


def gate(records: list[dict], max_ratio: float) -> dict:
    """{"kind": "gate", ...}: ok unless some dq, dk or dv error at the largest W exceeds max_ratio x W = 1's."""
    largest = max(r["W"] for r in records)
    failures = [
        f"{r['dtype']} {r['layout']} {r['tensor']}: W={largest} error {r['error']:.3e} is {r['ratio']:.2f}x W=1's"
        for r in records
        if r["W"] == largest and r["tensor"] in GATED and not r["ratio"] <= max_ratio
    ]
    return dict(kind="gate", W=largest, tensors=list(GATED), max_ratio=max_ratio, ok=not failures, failures=failures)


def table(records: list[dict]) -> str:
    """One row per (dtype, layout, W): each tensor's error and its ratio to W = 1; a plain-PyTorch row per dtype."""
    cells, pt = {}, {}
    for r in records:
        cells.setdefault((r["dtype"], r["layout"], r["W"]), {})[r["tensor"]] = f"{r['error']:.2e} ({r['ratio']:.2f})"
        pt.setdefault(r["dtype"], {})[r["tensor"]] = f"{r['pt']:.2e}"
    rows = [[*key, *(cell[n] for n in NAMES)] for key, cell in cells.items()]
    rows += [[dtype, "plain PyTorch", "-", *(errors[n] for n in NAMES)] for dtype, errors in pt.items()]
    return markdown_table(["dtype", "layout", "W", *(f"{n} (x W=1)" for n in NAMES)], rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    records = []
    for dtype in args.dtypes:
        records += ring_errors(args, DTYPES[dtype])
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    result = gate(records, args.max_ratio)
    write_json(args.out, env_record(args.device), [*records, result])
    print(table(records))
    verdict = "PASS: within" if result["ok"] else "FAIL: not all within"
    print(f"gate {verdict} {args.max_ratio}x W=1 for dq, dk, dv at W={result['W']}")
    for failure in result["failures"]:
        print(f"  {failure}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
