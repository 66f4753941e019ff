"""A simulated ring: W virtual ranks in one process, no communication (docs/design.md, section 7): a measuring
tool for the ring's numerics and for the cost of its decomposition, not a runtime part.

It runs the same schedule (schedule.ring_streams, schedule.block_tasks) and the same per-step
code (parallel/steps.py: own_block_forward, own_block_backward at step 0; forward_step, backward_step,
add_to_chain after, home_gradients at the end) as the distributed loops in parallel/ring.py, with
the blocks that rank r would hold at step t taken from a list instead of received. Steps run in ring order
and, within a step, ranks in order, so the dK/dV accumulator of every block collects its
contributions in the order the real ring adds them: the results are bitwise those of the
distributed ring with the same ops. Uses: measuring the ring's numerics for any W on one device,
and timing what the decomposition itself costs against one fused call, without a network.
"""

import torch

from ..ops import AttnOps, capped_ops
from ..ops.validation import check_window
from ..parallel.layout import check_layout, check_local_seqlen, check_seqlen, shard_indices
from ..parallel.schedule import held_blocks, ring_streams
from ..parallel.steps import (
    HeldBlock,
    add_to_chain,
    backward_step,
    chains_round_early,
    finishing_plan,
    forward_step,
    home_gradients,
    own_block_backward,
    own_block_forward,
    pack_rows,
    start_chains,
    state_dtype,
)

Window = tuple[int | None, int | None]


def _check_shards(name: str, shards: list[torch.Tensor], world_size: int) -> None:
    if len(shards) != world_size:
        raise ValueError(f"{name} must hold one shard per virtual rank ({world_size}), got {len(shards)}")


