"""Sequence layouts: which global tokens each rank of the ring holds (docs/design.md, section 4).

- "contiguous": the global sequence of S tokens is cut into W equal chunks; group rank r holds
  chunk r, tokens [r * S / W, (r + 1) * S / W).
- "zigzag": the sequence is cut into 2W equal chunks c_0 ... c_{2W-1}; rank r holds c_r followed
  by c_{2W-1-r}. Under a causal mask every rank then does the same work at every ring step.

In both layouts a rank's local tokens are in increasing global order.

With a Ulysses group of U ranks beside a ring of R (2-D context parallelism, parallel/grid.py), the ring's layout
is over R ring shards of S / R tokens, and rank (u, r) (Ulysses rank u, ring rank r) holds the u-th of U equal
consecutive pieces of ring shard r: `grid_shard_ranges`. After the Ulysses exchange (parallel/ulysses.py), which
puts the U pieces together in Ulysses-rank order, each rank of ring r holds exactly ring shard r.

The index maps (`shard_ranges`, `shard_indices`) are pure functions of (seqlen, rank, world
size, layout) and need no process group; `shard`, `unshard` and `position_ids` apply them to
this process's rank in a group. `shard` and `unshard` are collectives: every rank first
compares its call with the others' (parallel/agreement.py), so ranks that pass different
shapes, or call another collective, all raise the same ValueError before any data moves.
"""

import math
import numbers
import operator

import torch
import torch.distributed as dist

from .agreement import ShardSignature, UnshardSignature, check_agreement, shared_refusals
from .grid import GridShardSignature, GridUnshardSignature, agree_across_grid, grid_groups
from .groups import Group, ring_group

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """Raise ValueError unless `layout` is one of LAYOUTS (the one place layout names are checked)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    """Equal chunks each rank holds: 1 ("contiguous") or 2 ("zigzag"). Raises ValueError for an unknown layout."""
    check_layout(layout)
    return 2 if layout == "zigzag" else 1


def check_seqlen(seqlen: int, world_size: int, layout: str, name: str = "seqlen") -> None:
    """Raise ValueError unless the global length `seqlen` splits evenly over `world_size` ranks in `layout`:
    divisible by W ("contiguous") or 2W ("zigzag"). `name` is the argument named in the message; a world_size
    that is not a positive int is refused too."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(seqlen, bool) or not hasattr(type(seqlen), "__index__"):  # an int, a SymInt under torch.compile
        raise TypeError(f"{name} must be an int, got {seqlen!r} ({type(seqlen).__name__})")
    multiple = chunks_per_rank(layout) * world_size
    if seqlen < 0 or seqlen % multiple != 0:
        how = f"2 x world size {world_size}" if layout == "zigzag" else f"world size {world_size}"
        raise ValueError(
            f"{name} = {seqlen} must be a non-negative multiple of {multiple} ({how}) for layout {layout!r}; "
            "pad the sequence with ringattn.pad_to_multiple"
        )


def check_local_seqlen(seqlen_local: int, layout: str, name: str = "seqlen_local") -> None:
    """Raise ValueError unless a rank's local length splits into the layout's equal chunks (even for "zigzag")."""
    chunks = chunks_per_rank(layout)
    if seqlen_local % chunks != 0:
        raise ValueError(
            f"{name} = {seqlen_local} must be divisible by {chunks} for layout {layout!r} "
            "(each rank holds two equal chunks of the sequence)"
        )


def check_dim(dim: int, ndim: int, name: str = "dim") -> int:
    """`dim` of a tensor of `ndim` dims as an index in [0, ndim). Raises ValueError unless -ndim <= dim < ndim."""
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name} must be in [-{ndim}, {ndim}) for a tensor of {ndim} dims, got {dim}")
    return dim % ndim


