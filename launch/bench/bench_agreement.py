"""What the agreement check costs per call: one all_gather of a 32-int64 header on the group's CPU channel.

    NPROC=2 DEVICE=cpu bash launch/torchrun.sh launch/bench/bench_agreement.py
    NPROC=4 DEVICE=cpu bash launch/torchrun.sh launch/bench/bench_agreement.py
    NPROC=2 bash launch/torchrun.sh launch/bench/bench_agreement.py  # GPUs: an NCCL world, through its gloo twin

Every ring call (ring_attn_func, ring_attn_varlen_func), shard, unshard and SequenceParallel.gather starts with
ringattn.parallel.agreement.check_agreement; this times it alone, as a ring call makes it: the signature of a
(1, 4096, 32, 128) bf16 causal call with 8 K/V heads on the world group (every call's header has one size, so the
fields do not change the cost). Providers:
- agreement: check_agreement("ring_attn_func", signature, world) under RINGATTN_AGREEMENT=always (the default);
- off: the same under RINGATTN_AGREEMENT=off (the setting read, no exchange);
- all_gather: the bare collective check_agreement makes, dist.all_gather of 32 int64 on the CPU channel, for scale.

Timing: per round a barrier, then --calls back-to-back calls timed on the host (perf_counter): per call = the round's
time / calls; us = the median over --rounds rounds, the slowest rank's. Prints a markdown table and writes
[env, *records] (provider, W, backend, us, load_average) to --out (default docs/benchmarks/agreement_{device}.json,
device cpu or the GPU's model, e.g. h200), keeping the records of other W already there when they were measured in
the same environment (else it refuses: write to another file); the env record holds the CPU count, --calls and
--rounds, each record the 1-minute load average at its run: on CPU ranks the times are mostly the operating
system's scheduling of the ranks.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ringattn.benchmark import device_tag, env_record, kept_records, markdown_table, write_json
from ringattn.distributed import destroy, exit_on_bad_arguments, init_distributed, log
from ringattn.parallel.agreement import AGREEMENT_ENV, RingSignature, check_agreement, cpu_channel, encode_header

SIGNATURE = RingSignature(1, 4096, 32, 8, 128, torch.bfloat16, True, 128**-0.5, "zigzag", "q,k,v")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is kept")
    parser.add_argument("--out", default=None, help="JSON output (default docs/benchmarks/agreement_{device}.json)")
    args = parser.parse_args()
    exit_on_bad_arguments(parser, [f"--{name} must be >= 1" for name in ("calls", "rounds") if getattr(args, name) < 1])
    return args


def time_per_call_us(call, args, channel, device) -> float:
    """The slowest rank's median (over rounds) of the host time per call, in microseconds."""
    for _ in range(10):
        call()
    per_call = []
    for _ in range(args.rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group=channel)
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        per_call.append((time.perf_counter() - start) / args.calls)
    slowest = torch.tensor([statistics.median(per_call) * 1e6], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=channel)
    return round(float(slowest), 1)


def main() -> None:
    args = parse_args()
    env = init_distributed()
    channel, _ = cpu_channel(None)  # the world's: itself on gloo, its gloo twin on NCCL
    header = encode_header("ring_attn_func", SIGNATURE)
    gathered = [torch.empty_like(header) for _ in range(env.world_size)]
    providers = {
        "agreement": (lambda: check_agreement("ring_attn_func", SIGNATURE, None), "always"),
        "off": (lambda: check_agreement("ring_attn_func", SIGNATURE, None), "off"),
        "all_gather": (lambda: dist.all_gather(gathered, header, group=channel), "always"),
    }
    records = []
    for provider, (call, mode) in providers.items():
        os.environ[AGREEMENT_ENV] = mode
        us = time_per_call_us(call, args, channel, env.device)
        # host timings depend on how busy the CPUs are
        load = round(os.getloadavg()[0], 2)
        records.append(dict(provider=provider, W=env.world_size, backend=env.backend, us=us, load_average=load))
        log(f"{provider} W={env.world_size}: {us} us per call")
    if env.is_main:
        out = args.out or os.path.join("docs", "benchmarks", f"agreement_{device_tag(env.device)}.json")
        header = env_record(env.device, calls=args.calls, rounds=args.rounds, cpus=os.cpu_count())
        kept = [r for r in kept_records(out, header) if r["W"] != env.world_size]
        records = sorted(kept + records, key=lambda r: (r["W"], r["provider"]))
        write_json(out, header, records)
        head = ["provider", "W", "backend", "us per call"]
        print(markdown_table(head, [[r["provider"], r["W"], r["backend"], r["us"]] for r in records]))
    destroy()


if __name__ == "__main__":
    main()
