"""What one rank computes at one ring step (schedule in docs/design.md, section 4), for the distributed loops
(parallel/ring.py) and the one-process simulated ring (testing/simulate.py) alike, so both compute bitwise the same
thing.

At step 0 a rank holds its own K/V block: `own_block_forward` writes the fp32 state (out, lse), `own_block_backward`
stores dQ and the own block's dK/dV accumulators into uninitialised buffers. At later steps it holds the blocks of its
K/V streams (`HeldBlock`: a block's rows packed as the stream carries them, `pack_rows`): `forward_step` merges into
the state in the kernel's epilogue (ops.fwd_merge_: no separate merge pass), `backward_step` adds into dQ and stores
each block's dK/dV share, which `add_share_` (or `add_share_rounded`, the last) adds to the block's accumulators;
`home_gradients` puts a rank's accumulators back together when they come home. Which sub-blocks are computed, and with
which mask, is the pure function schedule.block_tasks; these run its tasks on views of the local tensors and state (no
copies). Out and dQ are returned in the inputs' dtype: the task that finishes a row (no later step touches it;
`finishing_plan`) writes it rounded, straight from the kernel, instead of into the fp32 state.
"""

from typing import NamedTuple

import torch

from ..ops import LSE_DTYPE, AttnOps, FinalRows
from .documents import ShardDocuments
from .schedule import BlockMode, BlockTask, KVStream, block_tasks, held_blocks, ring_streams, union


def state_dtype(q: torch.Tensor) -> torch.dtype:
    """Running state and gradient accumulators: fp32, or the inputs' dtype if wider (float64 checks)."""
    return torch.promote_types(q.dtype, torch.float32)


def _rows(t: torch.Tensor, rows: range, dim: int = 1) -> torch.Tensor:
    """A view of t's rows `rows` along dim (1 for (B, S, H, D), 2 for (B, H, S))."""
    return t.narrow(dim, rows.start, len(rows))


class HeldBlock(NamedTuple):
    """A K/V block in a rank's hands: whose it is (kv_rank), and k, v (B, rows, Hkv, D) holding its rows `rows`
    (a KVStream's: disjoint, increasing) packed in that order."""

    kv_rank: int
    k: torch.Tensor
    v: torch.Tensor
    rows: tuple[range, ...]


def pack_rows(t: torch.Tensor, rows: tuple[range, ...]) -> torch.Tensor:
    """t's rows `rows` along dim 1, packed in order into one contiguous tensor (t itself, made contiguous, when
    they are all of it)."""
    if rows == (range(0, t.shape[1]),):
        return t.contiguous()
    return torch.cat([_rows(t, r) for r in rows], dim=1)


def unpack_rows_(dest: torch.Tensor, packed: torch.Tensor, rows: tuple[range, ...], add: bool = False) -> None:
    """The inverse of pack_rows into dest, in place: dest's rows `rows` become (add: gain) packed's."""
    start = 0
    for r in rows:
        part = packed.narrow(1, start, len(r))
        if add:
            _rows(dest, r).add_(part)
        else:
            _rows(dest, r).copy_(part)
        start += len(r)


def _packed(rows: range, held: tuple[range, ...]) -> range:
    """Where a block's rows `rows` lie in a pack of its rows `held` (pack_rows)."""
    start = 0
    for r in held:
        if r.start <= rows.start and rows.stop <= r.stop:
            return range(start + rows.start - r.start, start + rows.stop - r.start)
        start += len(r)
    raise RuntimeError(f"the block's rows {rows} are not among the rows held, {held}")