def check_tensor_dim(x, dim: int, name: str) -> int:
    """`dim` of the tensor `x` as an index (check_dim). Raises TypeError, naming `name`, unless x is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return check_dim(dim, x.dim())


def check_rank(rank: int, world_size: int, name: str = "rank") -> None:
    """Raise ValueError unless rank and world_size are integers (not bools), world_size >= 1 and 0 <= rank <
    world_size."""
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in (rank, world_size)):
        raise ValueError(f"{name} and world_size must be ints, got {rank!r} and {world_size!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{name} must be in [0, world_size) with world_size >= 1, got {rank}, world_size {world_size}")


def shard_ranges(seqlen: int, rank: int, world_size: int, layout: str) -> list[range]:
    """The global token ranges `rank` holds, in local order (pure; no communication).

    Returns [range(r*L, (r+1)*L)] for "contiguous" (L = seqlen / W) and
    [range(r*C, (r+1)*C), range((2W-1-r)*C, (2W-r)*C)] for "zigzag" (C = seqlen / 2W).
    Raises:
        ValueError: unknown layout, rank outside [0, world_size), or seqlen not divisible (check_seqlen).
    """
    check_rank(rank, world_size)
    check_seqlen(seqlen, world_size, layout)
    chunk = seqlen // (chunks_per_rank(layout) * world_size)
    chunk_ids = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return [range(c * chunk, (c + 1) * chunk) for c in chunk_ids]


def shard_indices(
    seqlen: int, rank: int, world_size: int, layout: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 (seqlen / W,): the global position of each of `rank`'s local tokens (pure; no communication).

    A rank's shard of a full tensor x is x.index_select(dim, shard_indices(...)).
    Raises ValueError as shard_ranges.
    """
    ranges = shard_ranges(seqlen, rank, world_size, layout)
    return torch.cat([torch.arange(r.start, r.stop, dtype=torch.int64, device=device) for r in ranges])


