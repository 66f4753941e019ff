"""What the ring's decomposition costs on one GPU: the simulated ring (and Ulysses x ring grids) against one fused call.

    PYTHONPATH=. python3 launch/bench/bench_simulated_ring.py
    PYTHONPATH=. python3 launch/bench/bench_simulated_ring.py --world-sizes 8 --seqlens-local 8192 --out /tmp/s.json
    PYTHONPATH=. python3 launch/bench/bench_simulated_ring.py --world-sizes 8 --seqlens-local 16384 --window 4096 \
        --layouts contiguous zigzag --full-cells --no-block --append  # added to the record, its other cells kept
    PYTHONPATH=. python3 launch/bench/bench_simulated_ring.py --world-sizes 4 8 --seqlens-local 8192 --layouts zigzag \
        --kv-heads 8 --ulysses 2 4 --full-cells --no-block --append  # the 2-D grids 2x2, 2x4, 4x2 beside the pure ring
    TRITON_INTERPRET=1 PYTHONPATH=. python3 launch/bench/bench_simulated_ring.py --tiny  # CPU dry run, no JSON

Claims measured: at S_local >= 8k, D = 128, the simulated ring's forward+backward is within 5% of one
fused call over the whole sequence, for contiguous and zigzag causal; and a U x R grid's compute (--ulysses) is within
5% of the pure ring's on the same W ranks.

Defaults: bf16, B = 1, H = Hkv = 32, D = 128, W in (2, 4, 8), S_local in (8192, 16384), so S = W S_local
from 16k to 128k; causal in both layouts in every cell, and non-causal once, in the cell W = 8,
S_local = 8192 (--full-cells), in the first layout only (without a mask every ring step is the whole
block, in both layouts). Providers, each timed "fwd" and "fwd+bwd":
- fused: ringattn.ops.attn_fwd (out in bf16), then attn_bwd, over the whole sequence, as
  flash_attn_func runs them. Timed once per (S, causal); cells with the same S repeat the numbers.
- simulated_ring: testing/simulate.py with KERNEL_OPS, on shards split once outside the timed calls
  (shard_indices): simulate_ring_forward, then simulate_ring_backward (which takes the bf16 out), both
  returning bf16 as ring_attn_forward and ring_attn_backward do (out and dq rounded by the kernel of the
  step that finishes each row, dK and dV with their last share): what ringattn::ring_attn_fwd does on every
  rank, summed over the W ranks, without communication.
- simulated_ulysses_ring (--ulysses U, for every U that divides W with R = W / U >= 2; a ring of one is pure
  Ulysses, the fused call on a share of the heads, and is left out): the compute of ulysses_ring_attn_func on a U x R
  grid of the same W ranks, each holding S_local = S / W tokens of every head before the Ulysses exchange: after
  it, rank (u, r) holds ring shard r (S / R tokens, the layout over R) of query heads Hq / U and of K/V heads Hkv / U
  (or, when U % Hkv == 0, the one K/V head its queries share, copied to U / Hkv ranks), split with
  ringattn.parallel.ulysses.rank_heads outside the timed calls; each of the U Ulysses ranks' rings of R runs as
  simulated_ring does, and all U are timed (they run the same schedule on tensors of the same shapes, so each is
  1 / U of the grid's time). The all-to-alls are not timed (the record's "untimed" says so): this is the
  decomposition's compute, to set beside the pure ring's on the same W ranks. The check sums the gradients of a
  copied K/V head, as the inverse exchange does. Its records hold U, R, ring_S_local (S / R), the paired fused_ms
  and overhead, the pure ring's ms timed in the same rounds (ring_ms) and ratio_to_ring = ms / ring_ms (the table's
  "2-D / pure ring"); steps_computed is over the grid (of U R^2), forward_steps of R.
--window LEFT gives every cell a sliding window of LEFT keys back (flash-attn's window_size (LEFT, 0) with causal,
(LEFT, -1) without), the fused call the same window; --softcap soft-caps both. A ring record counts the blocks that
computed something, summed over the ranks (steps_computed, of W^2), the forward's steps (forward_steps, of W: the ring
stops after the last step of its K/V streams, schedule.ring_streams), and the K/V rows one rank sends in a forward
(kv_rows_sent, of (W - 1) S_local without a window: each of K and V, summed over the hops; a window sends only the
rows it reads, one way or both); FLOPs are then counted over the window's visible pairs.
--breakdown (a GPU) also profiles one forward+backward of each ring and of its fused call (torch.profiler, after one
warm-up call) and records their GPU kernel time and launches by group (kernel_group: attention forward, attention
backward, row stats, other) in the fwd+bwd records, under "kernels", with a table of them: where the overhead goes.
Before any timing, the ring's out, dq, dk, dv must be within 1e-2 relative L2 error of the fused call's
(a failing cell is recorded with "error" and not timed; the script then exits with status 1).

Block entry point (skip with --no-block): one steps.forward_step and one steps.backward_step with
steps.add_share_, the very functions the ring calls at every step after the first (whatever they do now:
kernel launch, merge into the fp32 running state, dQ added into fp32, dK/dV stored as an fp32 share and
added to the block's accumulators), on a full off-diagonal S_local x S_local block (contiguous
causal, rank 1 holding kv block 0 of W = 2), against the public attn_fwd (out in bf16) and attn_bwd
(the row stats computed inside) on the same block: providers block_step and block_public, modes fwd and bwd.

Timing: triton.testing.do_bench median (--warmup, --rep in ms), no host syncs inside the timed calls.
The ring and the fused call it is compared with are timed in turn, --rounds times each (fused, ring, grids,
fused, ring, grids, ...), and each side's median is kept, so drift in the GPU's speed during a run (a few
percent between minutes) falls on both: a ring record holds its paired fused_ms, and its overhead is
ms / fused_ms - 1 (block_step: / block_public ms - 1, timed once each). The fused records hold the
fused call's first timing. TFLOP/s: forward 4 B H S^2 D (x 0.5 causal), fwd+bwd 3.5x, bwd 2.5x.
peak_bytes: peak allocated during one call above what was allocated before it (inputs and shards
excluded). Writes [env, *records] to --out after every cell and prints markdown tables. Default grid:
6 (W, S_local) cells x 2 layouts x 2 modes causal, plus 2 non-causal: 26 ring records, 14 fused ones
and 8 block records; about 6 minutes on an H200 (343 s with --rounds 3).
"""

