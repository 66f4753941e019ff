"""Op-agnostic ring attention forward and backward loops (schedule in docs/design.md, section 4): the
communication around what one rank computes at a step (parallel/steps.py).

Forward: at step t, rank r computes its queries against the K/V block of rank r - t while
the block for step t + 1 is in flight (with a sliding window: the blocks of its K/V streams, one or two, in the
rows the windows read; schedule.ring_streams).
Backward: K/V travel the ring again together with fp32 dK/dV accumulators; each rank adds
its contribution to the accumulators of the block in hand and passes them on, so after W
steps (and one last hop) every rank holds the full gradient of its own K/V (with a sliding window,
after each stream's last step, the last hop going straight home; home_gradients). dQ accumulates
locally in fp32.
"""

import torch

from ..ops import AttnOps
from .comm import RingComm
from .documents import ShardDocuments
from .schedule import BlockMode, held_blocks, ring_streams
from .steps import (
    HeldBlock,
    add_to_chain,
    backward_step,
    chains_round_early,
    finishing_plan,
    forward_step,
    home_gradients,
    own_block_backward,
    own_block_forward,
    own_block_tasks,
    pack_rows,
    start_chains,
    state_dtype,
)


def ring_attn_forward(
    comm: RingComm,
    ops: AttnOps,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    layout: str = "contiguous",
    docs: ShardDocuments | None = None,
    window: tuple[int | None, int | None] = (None, None),
    keep_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of global attention.

    Args:
        q: (B, S_local, Hq, D); k, v: (B, S_local, Hkv, D), this rank's shards in `layout`
            ("contiguous" or "zigzag"; S_local even for "zigzag").
        docs: packed documents of each batch row (ShardDocuments): attention stays inside each document.
        window: a sliding window (left, right) over global positions, None for no limit: blocks outside every
            query's window are skipped, and K/V travel only as far, in the direction and in the rows the window
            reaches (schedule.ring_streams).
        keep_state: return out unrounded, in state_dtype(q) (for a merge after the ring: attention sinks).
    Returns:
        out (B, S_local, Hq, D) in q's dtype (each row rounded from the fp32 state by the step that finishes it,
        or after the last step where there is no finishing plan; with W = 1 one fused call), or with keep_state the
        fp32 state, and lse (B, Hq, S_local) float64.
    Raises:
        RuntimeError: a peer failed or did not arrive within comm's timeout (RingComm.wait).
    """
    world_size, rank = comm.world_size, comm.rank
    if world_size == 1:
        ((task, kwargs),) = own_block_tasks(layout, 0, 1, causal, q.shape[1], docs, window)
        out_dtype = state_dtype(q) if keep_state else None
        return ops.fwd(q, k, v, softmax_scale, task.mode is BlockMode.CAUSAL, out_dtype, **kwargs)
    streams = ring_streams(layout, world_size, causal, q.shape[1], window)
    steps = max((s.steps for s in streams), default=0)
    plan = None if keep_state else finishing_plan(layout, rank, world_size, causal, q.shape[1], docs, window)
    if plan is None:  # the fp32 state is kept, or rounded after the last step
        plan, finished = [None] * (steps + 1), None
    else:
        finished = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # out, each row written once, rounded
    k, v = k.contiguous(), v.contiguous()
    held = [(pack_rows(k, s.rows), pack_rows(v, s.rows)) for s in streams]  # the K/V each stream passes on
    for step in range(steps + 1):
        nxt = [(comm.send_recv(hk, shift=s.direction), comm.send_recv(hv, shift=s.direction)) if step < s.steps
               else None for s, (hk, hv) in zip(streams, held, strict=True)]  # fmt: skip
        sending = any(n is not None for n in nxt)
        if sending:
            comm.commit(f"forward step {step} (K/V)")
        if step == 0:
            out, lse = own_block_forward(ops, layout, rank, world_size, causal, softmax_scale, q, k, v, docs,
                                         finished, plan[step], window)  # fmt: skip
        else:
            blocks = [HeldBlock(kv_rank, *held[i], streams[i].rows)
                      for i, kv_rank in held_blocks(streams, rank, step, world_size)]  # fmt: skip
            forward_step(ops, layout, rank, world_size, causal, softmax_scale, q, blocks, out, lse, docs, finished,
                         plan[step], window)  # fmt: skip
        if sending:
            comm.wait()
            held = [h if n is None else n for n, h in zip(nxt, held, strict=True)]
    return (out if keep_state else _rounded(out, finished, q.dtype)), lse


def _rounded(state: torch.Tensor, finished: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The result in its final dtype: `finished`, whose rows the finishing steps wrote, or, where there was no
    finishing plan (finished None), the fp32 state rounded now."""
    return state.to(dtype) if finished is None else finished


