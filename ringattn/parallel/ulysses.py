"""The Ulysses exchange: an all-to-all over the Ulysses group that trades a sequence split for a head split, and its
inverse (docs/design.md, "Ulysses x ring").

Before the exchange each of the U ranks of a Ulysses group holds L tokens of every head, rank u the u-th of U
consecutive pieces; after it each holds all U * L tokens (the pieces in rank order) of its own heads:

- H % U == 0: rank j gets heads [j * H / U, (j + 1) * H / U);
- U % H == 0 (fewer K/V heads than ranks): rank j gets head j // (U / H), which thus travels to U / H ranks, and
  the inverse sums the U / H copies (that is the adjoint of the copying, so the gradient of K and V in the backward).

Every rank sends every other rank the same number of elements, so the exchange is one all_to_all_single with even
splits, which both NCCL and gloo implement (gloo's list form, all_to_all, refuses tensors of different sizes; the
even single form needs no such care). On gloo (CPU tensors) the wait is bounded by the ring's P2P timeout
($RINGATTN_P2P_TIMEOUT_S) and a peer that never arrives raises a RuntimeError naming the exchange.

Both directions are torch.library custom ops with fake implementations and each other as their backward
(ringattn::ulysses_seq_to_heads, ringattn::ulysses_heads_to_seq), so torch.compile sees one call and no collective.
The output's exchange (heads_to_seq) is numbered, and its backward agrees on the number before its all-to-all: the
first exchange of a call's backward, so that ranks running the backwards of two calls in another order raise the
same error instead of trading one call's gradients for the other's (or aborting gloo on other sizes).
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .agreement import REFUSALS, check_backward, number_call, shared_refusals
from .comm import check_usable, p2p_timeout_s, wait_all

_EXCHANGES = "ulysses"  # heads_to_seq's numbers are counted apart from the ring calls on the same group


def heads_per_rank(heads: int, ulysses_size: int) -> int:
    """Heads each rank holds after the exchange: heads / U, or 1 when U % heads == 0 (copies of one head).

    Raises:
        ValueError: neither divides the other.
    """
    if heads % ulysses_size == 0:
        return heads // ulysses_size
    if ulysses_size % heads == 0:
        return 1
    raise ValueError(f"{heads} heads cannot be split over {ulysses_size} Ulysses ranks: one must divide the other")


def rank_heads(heads: int, ulysses_rank: int, ulysses_size: int) -> range:
    """The heads (of `heads`) that Ulysses rank `ulysses_rank` holds after the exchange (pure). Raises ValueError as
    heads_per_rank."""
    per_rank = heads_per_rank(heads, ulysses_size)
    first = ulysses_rank * per_rank if heads >= ulysses_size else ulysses_rank // (ulysses_size // heads)
    return range(first, first + per_rank)


def all_to_all_even(send: torch.Tensor, group: dist.ProcessGroup, what: str) -> torch.Tensor:
    """(U, ...) -> (U, ...): row j of `send` goes to group rank j; row i of the result came from group rank i.

    One all_to_all_single with even splits. On CPU tensors (gloo) the wait is bounded by p2p_timeout_s().
    Raises:
        RuntimeError: a peer fails or does not arrive in time (gloo), naming `what` and this rank.
    """
    send = send.contiguous()
    recv = torch.empty_like(send)
    where = f"{what} on Ulysses group rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    check_usable(group, where)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    if send.device.type == "cpu":
        wait_all([work], p2p_timeout_s(), where, None, group)
    else:
        work.wait()  # orders the current stream after NCCL's; the process group's timeout applies
    return recv


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, L, H, D) this rank's L tokens of every head -> (B, U * L, h, D) every rank's tokens of this rank's h
    heads (rank_heads)."""
    size = dist.get_world_size(group)
    batch, seqlen, heads, dim = x.shape
    per_rank = heads_per_rank(heads, size)
    if heads >= size:
        split = x.view(batch, seqlen, size, per_rank, dim)
    else:  # each head goes to U / H ranks
        split = x[:, :, :, None].expand(batch, seqlen, heads, size // heads, dim).reshape(batch, seqlen, size, 1, dim)
    recv = all_to_all_even(split.permute(2, 0, 1, 3, 4), group, "Ulysses all-to-all (sequence to heads)")
    return recv.permute(1, 0, 2, 3, 4).reshape(batch, size * seqlen, per_rank, dim)  # (U, B, L, h, D) -> (B, UL, h, D)


def _heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, heads: int) -> torch.Tensor:
    """(B, U * L, h, D) every rank's tokens of this rank's heads -> (B, L, heads, D) this rank's tokens of every
    head: the inverse of _seq_to_heads for a tensor of `heads` heads, summing the copies where U % heads == 0."""
    size = dist.get_world_size(group)
    batch, total, per_rank, dim = y.shape
    seqlen = total // size
    send = y.view(batch, size, seqlen, per_rank, dim).transpose(0, 1)  # row j: rank j's tokens
    recv = all_to_all_even(send, group, "Ulysses all-to-all (heads to sequence)")  # (U, B, L, h, D), row j: heads_j
    out = recv.permute(1, 2, 0, 3, 4)  # (B, L, U, h, D)
    if heads >= size:  # contiguous: with one head a rank (h = 1) the reshape is a view
        return out.reshape(batch, seqlen, heads, dim).contiguous()
    return out.reshape(batch, seqlen, heads, size // heads, dim).sum(3)  # the copies of each head, in rank order


@torch.library.custom_op("ringattn::ulysses_seq_to_heads", mutates_args=())
def seq_to_heads_op(x: torch.Tensor, group_name: str, after: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L, H, D) -> (B, U * L, h, D) over the Ulysses group named `group_name` (module docstring); differentiable
    (the backward is ringattn::ulysses_heads_to_seq). `after`, unread, is the output of the op that must run first
    (the call's agreement), so that a compiled graph keeps the order."""
    return _seq_to_heads(x, _resolve_process_group(group_name))


@seq_to_heads_op.register_fake
def _seq_to_heads_fake(x, group_name, after=None):
    size = dist.get_world_size(_resolve_process_group(group_name))
    batch, seqlen, heads, dim = x.shape
    return x.new_empty(batch, size * seqlen, heads_per_rank(heads, size), dim)


@torch.library.custom_op("ringattn::ulysses_heads_to_seq", mutates_args=())
def heads_to_seq_op(
    y: torch.Tensor, group_name: str, heads: int, ring_group_name: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, U * L, h, D) -> (B, L, heads, D) over the Ulysses group named `group_name`, summing the copies of a head
    held by several ranks (module docstring), and the exchange's number on the group (number_call: a 0-dim
    int64 CPU tensor); differentiable: the backward first agrees on that number (ringattn::ulysses_backward_check,
    sharing a mismatch over the grid's ring named `ring_group_name`, "" for none), so that a rank running the
    backward of another call raises on every rank, then runs ringattn::ulysses_seq_to_heads."""
    group = _resolve_process_group(group_name)
    number = number_call(group, _EXCHANGES)
    return _heads_to_seq(y, group, heads), number


@heads_to_seq_op.register_fake
def _heads_to_seq_fake(y, group_name, heads, ring_group_name=""):
    size = dist.get_world_size(_resolve_process_group(group_name))
    batch, total, _, dim = y.shape
    return y.new_empty(batch, total // size, heads, dim), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("ringattn::ulysses_backward_check", mutates_args=())
def backward_check_op(number: torch.Tensor, group_name: str, ring_group_name: str) -> torch.Tensor:
    """The ranks of the Ulysses group named `group_name` agree that they differentiate the same exchange (its
    number, from ringattn::ulysses_heads_to_seq), else all raise (agreement.check_backward); at every call, compiled
    or not. A grid's ranks that raise also share the error over their ring (named `ring_group_name`, "" for none),
    where the ranks of other Ulysses groups, whose own check passed, meet it in their ring backward's agreement: so
    every rank of the grid raises it. Returns an empty int64 CPU tensor, for the backward's exchange to take as
    `after`."""
    try:
        check_backward("Ulysses backward", number, _resolve_process_group(group_name))
    except REFUSALS as err:
        if not ring_group_name:
            raise
        # every rank of the ring raises it (a CommunicationError: raised as it is, with no exchange after it)
        with shared_refusals("Ulysses backward", _resolve_process_group(ring_group_name)):
            raise err from None
    return torch.empty(0, dtype=torch.int64)


@backward_check_op.register_fake
def _backward_check_fake(number, group_name, ring_group_name):
    return torch.empty(0, dtype=torch.int64)


def _seq_to_heads_setup(ctx, inputs, output) -> None:
    x, group_name, _ = inputs
    ctx.group_name, ctx.heads = group_name, x.shape[2]


def _seq_to_heads_backward(ctx, grad):
    return heads_to_seq_op(grad.contiguous(), ctx.group_name, ctx.heads)[0], None, None


def _heads_to_seq_setup(ctx, inputs, output) -> None:
    # the number kept on ctx, not saved: under activation checkpointing (without reentry) a saved one would be the
    # recomputation's, a new exchange's, and the backward would agree on that instead of the call it differentiates
    ctx.group_name, ctx.number, ctx.ring_group_name = inputs[1], output[1], inputs[3]
    ctx.mark_non_differentiable(output[1])


def _heads_to_seq_backward(ctx, grad, _dnumber):
    checked = backward_check_op(ctx.number, ctx.group_name, ctx.ring_group_name)
    return seq_to_heads_op(grad.contiguous(), ctx.group_name, checked), None, None, None


seq_to_heads_op.register_autograd(_seq_to_heads_backward, setup_context=_seq_to_heads_setup)
heads_to_seq_op.register_autograd(_heads_to_seq_backward, setup_context=_heads_to_seq_setup)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, after: torch.Tensor | None = None) -> torch.Tensor:
    """(B, L, H, D) this rank's L tokens of all H heads -> (B, U * L, h, D): the U ranks' tokens, in group-rank order,
    of this rank's heads rank_heads(H, rank, U); h = heads_per_rank(H, U). A collective on `group`; differentiable.
    `after`: the output of an op that must run before the exchange (seq_to_heads_op's `after`)."""
    return seq_to_heads_op(x.contiguous(), group.group_name, after)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, heads: int, ring: dist.ProcessGroup | None = None):
    """The inverse exchange: (B, U * L, h, D) -> (B, L, heads, D). A collective on `group`; differentiable (a
    grid's `ring`: where the backward's check shares a mismatch, backward_check_op)."""
    return heads_to_seq_op(y.contiguous(), group.group_name, heads, "" if ring is None else ring.group_name)[0]
