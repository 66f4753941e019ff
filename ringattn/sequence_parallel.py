"""Sequence parallelism for a whole model: shard a batch over a group, a loss equal to the unsharded one,
gather outputs.

Every rank of the group holds the same full batch; each keeps its shard of the sequence in the group's
layout (ringattn.LAYOUTS) and runs the model on it. Per-token layers (embeddings, projections, MLPs,
norms) need nothing more; attention goes through ring_attn_func with the same group and layout, and
RoPE takes the global positions this rank's tokens have (`ShardedBatch.position_ids`).

Labels are shifted on the full sequence before sharding (the target of position i is token i + 1,
which may live on another rank), so a shard's loss needs no neighbour. `cross_entropy` divides
the sum of this rank's per-token losses by the number of counted tokens in the whole group, so the
ranks' gradients add up to the gradient of the unsharded mean loss.

Packed documents (several documents in a row, each row of the batch its own): `shard_batch(...,
position_ids=...)` (positions restarting at 0 at each document, per row) or `shard_batch(..., cu_seqlens=...)`
carries the global document boundaries in ShardedBatch.cu_seqlens (those of the flattened batch * S tokens, the
padding a document of its own) and gives each token its position inside its document;
`SequenceParallel.attention(q, k, v, batch.cu_seqlens, causal=True)` keeps attention inside each document
(ring_attn_varlen_func, all rows in one ring). No token's target is the next document's first token. A padding
mask (`shard_batch(..., attention_mask=...)`, left or right padding per row) makes each row's padding a document
of its own, out of the loss: the real tokens train as the unpadded rows would. So is the padding shard_batch adds
to make the length a multiple of the ranks: with any padding the batch has boundaries, and an encoder's tokens
(non-causal attention) never attend to the padding.

2-D context parallelism (Ulysses x ring): `SequenceParallel(ulysses_group=..., group=ring)` or
`SequenceParallel(mesh=mesh)` (dimensions "ulysses" and "ring") splits each sequence over the U x R ranks of the grid
in the 2-D layout (ringattn.grid_shard_indices), runs ulysses_ring_attn_func (its varlen form for documents), and
reduces the loss and the gradients over every rank of the grid.
"""

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor

from .functional import ring_attn_func, ring_attn_varlen_func
from .parallel.agreement import (
    CrossEntropySignature,
    ShardBatchSignature,
    SyncGradientsSignature,
    gather_on_cpu,
    shared_refusals,
)
from .parallel.documents import (
    check_cu_seqlens,
    cu_seqlens_from_position_ids,
    document_ids,
    host_values,
    pad_cu_seqlens,
)
from .parallel.grid import (
    Grid,
    GridCrossEntropySignature,
    GridShardBatchSignature,
    GridSyncGradientsSignature,
    agree_on,
    grid_all_gather,
    grid_arguments,
    shared_grid_refusals,
)
from .parallel.groups import Group, check_live, copy_sharing_groups, or_world, ring_group
from .parallel.layout import (
    check_layout,
    check_pad_value,
    chunks_per_rank,
    grid_shard_indices,
    pad_to_multiple,
    shard,
    shard_indices,
    unshard,
)
from .ulysses import ulysses_ring_attn_func, ulysses_ring_attn_varlen_func

IGNORE_INDEX = -100
GRAD_REDUCTIONS = ("sum", "mean")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets: out[..., i] = labels[..., i + 1]; the last position gets `ignore_index`.

    Apply it to the full sequence, before sharding: after sharding, the target of a rank's last
    token (in zigzag, of each chunk's last token) is on another rank.

    Args:
        labels: (batch, seqlen) integer labels, Hugging Face's convention (labels = input_ids, with
            `ignore_index` where no loss is wanted).
    Returns:
        (batch, seqlen), a new tensor of labels' dtype.
    """
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def document_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 (S,): the position of every token inside its document, 0 at each document start.

    Args:
        cu_seqlens: (n_docs + 1,) int32 document boundaries of an S-token packed sequence.
    Returns:
        positions on cu_seqlens' device, e.g. [0, 1, 2, 0, 0, 1] for boundaries [0, 3, 4, 6].
    """
    total = int(cu_seqlens[-1])
    starts = cu_seqlens.to(torch.int64)[document_ids(cu_seqlens, total).to(torch.int64)]  # (S,)
    return torch.arange(total, device=cu_seqlens.device) - starts


def _padding(attention_mask: torch.Tensor | None, batch: int, seqlen: int) -> torch.Tensor | None:
    """(batch, seqlen) bool on the host, True at padding, from Hugging Face's attention_mask (1 real, 0 padding);
    None without a mask or without zeros.

    Raises:
        TypeError: not a tensor, or a floating or complex one.
        ValueError: another shape than (batch, seqlen); values other than 0 and 1; on the meta device.
    """
    if attention_mask is None:
        return None
    if (
        not isinstance(attention_mask, torch.Tensor)
        or attention_mask.is_floating_point()
        or attention_mask.is_complex()
    ):
        raise TypeError(
            "attention_mask must be an integer or bool tensor of 1s (real tokens) and 0s (padding), got "
            f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)}"
        )
    if tuple(attention_mask.shape) != (batch, seqlen):
        raise ValueError(
            f"attention_mask must have input_ids' (batch, seqlen) {(batch, seqlen)}, got {tuple(attention_mask.shape)}"
        )
    mask = host_values(attention_mask, "attention_mask").to(torch.int64)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 1 (real token) and 0 (padding) only, got other values")
    return None if bool(mask.all()) else mask == 0