def simulate_ring_forward(
    ops: AttnOps,
    q_shards: list[torch.Tensor],
    k_shards: list[torch.Tensor],
    v_shards: list[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    layout: str = "contiguous",
    out_dtype: torch.dtype | None = None,
    window: Window = (None, None),
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The forward of a ring of W = len(q_shards) ranks, run in this process, up to the last step any rank computes
    (schedule.ring_streams, as ring_attn_forward).

    Args:
        q_shards: W tensors (B, S_local, Hq, D), rank r's queries in `layout`.
        k_shards, v_shards: W tensors (B, S_local, Hkv, D).
        out_dtype: the dtype the finishing step of each row writes out in, as ring_attn_forward writes q's dtype;
            None: state_dtype (fp32, or float64 for float64 inputs), the unrounded result.
        window: a sliding window over global positions (ops' form: None for no limit on a side), as the ring's.
    Returns:
        [(out, lse)] per rank: out (B, S_local, Hq, D) in out_dtype, lse (B, Hq, S_local) float64, as
        ring.ring_attn_forward returns them on that rank when W > 1 (also for W = 1 here).
    Raises:
        ValueError: shard lists of different lengths, an unknown layout, an odd S_local with "zigzag".
    """
    world_size = len(q_shards)
    _check_shards("k_shards", k_shards, world_size)
    _check_shards("v_shards", v_shards, world_size)
    k_shards = [k.contiguous() for k in k_shards]  # what the real ring holds: its own block, then received copies
    v_shards = [v.contiguous() for v in v_shards]
    plans = [finishing_plan(layout, rank, world_size, causal, q.shape[1], window=window)
             for rank, q in enumerate(q_shards)]  # fmt: skip
    finished = [torch.empty(q.shape, dtype=out_dtype or state_dtype(q), device=q.device) for q in q_shards]
    states = [
        own_block_forward(ops, layout, rank, world_size, causal, softmax_scale, q, k, v,
                          finished=finished[rank], finishing=plans[rank][0], window=window)
        for rank, (q, k, v) in enumerate(zip(q_shards, k_shards, v_shards, strict=True))
    ]  # fmt: skip
    streams = ring_streams(layout, world_size, causal, q_shards[0].shape[1], window)
    packs = [[(pack_rows(k, st.rows), pack_rows(v, st.rows)) for k, v in zip(k_shards, v_shards, strict=True)]
             for st in streams]  # fmt: skip
    for step in range(1, max((st.steps for st in streams), default=0) + 1):
        for rank in range(world_size):
            blocks = [HeldBlock(kv, *packs[i][kv], streams[i].rows)
                      for i, kv in held_blocks(streams, rank, step, world_size)]  # fmt: skip
            out, lse = states[rank]
            forward_step(
                ops, layout, rank, world_size, causal, softmax_scale, q_shards[rank], blocks, out, lse,
                finished=finished[rank], finishing=plans[rank][step], window=window,
            )  # fmt: skip
    return [(finished[rank], lse) for rank, (_, lse) in enumerate(states)]


def simulate_ring_backward(
    ops: AttnOps,
    dout_shards: list[torch.Tensor],
    q_shards: list[torch.Tensor],
    k_shards: list[torch.Tensor],
    v_shards: list[torch.Tensor],
    out_shards: list[torch.Tensor],
    lse_shards: list[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    layout: str = "contiguous",
    grad_dtype: torch.dtype | None = None,
    window: Window = (None, None),
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The backward of a ring of W = len(q_shards) ranks, run in this process.

    Args:
        dout_shards, out_shards: W tensors (B, S_local, Hq, D); out as the forward returned it.
        q_shards, k_shards, v_shards: as in simulate_ring_forward.
        lse_shards: W tensors (B, Hq, S_local) float64, the global lse from the forward.
        grad_dtype: the dtype of the gradients, as ring_attn_backward returns the inputs' dtype: the finishing
            step of each dq row writes it in grad_dtype, and dk, dv are rounded to it with each block's last
            share (W > 1). None: state_dtype (fp32, or float64 for float64 inputs), unrounded.
        window: as in simulate_ring_forward.
    Returns:
        [(dq, dk, dv)] per rank, shaped like that rank's q, k, v, in grad_dtype or state_dtype.
    """
    world_size = len(q_shards)
    for name, shards in (("dout", dout_shards), ("k", k_shards), ("v", v_shards), ("out", out_shards)):
        _check_shards(f"{name}_shards", shards, world_size)
    _check_shards("lse_shards", lse_shards, world_size)
    k_shards = [k.contiguous() for k in k_shards]
    v_shards = [v.contiguous() for v in v_shards]
    stats = [ops.bwd_preprocess(o, d, lse) for o, d, lse in zip(out_shards, dout_shards, lse_shards, strict=True)]
    plans = [finishing_plan(layout, rank, world_size, causal, q.shape[1], window=window)
             for rank, q in enumerate(q_shards)]  # fmt: skip
    dq_finished = [torch.empty(q.shape, dtype=grad_dtype or state_dtype(q), device=q.device) for q in q_shards]
    # as ring_attn_backward: step 0 stores dq and the own block's accumulators, later shares are stored then added
    grads = [
        own_block_backward(ops, layout, rank, world_size, causal, softmax_scale, dout_shards[rank], q_shards[rank],
                           k_shards[rank], v_shards[rank], out_shards[rank], lse_shards[rank], stats[rank],
                           dq_finished=dq_finished[rank], finishing=plans[rank][0], window=window)
        for rank in range(world_size)
    ]  # fmt: skip
    dq = [g[0] for g in grads]
    streams = ring_streams(layout, world_size, causal, q_shards[0].shape[1], window)
    if not streams:  # a window inside each rank's own block: no later share rounds them
        return [(dq_finished[r], *(g.to(grad_dtype) if grad_dtype else g for g in grads[r][1:]))
                for r in range(world_size)]  # fmt: skip
    round_early = chains_round_early(streams) and grad_dtype is not None  # as the ring, rounding the last share
    packs = [[(pack_rows(k, st.rows), pack_rows(v, st.rows)) for k, v in zip(k_shards, v_shards, strict=True)]
             for st in streams]  # fmt: skip
    # chains[i][b]: the dK/dV accumulators of block b in stream i, as the ring passes them on (None: not started)
    chains = [list(c) for c in zip(*(start_chains(g[1], g[2], streams) for g in grads), strict=True)]
    shares = [tuple(torch.empty(t.shape, dtype=dq[0].dtype, device=t.device) for t in pack[0]) for pack in packs]
    for step in range(1, max(st.steps for st in streams) + 1):
        for rank in range(world_size):
            active = held_blocks(streams, rank, step, world_size)
            blocks = [HeldBlock(kv, *packs[i][kv], streams[i].rows) for i, kv in active]
            rows = backward_step(
                ops, layout, rank, world_size, causal, softmax_scale,
                dout_shards[rank], q_shards[rank], blocks, out_shards[rank], lse_shards[rank], stats[rank],
                dq[rank], [shares[i] for i, _ in active], add_dkdv=False,
                dq_finished=dq_finished[rank], finishing=plans[rank][step], window=window,
            )  # fmt: skip
            for (i, kv), share_rows in zip(active, rows, strict=True):
                rounded = grad_dtype if step == streams[i].steps and round_early else None
                chains[i][kv] = add_to_chain(chains[i][kv], *shares[i], share_rows, rounded)
    results = []
    for r in range(world_size):
        homes = [chains[i][r] for i in range(len(streams))]
        dk, dv = home_gradients(grads[r][1], grads[r][2], homes, streams, grad_dtype or state_dtype(q_shards[r]))
        results.append((dq_finished[r], dk, dv))
    return results


def simulate_ring_attn(
    ops: AttnOps,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    world_size: int,
    layout: str = "contiguous",
    dout: torch.Tensor | None = None,
    window: Window = (None, None),
    softcap: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """Ring attention over full tensors: shard them for `world_size` virtual ranks, run the simulated ring,
    reassemble the results in global order.

    Args:
        q: (B, S, Hq, D); k, v: (B, S, Hkv, D); S divisible by world_size ("contiguous") or 2 world_size ("zigzag").
        dout: (B, S, Hq, D); when given, the backward runs too.
        window, softcap: a sliding window over global positions (simulate_ring_forward) and the soft-cap (0: none).
    Returns:
        (out (B, S, Hq, D), lse (B, Hq, S)), and with dout also (dq, dk, dv), all in fp32
        (float64 for float64 inputs).
    Raises:
        ValueError: an unknown layout, a world_size that is not a positive int, S not divisible, mismatched
            shapes, a window side below 0.
    """
    check_layout(layout)
    if any(side is not None and side < 0 for side in check_window(window)):
        raise ValueError(f"window's sides must be >= 0, or None for no limit, got {tuple(window)}")
    seqlen = q.shape[1]
    check_seqlen(seqlen, world_size, layout, name="q.shape[1]")
    if k.shape[1] != seqlen or v.shape[1] != seqlen or (dout is not None and dout.shape != q.shape):
        raise ValueError(f"k, v (and dout) must have q's sequence length {seqlen} (and dout q's shape)")
    check_local_seqlen(seqlen // world_size, layout)
    idx = [shard_indices(seqlen, r, world_size, layout, device=q.device) for r in range(world_size)]

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.index_select(1, i) for i in idx]

    def join(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        shape = list(parts[0].shape)
        shape[dim] = seqlen
        full = parts[0].new_empty(shape)
        for i, part in zip(idx, parts, strict=True):
            full.index_copy_(dim, i, part)
        return full

    qs, ks, vs = split(q), split(k), split(v)
    ops = capped_ops(ops, softcap)
    states = simulate_ring_forward(ops, qs, ks, vs, softmax_scale, causal, layout, window=window)
    outs, lses = [s[0] for s in states], [s[1] for s in states]
    result = (join(outs), join(lses, dim=2).to(state_dtype(q)))  # lse as ring_attn_func returns it
    if dout is None:
        return result
    # the backward sees the forward's output in the input dtype, as ringattn::ring_attn_fwd's autograd saves it
    outs_in = [o.to(q.dtype) for o in outs]
    grads = simulate_ring_backward(ops, split(dout), qs, ks, vs, outs_in, lses, softmax_scale, causal, layout,
                                   window=window)  # fmt: skip
    return result + tuple(join([g[i] for g in grads]) for i in range(3))