def check_grid_seqlen(seqlen: int, ulysses_size: int, ring_size: int, layout: str, name: str = "seqlen") -> None:
    """Raise ValueError unless the global length `seqlen` splits over a U x R grid in `layout`: into R ring shards
    (check_seqlen), each cut into U equal pieces."""
    check_seqlen(seqlen, ring_size, layout, name)
    if ulysses_size < 1 or (seqlen // ring_size) % ulysses_size != 0:
        raise ValueError(
            f"{name} = {seqlen} must be a multiple of the Ulysses degree {ulysses_size} x the ring degree {ring_size}"
            + (f" (and of 2 x ring degree for layout {layout!r})" if chunks_per_rank(layout) == 2 else "")
            + "; pad the sequence with ringattn.pad_to_multiple"
        )


def grid_shard_ranges(
    seqlen: int, ulysses_rank: int, ulysses_size: int, ring_rank: int, ring_size: int, layout: str
) -> list[range]:
    """The global token ranges rank (ulysses_rank, ring_rank) of a U x R grid holds, in local order (pure): the
    ulysses_rank-th of U equal consecutive pieces of the ring shard shard_ranges(seqlen, ring_rank, R, layout), one
    range, or two where a "zigzag" piece spans the shard's two chunks.

    Raises:
        ValueError: unknown layout, a rank out of range, or seqlen not divisible (check_grid_seqlen).
    """
    check_rank(ulysses_rank, ulysses_size, "ulysses_rank")
    check_rank(ring_rank, ring_size, "ring_rank")
    check_grid_seqlen(seqlen, ulysses_size, ring_size, layout)
    piece = seqlen // (ring_size * ulysses_size)
    start, stop = ulysses_rank * piece, (ulysses_rank + 1) * piece  # in the ring shard's local order
    ranges, offset = [], 0
    for r in shard_ranges(seqlen, ring_rank, ring_size, layout):
        lo, hi = max(start, offset), min(stop, offset + len(r))
        if lo < hi:
            ranges.append(range(r.start + lo - offset, r.start + hi - offset))
        offset += len(r)
    return ranges


def grid_shard_indices(
    seqlen: int,
    ulysses_rank: int,
    ulysses_size: int,
    ring_rank: int,
    ring_size: int,
    layout: str,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """int64 (seqlen / (U R),): the global position of each local token of rank (ulysses_rank, ring_rank) of a U x R
    grid (pure; no communication). With U = 1 it is shard_indices(seqlen, ring_rank, R, layout). Raises ValueError as
    grid_shard_ranges."""
    ranges = grid_shard_ranges(seqlen, ulysses_rank, ulysses_size, ring_rank, ring_size, layout)
    return torch.cat([torch.arange(r.start, r.stop, dtype=torch.int64, device=device) for r in ranges] or
                     [torch.empty(0, dtype=torch.int64, device=device)])  # fmt: skip


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard, unshard and position_ids need torch.distributed initialised (dist.init_process_group); "
            "without a process group use shard_indices(seqlen, rank, world_size, layout)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, dim: int = 1, group: Group = None, layout: str = "zigzag", ulysses_group: Group = None):
    """This rank's shard of a full tensor, along `dim`.

    A collective: every rank holds the same full tensor x and calls it (the ranks compare x's shape
    and dtype, dim and layout first). The result is a new contiguous tensor holding the tokens
    shard_indices(x.shape[dim], rank, W, layout) of x, in that order. Differentiable (gradients
    flow back to x). Pass the attention (ring_attn_func, RingAttention) the same `layout`.

    Args:
        x: any shape (up to 16 dims); x.shape[dim] is the global length S, divisible by W ("contiguous") or 2W
            ("zigzag").
        dim: the sequence dim, in [-x.dim(), x.dim()) (1 for (batch, seqlen, nheads, headdim); 2 or -1 for an lse
            (batch, nheads, seqlen)).
        group: the ring's process group (default: the world, or with ulysses_group, no ring: degree 1), or a 1-D
            DeviceMesh (parallel/groups.py).
        ulysses_group: None, or the Ulysses group of ulysses_ring_attn_func's 2-D layout (a ProcessGroup or a 1-D
            DeviceMesh, mesh["ulysses"]): this rank (u, r) then gets grid_shard_indices(S, u, U, r, R, layout), the
            u-th of U pieces of ring shard r; S must be divisible by U x R (and 2R for "zigzag"), the result has
            S / (U R) tokens.
    Returns:
        x's shard, x.shape with S replaced by S / W (S / (U R) with ulysses_group).
    Raises:
        ValueError: unknown layout; dim out of range; S not divisible by W or 2W; ranks whose x.shape, x.dtype, dim
            or layout differ; a DeviceMesh of more than one dimension; with ulysses_group, groups that are not the
            two dimensions of one grid (parallel/grid.py). On every rank alike when any rank raises it
            (parallel/agreement.py).
        TypeError: a group that is not a ProcessGroup, a DeviceMesh or None; an x that is not a tensor.
        RuntimeError: torch.distributed not initialised.
    """
    if ulysses_group is not None:
        return _grid_shard(x, dim, grid_groups(ulysses_group, group, ring_name="group"), layout)
    group = ring_group(group)
    with shared_refusals("shard", group):
        check_layout(layout)
        rank, world_size = _group_rank_and_size(group)
        dim = check_tensor_dim(x, dim, "x")
        check_seqlen(x.shape[dim], world_size, layout, name=f"x.shape[{dim}]")
    check_agreement("shard", ShardSignature(tuple(x.shape), x.dtype, dim, layout), group)
    pieces = [x.narrow(dim, r.start, len(r)) for r in shard_ranges(x.shape[dim], rank, world_size, layout)]
    return torch.cat(pieces, dim).contiguous()


def unshard(
    x_local: torch.Tensor, dim: int = 1, group: Group = None, layout: str = "zigzag", ulysses_group: Group = None
):
    """Gather every rank's shard and reassemble the full tensor (the inverse of `shard`) along `dim`.

    A collective: every rank of the group calls it with its shard of the same shape, and every
    rank gets the full tensor. The ranks compare their shards' shapes and dtypes, dim and layout
    before any data moves. Not differentiable: the result carries no autograd history (use it
    for checks, logging and evaluation, not inside a loss).

    Args:
        x_local: this rank's shard (up to 16 dims); x_local.shape[dim] = S / W (even for "zigzag").
        dim: the sequence dim, in [-x_local.dim(), x_local.dim()).
        group: the ring's process group (default: the world, or with ulysses_group, no ring), or a 1-D DeviceMesh.
        ulysses_group: None, or the Ulysses group of the 2-D layout (as in shard): every rank of the U x R grid
            then gets the full tensor of S = U R x_local.shape[dim] tokens.
    Returns:
        the full tensor, x_local.shape with S / W replaced by S, in global token order.
    Raises:
        ValueError: unknown layout; dim out of range; an odd local length with "zigzag" (with ulysses_group: an odd
            U x local length); ranks whose x_local.shape, x_local.dtype, dim or layout differ, or that call another
            collective; a DeviceMesh of more than one dimension; groups that are not one grid. On every rank alike
            when any rank raises it (parallel/agreement.py).
        TypeError: a group that is not a ProcessGroup, a DeviceMesh or None; an x_local that is not a tensor.
        RuntimeError: torch.distributed not initialised.
    """
    if ulysses_group is not None:
        return _grid_unshard(x_local, dim, grid_groups(ulysses_group, group, ring_name="group"), layout)
    group = ring_group(group)
    with shared_refusals("unshard", group):
        check_layout(layout)
        rank, world_size = _group_rank_and_size(group)
        dim = check_tensor_dim(x_local, dim, "x_local")
        check_local_seqlen(x_local.shape[dim], layout, name=f"x_local.shape[{dim}]")
    check_agreement("unshard", UnshardSignature(tuple(x_local.shape), x_local.dtype, dim, layout), group)
    return _unshard_ring(x_local, dim, group, world_size, layout)


def _unshard_ring(x_local: torch.Tensor, dim: int, group: dist.ProcessGroup | None, world_size: int, layout: str):
    """The full tensor from every ring rank's shard (checked and agreed): one all_gather, then the pieces in order."""
    seqlen_local = x_local.shape[dim]
    x_local = x_local.detach().contiguous()
    gathered = [torch.empty_like(x_local) for _ in range(world_size)]
    dist.all_gather(gathered, x_local, group=group)
    seqlen = seqlen_local * world_size
    pieces = []  # (global start, piece)
    for r, part in enumerate(gathered):
        offset = 0
        for g in shard_ranges(seqlen, r, world_size, layout):
            pieces.append((g.start, part.narrow(dim, offset, len(g))))
            offset += len(g)
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim)


def position_ids(
    seqlen: int,
    group: Group = None,
    layout: str = "zigzag",
    device: torch.device | str | None = None,
    ulysses_group: Group = None,
) -> torch.Tensor:
    """int64 (seqlen / W,): the global positions of this rank's tokens, for RoPE and for picking labels.

    Args:
        seqlen: the global sequence length S, divisible by W ("contiguous") or 2W ("zigzag").
        group: the ring's process group (default: the world, or with ulysses_group, no ring), or a 1-D DeviceMesh.
        device: where to create the tensor.
        ulysses_group: None, or the Ulysses group of the 2-D layout (as in shard): (seqlen / (U R),) positions,
            grid_shard_indices. Local: no communication.
    Raises:
        ValueError: unknown layout; S not divisible; a DeviceMesh of more than one dimension.
        TypeError: a group that is none of those.
        RuntimeError: torch.distributed not initialised.
    """
    check_layout(layout)
    if ulysses_group is not None:
        grid = grid_groups(ulysses_group, group, ring_name="group")
        return grid_shard_indices(seqlen, grid.ulysses_rank, grid.ulysses_size, grid.ring_rank, grid.ring_size,
                                  layout, device=device)  # fmt: skip
    rank, world_size = _group_rank_and_size(ring_group(group))
    return shard_indices(seqlen, rank, world_size, layout, device=device)


def _grid_shard(x: torch.Tensor, dim: int, grid, layout: str) -> torch.Tensor:
    """shard over a U x R grid (parallel/grid.Grid)."""

    def checks():
        check_layout(layout)
        d = check_tensor_dim(x, dim, "x")
        check_grid_seqlen(x.shape[d], grid.ulysses_size, grid.ring_size, layout, name=f"x.shape[{d}]")
        return ShardSignature(tuple(x.shape), x.dtype, d, layout)

    dim = agree_across_grid("shard", grid, checks, GridShardSignature).dim
    ranges = grid_shard_ranges(x.shape[dim], grid.ulysses_rank, grid.ulysses_size, grid.ring_rank, grid.ring_size,
                               layout)  # fmt: skip
    return torch.cat([x.narrow(dim, r.start, len(r)) for r in ranges], dim).contiguous()


def _grid_unshard(x_local: torch.Tensor, dim: int, grid, layout: str) -> torch.Tensor:
    """unshard over a U x R grid: the U pieces of the ring shard gathered over the Ulysses group, in Ulysses order,
    then the ring shards over the ring group."""

    def checks():
        check_layout(layout)
        d = check_tensor_dim(x_local, dim, "x_local")
        check_local_seqlen(grid.ulysses_size * x_local.shape[d], layout, name=f"U x x_local.shape[{d}]")
        return UnshardSignature(tuple(x_local.shape), x_local.dtype, d, layout)

    dim = agree_across_grid("unshard", grid, checks, GridUnshardSignature).dim
    ring_shard = x_local.detach().contiguous()
    if grid.ulysses is not None:
        pieces = [torch.empty_like(ring_shard) for _ in range(grid.ulysses_size)]
        dist.all_gather(pieces, ring_shard, group=grid.ulysses)
        ring_shard = torch.cat(pieces, dim)
    if grid.ring is None:  # a new tensor, as every other path's (with no exchange at all, x_local's memory)
        return ring_shard if grid.ulysses is not None else ring_shard.clone()
    return _unshard_ring(ring_shard, dim, grid.ring, grid.ring_size, layout)


def check_multiple(multiple) -> int:
    """`multiple` (a length to pad to a multiple of) as an int; ValueError unless an integer >= 1."""
    try:
        value = operator.index(multiple) if not isinstance(multiple, bool) else 0
    except TypeError:
        value = 0
    if value < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple!r}")
    return value