def _real_tokens(padding_row: torch.Tensor) -> range:
    """The real tokens of a row, padding_row (S,) bool True at padding, as one range (empty for a row of padding).

    Raises:
        ValueError: padding between real tokens (only left and right padding are supported).
    """
    real = torch.nonzero(~padding_row).flatten()
    if not real.numel():
        return range(0, 0)
    start, stop = int(real[0]), int(real[-1]) + 1
    if stop - start != real.numel():
        gap = start + int(torch.nonzero(padding_row[start:stop]).flatten()[0])
        raise ValueError(
            "attention_mask must pad each row on the left or the right (its real tokens contiguous): a row has "
            f"padding at token {gap}, between real tokens {start} and {stop - 1}"
        )
    return range(start, stop)


class _GlobalMean(torch.autograd.Function):
    """Value: total / count (all-reduced over the group); gradient: that of local_sum * grad_scale / count."""

    @staticmethod
    def forward(ctx, local_sum, total, count, grad_scale):
        ctx.save_for_backward(count)
        ctx.grad_scale = grad_scale
        return (total / count).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return (grad * (ctx.grad_scale / count)).to(grad.dtype), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: Group = None,
    ignore_index: int = IGNORE_INDEX,
    grad_reduction: str = "sum",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the group's sequence shards; a collective.

    Each rank passes the logits of its tokens and their (already shifted) labels. The returned value
    is, on every rank, the mean loss of the unsharded batch: sum of per-token losses over all ranks
    / number of tokens whose label is not `ignore_index` over all ranks (both all-reduced in float64).
    Its gradient is this rank's share: d(sum of this rank's losses / global count). Summed over the
    group (`sync_gradients`, grad_reduction="sum") the parameter gradients equal the unsharded ones.
    With grad_reduction="mean" the share is scaled by the group size, for a gradient all-reduce that
    averages (DistributedDataParallel or FSDP over this group).

    With gradient accumulation, pass num_items_in_batch (Hugging Face's name): the counted tokens of
    every micro-batch of the optimizer step over the group, which then divides instead of this call's
    count, so that the micro-batches' losses and gradients sum to those of the step's mean over every
    counted token (micro-batches of different lengths weighted by their tokens, not alike). Over a ring
    every rank holds the same unsharded batches, so it is the count of their shifted labels:
    sum((shift_labels(labels) != ignore_index).sum() for labels in the step's batches).

    When no token of the group is counted the loss is 0 with zero gradients (F.cross_entropy's
    mean would give NaN).

    Args:
        logits: (..., vocab), any float dtype; computed in fp32 (or float64 for float64 logits).
        labels: (...) integer targets, logits.shape[:-1].
        group: the sequence-parallel group (default: the world), or a 1-D DeviceMesh.
        ignore_index: label of tokens left out of the loss and the count.
        grad_reduction: "sum" or "mean", how the parameter gradients will be combined over the group.
        num_items_in_batch: None, or an int or integer tensor of one element >= this call's count over the group:
            the divisor, as above.
    Returns:
        a 0-dim tensor in fp32 (float64 for float64 logits).
    Raises (on every rank of the group, whichever rank's input is wrong):
        TypeError: logits not a floating tensor, labels not an integer tensor, num_items_in_batch neither None,
            an int nor an integer tensor of one element.
        ValueError: labels' shape does not match logits' leading dims; a label outside [0, vocab) that is not
            ignore_index; unknown grad_reduction; ranks that pass different ignore_index, grad_reduction or
            num_items_in_batch; num_items_in_batch below this call's count over the group (a rank's own count,
            say).
        RuntimeError: torch.distributed not initialised.
    """
    return _agreed_cross_entropy("cross_entropy", logits, labels, ring_group(group), ignore_index, grad_reduction,
                                 num_items_in_batch)  # fmt: skip


def _agreed_cross_entropy(call: str, logits, labels, place, ignore_index: int, grad_reduction: str,
                          num_items_in_batch) -> torch.Tensor:  # fmt: skip
    """cross_entropy as `call` over `place`, a group (None: the world) or a Grid: its local checks (a rank's refusal
    raised by every rank), then the loss, whose summing op makes the ranks' agreement on the call."""
    refusals = shared_grid_refusals(call, place) if isinstance(place, Grid) else shared_refusals(call, place)
    with refusals:
        _check_cross_entropy(logits, labels, ignore_index, grad_reduction, num_items_in_batch)
    return _cross_entropy(logits, labels, place, ignore_index, grad_reduction, num_items_in_batch, agree=call)


def _check_cross_entropy(logits, labels, ignore_index: int, grad_reduction: str, num_items_in_batch) -> None:
    """cross_entropy's local checks. The labels' range is checked (one host sync) except while torch.compile traces:
    on a GPU, F.cross_entropy would stop the process on a device-side assert. num_items_in_batch's value is checked
    once the ranks agree on it (cross_entropy_totals_op)."""
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    items = num_items_in_batch
    one_count = _integer_tensor(items) and items.numel() == 1
    if items is not None and (isinstance(items, bool) or not (isinstance(items, int) or one_count)):
        raise TypeError(
            "num_items_in_batch must be None, an int or an integer tensor of one element (the step's counted "
            f"tokens), got {_described(items)}"
        )
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a floating tensor of shape (..., vocab), got {_described(logits)}")
    if not _integer_tensor(labels):
        raise TypeError(f"labels must be an integer tensor, got {_described(labels)}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have logits' leading shape {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cross_entropy is a collective: it needs torch.distributed initialised")
    vocab = logits.shape[-1]
    if not torch.compiler.is_compiling():
        outside = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
        if outside.any():
            raise ValueError(
                f"labels must be in [0, {vocab}) (logits' vocab) or ignore_index ({ignore_index}), got "
                f"{labels[outside][0].item()}"
            )


def _integer_tensor(x) -> bool:
    """Whether x is a tensor of an integer dtype (not bool)."""
    return isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)


def _described(x) -> str:
    """A tensor's dtype and shape, or another value's type, for an error message."""
    return f"{x.dtype} of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def _cross_entropy(logits, labels, place, ignore_index: int, grad_reduction: str, num_items_in_batch,
                   agree: str) -> torch.Tensor:  # fmt: skip
    """cross_entropy as `agree`, its local checks passed, with its counts summed over `place`: a group (None: the
    world), or a Grid (its Ulysses group, then its ring), after the ranks' agreement on the call in the summing op;
    the gradient scale of "mean" is the number of ranks."""
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.int64)
    local_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    local_count = (flat_labels != ignore_index).sum()
    stats = torch.stack([local_sum.detach().double(), local_count.double()])  # (2,): sum, count
    if isinstance(place, Grid):  # "" for a dimension of degree 1
        names, ranks = ["" if g is None else g.group_name for g in (place.ulysses, place.ring)], place.size
    else:
        group = or_world(place)
        names, ranks = [group.group_name], dist.get_world_size(group)
    items = None if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).reshape(())
    totals = cross_entropy_totals_op(stats, items, names, agree, ignore_index, grad_reduction, logits.shape[-1])
    total, count = totals[0], totals[1].clamp(min=1.0)
    grad_scale = float(ranks) if grad_reduction == "mean" else 1.0
    return _GlobalMean.apply(local_sum, total, count, grad_scale)