import argparse
import statistics
import sys

import torch

from ringattn.benchmark import (
    DTYPES,
    attention_flops,
    device_tag,
    env_record,
    head_dim_problems,
    kept_records,
    markdown_table,
    parse_with_tiny,
    run_measuring_peak,
    script_parser,
    time_ms,
    write_json,
)
from ringattn.ops import KERNEL_OPS, attn_bwd, attn_fwd, capped_ops
from ringattn.parallel import LAYOUTS, BlockMode, BlockTask, block_tasks, held_blocks, ring_streams, shard_indices
from ringattn.parallel.steps import HeldBlock, add_share_, backward_step, forward_step
from ringattn.parallel.ulysses import rank_heads
from ringattn.testing import simulate_ring_backward, simulate_ring_forward
from ringattn.ulysses import check_ulysses_heads

MAX_RELATIVE_ERROR = 1e-2
NAMES = ("out", "dq", "dk", "dv")  # checked against the fused call
TINY = dict(world_sizes=[2, 3], seqlens_local=[32], heads=2, kv_heads=1, head_dim=16, full_cells=["all"], rounds=1,
            out=None)  # fmt: skip
# the block of the block entry point: (layout, rank, kv_rank, world_size, causal) of a full off-diagonal step
BLOCK_STEP = ("contiguous", 1, 0, 2, True)
GRID = "simulated_ulysses_ring"  # the provider of the U x R grid's records
UNTIMED = ("communication: the Ulysses all-to-alls (q, k, v, out forward; dout, dq, dk, dv backward) and the ring's "
           "K/V transfers")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__, TINY)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seqlens-local", type=int, nargs="+", default=[8192, 16384], help="S_local per rank")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument(
        "--full-cells", nargs="*", default=None, metavar="WxS_LOCAL",
        help="cells that also run non-causal (first layout only): WxS_LOCAL items, 'all', or none (default: 8x8192 "
        "where measured)",
    )  # fmt: skip
    parser.add_argument("--ulysses", type=int, nargs="+", default=[1], metavar="U",
                        help="Ulysses degrees of U x R grids timed beside the pure ring (1: none)")  # fmt: skip
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on a GPU, fp32 on CPU")
    parser.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timings of the ring and its fused call")
    parser.add_argument("--no-block", action="store_true", help="skip the block entry point section")
    parser.add_argument("--window", type=int, default=-1, metavar="LEFT",
                        help="a sliding window of LEFT keys back in every cell (-1: none)")  # fmt: skip
    parser.add_argument("--softcap", type=float, default=0.0, help="soft-cap the scores (0: none)")
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="profile a forward+backward of each ring and fused call: GPU kernel time by group",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="docs/benchmarks/simulated_ring_{device}.json",
                        help="JSON path ({device}: cpu, or the GPU's model, e.g. h200)")  # fmt: skip
    parser.add_argument("--append", action="store_true", help="keep --out's records of cells not measured again")
    args = parse_with_tiny(parser, TINY, argv)
    args.kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if min(args.world_sizes) < 1 or min(args.seqlens_local) < 1 or min(args.rounds, args.warmup, args.rep) < 1:
        parser.error("--world-sizes, --seqlens-local, --rounds, --warmup and --rep must be positive")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a positive multiple of --kv-heads {args.kv_heads}")
    for problem in head_dim_problems(args.head_dim):
        parser.error(problem)
    if args.window < -1 or not args.softcap >= 0:
        parser.error(f"--window must be -1 (none) or >= 0, got {args.window}; --softcap >= 0, got {args.softcap}")
    if args.dtype == "bf16" and not torch.cuda.is_available():
        parser.error("--dtype bf16 needs a GPU (Triton's interpreter computes bf16 wrongly)")
    if args.breakdown and not torch.cuda.is_available():
        parser.error("--breakdown profiles GPU kernels: it needs a GPU")
    if min(args.ulysses) < 1:
        parser.error(f"--ulysses takes degrees >= 1, got {args.ulysses}")
    args.ulysses = sorted({u for u in args.ulysses if u > 1})
    for ulysses in args.ulysses:
        try:
            check_ulysses_heads(args.heads, args.kv_heads, ulysses)
        except ValueError as e:
            parser.error(f"--ulysses {ulysses} with --heads {args.heads} --kv-heads {args.kv_heads}: {e}")
    args.band = (args.window, None) if args.window >= 0 else (None, None)  # the window in ringattn.ops' form
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out = args.out and args.out.replace("{device}", device_tag(args.device))
    args.dtype = DTYPES[args.dtype or ("bf16" if args.device.type == "cuda" else "fp32")]
    if any(s % 2 for s in args.seqlens_local) and "zigzag" in args.layouts:
        parser.error("zigzag needs even --seqlens-local")
    grid = {(w, s) for w in args.world_sizes for s in args.seqlens_local}
    if args.full_cells is None:
        args.full_cells = ["8x8192"] if (8, 8192) in grid else []
    try:
        args.full_cells = {"all" if c == "all" else _cell(c) for c in args.full_cells}
    except ValueError:
        parser.error(f"--full-cells takes WxS_LOCAL items (like 8x8192) or 'all', got {args.full_cells}")
    if args.full_cells - grid - {"all"}:
        parser.error(f"--full-cells {sorted(args.full_cells - grid - {'all'})} are not among the cells measured")
    return args


