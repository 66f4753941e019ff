"""Train a Hugging Face Llama with transformers.Trainer and ring attention: each sample's sequence split over a ring
of ranks, data parallelism across the rings (ringattn.integrations.trainer.RingTrainer).

    NPROC=2 bash launch/torchrun.sh examples/train_hf_trainer.py            # one ring of 2 ranks (GPUs, or CPU ranks)
    NPROC=4 bash launch/torchrun.sh examples/train_hf_trainer.py --cp 2     # 2 rings of 2 ranks: dp 2 x cp 2
    bash launch/torchrun.sh examples/train_hf_trainer.py --seqlen 65536     # GPUs: one ring of all, 64k tokens a sample

The model: a Llama built from a config (no download; --dim, --layers, --heads, --kv-heads, --vocab) with ring
attention registered with transformers (ringattn.integrations.hf) over this rank's ring, in the zigzag layout.
The rings: W ranks form W / --cp rings of --cp consecutive ranks (one dimension of a (dp, cp) DeviceMesh). Each
ring trains on its own batches; within a ring every rank reads the same batch and keeps its shard of each sequence.

The data: examples/train_gpt.py's copy task (BOS, n random tokens, SEP, the same n tokens; only the copy scored), as
a map-style dataset of dicts {input_ids, labels} (S,): the loss falls below log(vocab - 2) only by attending S / 2
tokens back, across ranks.

Output (rank 0): Trainer's log every --log-every steps (loss: the mean over every scored token of the global
batch), its final metrics (train_samples_per_second counts each sample once, not once per rank of its ring) and the
loss on --eval-samples held-out samples (eval_loss: the mean over every scored token, the samples spread over the
rings).

Defaults: on GPUs seqlen 8192 x cp, dim 512, 4 layers, 8 heads (2 KV heads) of 64, bf16 autocast, 200 steps; on CPU
ranks (Triton interpreter) seqlen 32 x cp, dim 64, 2 layers, 2 heads (1 KV head) of 32, fp32, 40 steps: about 40 s
of training on 2 cores with 2 ranks, which shows the pipeline at work but is too short to learn the copy (the loss
stays near chance, log(vocab - 2) = 2.64, for the first 80 steps at these sizes). `--help` lists the options.
"""

import argparse
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

from train_gpt import copy_task_batch  # noqa: E402  (examples/ is on sys.path: this script's folder)
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import ringattn  # noqa: E402
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.integrations import hf  # noqa: E402
from ringattn.integrations.trainer import RingTrainer  # noqa: E402
from ringattn.ops.validation import MAX_HEAD_DIM  # noqa: E402


