"""Train a small GPT on a long-range copy task with ring attention, each sample's sequence split over every rank.

    bash launch/torchrun.sh examples/train_gpt.py                  # all GPUs (NCCL), or 4 CPU ranks (gloo)
    NPROC=2 bash launch/torchrun.sh examples/train_gpt.py --check  # the first steps vs one device
    bash launch/torchrun.sh examples/train_gpt.py --seqlen 65536 --steps 300   # GPUs: 64k tokens per sample
    bash launch/torchrun.sh examples/train_gpt.py --compile       # the model under torch.compile

The model: token embedding, `--layers` blocks of (RMSNorm, causal self-attention with RoPE at global
positions and GQA (`--kv-heads` < `--heads`), RMSNorm, SwiGLU MLP), RMSNorm, output projection.
Attention is `ringattn.nn.RingAttention` in the zigzag layout; everything else is per token, so each
rank runs the model on its shard of the sequence only (`ringattn.SequenceParallel.shard_batch`) and
the parameter gradients are summed over the ranks (`sync_gradients`) before the optimizer step.
With W ranks each one holds S / W tokens, so a rank's activation memory grows with S / W, not S.

The data, made locally: each sample is BOS, n random tokens, SEP, the same n tokens again (S = 2n + 2).
Only the copy is scored, so the loss falls below log(vocab - 2) only by attending S / 2 tokens back,
across ranks. Every rank draws the same batch from the seed and keeps its shard.

Output (rank 0): a progress line (loss, copy accuracy, global tokens/s) rewritten every step and kept
every `--log-every` steps, and in `--out`: history.json and loss.png (skipped with a message if
matplotlib is missing).

--check: runs the first `--steps` (default 3) training steps (AdamW, clipping) three ways on the same
data from the same initial weights: ring-sharded over the ranks, single-device with plain PyTorch attention in the same
dtype, and single-device in float64; each step's ring loss and gradient norm must obey the tolerance rule of
ringattn.testing (error vs float64 at most 2x the plain single-device error, plus a floor). Exits with
status 1 if not.

--compile: trains (or checks) torch.compile(model): the ring runs as ringattn's custom ops, so the model compiles
as one graph per direction; the first step includes the compilation (tokens/s from the second on compares with an
eager run of the same options).

Defaults: on GPUs seqlen 8192 x W, batch 1, dim 512, 4 layers, 8 heads (2 KV heads) of 64, bf16
autocast, lr 1e-3, 200 steps; on CPU ranks (Triton interpreter) seqlen 32 x W, batch 2, dim 64,
2 layers, 2 heads (1 KV head) of 32, fp32, lr 5e-3, 70 steps: with 4 ranks on 2 cores two to three
minutes, in which the loss falls from ~2.9 to below 0.1 (the copy is learned). `--help` lists the options.
"""

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ringattn  # noqa: E402
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.ops import attn_fwd_ref  # noqa: E402
from ringattn.ops.validation import MAX_GRID_DIM, MAX_HEAD_DIM  # noqa: E402
from ringattn.sequence_parallel import IGNORE_INDEX, shift_labels  # noqa: E402
from ringattn.testing import check_close, max_abs_error, tolerance  # noqa: E402

BOS, SEP = 0, 1  # special tokens; the copied tokens are 2 .. vocab - 1


# ----------------------------------------------------------------------------------------------- model


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding at the tokens' global positions. x (B, S, H, D), D even; pos (B, S) or (S,) int64."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # (D/2,)
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (B, S, D/2) or (S, D/2)
    cos, sin = (t.unsqueeze(-2).to(x.dtype) for t in (angles.cos(), angles.sin()))  # (.., S, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]  # (B, S, H, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, S, H, D)