def _cell(text: str) -> tuple[int, int]:
    """(W, S_local) of a --full-cells item such as 8x8192; ValueError otherwise."""
    world_size, seqlen_local = text.split("x")
    return int(world_size), int(seqlen_local)


def make_inputs(seqlen: int, args, seed: int) -> tuple[torch.Tensor, ...]:
    """q, dout (1, S, H, D) and k, v (1, S, Hkv, D), standard normal in args.dtype."""
    gen = torch.Generator(device=args.device).manual_seed(seed)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    q, k, v, dout = (
        torch.randn(1, seqlen, h, args.head_dim, generator=gen, device=args.device, dtype=args.dtype) for h in heads
    )
    return q, k, v, dout


def relative_error(parts: list[torch.Tensor], full: torch.Tensor, idx: list[torch.Tensor]) -> float:
    """Relative L2 error of shards `parts` (rank r's along dim 1 at positions idx[r]) against `full`."""
    num = sum((p.float() - full.index_select(1, i).float()).square().sum() for p, i in zip(parts, idx, strict=True))
    return (num / full.float().square().sum()).sqrt().item()


def grid_error(
    parts: list[list[torch.Tensor]], full: torch.Tensor, idx: list[torch.Tensor], heads: list[range]
) -> float:
    """Relative L2 error against `full` (B, S, H, D) of a U x R grid's shards: parts[u][r] holds the tokens of ring
    shard r (positions idx[r]) of heads heads[u]. Shards of the same heads (a K/V head copied to several Ulysses
    ranks) are summed first, as the inverse exchange sums the copies' gradients. U = 1 is relative_error."""
    num = 0.0
    for group in dict.fromkeys(heads):  # each head range once, in order
        for r, i in enumerate(idx):
            part = sum(p[r].float() for p, h in zip(parts, heads, strict=True) if h == group)
            num += (part - full.index_select(1, i)[:, :, group.start : group.stop].float()).square().sum()
    return (num / full.float().square().sum()).sqrt().item()


def fused_calls(q, k, v, dout, scale: float, causal: bool, window, softcap: float):
    """(fwd, fwd+bwd) closures of one fused call over the whole sequence; fwd+bwd returns (out, dq, dk, dv)."""
    options = dict(window=window, softcap=softcap)

    def fwd():
        return attn_fwd(q, k, v, scale, causal, **options)

    def fwd_bwd():
        out, lse = attn_fwd(q, k, v, scale, causal, **options)
        return (out, *attn_bwd(dout, q, k, v, out, lse, scale, causal, **options))

    return fwd, fwd_bwd


