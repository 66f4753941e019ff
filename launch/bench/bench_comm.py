"""The rates the planner's cost model takes, measured: P2P and all-to-all bandwidth, copy bandwidth, attention TFLOP/s.

    PYTHONPATH=. python3 launch/bench/bench_comm.py                  # one GPU: copies and attention rates (W = 1)
    bash launch/torchrun.sh launch/bench/bench_comm.py               # W = all GPUs: also NCCL P2P and all-to-all
    NPROC=2 bash launch/torchrun.sh launch/bench/bench_comm.py       # W = 2
    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/bench_comm.py --tiny --out /tmp/comm.json  # CPU dry run

ringattn.parallel.planner predicts a layer's step from link bandwidths and attention rates (docs/planning.md);
this script measures them on the machine it runs on, every rank taking part:
- p2p (W >= 2): the ring's step, each rank sending --sizes-mib bytes to rank + 1 and receiving as much from
  rank - 1 at once (batch_isend_irecv), as the ring passes K/V blocks; gb_s = bytes / time, per rank and direction.
- all_to_all (W >= 2): all_to_all_single of a tensor of that many bytes per rank, as the Ulysses all-to-alls
  trade heads for tokens; gb_s = bytes (W - 1) / W / time: what leaves each rank, per second.
- copy (every W): a device-to-device copy of that many bytes on rank 0's device (read + write counted, as
  the usual copy-bandwidth ceiling). With one GPU this is all the memory system says: it is no NVLink figure.
- attention (every W, rank 0 while the others wait): ringattn.flash_attn_func (bf16, B = 1, D = --head-dim, causal)
  on the blocks a ring step computes, n x n for n in --block-seqlens, with Hq / U query and max(Hkv / U, 1) K/V
  heads for U in --ulysses (Hq, Hkv = --heads, --kv-heads); fwd and fwd+bwd TFLOP/s (FLOPs as
  docs/performance.md counts them).
  The output's last 1024 rows are checked against ringattn.ops.attn_fwd_ref first (relative L2 error < 1e-2).

Timing: each measurement runs --warmup untimed calls, then a barrier, then --iters calls back to back, the device
synchronised after them; ms is the slowest rank's mean per call (all ranks run the same counts: collectives).
On CPU ranks (gloo, the kernels in Triton's interpreter) --tiny sizes check that the script works; their numbers
say nothing about a GPU.

Output (rank 0): a markdown table per kind, the planner options the numbers suggest, and --out (default
docs/benchmarks/comm_{gpu}.json, gpu e.g. h200, or cpu: the benchmark's one record, replaced by each run, the largest W
the most complete) as a JSON list: an env record (kind "env": gpu, torch, triton, cuda, nccl, python, W, backend,
options), then records with keys kind, W, bytes, ms, gb_s (p2p, all_to_all, copy) or kind, B, S, H, Hkv, D, U, causal,
mode, ms, tflops, check_error (attention).
"""

import argparse
import os
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU ranks: kernels in the interpreter; before ringattn

import torch.distributed as dist  # noqa: E402

import ringattn  # noqa: E402
from ringattn.benchmark import (  # noqa: E402
    attention_flops,
    attention_inputs,
    device_tag,
    env_record,
    head_dim_problems,
    markdown_table,
    parse_with_tiny,
    script_parser,
    write_json,
)
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log  # noqa: E402
from ringattn.ops import attn_fwd_ref  # noqa: E402

TINY = dict(sizes_mib=[1 / 256, 1 / 16], block_seqlens=[32, 48], heads=4, kv_heads=2, head_dim=16, ulysses=[1, 2],
            warmup=1, iters=2)  # fmt: skip
