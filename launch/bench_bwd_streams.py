"""The backward's two kernels (dK/dV and dQ) launched one after the other against launched on two CUDA streams,
so that the programs of one fill the SMs the other's last wave leaves idle, on one GPU.

    PYTHONPATH=. python3 launch/bench_bwd_streams.py --out docs/benchmarks/bwd_streams_h200.json

The two kernels read the same inputs and write different outputs, so they may run at once. Variants:
- serial: dK/dV, then dQ, on the current stream (attn_bwd's way for long backwards, and before for all);
- dkdv_high: dK/dV on a high-priority side stream, dQ on the current one (the SMs go to dK/dV's programs
  first, dQ's fill what it leaves);
- dq_high: the same with the roles swapped;
- side_same: dK/dV on a side stream of the current stream's priority (attn_bwd's way for short backwards).
Forms: "public" (attn_bwd: bf16 results stored), "ring_step" (a later ring step: dQ added into fp32, the dK/dV
share stored in fp32) and "own_block" (step 0: fp32 dQ, dK, dV stored). Every variant's results are checked
bitwise against serial's before timing. Each variant is timed --rounds times in turn with the others (do_bench
medians), and the median of its rounds is kept.
"""

import argparse
import statistics

import torch
from bench_common import attention_flops, attention_inputs, env_record, markdown_table, write_json
from triton.testing import do_bench

from ringattn.ops import attn_bwd_preprocess, attn_fwd
from ringattn.ops.attn import _bwd_configs, _bwd_launches, _padded_head_dim
from ringattn.ops.streams import run_side_by_side

SHAPES = [  # (B, S, Hq, Hkv, D, causal)
    (1, 8192, 32, 32, 128, False),
    (1, 8192, 32, 32, 128, True),
    (1, 16384, 32, 32, 128, False),
    (1, 16384, 32, 32, 128, True),
    (8, 4096, 32, 32, 128, False),
    (8, 4096, 32, 8, 128, False),
    (2, 16384, 32, 32, 128, False),
    (2, 16384, 32, 8, 128, False),
    (8, 4096, 32, 32, 128, True),
    (8, 4096, 32, 32, 64, False),
]
FORMS = ("public", "ring_step", "own_block")
VARIANTS = ("serial", "dkdv_high", "dq_high", "side_same")


def variants(dkdv, dq, device: torch.device) -> dict:
    """Callables running the two launches as each variant does."""
    high = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])
    return {
        "serial": lambda: (dkdv(), dq()),
        "dkdv_high": lambda: run_side_by_side(dkdv, dq, device, side=high),
        "dq_high": lambda: run_side_by_side(dq, dkdv, device, side=high),
        "side_same": lambda: run_side_by_side(dkdv, dq, device),  # attn_bwd's, for short backwards
    }


def bench_shape(shape, form: str, args) -> list[dict]:
    batch, seqlen, heads, kv_heads, head_dim, causal = shape
    q, k, v, dout = attention_inputs(batch, seqlen, heads, kv_heads, head_dim, torch.bfloat16, torch.device("cuda"), 0)
    scale = head_dim**-0.5
    out, lse = attn_fwd(q, k, v, scale, causal)
    delta = attn_bwd_preprocess(out, dout)
    grad_dtype = torch.bfloat16 if form == "public" else torch.float32
    dq, dk, dv = (torch.zeros(t.shape, dtype=grad_dtype, device=t.device) for t in (q, k, v))
    cfgs = _bwd_configs(_padded_head_dim(head_dim), q.dtype, q.device)
    launches = _bwd_launches(dout, q, k, v, lse, delta, dq, dk, dv, scale, causal, None, None,
                             form == "ring_step", False, None, *cfgs)  # fmt: skip
    runs = variants(*launches, q.device)
    expected = None
    for name, run in runs.items():  # ring_step adds into dq: reset it before each checked call
        dq.zero_()
        run()
        torch.cuda.synchronize()
        got = tuple(t.clone() for t in (dq, dk, dv))
        if expected is None:
            expected = got
        elif not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
            raise AssertionError(f"{name} differs from serial at {shape}, {form}")
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(do_bench(run, warmup=25, rep=args.rep, return_mode="median"))
    flops = attention_flops(batch, heads, seqlen, head_dim, causal, "bwd")
    records = []
    for name, ms_list in times.items():
        ms = statistics.median(ms_list)
        records.append(dict(form=form, variant=name, B=batch, S=seqlen, H=heads, Hkv=kv_heads, D=head_dim,
                            causal=causal, ms=ms, rounds_ms=ms_list, tflops=flops / ms / 1e9))  # fmt: skip
    serial = records[0]["ms"]
    cells = " ".join(f"{r['variant']} {r['ms']:.3f} ({serial / r['ms']:.3f}x)" for r in records)
    print(f"{form:9} B={batch} S={seqlen:6} Hkv={kv_heads:2} D={head_dim:3} causal={causal!s:5} {cells}", flush=True)
    return records


def table(records: list[dict]) -> str:
    head = ["form", "B", "S", "Hkv", "D", "causal", "serial ms", *(f"{v} speed-up" for v in VARIANTS[1:])]
    rows = []
    for i in range(0, len(records), len(VARIANTS)):
        group = records[i : i + len(VARIANTS)]
        r, serial = group[0], group[0]["ms"]
        rows.append([r["form"], r["B"], r["S"], r["Hkv"], r["D"], "yes" if r["causal"] else "no", f"{serial:.3f}",
                     *(f"{serial / g['ms']:.3f}" for g in group[1:])])  # fmt: skip
    return markdown_table(head, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    records = []
    for shape in SHAPES:
        for form in args.forms:
            if form == "own_block" and not shape[-1]:
                continue  # step 0 blocks are the causal diagonal ones (and non-causal rings' own blocks: as ring_step)
            records += bench_shape(shape, form, args)
    print(table(records))
    write_json(args.out, env_record(torch.device("cuda"), dtype="bfloat16"), records)


if __name__ == "__main__":
    main()