class SingleDeviceAttention(nn.Module):
    """Causal attention over the whole sequence on one device in plain PyTorch (any dtype; the check's baseline)."""

    def forward(self, q, k, v):  # q (B, S, H, D), k and v (B, S, Hkv, D) -> (B, S, H, D)
        return attn_fwd_ref(q, k, v, q.shape[-1] ** -0.5, True)[0]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, pos, attention):
        batch, seqlen, _ = x.shape  # x (B, S, dim): this rank's tokens
        hd = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        q = rope(q.view(batch, seqlen, self.heads, hd), pos)  # (B, S, H, D)
        k = rope(k.view(batch, seqlen, self.kv_heads, hd), pos)  # (B, S, Hkv, D): GQA, never repeated
        v = v.view(batch, seqlen, self.kv_heads, hd)  # (B, S, Hkv, D)
        out = attention(q, k, v)  # (B, S, H, D): attention over the whole global sequence
        return self.proj(out.reshape(batch, seqlen, self.heads * hd))  # (B, S, dim)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):  # (B, S, dim) -> (B, S, dim)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, S, hidden) each
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn, self.mlp = Attention(dim, heads, kv_heads), MLP(dim, 4 * dim)

    def forward(self, x, pos, attention):
        x = x + self.attn(self.attn_norm(x), pos, attention)  # (B, S, dim)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """tokens (B, S) at global positions pos -> logits (B, S, vocab); `attention` maps q, k, v to the output."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, attention: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.attention = attention  # no parameters: RingAttention or SingleDeviceAttention

    def forward(self, tokens, pos):
        x = self.embed(tokens)  # (B, S, dim)
        for block in self.blocks:
            x = block(x, pos, self.attention)
        return self.head(self.norm(x))  # (B, S, vocab)


# ------------------------------------------------------------------------------------------------ data


def copy_task_batch(batch: int, seqlen: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, S) = BOS, a_1..a_n, SEP, a_1..a_n with n = (S - 2) / 2; labels (B, S) = tokens with
    everything up to SEP set to IGNORE_INDEX (Hugging Face convention: shifted later, on the full sequence)."""
    n = (seqlen - 2) // 2
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(2, vocab, (batch, n), generator=gen)
    bos, sep = torch.full((batch, 1), BOS), torch.full((batch, 1), SEP)
    tokens = torch.cat([bos, a, sep, a], dim=1)
    labels = tokens.clone()
    labels[:, : n + 2] = IGNORE_INDEX
    return tokens, labels


# -------------------------------------------------------------------------------------------- training


def parse_args(world_size: int, on_gpu: bool, argv: list[str] | None = None) -> argparse.Namespace:
    """The options (from `argv`, default sys.argv), checked; exits with status 2 on a bad one."""
    p = argparse.ArgumentParser(
        description="Train a small GPT with ring attention (zigzag) on a copy task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sample; default 8192 x W (GPU), 32 x W (CPU)")
    p.add_argument("--batch", type=int, default=1 if on_gpu else 2)
    p.add_argument("--vocab", type=int, default=64 if on_gpu else 16)
    p.add_argument("--dim", type=int, default=512 if on_gpu else 64)
    p.add_argument("--layers", type=int, default=4 if on_gpu else 2)
    p.add_argument("--heads", type=int, default=8 if on_gpu else 2)
    p.add_argument("--kv-heads", type=int, default=2 if on_gpu else 1)
    p.add_argument("--steps", type=int, default=None, help="default: 200 (GPU), 70 (CPU), 3 with --check")
    p.add_argument("--lr", type=float, default=1e-3 if on_gpu else 5e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16" if on_gpu else "fp32", help="autocast dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/train_gpt"), help="history.json and loss.png go here")
    p.add_argument("--check", action="store_true", help="compare the first steps with single-device training")
    p.add_argument("--compile", action="store_true", help="train torch.compile(model) (the ring: custom ops)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.check else (200 if on_gpu else 70)
    if args.seqlen is None:  # here, not as the default: --help runs in one process, where W is 1
        args.seqlen = (8192 if on_gpu else 32) * world_size
    multiple = 2 * world_size
    problems = [
        f"--{name.replace('_', '-')} {getattr(args, name)} must be positive"
        for name in ("batch", "dim", "layers", "heads", "kv_heads", "log_every")
        if getattr(args, name) < 1
    ]
    if args.seqlen < 4 or args.seqlen % multiple:
        problems.append(f"--seqlen {args.seqlen} must be a multiple of 2 x ranks = {multiple} (zigzag), at least 4")
    if min(args.dim, args.heads, args.kv_heads) >= 1 and (
        args.dim % args.heads or (args.dim // args.heads) % 8 or args.dim // args.heads > MAX_HEAD_DIM
        or args.heads % args.kv_heads or max(args.heads, args.batch) > MAX_GRID_DIM
    ):  # fmt: skip
        problems.append(f"--dim / --heads must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, --heads a multiple of "
                        f"--kv-heads, --heads and --batch at most {MAX_GRID_DIM}")  # fmt: skip
    if args.warmup < 0 or not 0 < args.lr < math.inf:
        problems.append(f"--warmup {args.warmup} must be at least 0 and --lr {args.lr} positive and finite")
    if args.vocab < 3 or args.steps < 1:
        problems.append("--vocab must be at least 3 and --steps at least 1")
    if args.dtype == "bf16" and not on_gpu:
        problems.append("--dtype bf16 needs GPUs (Triton's interpreter computes bf16 wrongly)")
    exit_on_bad_arguments(p, problems)
    return args


class Progress:
    """One rewritten stderr line on rank 0: a bar, the step, loss, copy accuracy and global tokens/s.
    update(..., keep=True) ends the line, so it stays in the log."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.start = total, enabled, time.perf_counter()

    def update(self, step: int, loss: float, accuracy: float, tokens_per_s: float, keep: bool) -> None:
        if not self.enabled:
            return
        done = int(20 * step / self.total)
        elapsed = time.perf_counter() - self.start
        line = (
            f"[{'#' * done}{'.' * (20 - done)}] step {step}/{self.total} | loss {loss:.4f} | "
            f"copy accuracy {accuracy:.3f} | {tokens_per_s:,.0f} tok/s | {elapsed:.0f}s"
        )
        print(f"\r{line}", end="\n" if keep else "", file=sys.stderr, flush=True)