MAX_RELATIVE_ERROR = 1e-2
CHECK_ROWS = 1024  # query rows checked against the reference
OPTIONS_RECORDED = ("sizes_mib", "block_seqlens", "heads", "kv_heads", "head_dim", "ulysses", "warmup", "iters")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = script_parser(__doc__, TINY)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64, 256], help="bytes per rank, MiB")
    p.add_argument("--block-seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                   help="n of the n x n ring-step blocks timed")  # fmt: skip
    p.add_argument("--heads", type=int, default=32, help="Hq of the model")
    p.add_argument("--kv-heads", type=int, default=8, help="Hkv of the model")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ulysses", type=int, nargs="+", default=[1, 8], help="U: the heads a rank computes")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per measurement")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--no-attention", action="store_true", help="communication and copies only")
    p.add_argument("--out", type=Path, default=None, help="JSON (default under docs/benchmarks/, see the docstring)")
    args = parse_with_tiny(p, TINY, argv)
    problems = []
    if min(args.sizes_mib) <= 0:
        problems.append("--sizes-mib must be > 0")
    if min(args.block_seqlens) < 1 or args.heads < 1 or args.kv_heads < 1:
        problems.append("--block-seqlens, --heads and --kv-heads must be >= 1")
    problems += head_dim_problems(args.head_dim)
    if args.kv_heads >= 1 and args.heads % args.kv_heads:
        problems.append(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    for u in args.ulysses:
        if u < 1 or args.heads % u or (args.kv_heads % u and u % args.kv_heads):
            problems.append(f"--ulysses {u} must divide --heads and divide or be a multiple of --kv-heads")
    if args.warmup < 0 or args.iters < 1:
        problems.append("--warmup must be >= 0 and --iters >= 1")
    exit_on_bad_arguments(p, problems)
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """The slowest rank's mean milliseconds per call of fn() over `iters` calls after `warmup` and a barrier; every
    rank must call it with the same counts (fn may be collective)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) * 1e3 / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def bandwidth_records(env, sizes_mib: list[float], warmup: int, iters: int) -> list[dict]:
    """p2p and all_to_all (W >= 2) and copy (rank 0) records for each size."""
    rank, world, device = env.rank, env.world_size, env.device
    records = []
    for mib in sizes_mib:
        nbytes = int(mib * 2**20) // (2 * world) * 2 * world  # bf16 elements, a multiple of W
        send = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        recv = torch.empty_like(send)
        if world >= 2:
            ring_step = partial(_ring_step, send, recv, rank, world)
            ms = timed_ms(ring_step, device, warmup, iters)
            records.append(dict(kind="p2p", W=world, bytes=nbytes, ms=ms, gb_s=nbytes / ms / 1e6))
            ms = timed_ms(partial(dist.all_to_all_single, recv, send), device, warmup, iters)
            sent = nbytes * (world - 1) / world
            records.append(dict(kind="all_to_all", W=world, bytes=nbytes, ms=ms, gb_s=sent / ms / 1e6))
        copy_ms = timed_ms(partial(recv.copy_, send) if rank == 0 else _nothing, device, warmup, iters)
        records.append(dict(kind="copy", W=world, bytes=nbytes, ms=copy_ms, gb_s=2 * nbytes / copy_ms / 1e6))
        del send, recv
    return records


def check_error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Relative L2 error of out's last CHECK_ROWS query rows, the query heads of K/V head 0, against the fp32
    reference over all keys (causal, bottom-right aligned: the last rows see exactly their keys).
    out, q: (B, n, H, D); k, v: (B, n, Hkv, D)."""
    group = q.shape[2] // k.shape[2]
    rows = slice(-CHECK_ROWS, None)
    ref, _ = attn_fwd_ref(q[:1, rows, :group].float(), k[:1, :, :1].float(), v[:1, :, :1].float(),
                          q.shape[-1] ** -0.5, True)  # fmt: skip
    got = out[:1, rows, :group].float()
    return float((got - ref).norm() / ref.norm())


def _ring_step(send: torch.Tensor, recv: torch.Tensor, rank: int, world: int) -> None:
    """One ring step: `send` to rank + 1 while `recv` comes from rank - 1."""
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def _nothing() -> None:
    """What the ranks other than 0 do while rank 0 copies (they still meet its barriers)."""


def _fwd(q, k, v) -> None:
    with torch.no_grad():
        ringattn.flash_attn_func(q, k, v, causal=True)


def _fwd_bwd(q, k, v, dout) -> None:
    ringattn.flash_attn_func(q, k, v, causal=True).backward(dout)


def attention_records(env, args) -> list[dict]:
    """Rank 0 times flash_attn_func on each (U, n) block; the other ranks wait at a barrier."""
    records = []
    if env.rank == 0:
        dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
        for u in args.ulysses:
            heads, kv_heads = args.heads // u, max(args.kv_heads // u, 1)
            for n in args.block_seqlens:
                q, k, v, dout = attention_inputs(1, n, heads, kv_heads, args.head_dim, dtype, env.device, seed=n)
                error = check_error(ringattn.flash_attn_func(q, k, v, causal=True), q, k, v)
                shape = dict(B=1, S=n, H=heads, Hkv=kv_heads, D=args.head_dim, U=u, causal=True)
                if error > MAX_RELATIVE_ERROR:
                    records.append(dict(kind="attention", **shape, mode="fwd", error=f"relative error {error:.2e}"))
                    continue
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                calls = (("fwd", partial(_fwd, q, k, v)), ("fwd+bwd", partial(_fwd_bwd, qg, kg, vg, dout)))
                for mode, fn in calls:
                    ms = _local_ms(fn, env.device, args.warmup, args.iters)
                    flops = attention_flops(1, heads, n, args.head_dim, True, mode)
                    records.append(dict(kind="attention", **shape, mode=mode, ms=ms, tflops=flops / ms / 1e9,
                                        check_error=error))  # fmt: skip
    dist.barrier()
    return records


def _local_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3 / iters


def summary(records: list[dict]) -> str:
    """Markdown tables of the records and the planner options their largest sizes suggest."""
    parts = []
    links = [r for r in records if r["kind"] in ("p2p", "all_to_all", "copy")]
    if links:
        rows = [[r["kind"], r["W"], f"{r['bytes'] / 2**20:.3g}", f"{r['ms']:.4g}", f"{r['gb_s']:.4g}"] for r in links]
        parts.append(markdown_table(["kind", "W", "MiB per rank", "ms", "GB/s"], rows))
    attention = [r for r in records if r["kind"] == "attention"]
    if attention:
        rows = [[r["U"], r["S"], r["H"], r["Hkv"], r["mode"], f"{r['ms']:.4g}" if "ms" in r else r["error"],
                 f"{r['tflops']:.4g}" if "tflops" in r else "-"] for r in attention]  # fmt: skip
        parts.append(markdown_table(["U", "n", "H", "Hkv", "mode", "ms", "TFLOP/s"], rows))
    hints = []
    p2p = [r for r in links if r["kind"] == "p2p"]
    if p2p:
        hints.append(f"--nvlink-gb-s {max(p2p, key=lambda r: r['bytes'])['gb_s']:.3g} --nvlink-efficiency 1")
    for mode, flag in (("fwd", "--fwd-tflops"), ("fwd+bwd", "--fwd-bwd-tflops")):
        timed = [r for r in attention if r["mode"] == mode and "tflops" in r]
        if timed:
            hints.append(f"{flag} {max(timed, key=lambda r: (r['S'], r['H']))['tflops']:.3g}")
    if hints:
        parts.append("planner options from these numbers (largest sizes): " + " ".join(hints))
    return "\n\n".join(parts)


def default_out(env) -> Path:
    return Path("docs/benchmarks") / f"comm_{device_tag(env.device)}.json"


def main() -> None:
    args = parse_args()
    env = init_distributed()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if env.backend == "nccl" else None
    options = {k: getattr(args, k) for k in OPTIONS_RECORDED}
    record = env_record(env.device, W=env.world_size, backend=env.backend, nccl=nccl, options=options)
    records = bandwidth_records(env, args.sizes_mib, args.warmup, args.iters)
    if not args.no_attention:
        records += attention_records(env, args)
    out = args.out or default_out(env)
    if env.rank == 0:
        write_json(str(out), record, records)
        log(summary(records))
        log(f"wrote {out}")
    destroy()


if __name__ == "__main__":
    main()