@torch.library.custom_op(
    "ringattn::cross_entropy_totals", mutates_args=(),
    schema="(Tensor stats, Tensor? num_items, str[] group_names, str agree, int ignore_index, str grad_reduction, "
    "SymInt vocab) -> Tensor",
)  # fmt: skip
def cross_entropy_totals_op(stats, num_items, group_names, agree, ignore_index, grad_reduction, vocab):
    """stats (2,) float64, this rank's loss sum and counted tokens, summed over the group named in `group_names`
    (one name), or over a grid's (two: its Ulysses group and its ring, "" for a dimension of degree 1), after the
    ranks' agreement on call `agree`'s signature (ignore_index, grad_reduction, the vocab, num_items: None or a
    0-dim integer tensor, the count to return instead; over a grid, agree_across_grid).
    One custom op, so that torch.compile traces neither the exchanges nor the all-reduces.
    Raises (on every rank alike, from the agreed values): ValueError: num_items below the summed count."""
    if len(group_names) == 1:
        place = _resolve_process_group(group_names[0])
        groups = [place]
    else:
        place = Grid(*(_resolve_process_group(name) if name else None for name in group_names))
        groups = place.groups
    items = None if num_items is None else int(num_items)
    fields = (ignore_index, grad_reduction, int(vocab), float("-inf") if items is None else float(items))
    agree_on(agree, place, lambda: fields, CrossEntropySignature, GridCrossEntropySignature)
    totals = stats.clone()
    for group in groups:
        dist.all_reduce(totals, group=group)
    if items is not None:
        count = int(totals[1])
        if items < count:
            raise ValueError(
                "num_items_in_batch must count the counted tokens of every batch of the step over the group, at "
                f"least this call's {count}, got {items}"
            )
        totals[1] = items
    return totals


@cross_entropy_totals_op.register_fake
def _cross_entropy_totals_fake(stats, *options):
    return torch.empty_like(stats)


def sync_gradients(parameters, group: Group = None) -> None:
    """Sum each parameter's .grad over the group, in place.

    Each rank's gradients cover its own tokens; their sum is the unsharded gradient (pair it with cross_entropy(...,
    grad_reduction="sum")). Call it once per optimizer step, after the last backward: with gradient accumulation,
    not after each micro-batch's (a second call sums the gradients already summed, unlike DDP's averaging, which
    leaves equal gradients as they are). A parameter without a gradient on some ranks only (a layer no token of
    their shards reached, an MoE expert no token was routed to) counts as zeros there, and gets the sum as its .grad
    on every rank; one without a gradient on every rank is left without. Two small exchanges on the group's CPU
    channel (the call's agreement, on the parameters; which have gradients), then one all-reduce per dtype and
    device.

    Args:
        parameters: an nn.Module or an iterable of parameters, the same on every rank, in the same order.
        group: the sequence-parallel group (default: the world), or a 1-D DeviceMesh.
    Raises:
        ValueError: the ranks passed different parameters (their number, shapes or dtypes), or some rank makes
            another collective call of ringattn's, on every rank.
        TypeError: a sparse gradient, or a DTensor parameter (FSDP2, tensor parallelism), on some rank, on every
            rank.
        RuntimeError: a rank did not take part within the P2P timeout.
    """
    _sync_gradients(parameters, ring_group(group), "sync_gradients")