def lr_at(step: int, args) -> float:
    return args.lr * min(1.0, (step + 1) / max(args.warmup, 1))


def train_step(model, optimizer, step, args, tokens, pos, labels, loss_fn, after_backward=None) -> tuple:
    """One optimizer step; returns the loss, logits (B, S', vocab) and the gradients' norm before clipping, detached.
    tokens, labels (B, S'), pos (B, S').

    loss_fn(logits, labels) gives the loss; after_backward(model) runs before clipping (the gradient sync)."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    autocast = args.dtype == "bf16" and next(model.parameters()).dtype == torch.float32
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens, pos)  # (B, S', vocab)
    loss = loss_fn(logits, labels)
    loss.backward()
    if after_backward is not None:
        after_backward(model)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), logits.detach(), grad_norm.detach()


def ring_step(model, optimizer, step, args, sp, tokens, labels):
    """train_step on this rank's shard (in sp's layout) of tokens, labels (B, S) (labels unshifted, on any
    device): the sharded loss, gradients summed over the ranks. Returns the loss, this rank's logits
    (B, S / W, vocab), the gradients' norm before clipping and the ShardedBatch."""
    device = next(model.parameters()).device
    b = sp.shard_batch(tokens.to(device), labels.to(device))
    loss, logits, grad_norm = train_step(model, optimizer, step, args, b.input_ids, b.position_ids, b.labels,
                                         sp.cross_entropy, sp.sync_gradients)  # fmt: skip
    return loss, logits, grad_norm, b


def single_device_step(model, optimizer, step, args, tokens, labels):
    """train_step on the whole sequence on one device: tokens, labels (B, S) (labels unshifted).
    Returns the loss, logits (B, S, vocab) and the gradients' norm before clipping."""
    device = next(model.parameters()).device
    pos = torch.arange(tokens.shape[1], device=device)
    targets = shift_labels(labels).to(device)
    return train_step(model, optimizer, step, args, tokens.to(device), pos, targets, single_device_loss)


def make_model(args, attention: nn.Module) -> GPT:
    torch.manual_seed(args.seed)  # built on the CPU: the same weights on every rank and for every copy
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, attention)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.95), weight_decay=0.0)


def single_device_loss(logits, labels):  # unsharded: labels (B, S) already shifted; fp32 at least, as the ring's
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX)