def ring_calls(shards, scale: float, causal: bool, layout: str, window, softcap: float):
    """(fwd, fwd+bwd) closures of the simulated ring on pre-split shards (q, k, v, dout lists), returning the
    inputs' dtype as the ring's custom ops do; fwd+bwd returns (outs, dqs, dks, dvs), lists over the ranks."""
    qs, ks, vs, douts = shards
    dtype = qs[0].dtype
    ops = capped_ops(KERNEL_OPS, softcap)

    def fwd():
        states = simulate_ring_forward(ops, qs, ks, vs, scale, causal, layout, dtype, window=window)
        return [out for out, _ in states], [lse for _, lse in states]

    def fwd_bwd():
        outs, lses = fwd()
        grads = simulate_ring_backward(ops, douts, qs, ks, vs, outs, lses, scale, causal, layout, dtype,
                                       window=window)  # fmt: skip
        return (outs, *([g[i] for g in grads] for i in range(3)))

    return fwd, fwd_bwd


def grid_calls(
    q, k, v, dout, ulysses: int, ring_size: int, scale: float, causal: bool, layout: str, window, softcap: float, device
) -> tuple:
    """(fwd, fwd+bwd, idx, q_heads, kv_heads) of a U x R grid after the Ulysses exchange, simulated: rank (u, r) holds
    ring shard r of `layout` over R (positions idx[r], S / R tokens, in global order) of query heads q_heads[u]
    (Hq / U) and K/V heads kv_heads[u] (Hkv / U, or the one its queries share when U % Hkv == 0), as
    ulysses_ring_attn_func's exchange leaves them (rank_heads); each Ulysses rank's ring of R runs ring_calls on
    its shards, split (and made contiguous, as the exchange's output is) outside the timed calls. fwd returns
    [(outs, lses)] and fwd+bwd [(outs, dqs, dks, dvs)], one per Ulysses rank. U = 1 is the pure ring of R ranks on
    all the heads, the very ring_calls.

    Every Ulysses rank runs the same ring (the schedule depends on the layout, R, the mask, S / R and the window, not
    on the heads) on tensors of the same shapes: the grid's compute is U copies of one ring's, and all U are
    timed."""
    idx = [shard_indices(q.shape[1], r, ring_size, layout, device=device) for r in range(ring_size)]
    q_heads = [rank_heads(q.shape[2], u, ulysses) for u in range(ulysses)]
    kv_heads = [rank_heads(k.shape[2], u, ulysses) for u in range(ulysses)]
    rings = []
    for qh, kvh in zip(q_heads, kv_heads, strict=True):
        shards = [[t.index_select(1, i)[:, :, h.start : h.stop].contiguous() for i in idx]
                  for t, h in zip((q, k, v, dout), (qh, kvh, kvh, qh), strict=True)]  # fmt: skip
        rings.append(ring_calls(shards, scale, causal, layout, window, softcap))

    def fwd():
        return [ring_fwd() for ring_fwd, _ in rings]

    def fwd_bwd():
        return [ring_fwd_bwd() for _, ring_fwd_bwd in rings]

    return fwd, fwd_bwd, idx, q_heads, kv_heads


def ring_steps(shape: dict, layout: str, causal: bool, window) -> dict:
    """The ring's steps that computed (a block with a task, block_tasks), summed over the ranks and blocks; the
    forward's steps (the ring stops after the last step of its K/V streams, ring_streams); and the K/V rows each
    rank sends in a forward (each of K and V, summed over the hops)."""
    world_size, seqlen_local = shape["W"], shape["S_local"]
    streams = ring_streams(layout, world_size, causal, seqlen_local, window)
    steps = max((st.steps for st in streams), default=0)
    held = [[rank] + [kv for step in range(1, steps + 1) for _, kv in held_blocks(streams, rank, step, world_size)]
            for rank in range(world_size)]  # fmt: skip
    computed = sum(
        bool(block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local, window))
        for rank in range(world_size)
        for kv_rank in held[rank]
    )
    rows = sum(st.steps * sum(map(len, st.rows)) for st in streams)
    return dict(steps_computed=computed, forward_steps=steps + 1, kv_rows_sent=rows)