def _step_tasks(
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    seqlen_local: int,
    docs: ShardDocuments | None,
    window: tuple[int | None, int | None],
    held: list[tuple[int, tuple[range, ...]]],
) -> list[tuple[int, BlockTask, dict]]:
    """The tasks of block_tasks that run at a step, block by block for the blocks `held` there ((kv_rank, rows
    held), in order): (index of the block, the task with its key rows counted in the block's pack, its kernel
    call's keyword arguments: document ids (none without documents, or for a task inside one document, which the
    dense kernels then take), a BAND task's window). Tasks whose documents never meet are skipped."""
    tasks = []
    for i, (kv_rank, rows) in enumerate(held):
        for task in block_tasks(layout, rank, kv_rank, world_size, causal, seqlen_local, window):
            kwargs = dict(window=task.window) if task.mode is BlockMode.BAND else {}
            if docs is not None:
                meeting = docs.meeting(rank, task.q_rows, kv_rank, task.kv_rows)
                if not meeting.meet:
                    continue
                if not meeting.one:
                    kwargs.update(q_doc_ids=docs.ids(rank, task.q_rows), k_doc_ids=docs.ids(kv_rank, task.kv_rows))
            tasks.append((i, task._replace(kv_rows=_packed(task.kv_rows, rows)), kwargs))
    return tasks


def _held_rows(
    streams: tuple[KVStream, ...], rank: int, step: int, world_size: int, seqlen_local: int
) -> list[tuple[int, tuple[range, ...]]]:
    """(kv_rank, rows held) of each block `rank` holds at `step`: its own, whole, at step 0."""
    if step == 0:
        return [(rank, (range(0, seqlen_local),))]
    return [(kv_rank, streams[i].rows) for i, kv_rank in held_blocks(streams, rank, step, world_size)]