def run_check(args, env, sp, model, ring_model, optimizer) -> bool:
    """Ring-sharded (ring_model: model, or it compiled) vs single-device (plain attention, same dtype) vs float64 for
    the first steps (rank 0 checks)."""
    singles = {}
    if env.is_main:
        for name, dtype in (("plain", torch.float32), ("float64", torch.float64)):
            m = copy.deepcopy(model).to(dtype)
            m.attention = SingleDeviceAttention()
            singles[name] = (m, make_optimizer(m))
    rows = []
    for step in range(args.steps):
        tokens, labels = copy_task_batch(args.batch, args.seqlen, args.vocab, args.seed + step)
        ring_loss, _, ring_norm, _ = ring_step(ring_model, optimizer, step, args, sp, tokens, labels)
        if env.is_main:
            results = {
                name: single_device_step(m, opt, step, args, tokens, labels) for name, (m, opt) in singles.items()
            }
            losses = {name: r[0] for name, r in results.items()}
            row = {"step": step, "ring": ring_loss.item(), **{k: v.item() for k, v in losses.items()}}
            try:
                check_close(f"step {step} loss", ring_loss, losses["plain"], losses["float64"])
                # the gradients' scale too, which AdamW and clipping all but hide from the losses (a sum over the
                # ranks off by a factor W would pass on the losses alone)
                check_close(f"step {step} gradient norm", ring_norm, results["plain"][2], results["float64"][2])
                row["ok"] = True
            except AssertionError as e:
                row["ok"], row["error"] = False, str(e)
            row["allowed"] = tolerance(losses["plain"], losses["float64"])
            row["ring_err"] = max_abs_error(ring_loss, losses["float64"])
            row["plain_err"] = max_abs_error(losses["plain"], losses["float64"])
            rows.append(row)
    ok = torch.tensor([float(all(r["ok"] for r in rows)) if env.is_main else 0.0], device=env.device)
    dist.broadcast(ok, src=0)
    log(f"{'step':>4} {'ring loss':>12} {'plain loss':>12} {'float64 loss':>14} {'ring err':>10} {'plain err':>10} "
        f"{'allowed':>10}")  # fmt: skip
    for r in rows:
        log(f"{r['step']:>4} {r['ring']:>12.7f} {r['plain']:>12.7f} {r['float64']:>14.9f} {r['ring_err']:>10.2e} "
            f"{r['plain_err']:>10.2e} {r['allowed']:>10.2e}  {'ok' if r['ok'] else 'FAIL'}")  # fmt: skip
    for r in rows:
        if not r["ok"]:
            log(f"  {r['error']}")
    log("check: " + ("passed" if ok.item() else "FAILED") + " (ring-sharded vs single-device, tolerance rule)")
    return bool(ok.item())


def save_outputs(history: list[dict], out: Path, chance: float, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "history.json").write_text(json.dumps(history, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"wrote {out / 'history.json'}; no loss.png: matplotlib is not installed (pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="training loss")
    ax.axhline(chance, color="gray", linestyle="--", label="chance: log(vocab - 2)")
    ax.set(xlabel="step", ylabel="loss on the copied tokens", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    log(f"wrote {out / 'history.json'} and {out / 'loss.png'}")


def main() -> int:
    on_gpu = torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = parse_args(world_size, on_gpu)
    env = init_distributed()
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 stays fp32 (the check compares fp32 runs)
    sp = ringattn.SequenceParallel(layout="zigzag")
    attention = ringattn.nn.RingAttention(causal=True, sp=sp)
    model = make_model(args, attention).to(env.device)
    ring_model = torch.compile(model) if args.compile else model  # the same parameters
    optimizer = make_optimizer(model)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"train_gpt: {env.world_size} rank(s) ({env.backend}, {env.device.type}), {args.dtype}"
        f"{', torch.compile' if args.compile else ''}; "
        f"{params / 1e6:.2f}M parameters ({args.layers} layers, dim {args.dim}, {args.heads} heads, "
        f"{args.kv_heads} KV heads); batch {args.batch} x {args.seqlen} tokens ({args.seqlen // env.world_size} "
        f"per rank, zigzag); {args.steps} steps"
    )
    log(model.attention)

    if args.check:
        ok = run_check(args, env, sp, model, ring_model, optimizer)
        destroy()
        return 0 if ok else 1

    progress = Progress(args.steps, env.is_main)
    history, tokens_per_step = [], args.batch * args.seqlen
    for step in range(args.steps):
        t0 = time.perf_counter()
        tokens, labels = copy_task_batch(args.batch, args.seqlen, args.vocab, args.seed + step)
        loss, logits, _, b = ring_step(ring_model, optimizer, step, args, sp, tokens, labels)
        counted = b.labels != IGNORE_INDEX
        stats = torch.stack([((logits.argmax(-1) == b.labels) & counted).sum(), counted.sum()]).double()
        dist.all_reduce(stats)  # copy accuracy over the whole batch
        loss_value, accuracy = loss.item(), (stats[0] / stats[1].clamp(min=1)).item()
        rate = tokens_per_step / (time.perf_counter() - t0)
        history.append({"step": step + 1, "loss": loss_value, "copy_accuracy": accuracy, "tokens_per_s": rate})
        keep = (step + 1) % args.log_every == 0 or step + 1 == args.steps  # this line stays in the log
        progress.update(step + 1, loss_value, accuracy, rate, keep)
    chance = math.log(args.vocab - 2)
    log(f"done: loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} (chance: {chance:.3f})")
    if env.is_main:
        title = f"train_gpt: {args.seqlen} tokens per sample over {env.world_size} rank(s), zigzag"
        save_outputs(history, args.out, chance, title)
    destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
