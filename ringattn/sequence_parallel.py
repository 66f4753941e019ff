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

Not yet here: packed variable-length documents (several documents per row, cu_seqlens). They need
ring_attn_varlen_func; ShardedBatch and SequenceParallel.shard_batch are where cu_seqlens will be
sharded and carried.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .parallel.layout import check_layout, chunks_per_rank, pad_to_multiple, shard, shard_indices, unshard

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
    group: dist.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
    grad_reduction: str = "sum",
) -> torch.Tensor:
    """Mean cross-entropy over every counted token of the group's sequence shards; a collective.

    Each rank passes the logits of its tokens and their (already shifted) labels. The returned value
    is, on every rank, the mean loss of the unsharded batch: sum of per-token losses over all ranks
    / number of tokens whose label is not `ignore_index` over all ranks (both all-reduced in float64).
    Its gradient is this rank's share: d(sum of this rank's losses / global count). Summed over the
    group (`sync_gradients`, grad_reduction="sum") the parameter gradients equal the unsharded ones.
    With grad_reduction="mean" the share is scaled by the group size, for a gradient all-reduce that
    averages (DistributedDataParallel or FSDP over this group).

    When no token of the group is counted the loss is 0 with zero gradients (F.cross_entropy's
    mean would give NaN).

    Args:
        logits: (..., vocab), any float dtype; computed in fp32 (or float64 for float64 logits).
        labels: (...) integer targets, logits.shape[:-1].
        group: the sequence-parallel group (default: the world).
        ignore_index: label of tokens left out of the loss and the count.
        grad_reduction: "sum" or "mean", how the parameter gradients will be combined over the group.
    Returns:
        a 0-dim tensor in fp32 (float64 for float64 logits).
    Raises:
        ValueError: labels' shape does not match logits' leading dims; unknown grad_reduction.
        RuntimeError: torch.distributed not initialised.
    """
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {GRAD_REDUCTIONS}, got {grad_reduction!r}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have logits' leading shape {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cross_entropy is a collective: it needs torch.distributed initialised")
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, logits.shape[-1]).to(compute_dtype)
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.int64)
    local_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    local_count = (flat_labels != ignore_index).sum()
    stats = torch.stack([local_sum.detach().double(), local_count.double()])  # (2,): sum, count
    dist.all_reduce(stats, group=group)
    total, count = stats[0], stats[1].clamp(min=1.0)
    grad_scale = float(dist.get_world_size(group)) if grad_reduction == "mean" else 1.0
    return _GlobalMean.apply(local_sum, total, count, grad_scale)