def finishing_plan(
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    seqlen_local: int,
    docs: ShardDocuments | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> list[list[range]] | None:
    """plan[step][i]: the rows of `rank`'s shard that the i-th task `rank` computes at `step` (in the order the step
    runs them, block after block) finishes: the task's query rows that no later task touches. There the task writes
    out and dQ rounded to their final dtype. Every row is finished by exactly one task, as step 0 computes the whole
    shard. One entry per step of the ring (ring_streams). None where some task's finished rows are not one range (a
    kernel finishes one): zigzag over 3 ranks or more, packed documents and a window of very unequal sides, not
    causal; the ring then rounds its fp32 results after the last step.
    """
    streams = ring_streams(layout, world_size, causal, seqlen_local, window)
    steps = max((s.steps for s in streams), default=0)
    touched = [
        [task.q_rows for _, task, _ in _step_tasks(layout, rank, world_size, causal, seqlen_local, docs, window,
                                                   _held_rows(streams, rank, step, world_size, seqlen_local))]
        for step in range(steps + 1)
    ]  # fmt: skip
    later: list[range] = []
    plan = []
    for step_rows in reversed(touched):
        finished = []
        for rows in reversed(step_rows):
            pieces = _outside(rows, later)
            if len(pieces) > 1:
                return None
            finished.append(pieces[0] if pieces else range(rows.start, rows.start))
            later.append(rows)
        plan.append(finished[::-1])
    return plan[::-1]


def _outside(rows: range, covered: list[range]) -> list[range]:
    """The rows of `rows` outside every range of `covered`, as disjoint ranges in increasing order."""
    pieces = [rows]
    for c in (c for c in covered if len(c)):
        pieces = [
            p for piece in pieces
            for p in (range(piece.start, min(piece.stop, c.start)), range(max(piece.start, c.stop), piece.stop))
            if len(p)
        ]  # fmt: skip
    return pieces


def _task_final_rows(
    finished: torch.Tensor | None, finishing: list[range] | None, i: int, n_tasks: int, q_rows: range
) -> FinalRows | None:
    """The FinalRows of the i-th of a step's n_tasks tasks (query rows q_rows) for its kernel call: a view of
    `finished` (the rank's result in its final dtype, (B, S_local, H, D)) over the task's rows, with the rows it
    finishes (`finishing`, the step's entry of finishing_plan) counted from q_rows.start; None if it finishes none."""
    if finished is None:
        return None
    if len(finishing) != n_tasks:
        raise RuntimeError(f"the finishing plan gives {len(finishing)} tasks for a step of {n_tasks}")
    rows = finishing[i]
    if not len(rows):
        return None
    return FinalRows(_rows(finished, q_rows), range(rows.start - q_rows.start, rows.stop - q_rows.start))


def own_block_tasks(
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    seqlen_local: int,
    docs: ShardDocuments | None,
    window: tuple[int | None, int | None] = (None, None),
) -> list[tuple[BlockTask, dict]]:
    """The tasks of step 0, where a rank holds its own block, as (task, kernel arguments) (_step_tasks). Every layout
    computes that block whole (with W = 1 it is the whole sequence, one task), and every row shares its own
    document; only a window over a zigzag shard splits it into several tasks (block_tasks)."""
    held = _held_rows((), rank, 0, world_size, seqlen_local)
    return [(task, kwargs) for _, task, kwargs in _step_tasks(layout, rank, world_size, causal, seqlen_local, docs,
                                                              window, held)]  # fmt: skip


def _merge_tasks_(
    ops: AttnOps,
    tasks: list[tuple[int, BlockTask, dict]],
    blocks: list[HeldBlock],
    softmax_scale: float,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    finished: torch.Tensor | None,
    finishing: list[range] | None,
    fresh: bool = False,
) -> None:
    """Merge each task's attention (q's rows against its block's rows, _step_tasks) into (out, lse) in place, in
    order. fresh: (out, lse) hold nothing yet; the first task to reach a row stores there (attn_fwd_merge_'s fresh),
    and the rows no task reaches get the merge's identity (out 0, lse -inf)."""
    reached: list[range] = []
    for i, (b, task, kwargs) in enumerate(tasks):
        qs, kvs = task.q_rows, task.kv_rows
        first = fresh and _first_reach(qs, reached, lambda new: _identity_(out, lse, new))
        reached.append(qs)
        ops.fwd_merge_(
            _rows(q, qs),
            _rows(blocks[b].k, kvs),
            _rows(blocks[b].v, kvs),
            softmax_scale,
            task.mode is BlockMode.CAUSAL,
            _rows(out, qs),  # views: the kernel merges into the running state in place
            _rows(lse, qs, 2),
            **kwargs,
            final=_task_final_rows(finished, finishing, i, len(tasks), qs),
            fresh=first,
        )
    if fresh:
        _identity_(out, lse, _outside(range(0, out.shape[1]), reached))


def _first_reach(rows: range, reached: list[range], fill_) -> bool:
    """Whether a task reaching `rows` is the first to reach all of them (`reached`: the rows earlier tasks reached):
    it then stores into what holds nothing yet. Where only some of them are new, fill_(those ranges) puts the
    identity there first (the merge's, or zero gradients), for the task to merge or add into."""
    new = _outside(rows, reached)
    if new and new != [rows]:
        fill_(new)
    return new == [rows]


def _zero_rows_(grads: tuple[torch.Tensor, ...], rows: list[range]) -> None:
    """Zero the rows `rows` (along dim 1) of each of `grads`."""
    for g in grads:
        for r in rows:
            _rows(g, r).zero_()


def _identity_(out: torch.Tensor, lse: torch.Tensor, rows: list[range]) -> None:
    """The merge's identity (out 0, lse -inf) in the rows `rows` of a state (out (B, S, H, D), lse (B, H, S))."""
    for r in rows:
        _rows(out, r).zero_()
        _rows(lse, r, 2).fill_(-torch.inf)


def own_block_forward(
    ops: AttnOps,
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    softmax_scale: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: ShardDocuments | None = None,
    finished: torch.Tensor | None = None,
    finishing: list[range] | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0 of the forward on one rank: q's attention to the rank's own K/V block, which starts the running state.

    Args:
        q: (B, S_local, Hq, D); k, v: (B, S_local, Hkv, D), this rank's shards.
        finished, finishing: the rank's result (B, S_local, Hq, D) in its final dtype, and finishing_plan's step 0:
            the rows this step finishes go there, rounded; None: into out.
        window: the sliding window over global positions (block_tasks).
    Returns:
        out (B, S_local, Hq, D) in state_dtype(q) and lse (B, Hq, S_local) float64, for forward_step to merge into: the
        same bits as merging the block into the merge's identity (out 0, lse -inf), without filling that
        identity and reading it back: each row's first task stores (one task over the whole block but where a
        window splits a zigzag block), later ones merge. Rows written to final are unspecified in out.
    """
    tasks = own_block_tasks(layout, rank, world_size, causal, q.shape[1], docs, window)
    out = torch.empty(q.shape, dtype=state_dtype(q), device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=LSE_DTYPE, device=q.device)
    own = [HeldBlock(rank, k, v, (range(0, k.shape[1]),))]
    _merge_tasks_(ops, [(0, t, kw) for t, kw in tasks], own, softmax_scale, q, out, lse, finished, finishing, True)
    return out, lse


def forward_step(
    ops: AttnOps,
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    softmax_scale: float,
    q: torch.Tensor,
    blocks: list[HeldBlock],
    out: torch.Tensor,
    lse: torch.Tensor,
    docs: ShardDocuments | None = None,
    finished: torch.Tensor | None = None,
    finishing: list[range] | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> None:
    """One ring step of the forward on one rank: merge q's attention to the K/V blocks in hand into (out, lse).

    Args:
        q: (B, S_local, Hq, D) this rank's queries; blocks: the blocks held at the step (one per KVStream there,
            in the streams' order).
        out, lse: the running state (from own_block_forward), updated in place.
        docs: packed documents (ring_attn_varlen_func): sub-blocks whose documents never meet are
            skipped, the others masked by document.
        finished, finishing: where the rows this step finishes go, rounded, instead of into out (finishing_plan's
            entry of this step), as in own_block_forward.
        window: as in own_block_forward.
    """
    held = [(b.kv_rank, b.rows) for b in blocks]
    tasks = _step_tasks(layout, rank, world_size, causal, q.shape[1], docs, window, held)
    _merge_tasks_(ops, tasks, blocks, softmax_scale, q, out, lse, finished, finishing)


def own_block_backward(
    ops: AttnOps,
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    softmax_scale: float,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor,
    docs: ShardDocuments | None = None,
    dq_finished: torch.Tensor | None = None,
    finishing: list[range] | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 0 of the backward on one rank: the gradients of q's attention to the rank's own block, stored into new
    state_dtype(q) buffers (nothing zeroed, nothing read back): this rank's dq and its own block's dK, dV
    accumulators, which later steps add to.

    Args:
        dout, q, out: (B, S_local, Hq, D); k, v: (B, S_local, Hkv, D), this rank's shards;
        lse: (B, Hq, S_local) float64, the global lse; stats: its row stats (3, B, Hq, S_local), ops'
            attn_bwd_preprocess(out, dout, lse), once for the whole ring.
        dq_finished, finishing: where the dq rows this step finishes go, rounded, as own_block_forward's.
        window: as in own_block_forward.
    Returns:
        dq, dk, dv shaped like q, k, v, in state_dtype(q) (dq's rows written to dq_finished unspecified).
    """
    tasks = own_block_tasks(layout, rank, world_size, causal, q.shape[1], docs, window)
    dq, dk, dv = (torch.empty(t.shape, dtype=state_dtype(q), device=t.device) for t in (q, k, v))
    own = HeldBlock(rank, k, v, (range(0, k.shape[1]),))
    # each row's first task stores (one task over the whole block but where a window splits a zigzag block)
    kv_written = _backward_tasks_(ops, tasks, own, softmax_scale, dout, q, out, lse, stats, dq, dk, dv, False,
                                  dq_finished, finishing, add_dq=False)  # fmt: skip
    # the rows no task reaches
    _zero_rows_((dq,), _outside(range(0, q.shape[1]), [task.q_rows for task, _ in tasks]))
    _zero_rows_((dk, dv), _outside(range(0, k.shape[1]), list(kv_written)))
    return dq, dk, dv


def _backward_tasks_(
    ops: AttnOps,
    tasks: list[tuple[BlockTask, dict]],
    block: HeldBlock,
    softmax_scale: float,
    dout: torch.Tensor,
    q: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor,
    dq: torch.Tensor,
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    add_dkdv: bool,
    dq_finished: torch.Tensor | None,
    finishing: list[range] | None,
    add_dq: bool = True,
) -> tuple[range, ...]:
    """Each task's gradients against `block`, in order, added into (add_dq) dq and (add_dkdv) dk_acc, dv_acc (shaped
    like the block's k, v); where one is False, the first task to reach a row stores its gradient there and later
    ones add. `finishing`: finishing_plan's entries of these tasks. Returns the K/V rows written, union()."""
    written: list[range] = []
    q_written: list[range] = []
    for i, (task, kwargs) in enumerate(tasks):
        qs, kvs = task.q_rows, task.kv_rows
        add = add_dkdv or not _first_reach(kvs, written, lambda new: _zero_rows_((dk_acc, dv_acc), new))
        add_q = add_dq or not _first_reach(qs, q_written, lambda new: _zero_rows_((dq,), new))
        written.append(kvs)
        q_written.append(qs)
        ops.bwd(
            _rows(dout, qs),
            _rows(q, qs),
            _rows(block.k, kvs),
            _rows(block.v, kvs),
            _rows(out, qs),
            _rows(lse, qs, 2),
            softmax_scale,
            task.mode is BlockMode.CAUSAL,
            stats=_rows(stats, qs, 3),
            dq_acc=_rows(dq, qs),
            dk_acc=_rows(dk_acc, kvs),
            dv_acc=_rows(dv_acc, kvs),
            **kwargs,
            add_dq=add_q,
            add_dkdv=add,
            dq_final=_task_final_rows(dq_finished, finishing, i, len(tasks), qs),
        )
    return union(written)


def backward_step(
    ops: AttnOps,
    layout: str,
    rank: int,
    world_size: int,
    causal: bool,
    softmax_scale: float,
    dout: torch.Tensor,
    q: torch.Tensor,
    blocks: list[HeldBlock],
    out: torch.Tensor,
    lse: torch.Tensor,
    stats: torch.Tensor,
    dq: torch.Tensor,
    accumulators: list[tuple[torch.Tensor, torch.Tensor]],
    docs: ShardDocuments | None = None,
    add_dkdv: bool = True,
    dq_finished: torch.Tensor | None = None,
    finishing: list[range] | None = None,
    window: tuple[int | None, int | None] = (None, None),
) -> list[tuple[range, ...]]:
    """One ring step of the backward on one rank: add the gradients of q's attention to the blocks in hand into dq
    (this rank's) and each block's (dk_acc, dv_acc) of `accumulators` (shaped like its k, v), in place.

    Args:
        dout, q, out: (B, S_local, Hq, D); lse, stats: the global lse and its row stats, as own_block_backward's.
        blocks: the blocks held at the step, as forward_step's.
        docs: packed documents, as in forward_step.
        add_dkdv: False stores each block's dK, dV into the rows of its accumulators it computes instead of adding
            (_backward_tasks_).
        dq_finished, finishing: where the dq rows this step finishes go, rounded, instead of into dq (as
            forward_step's).
        window: as in own_block_forward.
    Returns:
        per block, the rows of its accumulators that were added or stored (union()).
    """
    held = [(b.kv_rank, b.rows) for b in blocks]
    tasks = _step_tasks(layout, rank, world_size, causal, q.shape[1], docs, window, held)
    written, done = [], 0
    for b, (block, (dk_acc, dv_acc)) in enumerate(zip(blocks, accumulators, strict=True)):
        mine = [(task, kwargs) for i, task, kwargs in tasks if i == b]
        block_finishing = None if finishing is None else finishing[done : done + len(mine)]
        written.append(_backward_tasks_(ops, mine, block, softmax_scale, dout, q, out, lse, stats, dq, dk_acc,
                                        dv_acc, add_dkdv, dq_finished, block_finishing))  # fmt: skip
        done += len(mine)
    return written


def add_share_(
    dk_acc: torch.Tensor, dv_acc: torch.Tensor, share_k: torch.Tensor, share_v: torch.Tensor, rows: tuple[range, ...]
) -> None:
    """Add a rank's share of a block's dK, dV (stored by backward_step with add_dkdv=False) to the block's
    accumulators in place, over the K/V rows backward_step returned. All shaped like the block's k, v."""
    for kvs in rows:
        _rows(dk_acc, kvs).add_(_rows(share_k, kvs))
        _rows(dv_acc, kvs).add_(_rows(share_v, kvs))


def add_share_rounded(
    dk_acc: torch.Tensor,
    dv_acc: torch.Tensor,
    share_k: torch.Tensor,
    share_v: torch.Tensor,
    rows: tuple[range, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_share_ for the block's last share, and the rounding of the finished sums to `dtype`, in one pass: new
    dK, dV shaped like the block's k, v in dtype, bitwise the in-place add followed by .to(dtype), without writing
    the fp32 sums and reading them back. The other rows are only rounded."""
    return _sum_rounded(dk_acc, share_k, rows, dtype), _sum_rounded(dv_acc, share_v, rows, dtype)


def _sum_rounded(acc: torch.Tensor, share: torch.Tensor, rows: tuple[range, ...], dtype: torch.dtype) -> torch.Tensor:
    """(acc + share over the disjoint row ranges `rows`, acc elsewhere) in dtype, as a new tensor."""
    total = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    done = 0
    for kvs in sorted(rows, key=lambda r: r.start):
        _rows(total, range(done, kvs.start)).copy_(_rows(acc, range(done, kvs.start)))
        torch.add(_rows(acc, kvs), _rows(share, kvs), out=_rows(total, kvs))  # fp32 sum, rounded on store
        done = kvs.stop
    rest = range(done, acc.shape[1])
    _rows(total, rest).copy_(_rows(acc, rest))
    return total


def chains_round_early(streams: tuple[KVStream, ...]) -> bool:
    """Whether every stream's dK/dV accumulators start from the owner's own share (step 0) and so hold a block's
    complete gradient in their rows after their last step, rounded there (add_share_rounded) before going home:
    when no two streams carry the same rows. Else the first stream's start from the owner's share and the second's
    from zero (at their first holder), and both come home in fp32 to be summed there (home_gradients)."""
    rows = [r for s in streams for r in s.rows]
    return sum(map(len, rows)) == sum(map(len, union(rows)))


def start_chains(
    dk: torch.Tensor, dv: torch.Tensor, streams: tuple[KVStream, ...]
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per stream, the dK/dV accumulators a block's chain starts with at its owner after step 0: the owner's share
    (dk, dv (B, S_local, Hkv, D), from own_block_backward) in the stream's rows, or None where the chain starts from
    zero at its first holder (chains_round_early)."""
    early = chains_round_early(streams)
    return [(pack_rows(dk, s.rows), pack_rows(dv, s.rows)) if early or i == 0 else None
            for i, s in enumerate(streams)]  # fmt: skip


def add_to_chain(
    chain: tuple[torch.Tensor, torch.Tensor] | None,
    share_k: torch.Tensor,
    share_v: torch.Tensor,
    rows: tuple[range, ...],
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's accumulators with a holder's share added (stored by backward_step, over `rows`): in place
    (add_share_), or with `dtype` (the chain's last share, chains_round_early) rounded to it in the same pass
    (add_share_rounded); a chain of None starts here, from zero."""
    if chain is None:
        chain = (torch.zeros_like(share_k), torch.zeros_like(share_v))
    if dtype is not None:
        return add_share_rounded(*chain, share_k, share_v, rows, dtype)
    add_share_(*chain, share_k, share_v, rows)
    return chain


def home_gradients(
    dk: torch.Tensor,
    dv: torch.Tensor,
    homes: list[tuple[torch.Tensor, torch.Tensor]],
    streams: tuple[KVStream, ...],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's own dK, dV in `dtype` from its own share (dk, dv: (B, S_local, Hkv, D) fp32, from step 0) and the
    accumulators of its block back home from each stream (homes, packed in the stream's rows, in dtype when
    chains_round_early, else fp32)."""
    if chains_round_early(streams):
        if len(streams) == 1 and streams[0].rows == (range(0, dk.shape[1]),):
            return homes[0]
        dk, dv = dk.to(dtype), dv.to(dtype)
        for s, (home_k, home_v) in zip(streams, homes, strict=True):
            unpack_rows_(dk, home_k, s.rows)
            unpack_rows_(dv, home_v, s.rows)
        return dk, dv
    for i, (s, (home_k, home_v)) in enumerate(zip(streams, homes, strict=True)):
        unpack_rows_(dk, home_k, s.rows, add=i > 0)  # the first stream's sum holds dk's own share
        unpack_rows_(dv, home_v, s.rows, add=i > 0)
    return dk.to(dtype), dv.to(dtype)
