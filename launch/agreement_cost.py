"""The cost of ring_attn_func's cross-rank agreement check (ringattn/parallel/agreement.py), per call.

    bash launch/torchrun.sh launch/agreement_cost.py [--calls 2000] [--json PATH]
    NPROC=2 bash launch/torchrun.sh launch/agreement_cost.py --json docs/benchmarks/agreement_cost_cpu.json

Times, on every rank, the median of `--calls` calls of:
- exchange: one exchange_signatures (encode, one all_gather of SIGNATURE_LEN int64 per rank on the
  world group, decode): the cost of every call with RINGATTN_AGREEMENT=always, and of the first
  call of each signature with the default "once";
- cached: check_agreement with "once" on a signature already validated (a dictionary lookup);
- local: the local part of check_ring_inputs' work that builds the signature (ring_signature).
Rank 0 prints the largest median over the ranks, in microseconds, and writes them as JSON with --json.
On GPUs the all_gather runs over NCCL on the rank's device and its result is read back, which also
waits for the work queued on the current stream before it.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from bench_common import host_median_s


def median_us(fn, calls: int) -> float:
    """Median microseconds of `calls` host-timed calls of fn()."""
    return host_median_s(fn, calls) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before ringattn is imported

    from ringattn.distributed import destroy, init_distributed
    from ringattn.parallel import agreement

    device = init_distributed().device

    q = torch.zeros(1, 4096, 16, 128, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    k = torch.zeros(1, 4096, 4, 128, device=device, dtype=q.dtype)
    sig = agreement.ring_signature(q, k, k, 128**-0.5, True, "zigzag")
    group = dist.group.WORLD
    for _ in range(20):  # warm-up: connections, allocations
        agreement.exchange_signatures(sig, group, device)
    os.environ[agreement.AGREEMENT_ENV] = "once"
    agreement.check_agreement(sig, group, device)
    results = {
        "exchange_us": median_us(lambda: agreement.exchange_signatures(sig, group, device), args.calls),
        "cached_us": median_us(lambda: agreement.check_agreement(sig, group, device), args.calls),
        "local_us": median_us(lambda: agreement.ring_signature(q, k, k, 128**-0.5, True, "zigzag"), args.calls),
    }
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, results)
    if dist.get_rank() == 0:
        worst = {key: max(r[key] for r in per_rank) for key in results}
        summary = {
            "backend": dist.get_backend(),
            "world_size": dist.get_world_size(),
            "device": torch.cuda.get_device_name(device) if cuda else f"CPU, {os.cpu_count()} cores",
            "calls": args.calls,
            "torch": torch.__version__,
            "median_us_worst_rank": {key: round(value, 1) for key, value in worst.items()},
        }
        print(json.dumps(summary, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
                f.write("\n")
    destroy()


if __name__ == "__main__":
    main()
