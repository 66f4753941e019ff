"""Time the backward kernels under a list of launch configs (bf16, D = 128, B = 4, S = 8192, H = 32).

    PYTHONPATH=. python3 launch/bwd_config_sweep.py

Prints forward time and, per (BLOCK_M, BLOCK_N, num_warps, num_stages), the backward time and
TFLOP/s (backward = 2.5 x forward FLOPs). Used to pick ops/attn.py::_bwd_config until the
autotuned configs of the kernel benchmark replace it.
"""

from functools import partial

import torch
from triton.testing import do_bench

import ringattn.ops.attn as attn_ops

CONFIGS = [(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2),
           (64, 64, 8, 3), (32, 128, 8, 2), (128, 32, 8, 2)]  # fmt: skip


def sweep(causal: bool, batch=4, seqlen=8192, heads=32, head_dim=128) -> None:
    scale = head_dim**-0.5
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = attn_ops.attn_fwd(q, k, v, scale, causal)
    fwd_flops = 4 * batch * heads * seqlen**2 * head_dim * (0.5 if causal else 1)
    ms = do_bench(partial(attn_ops.attn_fwd, q, k, v, scale, causal), warmup=25, rep=100)
    print(f"causal={causal} fwd {ms:.2f} ms {fwd_flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    default_config = attn_ops._bwd_config
    for cfg in CONFIGS:
        attn_ops._bwd_config = partial(lambda *_, c: attn_ops.LaunchConfig(*c), c=cfg)
        ms = do_bench(partial(attn_ops.attn_bwd, dout, q, k, v, out, lse, scale, causal), warmup=25, rep=100)
        print(f"  bwd {cfg}: {ms:.2f} ms {2.5 * fwd_flops / ms / 1e9:.0f} TFLOP/s", flush=True)
    attn_ops._bwd_config = default_config


if __name__ == "__main__":
    for causal in (False, True):
        sweep(causal)