def ring_attn_backward(
    comm: RingComm,
    ops: AttnOps,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    layout: str = "contiguous",
    docs: ShardDocuments | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this rank's q, k, v shards.

    Args:
        dout, out: (B, S_local, Hq, D); q: (B, S_local, Hq, D); k, v: (B, S_local, Hkv, D);
        lse: (B, Hq, S_local) float64, the global normaliser from the forward.
        layout, docs, window: what the forward ran with. K/V travel as the forward's (ring_streams), each block's
            dK, dV accumulators with it (packed in the stream's rows), and from its stream's last step straight
            home (one hop back over the steps taken: the next rank with the whole ring); steps without tasks run
            no kernel.
    Returns:
        dq, dk, dv shaped like q, k, v, in the inputs' dtype: each dq row rounded from its fp32 sum by the step
        that finishes it (after the last step where there is no finishing plan); dk and dv rounded with their last
        share, before the last hop, which then carries half the bytes of fp32 (the same rounding as after it;
        chains_round_early). With W = 1 from one fused call.
    Raises:
        RuntimeError: a peer failed or did not arrive within comm's timeout (RingComm.wait).
    """
    world_size, rank = comm.world_size, comm.rank
    if world_size == 1:
        ((task, kwargs),) = own_block_tasks(layout, 0, 1, causal, q.shape[1], docs, window)
        return ops.bwd(dout, q, k, v, out, lse, softmax_scale, task.mode is BlockMode.CAUSAL, **kwargs)
    stats = ops.bwd_preprocess(out, dout, lse)
    plan = finishing_plan(layout, rank, world_size, causal, q.shape[1], docs, window)
    streams = ring_streams(layout, world_size, causal, q.shape[1], window)
    steps = max((s.steps for s in streams), default=0)
    if plan is None:  # dq rounded after the last step
        plan, dq_finished = [None] * (steps + 1), None
    else:
        dq_finished = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # each row written once, rounded
    k, v = k.contiguous(), v.contiguous()
    if steps == 0:  # a window inside each rank's own block: nothing travels
        dq, dk, dv = own_block_backward(ops, layout, rank, world_size, causal, softmax_scale, dout, q, k, v, out,
                                        lse, stats, docs, dq_finished, plan[0], window)  # fmt: skip
        return _rounded(dq, dq_finished, q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    round_early = chains_round_early(streams)
    # this rank's share of a later step's block, per stream
    shares = [tuple(k.new_empty((k.shape[0], sum(map(len, s.rows)), *k.shape[2:]), dtype=state_dtype(q))
                    for _ in range(2)) for s in streams]  # fmt: skip
    # One batch in flight at a time, overlapping the next step's kernels: K/V for the step after
    # next, and the dK/dV accumulators of the blocks just finished (they travel with their blocks).
    held = [(pack_rows(k, s.rows), pack_rows(v, s.rows)) for s in streams]
    nxt = [(comm.send_recv(hk, shift=s.direction), comm.send_recv(hv, shift=s.direction))
           for s, (hk, hv) in zip(streams, held, strict=True)]  # fmt: skip
    comm.commit("backward step 0 (K/V)")
    chains: list = [None] * len(streams)  # per stream, the accumulators of the block in hand, from its earlier holders
    for step in range(steps + 1):
        if step == 0:  # dq and the accumulators of this rank's own block
            dq, dk, dv = own_block_backward(ops, layout, rank, world_size, causal, softmax_scale, dout, q, k, v, out,
                                            lse, stats, docs, dq_finished, plan[step], window)  # fmt: skip
            chains = start_chains(dk, dv, streams)
        else:
            # From step 1 on the accumulators arrive only after the kernels (they overlap the transfer): the kernels
            # store this rank's shares, which are then added to the arrived accumulators, in the rows they cover.
            active = held_blocks(streams, rank, step, world_size)
            blocks = [HeldBlock(kv_rank, *held[i], streams[i].rows) for i, kv_rank in active]
            rows = backward_step(
                ops, layout, rank, world_size, causal, softmax_scale, dout, q, blocks, out, lse, stats, dq,
                [shares[i] for i, _ in active], docs, add_dkdv=False, dq_finished=dq_finished, finishing=plan[step],
                window=window,
            )  # fmt: skip
            written = {i: r for (i, _), r in zip(active, rows, strict=True)}  # per stream, the rows of its share
        comm.wait()  # K/V of step + 1, and the accumulators of this step's blocks
        for i, s in enumerate(streams):
            if step > s.steps:
                continue
            if step > 0:  # the received accumulators are ours now: this rank's share is added, then they go on
                # complete after the stream's last share: rounded now, not after the hop (half the bytes)
                rounded = k.dtype if step == s.steps and round_early else None
                chains[i] = add_to_chain(chains[i], *shares[i], written[i], rounded)
            if chains[i] is not None:  # on, or from the stream's last step straight home (shift: back over its steps)
                shift = -s.direction * step if step == s.steps else s.direction
                chains[i] = (comm.send_recv(chains[i][0], shift=shift), comm.send_recv(chains[i][1], shift=shift))
            if step < s.steps:
                held[i] = nxt[i]
                if step + 2 <= s.steps:
                    nxt[i] = (comm.send_recv(held[i][0], shift=s.direction),
                              comm.send_recv(held[i][1], shift=s.direction))  # fmt: skip
        comm.commit(f"backward step {step + 1} (dK/dV and K/V)")
    comm.wait()
    return _rounded(dq, dq_finished, q.dtype), *home_gradients(dk, dv, chains, streams, k.dtype)
