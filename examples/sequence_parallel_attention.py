"""Sequence parallelism for a self-attention block: every rank holds a shard of the sequence.

    bash launch/torchrun.sh examples/sequence_parallel_attention.py
    NPROC=2 bash launch/torchrun.sh examples/sequence_parallel_attention.py --seqlen 512 --dtype fp32

The block (qkv projection with fewer K/V heads than query heads (GQA), causal attention,
output projection) has the same weights on every rank. Each rank feeds it only its contiguous
shard of the tokens; the projections are per token, and `ringattn.ring_attn_func` gives each
query its attention over the whole global sequence. In the backward pass each rank's weight
gradients cover its own tokens only, so they are summed over the group (as data parallelism
sums them over the batch).

The example checks that each rank's output shard, its input-gradient shard and the summed
weight gradients equal the same block run on the whole sequence on one device with
`ringattn.flash_attn_func`. Both are held to the tolerance rule of ringattn.testing against the
block computed in float64 with the pure-PyTorch attention `ringattn.ops.attn_fwd_ref`: at most
2x the error of that pure-PyTorch block run in the same dtype. Exits with status 1 on a mismatch.
"""

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class SelfAttention(nn.Module):
    """x (B, S, dim) -> (B, S, dim): qkv projection, attention, output projection."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, attention) -> torch.Tensor:
        """`attention(q, k, v)` maps q (B, S, H, D), k and v (B, S, Hkv, D) to (B, S, H, D)."""
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(batch, seqlen, self.heads, self.head_dim)  # (B, S, H, D), strided views of the projection
        k = k.view(batch, seqlen, self.kv_heads, self.head_dim)  # (B, S, Hkv, D)
        v = v.view(batch, seqlen, self.kv_heads, self.head_dim)  # (B, S, Hkv, D)
        out = attention(q, k, v)  # (B, S, H, D)
        return self.proj(out.reshape(batch, seqlen, self.heads * self.head_dim))  # (B, S, dim)


def run_block(block: nn.Module, x: torch.Tensor, dy: torch.Tensor, attention) -> dict[str, torch.Tensor]:
    """Forward and backward of `block` (in x's dtype); returns y, dx and each weight's gradient."""
    block = copy.deepcopy(block).to(x.dtype)
    x = x.detach().clone().requires_grad_()
    y = block(x, attention)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad} | {f"d{name}": p.grad for name, p in block.named_parameters()}


def main() -> int:
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton kernels on the CPU; set before ringattn is imported
    import ringattn
    from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed
    from ringattn.ops import attn_fwd_ref
    from ringattn.testing import check_close, max_abs_error

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=None, help="global sequence length (a multiple of the ranks)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16" if on_gpu else "fp32")
    args = parser.parse_args()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; checked by init_distributed
    # sizes: small on the CPU, where the kernels run in the interpreter
    batch, dim, heads, kv_heads, head_dim = (2, 1024, 16, 4, 64) if on_gpu else (2, 128, 4, 2, 32)
    seqlen = (1024 if on_gpu else 64) * world_size if args.seqlen is None else args.seqlen
    problems = []
    if args.dtype == "bf16" and not on_gpu:
        problems.append("--dtype bf16 needs a GPU (Triton's interpreter computes bf16 wrongly); use fp32 or fp16")
    if seqlen <= 0 or seqlen % world_size:
        problems.append(f"--seqlen {seqlen} must be a positive multiple of the number of ranks {world_size}")
    exit_on_bad_arguments(parser, problems)  # status 2 on every rank, before any process group
    env = init_distributed()  # NCCL on GPUs (one rank a GPU), gloo on the CPU; a plain run is a group of one
    device, rank = env.device, env.rank

    local = seqlen // world_size
    shard = slice(rank * local, (rank + 1) * local)  # this rank's tokens
    dtype = DTYPES[args.dtype]

    torch.manual_seed(0)  # the same weights and data on every rank
    block = SelfAttention(dim, heads, kv_heads, head_dim).to(device)
    x = torch.randn(batch, seqlen, dim, device=device)  # (B, S, dim), the whole sequence
    dy = torch.randn(batch, seqlen, dim, device=device)  # (B, S, dim), gradient of the output

    def ring(q, k, v):  # this rank's shard of the global causal attention
        return ringattn.ring_attn_func(q, k, v, causal=True, layout="contiguous")

    def flash(q, k, v):  # one device, whole sequence
        return ringattn.flash_attn_func(q, k, v, causal=True)

    def plain(q, k, v):  # pure PyTorch, differentiable by autograd
        return attn_fwd_ref(q, k, v, q.shape[-1] ** -0.5, True)[0]

    # sequence parallel: the block sees only this rank's tokens
    sharded = run_block(block, x[:, shard].to(dtype), dy[:, shard].to(dtype), ring)
    for name in sharded:
        if name not in ("y", "dx"):  # weight gradients: sum the contributions of all tokens
            sharded[name] = sharded[name].float()
            dist.all_reduce(sharded[name])

    # the same block on the whole sequence: fused kernel, plain PyTorch, float64 reference
    unsharded = run_block(block, x.to(dtype), dy.to(dtype), flash)
    pt = run_block(block, x.to(dtype), dy.to(dtype), plain)
    ref = run_block(block, x.double(), dy.double(), plain)

    failures, lines = [], []
    for name, ours in sharded.items():
        per_token = name in ("y", "dx")  # compare this rank's tokens; weight gradients whole
        ref_t, pt_t, unsharded_t = (r[name][:, shard] if per_token else r[name] for r in (ref, pt, unsharded))
        errors = []
        for label, t in (("sequence-parallel", ours), ("unsharded", unsharded_t)):
            try:
                errors.append(check_close(f"rank {rank} {label} {name}", t, pt_t, ref_t)[0])
            except AssertionError as e:
                failures.append(str(e))
                errors.append(max_abs_error(t, ref_t))
        plain_err, diff = max_abs_error(pt_t, ref_t), max_abs_error(ours, unsharded_t)
        lines.append(f"{rank:>4} {name:>12} {errors[0]:>12.3e} {errors[1]:>12.3e} {plain_err:>12.3e} {diff:>12.3e}")

    gathered = [None] * world_size
    dist.all_gather_object(gathered, (lines, failures))
    if rank == 0:
        print(
            f"self-attention block, {world_size} rank(s): batch {batch}, seqlen {seqlen} ({local} per rank), "
            f"dim {dim}, heads {heads}, kv heads {kv_heads}, head dim {head_dim}, {args.dtype}, causal"
        )
        header = ("rank", "tensor", "seq-par err", "unshard err", "plain err", "seq-unshard")
        print(f"{header[0]:>4} " + " ".join(f"{h:>12}" for h in header[1:]))
        for rank_lines, _ in gathered:
            print("\n".join(rank_lines))
        print("(errors: max |x - float64 reference| on this rank's tokens; weight gradients summed over the ranks)")
        all_failures = [f for _, rank_failures in gathered for f in rank_failures]
        print("FAILED:\n  " + "\n  ".join(all_failures) if all_failures else "passed", flush=True)
    ok = not any(rank_failures for _, rank_failures in gathered)
    destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
