"""Pick the Ulysses x ring split (U, R) of a context-parallel attention layer from a cost model.

    python3 -m ringattn.parallel.planner --world 64 --gpus-per-node 8 --heads 32 --kv-heads 8 --head-dim 128 \\
        --seqlen 1048576                         # every valid (U, R), fastest first, with the reason
    python3 -m ringattn.parallel.planner --doc   # the generated tables of docs/planning.md

Arithmetic only: it needs no GPU and no process group, and its own code uses no torch. The model, its assumptions
and how it compares with measured and published points are in docs/planning.md; in short, per attention layer and
per rank, with W = U R ranks, each holding S / W tokens of a global sequence of S, B sequences, Hq query and Hkv
K/V heads of D:

- compute: F = 4 B Hq S^2 D / W FLOPs forward (x 0.5 causal), the backward 2.5 F; forward at `fwd_tflops`, the
  backward at the rate that makes forward+backward (3.5 F) run at `fwd_bwd_tflops`.
- Ulysses (U > 1): four all-to-alls forward (q, k, v in; out back) and four backward (dout in; dq, dk, dv back),
  none overlapped with compute. Each rank keeps 1 / U of its slice and sends the rest; with Hkv < U the K/V heads are
  replicated (a rank needs Hkv_u = max(Hkv / U, 1) heads of S / R tokens, and only those travel), so a K/V tensor
  sends (U - 1) Hkv_u B (S / W) D bytes-per-element. Time: the bytes to peers in this node over NVLink and those
  to other nodes over the network, concurrently, plus one latency.
- ring (R > 1): R steps on blocks of n = S / R tokens (zigzag: every step the same work, F / R, causal or not).
  Forward: c + (R - 1) max(c, x) + one latency (the first transfer's start, before any overlap), x the time of one
  K/V block (2 B n Hkv_u D bytes-per-element). Backward: c_b + (R - 1) max(c_b, x_b) + x_h, x_b a K/V block and
  its fp32 dK/dV accumulator, x_h the last dK/dV hop home, which no compute follows.
- links: a group whose ranks all sit on one node uses NVLink (`nvlink_gb_s` x `nvlink_efficiency` per GPU and
  direction), otherwise the network (`internode_gb_s` x `internode_efficiency` per GPU and direction, the slowest
  hop setting the ring's pace). Ranks are numbered node by node; a Ulysses group is U consecutive ranks, a ring
  group every U-th rank; the slowest rank of any group sets the pace of every step.

The ring hides its transfer when c >= x: for U = 1, bf16 and no mask that is S / R >= F_rate / (g B_link),
g = Hq / Hkv (ring_hiding_seqlen): a block's compute against its K/V block's transfer.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, fields, replace

__all__ = [
    "DEFAULTS",
    "Plan",
    "cost",
    "doc_tables",
    "main",
    "markdown",
    "plan",
    "ring_hiding_seqlen",
    "valid_splits",
]

# Defaults: an H100/H200 node. NVLink 4: 450 GB/s per direction per GPU, ~0.8 of it achieved by large transfers;
# 400 Gb/s InfiniBand per GPU = 50 GB/s. Attention rates: ringattn's forward on one H200, bf16, D = 128, causal,
# S >= 16k (docs/performance.md, docs/benchmarks/kernel_h200.json): 597 to 620 TFLOP/s; forward+backward 450, short
# of the 527 to 560 one fused call measures there (docs/planning.md). Latencies: one NCCL send/recv or all-to-all
# launch, order of magnitude.
DEFAULTS = dict(
    batch=1,
    causal=True,
    dtype_bytes=2,
    nvlink_gb_s=450.0,
    nvlink_efficiency=0.8,
    internode_gb_s=50.0,
    internode_efficiency=0.8,
    nvlink_latency_us=10.0,
    internode_latency_us=20.0,
    fwd_tflops=600.0,
    fwd_bwd_tflops=450.0,
    ulysses_across_nodes=False,
)
ACCUMULATOR_BYTES = 4  # the ring backward's dK/dV accumulators travel in fp32
MAX_HEADDIM = 256  # the kernels' largest head dim, ops/validation.py's MAX_HEAD_DIM (this module imports no torch)


@dataclass(frozen=True)
class Plan:
    """The predicted cost of one (U, R) split of one attention layer, per rank, in seconds (bytes: sent per rank).

    fwd_s, fwd_bwd_s: the layer's forward and forward+backward step time. compute_*_s: the attention kernels alone;
    a2a_*_s: the Ulysses all-to-alls (exposed); ring_*_s: the ring loops, compute and exposed transfer together;
    ring_step_*: one step's compute and transfer (forward; backward with the fp32 dK/dV); efficiency: compute /
    step time, forward+backward; tflops_per_gpu: attention FLOPs per GPU per second, forward+backward."""

    u: int
    r: int
    fwd_s: float
    fwd_bwd_s: float
    compute_fwd_s: float
    compute_bwd_s: float
    a2a_fwd_s: float
    a2a_bwd_s: float
    a2a_bytes_fwd: float
    a2a_link: str  # "none", "nvlink", "internode" (the group spans nodes)
    ring_fwd_s: float
    ring_bwd_s: float
    ring_step_compute_fwd_s: float
    ring_step_transfer_fwd_s: float
    ring_step_compute_bwd_s: float
    ring_step_transfer_bwd_s: float
    ring_bytes_per_step_fwd: float
    ring_link: str  # "none", "nvlink", "internode"
    kv_heads_local: int
    kv_replicated: bool
    efficiency: float
    tflops_per_gpu: float
    why: str

    @property
    def ring_exposed_fwd_s(self) -> float:
        """Forward ring time beyond its compute: transfers not hidden (0 when R = 1)."""
        return self.ring_fwd_s - self.compute_fwd_s

    @property
    def ring_exposed_bwd_s(self) -> float:
        """Backward ring time beyond its compute, the last dK/dV hop included (0 when R = 1)."""
        return self.ring_bwd_s - self.compute_bwd_s


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_positive(name: str, value, at_most: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok or (at_most is not None and value > at_most):
        bound = f" and <= {at_most}" if at_most is not None else ""
        raise ValueError(f"{name} must be a finite number > 0{bound}, got {value!r}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_heads(nheads, nheads_k) -> None:
    _check_int("nheads", nheads)
    _check_int("nheads_k", nheads_k)
    if nheads % nheads_k:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_k ({nheads_k})")


def _check_arguments(world_size, gpus_per_node, nheads, nheads_k, headdim, seqlen, options: dict) -> None:
    for name, value in (("world_size", world_size), ("gpus_per_node", gpus_per_node), ("headdim", headdim),
                        ("seqlen", seqlen), ("batch", options["batch"]),
                        ("dtype_bytes", options["dtype_bytes"])):  # fmt: skip
        _check_int(name, value)
    _check_heads(nheads, nheads_k)
    for name in ("causal", "ulysses_across_nodes"):
        _check_bool(name, options[name])
    if headdim % 8 or headdim > MAX_HEADDIM:
        raise ValueError(f"headdim must be a multiple of 8 from 8 to {MAX_HEADDIM}, got {headdim}")
    if seqlen < world_size:
        raise ValueError(f"seqlen ({seqlen}) must be at least world_size ({world_size}): a token a rank")
    for name in ("nvlink_gb_s", "internode_gb_s", "fwd_tflops", "fwd_bwd_tflops"):
        _check_positive(name, options[name])
    for name in ("nvlink_efficiency", "internode_efficiency"):
        _check_positive(name, options[name], at_most=1.0)
    for name in ("nvlink_latency_us", "internode_latency_us"):
        value = options[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if options["fwd_bwd_tflops"] >= 3.5 * options["fwd_tflops"]:
        raise ValueError(
            f"fwd_bwd_tflops ({options['fwd_bwd_tflops']}) must be below 3.5 x fwd_tflops: forward+backward is 3.5x "
            "the forward's FLOPs and includes the forward's time"
        )


def _options(overrides: dict) -> dict:
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **overrides}


def _nodes_of(ranks, gpus_per_node: int) -> set[int]:
    return {rank // gpus_per_node for rank in ranks}


def valid_splits(
    world_size: int, gpus_per_node: int, nheads: int, nheads_k: int, ulysses_across_nodes: bool = False
) -> list[tuple[int, int]]:
    """Every (U, R) with U R = world_size that the layer can run: U divides nheads; U divides nheads_k or
    nheads_k divides U (K/V heads split evenly, or each replicated on U / nheads_k ranks); and, unless
    ulysses_across_nodes, each Ulysses group (U consecutive ranks) sits on one node. Sorted by U.

    Raises ValueError for a bad argument, naming it."""
    _check_int("world_size", world_size)
    _check_int("gpus_per_node", gpus_per_node)
    _check_heads(nheads, nheads_k)
    _check_bool("ulysses_across_nodes", ulysses_across_nodes)
    splits = []
    for u in range(1, world_size + 1):
        if world_size % u or nheads % u or (nheads_k % u and u % nheads_k):
            continue
        r = world_size // u
        in_node = all(len(_nodes_of(range(k * u, (k + 1) * u), gpus_per_node)) == 1 for k in range(r))
        if in_node or ulysses_across_nodes:
            splits.append((u, r))
    return splits


def ring_hiding_seqlen(
    nheads: int, nheads_k: int, link_bytes_s: float, tflops: float, causal: bool = False, dtype_bytes: int = 2
) -> float:
    """The shortest ring block n (tokens per rank per step) whose forward compute, 4 Hq n^2 D (x 0.5 causal) at
    `tflops`, takes as long as sending its K/V block, 2 n Hkv D dtype_bytes at `link_bytes_s` (latency left out):
    n* = dtype_bytes Hkv F / (2 Hq B_link), x 2 causal; with bf16 and no mask n* = F / (g B_link), g = Hq / Hkv.
    The head dimension and batch cancel."""
    _check_heads(nheads, nheads_k)
    _check_positive("link_bytes_s", link_bytes_s)
    _check_positive("tflops", tflops)
    _check_bool("causal", causal)
    _check_int("dtype_bytes", dtype_bytes)
    return dtype_bytes * nheads_k * tflops * 1e12 / (2 * nheads * link_bytes_s) * (2.0 if causal else 1.0)


def _a2a_time(rank: int, group: range, gpus_per_node: int, per_peer: float, o: dict) -> float:
    """Seconds of one forward's four all-to-alls for `rank` of its Ulysses `group`: per_peer bytes to each peer,
    those in its node over NVLink and the others over the network at once, and each collective's latency."""
    same_node = sum(1 for p in group if p != rank and p // gpus_per_node == rank // gpus_per_node)
    other_nodes = len(group) - 1 - same_node
    nvl = o["nvlink_gb_s"] * 1e9 * o["nvlink_efficiency"]
    net = o["internode_gb_s"] * 1e9 * o["internode_efficiency"]
    latency = (o["internode_latency_us"] if other_nodes else o["nvlink_latency_us"]) * 1e-6
    return max(per_peer * same_node / nvl, per_peer * other_nodes / net) + 4 * latency


def _link(ranks, gpus_per_node: int, o: dict) -> tuple[str, float, float]:
    """(name, bytes/s, latency s) of the slowest link between `ranks`."""
    if len(_nodes_of(ranks, gpus_per_node)) == 1:
        return "nvlink", o["nvlink_gb_s"] * 1e9 * o["nvlink_efficiency"], o["nvlink_latency_us"] * 1e-6
    return "internode", o["internode_gb_s"] * 1e9 * o["internode_efficiency"], o["internode_latency_us"] * 1e-6


def cost(
    u: int,
    r: int,
    gpus_per_node: int,
    nheads: int,
    nheads_k: int,
    headdim: int,
    seqlen: int,
    **options,
) -> Plan:
    """The Plan of one split (U = u, R = r) of world size u r; options as plan's. The split is costed as given,
    even one that valid_splits would leave out for its placement (a Ulysses group across nodes is costed on the
    network); U must still divide nheads and agree with nheads_k.

    Raises ValueError for a bad argument, naming it; TypeError for an unknown option."""
    o = _options(options)
    _check_int("u", u)
    _check_int("r", r)
    world_size = u * r
    _check_arguments(world_size, gpus_per_node, nheads, nheads_k, headdim, seqlen, o)
    if nheads % u:
        raise ValueError(f"u ({u}) must divide nheads ({nheads}): each Ulysses rank takes nheads / u query heads")
    if nheads_k % u and u % nheads_k:
        raise ValueError(f"u ({u}) must divide nheads_k ({nheads_k}) or be a multiple of it (K/V heads replicated)")
    batch, elem = o["batch"], o["dtype_bytes"]
    kv_local = max(nheads_k // u, 1)  # K/V heads a rank needs after the all-to-all

    # compute, per rank
    flops_fwd = 4 * batch * nheads * seqlen**2 * headdim * (0.5 if o["causal"] else 1.0) / world_size
    rate_fwd = o["fwd_tflops"] * 1e12
    rate_bwd = 2.5 / (3.5 / (o["fwd_bwd_tflops"] * 1e12) - 1 / rate_fwd)
    compute_fwd, compute_bwd = flops_fwd / rate_fwd, 2.5 * flops_fwd / rate_bwd

    # Ulysses all-to-alls: the slowest rank of any group sets the pace (with ulysses_across_nodes, groups sit
    # differently across the nodes)
    tokens_rank = batch * seqlen / world_size
    a2a_link, a2a_fwd, a2a_bytes = "none", 0.0, 0.0
    if u > 1:
        peer_heads = 2 * nheads / u + 2 * kv_local  # q and out (or dout and dq); k and v (or dk and dv), per peer
        per_peer = tokens_rank * headdim * elem * peer_heads
        a2a_bytes = per_peer * (u - 1)
        groups = [range(k * u, (k + 1) * u) for k in range(r)]
        a2a_link = max((_link(g, gpus_per_node, o)[0] for g in groups), key=lambda name: name == "internode")
        a2a_fwd = max(_a2a_time(rank, g, gpus_per_node, per_peer, o) for g in groups for rank in g)
    a2a_bwd = a2a_fwd  # dout in; dq, dk, dv back: the same tensors' sizes

    # the ring: every u-th rank; the slowest ring sets the pace
    ring_link, step_x, step_xb = "none", 0.0, 0.0
    step_c, step_cb = compute_fwd / r, compute_bwd / r
    kv_block = 2 * batch * (seqlen / r) * kv_local * headdim  # K and V elements of one step
    if r > 1:
        links = [_link(range(k, world_size, u), gpus_per_node, o) for k in range(u)]
        ring_link, bandwidth, latency = min(links, key=lambda link: link[1])
        step_x = kv_block * elem / bandwidth + latency
        step_xb = kv_block * (elem + ACCUMULATOR_BYTES) / bandwidth + latency
        hop_home = kv_block * ACCUMULATOR_BYTES / bandwidth + latency
        ring_fwd = latency + step_c + (r - 1) * max(step_c, step_x)
        ring_bwd = step_cb + (r - 1) * max(step_cb, step_xb) + hop_home
    else:
        ring_fwd, ring_bwd = compute_fwd, compute_bwd

    fwd = a2a_fwd + ring_fwd
    fwd_bwd = fwd + a2a_bwd + ring_bwd
    plan_ = Plan(
        u=u, r=r, fwd_s=fwd, fwd_bwd_s=fwd_bwd, compute_fwd_s=compute_fwd, compute_bwd_s=compute_bwd,
        a2a_fwd_s=a2a_fwd, a2a_bwd_s=a2a_bwd, a2a_bytes_fwd=a2a_bytes, a2a_link=a2a_link,
        ring_fwd_s=ring_fwd, ring_bwd_s=ring_bwd, ring_step_compute_fwd_s=step_c if r > 1 else 0.0,
        ring_step_transfer_fwd_s=step_x, ring_step_compute_bwd_s=step_cb if r > 1 else 0.0,
        ring_step_transfer_bwd_s=step_xb, ring_bytes_per_step_fwd=kv_block * elem if r > 1 else 0.0,
        ring_link=ring_link, kv_heads_local=kv_local, kv_replicated=nheads_k < u,
        efficiency=(compute_fwd + compute_bwd) / fwd_bwd, tflops_per_gpu=3.5 * flops_fwd / fwd_bwd / 1e12, why="",
    )  # fmt: skip
    return _with_reason(plan_)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _ring_reason(link: str, which: str, transfer: float, compute: float) -> str:
    if transfer <= compute:
        return f"ring transfer hidden over {link} ({_ms(transfer)} per {which}step under {_ms(compute)} of compute)"
    return f"ring transfer exposed over {link} ({_ms(transfer)} per {which}step against {_ms(compute)} of compute)"


def _with_reason(p: Plan) -> Plan:
    """p with its `why`: the ring's state (hidden or not, over which link), the all-to-all's link and share."""
    parts = []
    if p.r == 1 and p.u == 1:
        parts.append("one GPU: compute only")
    if p.r > 1:
        link = "NVLink" if p.ring_link == "nvlink" else "the network"
        fwd = (p.ring_step_transfer_fwd_s, p.ring_step_compute_fwd_s)
        bwd = (p.ring_step_transfer_bwd_s, p.ring_step_compute_bwd_s)
        if fwd[0] > fwd[1] or bwd[0] <= bwd[1]:  # the forward's step, unless the backward's alone is exposed
            parts.append(_ring_reason(link, "", *fwd))
        else:
            parts.append(_ring_reason(link, "backward ", *bwd))
    if p.u > 1:
        where = "all-to-all crosses nodes" if p.a2a_link == "internode" else "all-to-all within the node"
        parts.append(f"{where} ({100 * (p.a2a_fwd_s + p.a2a_bwd_s) / p.fwd_bwd_s:.0f}% of the step)")
        if p.kv_replicated:
            parts.append("K/V heads replicated (Hkv < U)")
    return Plan(**{**{f.name: getattr(p, f.name) for f in fields(p)}, "why": "; ".join(parts)})


def plan(
    world_size: int,
    gpus_per_node: int,
    nheads: int,
    nheads_k: int,
    headdim: int,
    seqlen: int,
    objective: str = "fwd+bwd",
    **options,
) -> list[Plan]:
    """Every valid (U, R) split of `world_size` ranks for one attention layer, fastest first.

    Args:
        world_size: ranks of the context-parallel group (U x R); gpus_per_node: ranks per node, numbered node by
            node. nheads, nheads_k, headdim: Hq, Hkv, D. seqlen: S, the global tokens of one sequence.
        objective: "fwd+bwd" (training) or "fwd" (prefill): the time the list is sorted by (ties: smaller U).
        options (keywords, DEFAULTS): batch; causal; dtype_bytes (q, k, v, out and gradients on the wire);
            nvlink_gb_s, internode_gb_s (GB/s per GPU and direction) and their *_efficiency (achieved fraction);
            nvlink_latency_us, internode_latency_us (per transfer or collective); fwd_tflops, fwd_bwd_tflops
            (attention rate per GPU, forward and forward+backward); ulysses_across_nodes (let a Ulysses group span
            nodes, its all-to-all then partly on the network).
    Returns:
        list[Plan] (the module docstring and docs/planning.md give the model); never empty, as U = 1 (the pure
        ring) is always valid.
    Raises:
        ValueError: a bad argument, naming it; an unknown objective.
        TypeError: an unknown option."""
    if objective not in ("fwd+bwd", "fwd"):
        raise ValueError(f"objective must be 'fwd+bwd' or 'fwd', got {objective!r}")
    o = _options(options)
    _check_arguments(world_size, gpus_per_node, nheads, nheads_k, headdim, seqlen, o)
    splits = valid_splits(world_size, gpus_per_node, nheads, nheads_k, o["ulysses_across_nodes"])
    plans = [cost(u, r, gpus_per_node, nheads, nheads_k, headdim, seqlen, **o) for u, r in splits]
    key = (lambda p: (p.fwd_bwd_s, p.u)) if objective == "fwd+bwd" else (lambda p: (p.fwd_s, p.u))
    return sorted(plans, key=key)


# --- tables -------------------------------------------------------------------------------------------------------


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def markdown(plans: list[Plan]) -> str:
    """A markdown table of `plans`, one row each, in the given order."""
    head = ["U", "R", "fwd ms", "fwd+bwd ms", "compute f+b ms", "all-to-all f+b ms", "ring exposed f+b ms",
            "efficiency", "TFLOP/s per GPU", "why"]  # fmt: skip
    rows = [[p.u, p.r, f"{p.fwd_s * 1e3:.3g}", f"{p.fwd_bwd_s * 1e3:.3g}",
             f"{(p.compute_fwd_s + p.compute_bwd_s) * 1e3:.3g}", f"{(p.a2a_fwd_s + p.a2a_bwd_s) * 1e3:.3g}",
             f"{(p.ring_exposed_fwd_s + p.ring_exposed_bwd_s) * 1e3:.3g}", f"{100 * p.efficiency:.0f}%",
             f"{p.tflops_per_gpu:.0f}", p.why] for p in plans]  # fmt: skip
    return _table(head, rows)


def _table(head: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


LLAMA3_8B = dict(nheads=32, nheads_k=8, headdim=128)
SCALING_ROWS = ((8, 131072), (16, 262144), (32, 524288), (64, 1048576), (128, 1048576), (256, 1048576),
                (512, 1048576), (1024, 1048576))  # fmt: skip


def scaling_table(**options) -> str:
    """docs/planning.md's first table: the planner's choice for Llama-3-8B attention (Hq 32, Hkv 8, D 128,
    causal, B 1) on 8 to 1024 GPUs of 8 a node, beside the pure ring (U = 1) and the widest Ulysses (U = 8)."""
    head = ["GPUs", "S", "S / GPU", "choice (U, R)", "fwd ms", "fwd+bwd ms", "efficiency", "TFLOP/s per GPU",
            "pure ring f+b ms", "U = 8 f+b ms", "why"]  # fmt: skip
    rows = []
    for world, seqlen in SCALING_ROWS:
        plans = plan(world, 8, seqlen=seqlen, **LLAMA3_8B, **options)
        by_u = {p.u: p for p in plans}
        best = plans[0]
        rows.append([world, _tokens(seqlen), _tokens(seqlen // world), f"({best.u}, {best.r})",
                     f"{best.fwd_s * 1e3:.3g}", f"{best.fwd_bwd_s * 1e3:.3g}", f"{100 * best.efficiency:.0f}%",
                     f"{best.tflops_per_gpu:.0f}", f"{by_u[1].fwd_bwd_s * 1e3:.3g}",
                     f"{by_u[8].fwd_bwd_s * 1e3:.3g}" if 8 in by_u else "-", best.why])  # fmt: skip
    return _table(head, rows)


# ringattn's own measurements on 2 and 4 H200s (docs/performance.md): zigzag causal, MHA, S_local = 8k, fwd+bwd
MEASURED_RING = (
    # (W, S_local, Hkv, measured ring fwd+bwd ms, T1 fwd+bwd ms on one GPU)
    (2, 8192, 32, 12.02, 19.31),
    (4, 8192, 32, 24.42, 75.64),
    (2, 8192, 8, 11.48, 20.08),
    (4, 8192, 8, 21.89, 77.28),
    (4, 4096, 32, 8.17, 19.14),
)
MEASURED_HOP_GB_S = {2: (274.0, 274.0), 4: (69.0, 158.0)}  # 128 MiB hops: 0.49 ms at W = 2, 0.85 to 1.95 at W = 4


def measured_table() -> str:
    """Predicted against measured fwd+bwd of ringattn's ring on 2 and 4 H200s over NVLink: the compute rate taken
    from the same run's T1 (one GPU, whole sequence; the forward at 1.25x that rate, which only splits the time
    between the passes), the link at the default (450 GB/s x 0.8) and at the hop bandwidths the profile measured."""
    head = ["W", "S / GPU", "Hkv", "T1 / W ms", "measured ms", "predicted ms (360 GB/s)",
            "predicted ms (measured hops)", "measured / predicted (360 GB/s)"]  # fmt: skip
    rows = []
    for world, local, hkv, measured, t1 in MEASURED_RING:
        seqlen = world * local
        rate = 3.5 * 4 * 32 * seqlen**2 * 128 * 0.5 / (t1 * 1e-3) / 1e12  # T1's forward+backward TFLOP/s
        common = dict(causal=True, fwd_tflops=rate * 1.25, fwd_bwd_tflops=rate)
        nominal = cost(1, world, 8, 32, hkv, 128, seqlen, **common)
        hops = sorted({cost(1, world, 8, 32, hkv, 128, seqlen, nvlink_gb_s=bw, nvlink_efficiency=1.0,
                            **common).fwd_bwd_s * 1e3 for bw in MEASURED_HOP_GB_S[world]})  # fmt: skip
        rows.append([world, _tokens(local), hkv, f"{t1 / world:.3g}", f"{measured:.3g}",
                     f"{nominal.fwd_bwd_s * 1e3:.3g}", " to ".join(f"{h:.3g}" for h in hops),
                     f"{measured / (nominal.fwd_bwd_s * 1e3):.2f}"])  # fmt: skip
    return _table(head, rows)


def _ring_only(p: Plan) -> Plan:
    """p without its all-to-alls: the head split made by tensor parallelism instead, whose traffic (in the linear
    layers) the model leaves out."""
    compute = p.compute_fwd_s + p.compute_bwd_s
    total = p.ring_fwd_s + p.ring_bwd_s
    return replace(
        p,
        fwd_s=p.ring_fwd_s,
        fwd_bwd_s=total,
        a2a_fwd_s=0.0,
        a2a_bwd_s=0.0,
        a2a_bytes_fwd=0.0,
        a2a_link="none",
        efficiency=compute / total,
        tflops_per_gpu=p.tflops_per_gpu * p.fwd_bwd_s / total,
    )


def _model_step_s(
    attention: Plan, layers: int, linear_flops: float, matmul_tflops: float, fwd_only: bool, recompute: bool = False
) -> float:
    """A whole model's step per rank: `layers` attention layers as `attention` predicts them, plus `linear_flops`
    (the rank's dense matrix products, all passes) at `matmul_tflops`; with `recompute`, every layer's forward
    again in the backward (full activation checkpointing). Everything else (norms, embeddings, the optimizer, the
    tensor- or data-parallel traffic) left out."""
    attn = attention.fwd_s if fwd_only else attention.fwd_bwd_s + (attention.fwd_s if recompute else 0.0)
    linear = linear_flops * (4 / 3 if recompute and not fwd_only else 1.0) / (matmul_tflops * 1e12)
    return layers * attn + linear


# Published points and what is assumed about them (docs/planning.md: sources, and which figures are assumptions)
LLAMA3_8B_LINEAR = 32 * 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) + 4096 * 128256  # weights in products per token
LLAMA3_405B_LINEAR = 405e9
A800 = dict(nvlink_gb_s=200.0, internode_gb_s=12.5, fwd_tflops=220.0, fwd_bwd_tflops=190.0)
A800_PEAK, A800_MATMUL = 312.0, 0.7 * 312.0
H100 = dict(fwd_tflops=550.0, fwd_bwd_tflops=420.0)
H100_PEAK, H100_MATMUL = 989.0, 0.7 * 989.0


def published_table() -> str:
    """The model beside three published points (docs/planning.md gives their sources and the assumptions)."""
    head = ["point", "published", "modelled as", "model: attention layer", "model: ring exposed",
            "model: all-to-all", "model: whole model"]  # fmt: skip
    rows = []
    # yunchang USP: Llama-3-8B, 208K tokens, 2 nodes of 8 A800, 47% MFU (training)
    seqlen = 208 * 1024
    usp = plan(16, 8, 32, 8, 128, seqlen, **A800)
    attn_flops = 32 * 3.5 * 4 * 32 * seqlen**2 * 128 * 0.5 / 16
    linear_flops = 6 * LLAMA3_8B_LINEAR * seqlen / 16
    for p in (usp[0], *[q for q in usp if q.u == 8]):
        mfu = [(attn_flops + linear_flops) / _model_step_s(p, 32, linear_flops, A800_MATMUL, False, rc)
               / (A800_PEAK * 1e12) for rc in (False, True)]  # fmt: skip
        rows.append([f"USP, Llama-3-8B, 208K, 2x8 A800: (U, R) = ({p.u}, {p.r})"
                     + (", the planner's choice" if p is usp[0] else ""), "47% MFU (training)",
                     "NVLink 200 GB/s, network 12.5 GB/s per GPU, attention 220 / 190 TFLOP/s, products 218",
                     f"{p.fwd_bwd_s * 1e3:.0f} ms f+b, {100 * p.efficiency:.0f}% of it compute",
                     _ms(p.ring_exposed_fwd_s + p.ring_exposed_bwd_s), _ms(p.a2a_fwd_s + p.a2a_bwd_s),
                     f"MFU {100 * mfu[0]:.0f}%, {100 * mfu[1]:.0f}% with full recomputation"])  # fmt: skip
    # TransformerEngine in NeMo: Llama-2-7B (Hq = Hkv = 32, 32 layers), FP8, DGX-H100, (TP, CP, DP) per row
    for tp, cp, dp, seqlen, tflops in ((4, 4, 8, 131072, 555), (4, 8, 8, 262144, 549), (8, 16, 4, 524288, 549),
                                       (8, 32, 4, 1048576, 536)):  # fmt: skip
        te = _ring_only(cost(tp, cp, 8, 32, 32, 128, seqlen, **H100))
        rows.append([f"TE CP, Llama-2-7B, {seqlen // 1024}K, TP {tp} x CP {cp} x DP {dp} ({tp * cp * dp} H100)",
                     f"{tflops} TFLOPS/GPU", f"TP {tp} as U = {tp}, ({tp}, {cp}) given",
                     f"{te.fwd_bwd_s * 1e3:.0f} ms f+b, {100 * te.efficiency:.0f}% of it compute",
                     _ms(te.ring_exposed_fwd_s + te.ring_exposed_bwd_s), "(TP's traffic instead: not modelled)",
                     "not modelled (FP8 products)"])  # fmt: skip
    # arXiv 2411.01783: Llama-3-405B (Hq 128, Hkv 8, 126 layers), 1M-token prefill, 128 H100 (TP 8 x CP 16)
    seqlen = 1048576
    one = _ring_only(cost(8, 1, 8, 128, 8, 128, seqlen, **H100))
    linear_flops = 2 * LLAMA3_405B_LINEAR * seqlen / 128
    for net, label in ((50.0, "400 Gb/s RDMA"), (12.5, "100 Gb/s TCP")):
        inf = _ring_only(cost(8, 16, 8, 128, 8, 128, seqlen, internode_gb_s=net, **H100))
        step = _model_step_s(inf, 126, linear_flops, H100_MATMUL, True)
        single = _model_step_s(one, 126, linear_flops * 16, H100_MATMUL, True)
        rows.append([f"CP prefill, Llama-3-405B, 1M, TP 8 x CP 16, {label}", "77 s, 93% parallel efficiency",
                     "TP 8 as U = 8, (8, 16) given; attention 550 TFLOP/s, products 692",
                     f"{inf.fwd_s * 1e3:.0f} ms fwd", _ms(inf.ring_exposed_fwd_s), "(TP's traffic instead)",
                     f"{step:.0f} s, {100 * single / (16 * step):.0f}% parallel efficiency"])  # fmt: skip
    return _table(head, rows)


def doc_tables() -> str:
    """The generated tables of docs/planning.md, under the headings the document gives them."""
    return "\n\n".join([
        "### The planner's choice, 8 to 1024 GPUs\n\n" + scaling_table(),
        "### Against ringattn's measured ring\n\n" + measured_table(),
        "### Against published points\n\n" + published_table(),
    ])  # fmt: skip


# --- command line -------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m ringattn.parallel.planner",
        description="Every valid Ulysses x ring split (U, R) of an attention layer, fastest first, from a cost model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--world", type=int, default=64, help="ranks in the context-parallel group (U x R)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--heads", type=int, default=32, help="Hq")
    p.add_argument("--kv-heads", type=int, default=8, help="Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=1048576, help="global tokens of one sequence")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--no-causal", action="store_true", help="attention without a mask")
    p.add_argument("--dtype-bytes", type=int, default=DEFAULTS["dtype_bytes"])
    for name, help_ in (("nvlink-gb-s", "NVLink GB/s per GPU and direction"),
                        ("nvlink-efficiency", "fraction of it achieved"),
                        ("internode-gb-s", "network GB/s per GPU and direction"),
                        ("internode-efficiency", "fraction of it achieved"),
                        ("nvlink-latency-us", "per transfer or collective"), ("internode-latency-us", "likewise"),
                        ("fwd-tflops", "attention forward TFLOP/s per GPU"),
                        ("fwd-bwd-tflops", "attention forward+backward TFLOP/s per GPU")):  # fmt: skip
        p.add_argument(f"--{name}", type=float, default=DEFAULTS[name.replace("-", "_")], help=help_)
    p.add_argument("--ulysses-across-nodes", action="store_true", help="let a Ulysses group span nodes")
    p.add_argument("--objective", choices=("fwd+bwd", "fwd"), default="fwd+bwd", help="sort by this step time")
    p.add_argument("--doc", action="store_true", help="print docs/planning.md's generated tables instead")
    return p


# plan()'s argument names as the command line spells them, for its error messages
_FLAGS = {
    "world_size": "--world",
    "gpus_per_node": "--gpus-per-node",
    "nheads": "--heads",
    "nheads_k": "--kv-heads",
    "headdim": "--head-dim",
    "seqlen": "--seqlen",
    **{name: "--" + name.replace("_", "-") for name in DEFAULTS},
}


def _as_flags(message: str) -> str:
    return re.sub(r"\b(" + "|".join(_FLAGS) + r")\b", lambda m: _FLAGS[m.group(1)], message)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.doc:
        print(doc_tables())
        return 0
    options = {k: getattr(args, k) for k in DEFAULTS if k not in ("causal",)}
    try:
        plans = plan(args.world, args.gpus_per_node, args.heads, args.kv_heads, args.head_dim, args.seqlen,
                     objective=args.objective, causal=not args.no_causal, **options)  # fmt: skip
    except ValueError as exc:
        parser.error(_as_flags(str(exc)))
    print(f"W = {args.world} ({args.gpus_per_node} a node), Hq {args.heads}, Hkv {args.kv_heads}, D {args.head_dim}, "
          f"S {args.seqlen}, B {args.batch}, {'non-causal' if args.no_causal else 'causal'}; per attention layer, "
          f"fastest ({args.objective}) first:\n")  # fmt: skip
    print(markdown(plans))
    best = plans[0]
    print(f"\nThe grid of the first, each Ulysses group {best.u} consecutive ranks as costed: "
          f'init_device_mesh(device, ({best.r}, {best.u}), mesh_dim_names=("ring", "ulysses"))')  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