def sync_gradients(parameters, group: dist.ProcessGroup | None = None) -> None:
    """Sum each parameter's .grad over the group, in place (parameters without a gradient are skipped).

    Each rank's gradients cover its own tokens; their sum is the unsharded gradient (pair it with
    cross_entropy(..., grad_reduction="sum")). Every rank must pass the same parameters in the same order.

    Args:
        parameters: an nn.Module or an iterable of parameters.
    """
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    # one all-reduce per dtype and device over a flat buffer, not one per parameter
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@dataclass
class ShardedBatch:
    """This rank's shard of a batch (SequenceParallel.shard_batch).

    input_ids: (batch, S_local) this rank's tokens.
    position_ids: (batch, S_local) int64, their global positions (an expanded view: one row repeated),
        for RoPE and for Hugging Face models' `position_ids`.
    labels: (batch, S_local) the shifted targets of these tokens, or None.
    seqlen: the global length S after padding (S_local = S / W).
    unpadded_seqlen: the length before padding; positions from it on are padding (label ignore_index).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    seqlen: int
    unpadded_seqlen: int


class SequenceParallel:
    """The group a sequence is split over and the layout of the split, with the helpers that use them.

    Pass the same `group` and `layout` to the attention (ring_attn_func, ringattn.nn.RingAttention,
    ringattn.integrations.hf.register): a layout mismatch gives wrong results silently.

    Args:
        group: the process group (default: the world); torch.distributed must be initialised.
        layout: "zigzag" (default; balanced causal work) or "contiguous".
    Raises:
        ValueError: unknown layout.
        RuntimeError: torch.distributed not initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, layout: str = "zigzag"):
        check_layout(layout)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("SequenceParallel needs torch.distributed initialised (dist.init_process_group)")
        self.group, self.layout = group, layout
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"SequenceParallel(layout={self.layout!r}, rank={self.rank}, world_size={self.world_size})"

    @property
    def multiple(self) -> int:
        """The global length must be a multiple of this: W ("contiguous") or 2W ("zigzag")."""
        return chunks_per_rank(self.layout) * self.world_size

    def position_ids(self, seqlen: int, device: torch.device | str | None = None) -> torch.Tensor:
        """int64 (seqlen / W,): the global positions of this rank's tokens. Raises ValueError if not divisible."""
        return shard_indices(seqlen, self.rank, self.world_size, self.layout, device=device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's shard of a full tensor along `dim` (differentiable; see ringattn.shard)."""
        return shard(x, dim=dim, group=self.group, layout=self.layout)

    def gather(self, x_local: torch.Tensor, dim: int = 1, seqlen: int | None = None) -> torch.Tensor:
        """Every rank's shard reassembled in global order, on every rank; a collective, not differentiable.

        Args:
            x_local: this rank's shard, e.g. logits (batch, S_local, vocab).
            dim: the sequence dim.
            seqlen: keep only the first `seqlen` positions (e.g. ShardedBatch.unpadded_seqlen).
        """
        full = unshard(x_local, dim=dim, group=self.group, layout=self.layout)
        return full if seqlen is None else full.narrow(dim % full.dim(), 0, seqlen)

    def shard_batch(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        shift: bool = True,
        ignore_index: int = IGNORE_INDEX,
        pad_id: int = 0,
    ) -> ShardedBatch:
        """This rank's shard of a batch that every rank holds in full.

        Labels are shifted (shift_labels) on the full sequence first; then tokens are padded with `pad_id`
        and labels with `ignore_index` at the end up to a multiple of `self.multiple`, and both are sharded.
        Under causal attention the padding comes last, so no real token attends to it.

        Args:
            input_ids: (batch, S) tokens (or (batch, S, ...) inputs: only dim 1 is the sequence).
            labels: (batch, S), or None. With shift=True (Hugging Face's convention) the target of
                position i is labels[:, i + 1]; with shift=False labels are already the targets.
            ignore_index: the label of tokens left out of the loss.
            pad_id: the token used for padding.
        Returns:
            ShardedBatch with input_ids, labels (batch, S_pad / W) and position_ids (batch, S_pad / W).
        Raises:
            ValueError: labels' (batch, S) differ from input_ids'.
        """
        if labels is not None and labels.shape[:2] != input_ids.shape[:2]:
            raise ValueError(
                f"labels must have input_ids' (batch, seqlen) {tuple(input_ids.shape[:2])}, got {tuple(labels.shape)}"
            )
        batch, unpadded = input_ids.shape[0], input_ids.shape[1]
        input_ids, _ = pad_to_multiple(input_ids, dim=1, multiple=self.multiple, value=pad_id)
        seqlen = input_ids.shape[1]
        if labels is not None:
            if shift:
                labels = shift_labels(labels, ignore_index)
            labels, _ = pad_to_multiple(labels, dim=1, multiple=self.multiple, value=ignore_index)
            labels = self.shard(labels)
        positions = self.position_ids(seqlen, device=input_ids.device)  # (S_local,)
        return ShardedBatch(
            input_ids=self.shard(input_ids),
            position_ids=positions.unsqueeze(0).expand(batch, -1),
            labels=labels,
            seqlen=seqlen,
            unpadded_seqlen=unpadded,
        )

    def cross_entropy(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int = IGNORE_INDEX,
        grad_reduction: str = "sum",
    ) -> torch.Tensor:
        """The unsharded mean loss from this rank's logits and shifted labels (module-level cross_entropy)."""
        return cross_entropy(logits, labels, self.group, ignore_index, grad_reduction)

    def sync_gradients(self, parameters) -> None:
        """Sum gradients over the group (module-level sync_gradients)."""
        sync_gradients(parameters, self.group)