def kernel_group(name: str) -> str:
    """The group of a GPU kernel, by the profiler's name for it: ringattn's attention forward and backward kernels
    (any backend: every kernel ringattn/kernels launches is called _attn_<what>_kernel) and their row stats
    (_attn_bwd_preprocess_kernel); "other" for the rest, PyTorch's kernels (the ring's adds of dK/dV shares, fills,
    copies, casts)."""
    if "_attn_bwd_preprocess" in name:
        return "row stats"
    if "_attn_fwd" in name:
        return "attention forward"
    return "attention backward" if "_attn_bwd" in name else "other"


def kernel_breakdown(fn) -> dict[str, dict]:
    """{group: {"ms", "launches"}} of fn()'s GPU kernels in one call (kernel_group), profiled after one warm-up
    call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    groups: dict[str, dict] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            group = groups.setdefault(kernel_group(event.name), dict(ms=0.0, launches=0))
            group["ms"] += event.device_time / 1e3
            group["launches"] += 1
    return groups


def peak_of(fn, args, peak_bytes: int | None = None) -> int | None:
    """fn()'s peak bytes: given (from an earlier call), else from one more call (GPU; None on the CPU)."""
    if peak_bytes is None and args.device.type == "cuda":
        peak_bytes = run_measuring_peak(fn, args.device)[1]
    return peak_bytes


def measure(fn, args, peak_bytes: int | None = None) -> dict:
    """Median ms of fn(), and its peak bytes (peak_of)."""
    return dict(ms=time_ms(fn, args.warmup, args.rep), peak_bytes=peak_of(fn, args, peak_bytes))


def bench_cell(world_size: int, seqlen_local: int, args, fused_cache: dict) -> list[dict]:
    """Records of one (W, S_local): fused and simulated ring, every mask and layout asked for."""
    seqlen = world_size * seqlen_local
    q, k, v, dout = make_inputs(seqlen, args, seed=args.seed + seqlen)
    scale = args.head_dim**-0.5
    cell = dict(W=world_size, S_local=seqlen_local, S=seqlen, H=args.heads, Hkv=args.kv_heads, D=args.head_dim)
    records = []
    full = "all" in args.full_cells or (world_size, seqlen_local) in args.full_cells
    for causal in (True, False) if full else (True,):
        window = [args.window, 0 if causal else -1] if args.window >= 0 else [-1, -1]  # flash-attn's window_size
        shape = dict(cell, window=window, softcap=args.softcap)
        fused_fwd, fused_fwd_bwd = fused_calls(q, k, v, dout, scale, causal, args.band, args.softcap)
        expected, fb_peak = run_measuring_peak(fused_fwd_bwd, args.device)  # the reference of the check
        if (seqlen, causal) not in fused_cache:
            fused_cache[seqlen, causal] = {"fwd": measure(fused_fwd, args),
                                           "fwd+bwd": measure(fused_fwd_bwd, args, fb_peak)}  # fmt: skip
            if args.breakdown:
                fused_cache[seqlen, causal]["fwd+bwd"]["kernels"] = kernel_breakdown(fused_fwd_bwd)
        for mode, result in fused_cache[seqlen, causal].items():
            records.append(_record("fused", shape, None, causal, mode, result))
        fused = {"fwd": fused_fwd, "fwd+bwd": fused_fwd_bwd}
        for layout in args.layouts if causal else args.layouts[:1]:
            records += bench_ring(q, k, v, dout, shape, layout, causal, expected, fused, args)
        del expected
    return records