def check_pad_value(value, dtype: torch.dtype, name: str = "value") -> None:
    """Raise unless `value` (the argument `name`) is a real number that a tensor of `dtype` holds exactly (any for a
    floating dtype)."""
    if not isinstance(value, numbers.Real):  # Python's and numpy's numbers (not a tensor)
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if dtype.is_complex:
        return
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf if value > 0 else -math.inf
    if dtype.is_floating_point:
        finite = isinstance(value, numbers.Integral) or math.isfinite(number)  # an int is, however large
        if finite and abs(number) > torch.finfo(dtype).max:
            raise ValueError(f"{name} {value!r} is out of range for a tensor of dtype {dtype} (largest finite "
                             f"{torch.finfo(dtype).max:g}): use a finite value in range, or inf")  # fmt: skip
        return
    low, high = (0, 1) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    if not number.is_integer() or not low <= value <= high:
        raise ValueError(
            f"{name} {value!r} must be an integer in [{low}, {high}] for a tensor of dtype {dtype} (it would be "
            "written changed)"
        )


def pad_to_multiple(x: torch.Tensor, dim: int, multiple: int, value: float = 0) -> tuple[torch.Tensor, int]:
    """Pad x at the end of `dim` with `value` up to the next multiple of `multiple`.

    Use multiple = 2 * W for "zigzag" (W for "contiguous") before `shard`; slice the result back
    to the returned length after `unshard`. The padding takes part in attention like any token:
    under a causal mask it comes last, so no original query sees it and the original tokens'
    outputs are unchanged; without a causal mask every query attends to it and the result changes.
    Keep padded positions out of the loss (e.g. pad labels with the loss's ignore index).

    Returns:
        (padded x, original length x.shape[dim]); x itself (no copy) when already a multiple.
    Raises:
        ValueError: multiple not an int >= 1; dim not in [-x.dim(), x.dim()); a value x's dtype cannot hold (a
            fraction, an infinity or NaN, or a number out of range for an integer or bool x; a finite number past a
            floating x's largest).
        TypeError: x not a tensor; value not a real number.
    """
    multiple = check_multiple(multiple)
    dim = check_tensor_dim(x, dim, "x")
    check_pad_value(value, x.dtype)
    length = x.shape[dim]
    extra = -length % multiple
    if extra == 0:
        return x, length
    # a tensor of the value, not F.pad's: F.pad passes it through a double, which rounds int64 values past 2^53
    padding = torch.full((*x.shape[:dim], extra, *x.shape[dim + 1 :]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, padding], dim), length