def _gradients_present(params: list, groups: list) -> list[bool]:
    """Which of `params` (the same on every rank, agreed) have a gradient on some rank of `groups`, exchanged over
    each group in turn (so over every rank of a grid)."""
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int64)
    for group in groups:
        present = gather_on_cpu(present, group, "sync_gradients' exchange of the gradients present").amax(0)
    return present.bool().tolist()


def _sync_gradients(parameters, place, call: str) -> None:
    """sync_gradients as `call`, summing over `place`: a group (None: the world), or a Grid (its Ulysses group, then
    its ring). The ranks agree on the call and its parameters first (check_agreement, agree_across_grid), so that
    another parameter list, or a rank in another collective call, raises the same error on every rank."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    params = list(parameters)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("sync_gradients is a collective: it needs torch.distributed initialised")

    def checks() -> tuple[int, int]:
        if any(p.grad is not None and p.grad.layout != torch.strided for p in params):
            raise TypeError(
                "sync_gradients sums dense gradients: a parameter has a sparse .grad on this rank (nn.Embedding("
                "sparse=True)); use dense gradients"
            )
        if any(isinstance(p, DTensor) or isinstance(p.grad, DTensor) for p in params):
            raise TypeError(
                "sync_gradients sums plain tensors, but a parameter is a DTensor (FSDP2's fully_shard, tensor "
                "parallelism): shard the model over every rank, or over the (dp, cp) mesh (HSDP), and take the loss "
                'with cross_entropy(..., grad_reduction="mean"): FSDP then reduces over the sequence group too'
            )
        layout = repr([(tuple(p.shape), str(p.dtype)) for p in params]).encode()
        return len(params), zlib.crc32(layout)

    agree_on(call, place, checks, SyncGradientsSignature, GridSyncGradientsSignature)
    groups = place.groups if isinstance(place, Grid) else [place]
    if not params:
        return
    grads = []
    for p, present in zip(params, _gradients_present(params, groups), strict=True):
        if present and p.grad is None:
            p.grad = torch.zeros_like(p)  # no gradient on this rank: its share is zero
        if present:
            grads.append(p.grad)
    # one all-reduce per dtype and device over a flat buffer, not one per parameter
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        for group in groups:
            dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@dataclass
class ShardedBatch:
    """This rank's shard of a batch (SequenceParallel.shard_batch).

    input_ids: (batch, S_local) this rank's tokens.
    position_ids: (batch, S_local) int64, the positions of these tokens for RoPE and for Hugging Face
        models' `position_ids`: their global positions (an expanded view: one row repeated), or, where there are
        documents (cu_seqlens), their positions inside them (each row its own).
    labels: (batch, S_local) the shifted targets of these tokens, or None.
    seqlen: the global length S after padding (S_local = S / W, W the ranks of the group or of the grid).
    unpadded_seqlen: the length before padding; positions from it on are padding (label ignore_index).
    cu_seqlens: for packed documents, a padding mask or any padding to `seqlen` (else None): (n_docs + 1,) int32
        global document boundaries of the flattened batch * seqlen tokens (row b's token t is token b * seqlen + t,
        flash-attn's and Hugging Face's convention for packed rows): 0, every row start b * seqlen, ..., batch *
        seqlen; the padding to `seqlen` and each run of a padding mask's zeros form documents of their own. For
        batch 1 the boundaries of the one row. The same on every rank: pass it to SequenceParallel.attention or
        ring_attn_varlen_func, or to a Hugging Face model as cu_seq_lens_q and cu_seq_lens_k. On the CPU even for
        GPU batches: the ring plans which blocks meet on the host, and a host tensor spares it a device sync per
        call.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    seqlen: int
    unpadded_seqlen: int
    cu_seqlens: torch.Tensor | None = None


