"""The forward kernel with its K/V tiles loaded by TMA descriptors against masked pointer loads, on one GPU.

    PYTHONPATH=. python3 launch/bench_fwd_tma.py --out docs/benchmarks/fwd_tma_h200.json

The two load paths of _attn_fwd_kernel, switched by RINGATTN_FWD_TMA (0: pointers, 1: TMA where the device
and the tensors allow it, the default). bf16, H = 32, B x S = 32768 tokens, for D = 128 and 64 (MHA) and
D = 128 with Hkv = 8 (GQA), S in --seqlens, causal and not. Times the public attn_fwd and the ring's step
attn_fwd_merge_ (merging into a running fp32 state) under both paths, after checking that both give the
same bits. Timing: triton.testing.do_bench, median.
"""

import argparse
import os

import torch
from bench_common import attention_flops, env_record, markdown_table, write_json
from triton.testing import do_bench

from ringattn.ops import attn_fwd, attn_fwd_merge_

HEADS, TOKENS = 32, 32768
CASES = ((128, 32), (64, 32), (128, 8))  # (D, Hkv)
PATHS = {"pointers": "0", "tma": "1"}


def bench_case(head_dim: int, kv_heads: int, seqlen: int, causal: bool, rep: int) -> list[dict]:
    """Records of one shape: public fwd and ring step, per load path."""
    batch, scale = TOKENS // seqlen, head_dim**-0.5
    q = torch.randn(batch, seqlen, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    state = torch.zeros(q.shape, device="cuda"), torch.full((batch, HEADS, seqlen), float("-inf"), device="cuda")
    flops = attention_flops(batch, HEADS, seqlen, head_dim, causal, "fwd")
    outputs, records = {}, []
    for path, flag in PATHS.items():
        os.environ["RINGATTN_FWD_TMA"] = flag
        outputs[path] = attn_fwd(q, k, v, scale, causal)
        calls = {"public_fwd": lambda: attn_fwd(q, k, v, scale, causal),
                 "ring_step": lambda: attn_fwd_merge_(q, k, v, scale, causal, *state)}  # fmt: skip
        for call, fn in calls.items():
            ms = do_bench(fn, warmup=50, rep=rep, return_mode="median")
            records.append(dict(path=path, call=call, B=batch, S=seqlen, H=HEADS, Hkv=kv_heads, D=head_dim,
                                causal=causal, ms=ms, tflops=flops / ms / 1e9))  # fmt: skip
    same = all(torch.equal(a, b) for a, b in zip(outputs["pointers"], outputs["tma"], strict=True))
    if not same:
        raise AssertionError(f"TMA and pointer loads differ: D {head_dim}, Hkv {kv_heads}, S {seqlen}, causal {causal}")
    return records


def table(records: list[dict]) -> str:
    """A row per (shape, call): ms and TFLOP/s of both paths and the speed-up."""
    by = {(r["D"], r["Hkv"], r["S"], r["causal"], r["call"], r["path"]): r for r in records}
    rows = []
    for (d, hkv, s, causal, call, path), r in by.items():
        if path == "pointers":
            tma = by[(d, hkv, s, causal, call, "tma")]
            rows.append([d, hkv, s, "yes" if causal else "no", call, f"{r['ms']:.3f}", f"{tma['ms']:.3f}",
                         f"{r['tflops']:.0f}", f"{tma['tflops']:.0f}", f"{r['ms'] / tma['ms']:.2f}x"])  # fmt: skip
    head = ["D", "Hkv", "S", "causal", "call", "pointers ms", "TMA ms", "pointers TFLOP/s", "TMA TFLOP/s", "speed-up"]
    return markdown_table(head, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rep", type=int, default=300, help="do_bench's rep (ms)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    records = []
    for (head_dim, kv_heads), seqlen, causal in (
        (c, s, causal) for c in CASES for s in args.seqlens for causal in (False, True)
    ):
        records += bench_case(head_dim, kv_heads, seqlen, causal, args.rep)
        print("\n".join(table(records[-4:]).splitlines()[2:]), flush=True)
    print(table(records))
    write_json(args.out, env_record(torch.device("cuda"), dtype="bfloat16"), records)


if __name__ == "__main__":
    main()