def parse_args(world_size: int, on_gpu: bool) -> argparse.Namespace:
    """The options, checked; exits with status 2 on a bad one."""
    p = argparse.ArgumentParser(
        description="Train a Llama with transformers.Trainer and ring attention (RingTrainer) on a copy task.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cp", type=int, default=None, help="ranks per ring (sequence parallel); W / cp rings; default W")
    p.add_argument("--seqlen", type=int, default=None, help="tokens per sample; default 8192 x cp (GPU), 32 x cp (CPU)")
    p.add_argument("--batch", type=int, default=1 if on_gpu else 2, help="samples per ring and step")
    p.add_argument("--samples", type=int, default=2048, help="samples in the dataset")
    p.add_argument("--eval-samples", type=int, default=64 if on_gpu else 8, help="held-out samples evaluated after")
    p.add_argument("--vocab", type=int, default=64 if on_gpu else 16)
    p.add_argument("--dim", type=int, default=512 if on_gpu else 64)
    p.add_argument("--layers", type=int, default=4 if on_gpu else 2)
    p.add_argument("--heads", type=int, default=8 if on_gpu else 2)
    p.add_argument("--kv-heads", type=int, default=2 if on_gpu else 1)
    p.add_argument("--steps", type=int, default=200 if on_gpu else 40)
    p.add_argument("--lr", type=float, default=1e-3 if on_gpu else 5e-3)
    p.add_argument("--log-every", type=int, default=10 if on_gpu else 5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/train_hf_trainer"), help="Trainer's output_dir")
    args = p.parse_args()
    if args.cp is None:  # here, not as the default: --help runs in one process, where W is 1
        args.cp = world_size
    if args.seqlen is None:
        args.seqlen = (8192 if on_gpu else 32) * args.cp
    problems = []
    if args.cp < 1 or world_size % args.cp:
        problems.append(f"--cp {args.cp} must divide the number of ranks, {world_size}")
    if args.seqlen < 4 or args.vocab < 3 or min(args.batch, args.samples, args.eval_samples, args.steps) < 1:
        problems.append(
            "--seqlen must be at least 4, --vocab at least 3, --batch, --samples, --eval-samples and --steps at least 1"
        )
    if min(args.dim, args.layers, args.heads, args.kv_heads) < 1:
        problems.append("--dim, --layers, --heads and --kv-heads must be positive")
    elif args.dim % args.heads or (args.dim // args.heads) % 8 or args.dim // args.heads > MAX_HEAD_DIM:
        problems.append(f"--dim / --heads must be a multiple of 8 from 8 to {MAX_HEAD_DIM} (the kernels' head dims)")
    elif args.heads % args.kv_heads:
        problems.append("--heads must be a multiple of --kv-heads")
    exit_on_bad_arguments(p, problems)
    return args


def copy_task_samples(n: int, seqlen: int, vocab: int, seed: int) -> list[dict]:
    """n samples {input_ids, labels} (seqlen,) of the copy task."""
    tokens, labels = copy_task_batch(n, seqlen, vocab, seed)  # (n, seqlen) each
    return [{"input_ids": t, "labels": lab} for t, lab in zip(tokens, labels, strict=True)]


def main() -> None:
    on_gpu = torch.cuda.is_available()
    args = parse_args(int(os.environ.get("WORLD_SIZE", "1")), on_gpu)  # before any rank waits for another
    env = init_distributed()  # NCCL on GPUs, gloo on CPU ranks
    if args.cp == env.world_size:
        sp = ringattn.SequenceParallel(layout="zigzag")  # one ring of every rank
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(env.device.type, (env.world_size // args.cp, args.cp), mesh_dim_names=("dp", "cp"))
        sp = ringattn.SequenceParallel(mesh.get_group("cp"), layout="zigzag")  # rings of cp consecutive ranks

    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=args.seqlen,
        attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(args.seed)  # the same weights on every rank
    model = hf.prepare(LlamaForCausalLM(config), hf.register(sp=sp))

    dataset = copy_task_samples(args.samples, args.seqlen, args.vocab, args.seed)  # the same on every rank
    held_out = copy_task_samples(args.eval_samples, args.seqlen, args.vocab, args.seed + 1)

    training = TrainingArguments(
        output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch,
        learning_rate=args.lr, warmup_steps=min(10, args.steps // 4), logging_steps=args.log_every,
        bf16=on_gpu, use_cpu=not on_gpu, save_strategy="no", report_to="none", seed=args.seed,
    )  # fmt: skip
    rings = env.world_size // args.cp
    log(f"{env.world_size} ranks: {rings} ring(s) of {args.cp}; a step: {args.batch * rings} samples of {args.seqlen}")
    trainer = RingTrainer(model=model, args=training, train_dataset=dataset, eval_dataset=held_out, sp=sp)
    metrics = trainer.train().metrics
    log(f"final: loss {metrics['train_loss']:.4f}, {metrics['train_samples_per_second']:.2f} samples/s")
    log(f"held out: eval_loss {trainer.evaluate()['eval_loss']:.4f} over {args.eval_samples} samples")
    del trainer, model  # Trainer's DDP model holds the process group: released before it is destroyed (destroy())
    destroy()


if __name__ == "__main__":
    main()