class SequenceParallel:
    """The ranks a sequence is split over and the layout of the split, with the helpers that use them: one group (a
    ring), or a U x R grid of a Ulysses group and a ring (2-D context parallelism, ringattn.ulysses_ring_attn_func).

    Pass the same groups and `layout` to the attention (ring_attn_func or ulysses_ring_attn_func,
    ringattn.nn.RingAttention, ringattn.integrations.hf.register): a layout mismatch gives wrong results silently.

    Args:
        group: the process group of the ring (default: the world; with ulysses_group, no ring: degree 1), or a 1-D
            DeviceMesh (a (dp, cp) mesh's mesh["cp"]); torch.distributed must be initialised.
        layout: "zigzag" (default; balanced causal work) or "contiguous".
        ulysses_group: the Ulysses group of a 2-D grid (a ProcessGroup or a 1-D DeviceMesh), or None (the ring
            alone). Each rank (u, r) then holds the u-th of U pieces of ring shard r (ringattn.grid_shard_indices).
        mesh: instead of the groups, a DeviceMesh with dimensions named "ulysses" and "ring" (others, such as "dp",
            may be there too).
    Attributes:
        group, ulysses_group: the ProcessGroups of the ring and of the Ulysses dimension (ulysses_group None: the
            ring alone; group None: the world for the ring alone, degree 1 with ulysses_group).
        rank, world_size: this rank's index and the number of ranks a sequence is split over: those of the group,
            or of the grid (ring rank x U + Ulysses rank, and U x R).
    Raises:
        ValueError: unknown layout; a DeviceMesh of more than one dimension as a group; a mesh without dimensions
            "ulysses" and "ring", or a mesh together with groups.
        TypeError: a group that is not a ProcessGroup, a DeviceMesh or None.
        RuntimeError: torch.distributed not initialised.
    """

    def __init__(
        self,
        group: Group = None,
        layout: str = "zigzag",
        *,
        ulysses_group: Group = None,
        mesh: DeviceMesh | None = None,
    ):
        check_layout(layout)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SequenceParallel needs torch.distributed initialised (dist.init_process_group)")
        self.layout = layout
        if ulysses_group is None and mesh is None:
            self.group, self.ulysses_group, self.grid = ring_group(group), None, None
        else:
            self.grid, self.ulysses_group, self.group = grid_arguments(ulysses_group, group, mesh)

    @property
    def rank(self) -> int:
        """This process's rank in the group, or in the grid (ring rank x U + Ulysses rank); read at each use, as
        the ring functions read theirs (the world after a new dist.init_process_group, with group None)."""
        return dist.get_rank(self.group) if self.grid is None else self.grid.rank

    @property
    def world_size(self) -> int:
        """The ranks of the group, or of the grid (U R)."""
        return dist.get_world_size(self.group) if self.grid is None else self.grid.size

    def __deepcopy__(self, memo: dict) -> "SequenceParallel":
        """A copy sharing the process groups (which cannot be copied), as a model's copy that holds it needs."""
        return copy_sharing_groups(self, memo, (self.group, self.ulysses_group))

    def __repr__(self) -> str:
        grid = "" if self.grid is None else f", ulysses_size={self.grid.ulysses_size}, ring_size={self.grid.ring_size}"
        return f"SequenceParallel(layout={self.layout!r}, rank={self.rank}, world_size={self.world_size}{grid})"

    @property
    def multiple(self) -> int:
        """The global length must be a multiple of this: W ("contiguous") or 2W ("zigzag"); over a U x R grid, U R
        ("contiguous") or R lcm(2, U) ("zigzag": ring shards of two equal chunks, each cut into U pieces)."""
        if self.grid is None:
            return chunks_per_rank(self.layout) * self.world_size
        return self.grid.ring_size * math.lcm(chunks_per_rank(self.layout), self.grid.ulysses_size)

    def position_ids(self, seqlen: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 (seqlen / W,): the global positions of this rank's tokens (over a grid, grid_shard_indices). Raises
        ValueError if not divisible."""
        if self.grid is None:
            return shard_indices(seqlen, self.rank, self.world_size, self.layout, device=device)
        grid = self.grid
        return grid_shard_indices(seqlen, grid.ulysses_rank, grid.ulysses_size, grid.ring_rank, grid.ring_size,
                                  self.layout, device=device)  # fmt: skip

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full tensor along `dim`; a collective, differentiable (ringattn.shard)."""
        return shard(x, dim=dim, group=self.group, layout=self.layout, ulysses_group=self.ulysses_group)

    def gather(self, x_local: torch.Tensor, dim: int = 1, seqlen: int | None = None) -> torch.Tensor:
        """Every rank's shard reassembled in global order, on every rank; a collective, not differentiable.

        Args:
            x_local: this rank's shard, e.g. logits (batch, S_local, vocab).
            dim: the sequence dim.
            seqlen: keep only the first `seqlen` positions (e.g. ShardedBatch.unpadded_seqlen).
        Raises:
            ValueError: as ringattn.unshard, on every rank alike; seqlen not an int from 0 to the gathered length
                (checked once the shards are gathered, so that a rank's own seqlen leaves no peer waiting).
        """
        full = unshard(x_local, dim=dim, group=self.group, layout=self.layout, ulysses_group=self.ulysses_group)
        if seqlen is None:
            return full
        dim = dim % full.dim()
        if isinstance(seqlen, bool) or not isinstance(seqlen, int) or not 0 <= seqlen <= full.shape[dim]:
            raise ValueError(f"seqlen must be an int from 0 to the gathered length {full.shape[dim]}, got {seqlen!r}")
        return full.narrow(dim, 0, seqlen)

    def shard_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        shift: bool = True,
        ignore_index: int = IGNORE_INDEX,
        pad_id: int = 0,
    ) -> ShardedBatch:
        """This rank's shard of a batch that every rank holds in full; a collective (ringattn.shard).

        Labels are shifted (shift_labels) on the full sequence first; then tokens are padded with `pad_id`
        and labels with `ignore_index` at the end up to a multiple of `self.multiple`, and both are sharded.
        The padding is a document of its own: when there is any, the result carries the boundaries in
        `cu_seqlens` (each row one document and its padding another) and `position_ids` inside them, so that no
        real token attends to it, causal or not (an encoder's would otherwise). Pass them to the attention.

        Packed documents: pass their positions (`position_ids`, restarting at 0 at each document start, in
        each row, as packed-sequence trainers make them) or their boundaries (`cu_seqlens`: of the flattened
        batch * S tokens, every row start among them, flash-attn's convention). Each row holds its own
        documents. The result then carries the global boundaries in `cu_seqlens`, each row's padding forming a
        document of its own, and `position_ids` are the tokens' positions inside their documents. With
        shift=True the shifted label of each document's last token is set to `ignore_index`: no token is
        trained to predict the next document's first token.

        Padding: pass Hugging Face's `attention_mask` (batch, S), 1 for real tokens, 0 for padding, left or
        right padding in each row (the real tokens of a row must be contiguous). The padding becomes documents
        of its own and leaves the loss (its labels, and the targets that would predict it, set to
        `ignore_index`); the real tokens of each row get the positions they have in the unpadded row (or, with
        position_ids, inside their documents), so the batch trains as the unpadded rows would. Run the model
        with the boundaries (`cu_seqlens`) and no mask. A mask without zeros changes nothing.

        Args:
            input_ids: (batch, S) tokens (or (batch, S, ...) inputs: only dim 1 is the sequence).
            labels: (batch, S), or None. With shift=True (Hugging Face's convention) the target of
                position i is labels[:, i + 1]; with shift=False labels are already the targets.
            position_ids: packed documents: (batch, S) positions inside the documents ((S,) too for batch 1);
                their values at padding tokens are not read.
            cu_seqlens: packed documents: (n_docs + 1,) int32 or int64 boundaries of the flattened batch * S
                tokens, 0 first, batch * S last, every multiple of S among them.
            attention_mask: (batch, S) of 0s and 1s (any integer or bool dtype), or None.
            ignore_index: the label of tokens left out of the loss.
            pad_id: the token used for padding.
        Returns:
            ShardedBatch with input_ids, labels (batch, S_pad / W), position_ids (batch, S_pad / W) and,
            for packed documents or padding (an attention_mask's, or the padding to a multiple), cu_seqlens.
        Raises (on every rank alike when any rank raises them):
            ValueError: the ranks were not all given the same batch (a collective: one all_gather of a few int64
                per rank, the shape and a digest of each argument) or the same shift, ignore_index and pad_id;
                labels' (batch, S) differ from input_ids'; both
                position_ids and cu_seqlens given; position_ids or cu_seqlens that do not describe documents of
                the batch's rows (cu_seqlens_from_position_ids, check_cu_seqlens); an attention_mask of another
                shape, with values other than 0 and 1, or with padding between a row's real tokens; a pad_id
                (ignore_index) that input_ids' (labels') integer dtype cannot hold exactly.
            TypeError: position_ids, cu_seqlens or attention_mask of the wrong type (as above); a pad_id or
                ignore_index that is not a number.
        """

        def checks():
            if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 2:
                got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
                raise ValueError(f"input_ids must be a tensor (batch, seqlen, ...), got {got}: for one sequence, pass "
                                 "input_ids[None]")  # fmt: skip
            if labels is not None and labels.shape[:2] != input_ids.shape[:2]:
                raise ValueError(
                    f"labels must have input_ids' (batch, seqlen) {tuple(input_ids.shape[:2])}, "
                    f"got {tuple(labels.shape)}"
                )
            check_pad_value(pad_id, input_ids.dtype, "pad_id")
            if labels is not None:
                check_pad_value(ignore_index, labels.dtype, "ignore_index")
            batch, unpadded = input_ids.shape[:2]
            padding = _padding(attention_mask, batch, unpadded)  # (B, S) bool on the host, or None
            return padding, self._documents(batch, unpadded, position_ids, cu_seqlens, padding)  # rows' boundaries

        options = ShardBatchSignature(bool(shift), ignore_index, pad_id)
        # any rank's refusal, raised by all
        padding, rows = self._agreed("SequenceParallel.shard_batch", checks, options, GridShardBatchSignature)
        batch, unpadded = input_ids.shape[:2]
        self._check_same_batch(input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seqlens=cu_seqlens,
                               attention_mask=attention_mask)  # fmt: skip
        input_ids, _ = pad_to_multiple(input_ids, dim=1, multiple=self.multiple, value=pad_id)
        seqlen = input_ids.shape[1]
        if rows is None and seqlen > unpadded:  # the padding a document of its own: no real token sees it
            rows = [torch.tensor([0, unpadded]) for _ in range(batch)]
        if labels is not None:
            if padding is not None:  # no target is a padding token, and no padding token has a target
                labels = labels.masked_fill(padding.to(labels.device), ignore_index)
            if shift:
                labels = shift_labels(labels, ignore_index)
                if padding is not None:
                    labels = labels.masked_fill(padding.to(labels.device), ignore_index)
                for b, bounds in enumerate(rows or ()):  # a document's last token would learn the next's first
                    labels[b, bounds[1:].to(labels.device) - 1] = ignore_index
            labels, _ = pad_to_multiple(labels, dim=1, multiple=self.multiple, value=ignore_index)
            labels = self.shard(labels)
        if rows is None:
            positions = self.position_ids(seqlen, device=input_ids.device).unsqueeze(0).expand(batch, -1)
            docs = None
        else:
            rows = [pad_cu_seqlens(bounds, self.multiple)[0] for bounds in rows]  # each ends at seqlen
            docs = torch.cat([*(bounds[:-1] + b * seqlen for b, bounds in enumerate(rows)),
                              torch.tensor([batch * seqlen])]).to(torch.int32)  # fmt: skip
            in_documents = torch.stack([document_positions(bounds) for bounds in rows])  # (B, S_pad)
            positions = self.shard(in_documents).to(input_ids.device)  # (B, S_local) in-document
        return ShardedBatch(
            input_ids=self.shard(input_ids),
            position_ids=positions,
            labels=labels,
            seqlen=seqlen,
            unpadded_seqlen=unpadded,
            cu_seqlens=docs,
        )

    def _agreed(self, call: str, checks, fields: tuple, grid_signature: type):
        """Run a collective call's local `checks` (a callable) and return its result, after the agreement of the
        group's ranks (of the grid's, parallel/grid.py) on `fields` (a signature NamedTuple; over a grid, its
        `grid_signature`): a rank's refusal, or ranks that disagree, raised by every rank."""
        result = None

        def run_checks():
            nonlocal result
            result = checks()
            return tuple(fields)

        place = self.grid if self.grid is not None else self.group
        agree_on(call, place, run_checks, type(fields), grid_signature)
        return result

    def _check_same_batch(self, **tensors: torch.Tensor | None) -> None:
        """Raise ValueError on every rank unless every rank of the group (of the grid) passed equal tensors (None
        counts as a value).

        One all_gather over the group (over a grid, one over the Ulysses group and one over the ring) of (numel,
        batch, seqlen, dtype, digest) int64 per tensor: a data pipeline that gives each rank its own samples would
        otherwise mix them in one sequence and train on the mix silently.
        """
        if self.world_size == 1:
            return
        device = tensors["input_ids"].device
        local = torch.stack([self._fingerprint(t, device) for t in tensors.values()])  # (n_tensors, 5) int64
        if self.grid is None:
            gathered = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(gathered, local, group=self.group)
            gathered = torch.stack(gathered).cpu()  # (W, n_tensors, 5)
        else:
            gathered = grid_all_gather(local, self.grid).cpu()  # (U R, n_tensors, 5) in the order of Grid.rank
        differ = (gathered != gathered[:1]).any(dim=2)  # (W, n_tensors): differs from rank 0's
        if bool(differ.any()):
            names = [name for name, d in zip(tensors, differ.any(dim=0).tolist(), strict=True) if d]
            ranks = torch.nonzero(differ.any(dim=1)).flatten().tolist()
            which = "group" if self.grid is None else "grid"
            order = "" if self.grid is None else " (grid rank: ring rank x U + Ulysses rank)"
            raise ValueError(
                f"shard_batch needs the same full batch on every rank of the {which}: {', '.join(names)} of {which} "
                f"ranks {ranks}{order} differ from {which} rank 0's. A data pipeline that gives each rank its own "
                "samples (e.g. a sampler sharding the data over every rank, not only over the sequence-parallel "
                "replicas) would mix different samples in one sequence; so would ranks out of step (one rank making "
                "a shard_batch call the others do not, e.g. an evaluation batch on rank 0 only)"
            )

    @staticmethod
    def _fingerprint(x: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """int64 (5,) on `device`: numel, sizes of dims 0 and 1, a CRC32 of the dtype's name, and a position-weighted
        sum of x's values (of their bit patterns for floats; wrapping int64 arithmetic: exact, so equal on every rank
        for equal tensors); -1s for None."""
        if x is None:
            return torch.full((5,), -1, dtype=torch.int64, device=device)
        flat = x.detach().reshape(-1)
        if flat.is_floating_point():
            flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        weights = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device) * 2654435761 + 1  # (numel,)
        digest = (flat.to(torch.int64) * weights).sum().reshape(1)
        dims = torch.tensor([x.numel(), *(tuple(x.shape) + (1, 1))[:2], zlib.crc32(str(x.dtype).encode())],
                            dtype=torch.int64, device=device)  # fmt: skip
        return torch.cat([dims, digest.to(device)])

    @staticmethod
    def _documents(
        batch: int, seqlen: int, position_ids, cu_seqlens, padding: torch.Tensor | None
    ) -> list[torch.Tensor] | None:
        """The checked int64 boundaries (0, ..., seqlen) of each row's documents, the padding's runs documents of
        their own, or None for rows of one sequence each without padding."""
        if position_ids is None and cu_seqlens is None and padding is None:
            return None
        if position_ids is not None and cu_seqlens is not None:
            raise ValueError("pass the packed documents as position_ids or as cu_seqlens, not both")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, batch * seqlen, row=seqlen)
            flat = cu_seqlens.cpu().to(torch.int64)
        if position_ids is not None:
            if not isinstance(position_ids, torch.Tensor):
                raise TypeError(f"position_ids must be an integer tensor, got {type(position_ids).__name__}")
            if tuple(position_ids.shape) not in ((batch, seqlen), *([(seqlen,)] if batch == 1 else [])):
                one_row = " (or (S,) for batch 1)" if batch == 1 else ""
                raise ValueError(
                    f"position_ids must hold one position per token, (batch, S) = ({batch}, {seqlen}){one_row}, "
                    f"got shape {tuple(position_ids.shape)}"
                )
            pos = position_ids.reshape(batch, seqlen)
        rows = []
        for b in range(batch):
            real = range(0, seqlen) if padding is None else _real_tokens(padding[b])
            bounds = {0, seqlen, real.start, real.stop}
            if cu_seqlens is not None:
                in_row = flat[(flat >= b * seqlen) & (flat <= (b + 1) * seqlen)] - b * seqlen
                bounds.update(in_row.tolist())
            if position_ids is not None and len(real):
                try:
                    docs = cu_seqlens_from_position_ids(pos[b, real.start : real.stop])
                except ValueError as e:
                    if batch == 1 and real.start == 0:
                        raise
                    raise ValueError(
                        f"position_ids row {b}, counted from its first real token ({real.start}): {e}"
                    ) from None
                bounds.update((docs.cpu().to(torch.int64) + real.start).tolist())
            rows.append(torch.tensor(sorted(bounds), dtype=torch.int64))
        return rows

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        causal: bool,
        softmax_scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        deterministic: bool = False,
        learnable_sink: torch.Tensor | None = None,
        return_lse: bool = False,
    ):
        """Ring attention over this group in this layout (over a grid, Ulysses x ring attention), inside each
        document when there are documents.

        A collective: every rank of the group (of the grid) calls it with its shard. With `cu_seqlens` (a
        ShardedBatch's, the same on every rank) it runs ring_attn_varlen_func (ulysses_ring_attn_varlen_func), else
        ring_attn_func (ulysses_ring_attn_func); so a model can call `sp.attention(q, k, v, batch.cu_seqlens,
        causal=True)` for packed and unpacked batches alike.

        Args:
            q: (batch, S_local, nheads, headdim).
            k, v: (batch, S_local, nheads_k, headdim); nheads % nheads_k == 0.
            cu_seqlens: (n_docs + 1,) int32 global document boundaries of the flattened batch * S tokens
                (ShardedBatch.cu_seqlens), or None.
            causal: causal over global positions (inside each document with cu_seqlens).
            softmax_scale: defaults to 1 / sqrt(headdim).
            window_size, softcap, deterministic, learnable_sink: as ring_attn_func's (a sliding window over global
                positions, logit soft-capping, gradients with the same bits in every run, (nheads,) attention sinks
                whose gradient sync_gradients sums).
            return_lse: also return lse (batch, nheads, S_local) fp32.
        Returns:
            out (batch, S_local, nheads, headdim) in q's dtype, and lse with return_lse.
        Raises:
            ValueError, TypeError, RuntimeError: as ring_attn_func and ring_attn_varlen_func (4-D q, k, v with
                cu_seqlens), or over a grid as ulysses_ring_attn_func and ulysses_ring_attn_varlen_func.
        """
        kwargs = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                      deterministic=deterministic, learnable_sink=learnable_sink, layout=self.layout)  # fmt: skip
        if self.grid is not None:
            kwargs.update(ulysses_group=self.ulysses_group, ring_group=self.group, return_lse=return_lse)
            if cu_seqlens is None:
                return ulysses_ring_attn_func(q, k, v, **kwargs)
            return ulysses_ring_attn_varlen_func(q, k, v, cu_seqlens, **kwargs)
        kwargs.update(group=self.group)
        if cu_seqlens is None:
            return ring_attn_func(q, k, v, return_lse=return_lse, **kwargs)
        with shared_refusals("SequenceParallel.attention", self.group):
            for name, t in (("q", q), ("k", k), ("v", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 4:
                    raise ValueError(
                        f"attention needs {name} of shape (batch, S_local, heads, headdim), got "
                        f"{tuple(getattr(t, 'shape', ()))}"
                    )
        return ring_attn_varlen_func(q, k, v, cu_seqlens, return_lse=return_lse, **kwargs)

    def cross_entropy(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int = IGNORE_INDEX,
        grad_reduction: str = "sum",
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The unsharded mean loss from this rank's logits and shifted labels (module-level cross_entropy), its
        counts summed over the group (over every rank of the grid; grad_reduction="mean" scales by U x R)."""
        place = self.grid if self.grid is not None else self.group
        return _agreed_cross_entropy("SequenceParallel.cross_entropy", logits, labels, place, ignore_index,
                                     grad_reduction, num_items_in_batch)  # fmt: skip

    def sync_gradients(self, parameters) -> None:
        """Sum gradients over the group, or over every rank of the grid (module-level sync_gradients)."""
        place = self.grid if self.grid is not None else self.group
        _sync_gradients(parameters, place, "SequenceParallel.sync_gradients")


def sequence_parallel_arguments(where: str, sp, **given) -> tuple:
    """(layout, group, ulysses_group) of SequenceParallel `sp`, taken by `where` (RingAttention, hf.register) in
    place of the arguments `given` by name, which must all be None: the attention then runs over the groups and in the
    layout that sharded its inputs.

    Raises:
        TypeError: sp is not a SequenceParallel.
        ValueError: some of `given` are set; sp's groups were destroyed (dist.destroy_process_group).
    """
    if not isinstance(sp, SequenceParallel):
        raise TypeError(f"sp must be a ringattn.SequenceParallel or None, got {type(sp).__name__}")
    if names := [name for name, value in given.items() if value is not None]:
        raise ValueError(f"{where} takes its groups and layout from sp: pass sp without {', '.join(names)}")
    for name in ("group", "ulysses_group"):
        if getattr(sp, name) is not None:
            check_live(getattr(sp, name), f"sp.{name}")
    return sp.layout, sp.group, sp.ulysses_group
