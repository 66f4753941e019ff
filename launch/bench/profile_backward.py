"""One attention forward+backward, twice, for Nsight Compute: the second backward's main kernel is the one to
profile (the first compiles it).

    ncu --clock-control none --set full -k regex:_attn_bwd_gluon --launch-skip 1 --launch-count 1 -o bwd \\
        python3 launch/bench/profile_backward.py
    ncu --clock-control none --set full -k regex:FlashAttentionBackwardSm90 --launch-skip 1 --launch-count 1 \\
        -o bwd_fa4 python3 launch/bench/profile_backward.py --provider fa4
    ncu --import bwd.ncu-rep --page details

bf16 q, k, v, dout (B, S, H, D) with B x S = --tokens (defaults: S = 16384, H = Hkv = 32, D = 128, causal) by
ringattn.flash_attn_func or FlashAttention-4's flash_attn_func (where flash_attn.cute imports: ../shared/tools/
fa4_carry.sh carries it to a machine without network). Without a GPU, --tiny runs tiny fp32 shapes on the CPU (a
dry run: `TRITON_INTERPRET=1 python3 launch/bench/profile_backward.py --tiny`); the GPU's sizes there are a usage
error.
"""

import argparse

import torch

import ringattn
from ringattn.benchmark import parse_with_tiny

TINY = dict(seqlen=24, tokens=48, heads=4, kv_heads=2, head_dim=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["ringattn", "fa4"], default="ringattn")
    parser.add_argument("--seqlen", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=32768, help="B x S")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the CPU dry run")
    args = parse_with_tiny(parser, TINY)
    if not torch.cuda.is_available() and not args.tiny:
        parser.error("without a GPU, pass --tiny (a dry run of tiny fp32 shapes under TRITON_INTERPRET=1)")
    if args.provider == "fa4":
        from flash_attn.cute import flash_attn_func

        def attention(q, k, v):
            return flash_attn_func(q, k, v, causal=args.causal)[0]  # (out, lse)
    else:

        def attention(q, k, v):
            return ringattn.flash_attn_func(q, k, v, causal=args.causal)

    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    batch = max(1, args.tokens // args.seqlen)
    shapes = [(batch, args.seqlen, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    q, k, v = (torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes)
    dout = torch.randn_like(q)
    for _ in range(2):
        attention(q, k, v).backward(dout)
    print(f"{args.provider}: forward+backward twice, q {tuple(q.shape)}, k and v {tuple(k.shape)}, {dtype}")


if __name__ == "__main__":
    main()
