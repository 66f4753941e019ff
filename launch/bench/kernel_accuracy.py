"""Error of the fused kernels against a float64 reference, beside a plain PyTorch implementation
in the same dtype (the tolerance rule of ringattn.testing), on the GPU in bf16 and fp16.

    PYTHONPATH=. python3 launch/bench/kernel_accuracy.py --out docs/benchmarks/kernel_accuracy_h200.json

Prints a table; writes JSON records (dtype, shape, tensor, ours, pt, allowed) to --out.
"""

import argparse
import json

import torch

import ringattn
from ringattn.benchmark import env_record
from ringattn.ops import attn_fwd_ref
from ringattn.testing import magnitude, max_abs_error, tolerance

SHAPES = [  # (B, S, Hq, Hkv, D, causal)
    (2, 1024, 16, 16, 64, False),
    (2, 1024, 16, 16, 64, True),
    (1, 2048, 16, 4, 128, True),
    (1, 1999, 8, 1, 96, True),
    (1, 512, 8, 8, 256, False),
]


def attention(q, k, v, dout, causal, dtype):
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = attn_fwd_ref(q, k, v, q.shape[-1] ** -0.5, causal)
    out.backward(dout.to(dtype))
    return out, lse, q.grad, k.grad, v.grad


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("it measures the GPU kernels' errors: it needs a GPU (tests/ops check the kernels on the CPU)")
    records = []
    print(
        f"{'dtype':9} {'B':>2} {'S':>5} {'Hq':>3} {'Hkv':>3} {'D':>4} {'causal':6} {'tensor':6} "
        f"{'ours':>9} {'pt':>9} {'allowed':>9}"
    )
    for dtype in (torch.bfloat16, torch.float16):
        for batch, seqlen, heads_q, heads_k, head_dim, causal in SHAPES:
            gen = torch.Generator(device="cuda").manual_seed(seqlen)
            q, k, v, dout = (
                torch.randn(batch, seqlen, h, head_dim, device="cuda", generator=gen).to(dtype)
                for h in (heads_q, heads_k, heads_k, heads_q)
            )
            q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
            out, lse = ringattn.flash_attn_func(q_, k_, v_, causal=causal, return_lse=True)
            out.backward(dout)
            ours = (out, lse, q_.grad, k_.grad, v_.grad)
            ref = attention(q, k, v, dout, causal, torch.float64)
            pt = attention(q, k, v, dout, causal, dtype)
            grad_scale = max(magnitude(g) for g in ref[2:])
            for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
                scale = None if i < 2 else grad_scale
                rec = dict(
                    dtype=str(dtype).removeprefix("torch."),
                    B=batch,
                    S=seqlen,
                    Hq=heads_q,
                    Hkv=heads_k,
                    D=head_dim,
                    causal=causal,
                    tensor=name,
                    ours=max_abs_error(ours[i], ref[i]),
                    pt=max_abs_error(pt[i], ref[i]),
                    allowed=tolerance(pt[i], ref[i], scale),
                )
                rec["ok"] = rec["ours"] <= rec["allowed"]
                records.append(rec)
                print(
                    f"{rec['dtype']:9} {batch:>2} {seqlen:>5} {heads_q:>3} {heads_k:>3} {head_dim:>4} "
                    f"{str(causal):6} {name:6} {rec['ours']:9.2e} {rec['pt']:9.2e} {rec['allowed']:9.2e}"
                    f"{'' if rec['ok'] else '  FAIL'}"
                )
            del ref, pt
            torch.cuda.empty_cache()
    env = env_record(torch.device("cuda"))
    del env["kind"]  # this JSON holds it under "env", not in a list of records
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "records": records}, f, indent=1)
    failed = [r for r in records if not r["ok"]]
    print(f"{len(records) - len(failed)} within tolerance, {len(failed)} over")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
