"""The ring's forward step with the merge inside the kernel (attn_fwd_merge_) against the kernel writing an
fp32 block result followed by the separate merge pass (attn_fwd + merge_attn_states_), on one GPU.

    PYTHONPATH=. python3 launch/bench_fwd_merge.py --out docs/benchmarks/fwd_merge_h200.json

One block of the ring: S_local queries against S_local keys, B = 1, H = 32, D = 128, bf16, causal
(a diagonal block) and not (an off-diagonal one). Also times the public attn_fwd (bf16 out, no
state) on the same block: the speed the ring's step should match. Both step variants are checked
against each other before timing. Timing: triton.testing.do_bench, median.
"""

import argparse

import torch
from bench_common import attention_flops, env_record, markdown_table, write_json
from triton.testing import do_bench

from ringattn.ops import attn_fwd, attn_fwd_merge_, merge_attn_states_

HEADS, HEAD_DIM = 32, 128


def _state(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A running state as after one earlier block: out (B, S, H, D) fp32, lse (B, H, S) fp32."""
    batch, seqlen, heads, head_dim = q.shape
    out = torch.randn(batch, seqlen, heads, head_dim, device=q.device) * 0.1
    lse = torch.randn(batch, heads, seqlen, device=q.device) + 5.0
    return out, lse


def bench_block(seqlen: int, causal: bool, rep: int) -> list[dict]:
    scale = HEAD_DIM**-0.5
    q, k, v = (torch.randn(1, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def separate(out, lse):
        merge_attn_states_(out, lse, *attn_fwd(q, k, v, scale, causal, out_dtype=torch.float32))

    def fused(out, lse):
        attn_fwd_merge_(q, k, v, scale, causal, out, lse)

    start = _state(q)
    results = {}
    for name, step in (("separate_merge", separate), ("fused_merge", fused)):
        out, lse = (t.clone() for t in start)
        step(out, lse)
        results[name] = (out, lse)
    err = (
        (results["fused_merge"][0] - results["separate_merge"][0]).norm() / results["separate_merge"][0].norm()
    ).item()
    if not err < 1e-5:
        raise AssertionError(f"fused and separate merge differ: relative error {err:.2e}")
    flops = attention_flops(1, HEADS, seqlen, HEAD_DIM, causal, "fwd")
    records = []
    out, lse = _state(q)
    timed = {
        "separate_merge": lambda: separate(out, lse),
        "fused_merge": lambda: fused(out, lse),
        "public_fwd": lambda: attn_fwd(q, k, v, scale, causal),
    }
    for name, run in timed.items():
        ms = do_bench(run, warmup=25, rep=rep, return_mode="median")
        records.append(dict(provider=name, S_local=seqlen, H=HEADS, D=HEAD_DIM, causal=causal, ms=ms,
                            tflops=flops / ms / 1e9))  # fmt: skip
        print(f"S_local {seqlen:6} causal={causal!s:5} {name:15} {ms:7.3f} ms {records[-1]['tflops']:5.0f} TFLOP/s",
              flush=True)  # fmt: skip
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--rep", type=int, default=200, help="do_bench's rep (ms)")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args()
    records = [r for s in args.seqlens for causal in (False, True) for r in bench_block(s, causal, args.rep)]
    head = ["S_local", "causal", "public fwd ms", "separate merge ms", "fused merge ms", "fused / separate"]
    rows = []
    for s in args.seqlens:
        for causal in (False, True):
            ms = {r["provider"]: r["ms"] for r in records if r["S_local"] == s and r["causal"] == causal}
            ratio = ms["fused_merge"] / ms["separate_merge"]
            cells = [ms["public_fwd"], ms["separate_merge"], ms["fused_merge"], ratio]
            rows.append([s, "yes" if causal else "no", *(f"{c:.3f}" for c in cells)])
    print(markdown_table(head, rows))
    write_json(args.out, env_record(torch.device("cuda"), dtype="bfloat16"), records)


if __name__ == "__main__":
    main()