def paired_ms(fns: list, args) -> list[float]:
    """The median ms of each of fns over args.rounds rounds, each round timing them all in turn (fns[0], fns[1], ...,
    fns[0], ...)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(args.rounds):
        for fn, fn_times in zip(fns, times, strict=True):
            fn_times.append(time_ms(fn, args.warmup, args.rep))
    return [statistics.median(t) for t in times]


def grids_of(world_size: int, args) -> list[tuple[int, int]]:
    """(U, R) of the grids timed in a cell of W ranks: the pure ring (1, W), then (U, W / U) for every --ulysses U
    that divides W and leaves a ring of two ranks or more (a ring of one is pure Ulysses, which runs the fused call:
    not a ring's decomposition). Prints the degrees left out."""
    grids = [(1, world_size)]
    for ulysses in args.ulysses:
        if world_size % ulysses or world_size // ulysses < 2:
            print(f"W={world_size}: no {ulysses} x R grid with R >= 2, left out", flush=True)
        else:
            grids.append((ulysses, world_size // ulysses))
    return grids


def bench_ring(q, k, v, dout, shape: dict, layout: str, causal: bool, expected, fused: dict, args) -> list[dict]:
    """Records of the simulated ring in one layout, and of every U x R grid of the cell (grids_of, grid_calls): each
    checked against `expected` (the fused call's out, dq, dk, dv), then all timed in turn with the fused call
    (`fused`: {mode: closure}, paired_ms). If a check fails, its "error" record, and nothing timed in this layout."""
    seqlen, world_size = shape["S"], shape["W"]
    scale = shape["D"] ** -0.5
    runs, failed = [], []
    for ulysses, ring_size in grids_of(world_size, args):
        fwd, fwd_bwd, idx, q_heads, kv_heads = grid_calls(q, k, v, dout, ulysses, ring_size, scale, causal, layout,
                                                          args.band, args.softcap, args.device)  # fmt: skip
        got, fb_peak = run_measuring_peak(fwd_bwd, args.device)
        errors = {
            name: grid_error([g[i] for g in got], e, idx, kv_heads if name in ("dk", "dv") else q_heads)
            for i, (name, e) in enumerate(zip(NAMES, expected, strict=True))
        }
        del got
        grid = {} if ulysses == 1 else dict(U=ulysses, R=ring_size, ring_S_local=seqlen // ring_size)
        provider = "simulated_ring" if ulysses == 1 else GRID
        if not all(e < MAX_RELATIVE_ERROR for e in errors.values()):  # NaN fails too
            error = f"relative L2 error against the fused call: {errors}"
            where = f"W={world_size}" + (f" ({ulysses} x {ring_size})" if grid else "")
            print(f"{where} S_local={shape['S_local']} {layout} causal={causal}: {error}", flush=True)
            failed.append(dict(provider=provider, **shape, **grid, layout=layout, causal=causal, error=error))
            continue
        steps = ring_steps(dict(W=ring_size, S_local=seqlen // ring_size), layout, causal, args.band)
        steps["steps_computed"] *= ulysses  # every Ulysses rank runs the same ring
        if grid:
            grid.update(untimed=UNTIMED)
        runs.append((provider, grid, steps, {"fwd": (fwd, None), "fwd+bwd": (fwd_bwd, fb_peak)}))
    if failed:
        return failed
    records = []
    for mode in ("fwd", "fwd+bwd"):
        fused_ms, ring_ms, *grid_ms = paired_ms([fused[mode], *(calls[mode][0] for *_, calls in runs)], args)
        for (provider, grid, steps, calls), ms in zip(runs, [ring_ms, *grid_ms], strict=True):
            result = dict(ms=ms, peak_bytes=peak_of(calls[mode][0], args, calls[mode][1]))
            if args.breakdown and mode == "fwd+bwd":
                result["kernels"] = kernel_breakdown(calls[mode][0])
            rec = _record(provider, dict(shape, **grid), layout, causal, mode, result, fused_ms)
            if grid:
                rec.update(ring_ms=ring_ms, ratio_to_ring=ms / ring_ms)
            records.append(dict(rec, **steps))
    return records


def _record(provider: str, shape: dict, layout, causal: bool, mode: str, result: dict, baseline_ms=None) -> dict:
    window = tuple(None if side < 0 else side for side in shape.get("window", (-1, -1)))
    tflops = attention_flops(1, shape["H"], shape["S"], shape["D"], causal, mode, window) / result["ms"] / 1e9
    rec = dict(provider=provider, **shape, layout=layout, causal=causal, mode=mode, ms=result["ms"], tflops=tflops,
               peak_bytes=result["peak_bytes"])  # fmt: skip
    if "kernels" in result:
        rec["kernels"] = result["kernels"]
    if baseline_ms is not None:
        rec["public_ms" if provider == "block_step" else "fused_ms"] = baseline_ms
        rec["overhead"] = result["ms"] / baseline_ms - 1
    grid = f" {shape['U']} x {shape['R']}" if "U" in shape else ""
    line = f"{provider:15} W={shape['W']}{grid} S_local={shape['S_local']:>6} {layout or '-':10} causal={causal!s:5} "
    line += f"{mode:8} {rec['ms']:9.3f} ms {tflops:6.1f} TFLOP/s"
    print(line + (f" overhead {100 * rec['overhead']:+.1f}%" if "overhead" in rec else ""), flush=True)
    return rec


def bench_block(seqlen_local: int, args) -> list[dict]:
    """block_step (steps.forward_step / backward_step) vs block_public (attn_fwd / attn_bwd) on one full block."""
    layout, rank, kv_rank, world_size, causal = BLOCK_STEP
    whole = range(seqlen_local)
    tasks = block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local)
    if tasks != [BlockTask(whole, whole, BlockMode.FULL)]:
        raise AssertionError(f"{BLOCK_STEP} is no longer one full block in the schedule; pick another step")
    q, k, v, dout = make_inputs(seqlen_local, args, seed=args.seed + 1)
    scale = args.head_dim**-0.5
    step = (KERNEL_OPS, layout, rank, world_size, causal, scale)
    block = [HeldBlock(kv_rank, k, v, (whole,))]
    out, lse = attn_fwd(q, k, v, scale, False)  # the ring saves out in the input dtype
    f32 = dict(dtype=torch.float32, device=args.device)
    # the merge's identity
    state = (torch.zeros(q.shape, **f32), torch.full(lse.shape, float("-inf"), dtype=lse.dtype, device=args.device))
    stats = KERNEL_OPS.bwd_preprocess(out, dout, lse)  # the row stats, once for the ring
    grads = [torch.zeros(t.shape, **f32) for t in (q, k, v)]
    shares = [torch.empty(t.shape, **f32) for t in (k, v)]

    def ring_bwd_step():  # a later step's backward as the ring runs it: dK, dV stored as a share, then added
        (rows,) = backward_step(*step, dout, q, block, out, lse, stats, grads[0], [shares], add_dkdv=False)
        add_share_(*grads[1:], *shares, rows)

    calls = {  # mode: (public, ring step); the step merges into `state` and adds into `grads` at every call
        "fwd": (lambda: attn_fwd(q, k, v, scale, False), lambda: forward_step(*step, q, block, *state)),
        "bwd": (lambda: attn_bwd(dout, q, k, v, out, lse, scale, False), ring_bwd_step),
    }
    # check: from the merge's identity / zero accumulators, one step gives the public call's result
    forward_step(*step, q, block, *state)
    ring_bwd_step()
    expected = (out, *attn_bwd(dout, q, k, v, out, lse, scale, False))
    whole_idx = [torch.arange(seqlen_local, device=args.device)]
    errors = [relative_error([g], e, whole_idx) for g, e in zip((state[0], *grads), expected, strict=True)]
    if not all(e < MAX_RELATIVE_ERROR for e in errors):
        raise AssertionError(f"block step differs from the public call: relative L2 errors {errors}")
    shape = dict(W=None, S_local=seqlen_local, S=seqlen_local, H=args.heads, Hkv=args.kv_heads, D=args.head_dim)
    records = []
    for mode, (public, ring_step) in calls.items():
        public_rec = _record("block_public", shape, None, False, mode, measure(public, args))
        records += [public_rec, _record("block_step", shape, None, False, mode, measure(ring_step, args),
                                        public_rec["ms"])]  # fmt: skip
    return records


def ring_table(records: list[dict]) -> str:
    """One row per ring configuration: the pure ring (U x R = 1 x W) and each U x R grid, with the paired fused and
    ring ms per mode, overheads, ring TFLOP/s, peak memory, the steps that computed (of U R^2, over the ranks) and the
    forward's steps (of R); a grid's row also gives its time over the pure ring's (2-D / pure ring, timed in turn)."""
    by_key: dict = {}
    for r in records:
        if "ms" in r and r["provider"] in ("fused", "simulated_ring", GRID):
            key = (r["S_local"], r["W"], r["causal"], tuple(r.get("window", (-1, -1))), r.get("softcap", 0.0))
            by_key.setdefault(key, {})[(r["provider"], r["layout"], r.get("U", 1), r["mode"])] = r
    rows = []
    order = sorted(by_key, key=lambda k: (k[3:], k[0], k[1], -k[2]))  # plain cells first, then by size
    for (s_local, world_size, causal, window, softcap), cell in ((k, by_key[k]) for k in order):
        fused = [cell.get(("fused", None, 1, m)) for m in ("fwd", "fwd+bwd")]
        for layout, ulysses in sorted({(layout, u) for _, layout, u, _ in cell if layout}):
            provider = "simulated_ring" if ulysses == 1 else GRID
            ring = [cell.get((provider, layout, ulysses, m)) for m in ("fwd", "fwd+bwd")]
            if None in fused or None in ring:
                continue
            ring_size = world_size // ulysses
            band = "-" if window == (-1, -1) else f"({window[0]}, {window[1]})"
            ratios = [f"{r['ratio_to_ring']:.3f}" if ulysses > 1 else "-" for r in ring]
            rows.append([s_local, world_size, s_local * world_size, layout, "yes" if causal else "no",
                         f"{ulysses} x {ring_size}", band, f"{softcap:g}",
                         f"{ring[0]['fused_ms']:.2f}", f"{ring[0]['ms']:.2f}", f"{100 * ring[0]['overhead']:+.1f}%",
                         f"{ring[1]['fused_ms']:.2f}", f"{ring[1]['ms']:.2f}", f"{100 * ring[1]['overhead']:+.1f}%",
                         *ratios, f"{ring[1]['tflops']:.0f}", _gib(fused[1]), _gib(ring[1]),
                         f"{ring[1]['steps_computed']} / {ulysses * ring_size**2}",
                         f"{ring[1]['forward_steps']} / {ring_size}",
                         f"{ring[1]['kv_rows_sent']} / {(ring_size - 1) * s_local * ulysses}"])  # fmt: skip
    head = ["S_local", "W", "S", "layout", "causal", "U x R", "window", "softcap", "fused fwd ms", "ring fwd ms",
            "fwd overhead", "fused f+b ms", "ring f+b ms", "f+b overhead", "2-D / pure ring fwd",
            "2-D / pure ring f+b", "ring f+b TFLOP/s", "fused f+b peak GiB", "ring f+b peak GiB", "steps computed",
            "forward steps", "K/V rows sent"]  # fmt: skip
    return markdown_table(head, rows)


def breakdown_table(records: list[dict]) -> str:
    """One row per forward+backward record with a kernel breakdown (--breakdown): GPU ms and launches per group."""
    groups = ("attention forward", "attention backward", "row stats", "other")
    rows = []
    profiled = [r for r in records if "kernels" in r]
    profiled.sort(key=lambda r: (r["S_local"], r["W"], -r["causal"], r["provider"] != "fused", r["layout"] or ""))
    for r in profiled:
        kernels = r["kernels"]
        cells = [f"{kernels[g]['ms']:.2f} ({kernels[g]['launches']})" if g in kernels else "-" for g in groups]
        grid = f" {r['U']} x {r['R']}" if "U" in r else ""
        total = sum(k["ms"] for k in kernels.values())
        rows.append([r["S_local"], r["W"], r["S"], r["provider"] + grid, r["layout"] or "-",
                     "yes" if r["causal"] else "no", *cells, f"{total:.2f}"])  # fmt: skip
    head = ["S_local", "W", "S", "provider", "layout", "causal", *(f"{g} ms (launches)" for g in groups),
            "kernels ms"]  # fmt: skip
    return markdown_table(head, rows)


def block_table(records: list[dict]) -> str:
    """One row per (S_local, mode): the ring's step entry points against the public launchers on one block."""
    cells: dict = {}
    for r in records:
        if r["provider"] in ("block_step", "block_public"):
            cells.setdefault((r["S_local"], r["mode"]), {})[r["provider"]] = r
    rows = [
        [s_local, mode, f"{c['block_public']['ms']:.3f}", f"{c['block_step']['ms']:.3f}",
         f"{100 * c['block_step']['overhead']:+.1f}%", f"{c['block_public']['tflops']:.0f}",
         f"{c['block_step']['tflops']:.0f}", _gib(c["block_public"]), _gib(c["block_step"])]
        for (s_local, mode), c in sorted(cells.items())
    ]  # fmt: skip
    head = ["S_local", "mode", "public ms", "step ms", "step overhead", "public TFLOP/s", "step TFLOP/s",
            "public peak GiB", "step peak GiB"]  # fmt: skip
    return markdown_table(head, rows)


def _key(rec: dict) -> tuple:
    """What one record measured: provider, cell (with its heads and head dim), Ulysses degree, layout, mask, window,
    softcap, mode."""
    return (rec["provider"], rec["W"], rec["S_local"], rec["H"], rec["Hkv"], rec["D"], rec.get("U"), rec.get("layout"),
            rec["causal"], tuple(rec.get("window", (-1, -1))), rec.get("softcap", 0.0), rec.get("mode"))  # fmt: skip


def merged(kept: list[dict], new: list[dict]) -> list[dict]:
    """kept's records but those `new` measures again, then new's."""
    measured = {_key(r) for r in new}
    return [r for r in kept if _key(r) not in measured] + new


def _gib(rec: dict) -> str:
    return "-" if rec["peak_bytes"] is None else f"{rec['peak_bytes'] / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = env_record(args.device, dtype=str(args.dtype).removeprefix("torch."), warmup_ms=args.warmup,
                     rep_ms=args.rep)  # fmt: skip
    records: list[dict] = []
    kept = kept_records(args.out, env) if args.append else []
    fused_cache: dict = {}
    for seqlen_local in args.seqlens_local:
        for world_size in args.world_sizes:
            records += bench_cell(world_size, seqlen_local, args, fused_cache)
            write_json(args.out, env, merged(kept, records))  # after every cell: a run cut short keeps what it has
            if args.device.type == "cuda":
                torch.cuda.empty_cache()
    if not args.no_block:
        for seqlen_local in args.seqlens_local:
            records += bench_block(seqlen_local, args)
        write_json(args.out, env, merged(kept, records))
    print(ring_table(records))
    if args.breakdown:
        print()
        print(breakdown_table(records))
    if not args.no_block:
        print()
        print(block_table(records))
    failed = [r for r in records if "error" in r]
    if failed:
        print(f"{len(failed)} configurations failed the check against the fused call and were not timed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
