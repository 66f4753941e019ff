"""Ulysses x ring attention (2-D context parallelism): `ulysses_ring_attn_func` and `ulysses_ring_attn_varlen_func`.

A U x R grid of ranks (parallel/grid.py) holds one sequence of S tokens, S / (U R) a rank, in the 2-D layout of
parallel/layout.py: rank (u, r) holds the u-th of U equal pieces of ring shard r (grid_shard_indices). The Ulysses
all-to-all (parallel/ulysses.py) trades the sequence split for a head split: each rank then holds its ring shard
(S / R tokens) of Hq / U query heads and of the K/V heads those need; ring_attn_func (ring_attn_varlen_func) runs over
the ring group on them; the inverse all-to-all brings the output (and lse) back to the sequence split. The backward
runs the same in reverse: the all-to-alls are differentiable custom ops, the ring's own backward runs in between
(docs/design.md, "Ulysses x ring").

Signatures follow ring_attn_func's: every argument after q, k, v (and cu_seqlens) is keyword-only, with the groups
(ulysses_group, ring_group, or a DeviceMesh `mesh` with dimensions "ulysses" and "ring") in place of `group`.
"""

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from .functional import (
    _check_varlen_ring_dims,
    check_ring_inputs,
    flash_attn_func,
    flash_attn_varlen_func,
    graph_grads,
    ring_attn_func,
    ring_attn_varlen_func,
)
from .ops.validation import check_flag, check_flash_attn_options
from .parallel.agreement import ring_signature
from .parallel.documents import check_cu_seqlens_tensor, checked_fingerprint
from .parallel.grid import Grid, UlyssesRingSignature, agree_across_grid, grid_groups, shared_grid_refusals
from .parallel.groups import Group, or_world
from .parallel.layout import check_layout, chunks_per_rank
from .parallel.ulysses import heads_to_seq, rank_heads, seq_to_heads


def check_ulysses_heads(heads_q: int, heads_k: int, ulysses_size: int) -> None:
    """Raise ValueError, naming ulysses_group, unless U divides the query heads and U and the K/V heads divide one
    another (each rank's query heads then need one K/V head, or a whole 1 / U of them)."""
    if heads_q % ulysses_size != 0:
        raise ValueError(
            f"ulysses_group's size {ulysses_size} must divide q's head count {heads_q} (q.shape[2]): each Ulysses rank "
            "attends with an equal share of the query heads"
        )
    if heads_k % ulysses_size != 0 and ulysses_size % heads_k != 0:
        raise ValueError(
            f"ulysses_group's size {ulysses_size} and k's head count {heads_k} (k.shape[2]) must divide one another: "
            "each Ulysses rank needs 1 / U of the K/V heads, or one K/V head shared by U / nheads_k ranks"
        )


@torch.library.custom_op("ringattn::ulysses_ring_agreement", mutates_args=())
def ulysses_ring_agreement_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    sinks: bool,
    layout: str,
    grads: str,
    return_lse: bool,
    call: str,
    ulysses_group: str,
    ring_group: str | None,
) -> torch.Tensor:
    """A 2-D attention call's agreement across the grid of the groups named `ulysses_group` and `ring_group` (None:
    a ring of one), at every call, compiled or not (grid.agree_across_grid): the grid's ranks, the boundaries'
    values (cu_seqlens, global, or None), then the call's signature (q, k, v (B, L, H, D) checked, for their shapes
    and dtype; the other arguments as the ring takes them). Returns an empty int64 CPU tensor, which the exchanges
    after it take (seq_to_heads' `after`), so that a compiled graph keeps them after it.
    Raises ValueError, TypeError, RuntimeError as ulysses_ring_attn_func, on every rank of the grid alike."""
    ring = None if ring_group is None else _resolve_process_group(ring_group)
    grid = Grid(_resolve_process_group(ulysses_group), ring)

    def checks():
        documents = checked_fingerprint(cu_seqlens, q.shape[0], q.shape[1] * grid.size)  # a row's global length
        window = (window_left, window_right)
        sig = ring_signature(q, k, v, softmax_scale, causal, layout, grads, documents, window, softcap, sinks)
        return (*sig, return_lse)

    agree_across_grid(call, grid, checks, UlyssesRingSignature)
    return torch.empty(0, dtype=torch.int64)


@ulysses_ring_agreement_op.register_fake
def _ulysses_ring_agreement_fake(q, k, v, cu_seqlens, *options):
    return torch.empty(0, dtype=torch.int64)


def _ulysses_ring(call, grid: Grid, q, k, v, cu_seqlens, options: dict, layout, sink, return_lse: bool):
    """Checks and agreement across the grid, the exchange, the inner ring (or, for a ring of one, the fused call),
    the inverse exchange: (out (B, L, Hq, D), lse (B, Hq, L), None unless return_lse) of 4-D q, k, v; with
    cu_seqlens, of 4-D q, k, v (B packed rows) or 3-D ones (L, H, D) taken as B = 1. The Python arguments and the
    tensors' shapes are checked here (while tracing, under torch.compile), everything that communicates or reads
    values in ringattn::ulysses_ring_agreement, at every call."""
    size = grid.ulysses_size
    with shared_grid_refusals(call, grid):
        if cu_seqlens is not None and _check_varlen_ring_dims(q, k, v):
            q, k, v = q[None], k[None], v[None]
        causal, window, softcap, _ = check_flash_attn_options(
            options["dropout_p"], options["causal"], options["window_size"], options["softcap"],
            options["alibi_slopes"], options["deterministic"], options["return_attn_probs"],
        )  # fmt: skip
        return_lse = check_flag(return_lse, "return_lse")
        check_layout(layout)
        # the ring's length rule applies to the ring's local length U x L, checked below
        scale, _ = check_ring_inputs(q, k, v, None, "contiguous", options["softmax_scale"], sink, call, softcap)
        check_ulysses_heads(q.shape[2], k.shape[2], size)
        if size * q.shape[1] % chunks_per_rank(layout):
            raise ValueError(
                f"the Ulysses degree {size} x the local length {q.shape[1]} (q.shape[1]), the ring's local length, "
                f"must be even for layout {layout!r} (each ring rank holds two equal chunks)"
            )
        if cu_seqlens is not None:
            check_cu_seqlens_tensor(cu_seqlens)
    agreed = ulysses_ring_agreement_op(
        q, k, v, cu_seqlens, scale, causal, *window, softcap, sink is not None, layout, graph_grads(q, k, v, sink),
        bool(return_lse), call, grid.ulysses.group_name, None if grid.ring is None else grid.ring.group_name,
    )  # fmt: skip
    batch, heads_q = q.shape[0], q.shape[2]
    q_h = seq_to_heads(q, grid.ulysses, agreed)  # (B, S / R, Hq / U, D)
    k_h, v_h = seq_to_heads(torch.cat([k, v]), grid.ulysses, agreed).chunk(2)  # (B, S / R, h_kv, D) each
    heads = rank_heads(heads_q, grid.ulysses_rank, size)
    sink_h = None if sink is None else sink[heads.start : heads.stop]
    inner = {name: options[name] for name in ("causal", "window_size", "softcap", "deterministic")}
    inner.update(softmax_scale=scale, return_lse=True, learnable_sink=sink_h)
    if cu_seqlens is None and grid.ring is not None:
        out_h, lse_h = ring_attn_func(q_h, k_h, v_h, group=grid.ring, layout=layout, **inner)
    elif cu_seqlens is None:  # a ring of one: its shard is the whole sequence, in order
        out_h, lse_h = flash_attn_func(q_h, k_h, v_h, **inner)
    elif grid.ring is not None:  # every row in one ring
        out_h, lse_h = ring_attn_varlen_func(q_h, k_h, v_h, cu_seqlens, group=grid.ring, layout=layout, **inner)
    else:  # a ring of one: the rows, flattened, are the packed sequence cu_seqlens (any device) describes
        row = q_h.shape[1]  # no document is longer than a row (the boundaries hold every row start)
        bounds = cu_seqlens.to(q_h.device)  # flash_attn_varlen_func's boundaries are on q's device
        out_h, lse_h = flash_attn_varlen_func(q_h.flatten(0, 1), k_h.flatten(0, 1), v_h.flatten(0, 1), bounds, bounds,
                                              row, row, **inner)  # fmt: skip
        out_h = out_h.view(q_h.shape)  # (B, S / R, h, D)
        lse_h = lse_h.reshape(lse_h.shape[0], batch, -1).transpose(0, 1)  # (h, B S / R) -> (B, h, S / R)
    out = heads_to_seq(out_h, grid.ulysses, heads_q, grid.ring)  # (B, L, Hq, D)
    if not return_lse:
        return out, None
    lse = heads_to_seq(lse_h.detach().transpose(1, 2)[..., None], grid.ulysses, heads_q)  # (B, L, Hq, 1)
    return out, lse[..., 0].transpose(1, 2).reshape(batch, heads_q, q.shape[1])


def ulysses_ring_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    ulysses_group: Group = None,
    ring_group: Group = None,
    mesh=None,
    layout: str,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over one global sequence split over a U x R grid of ranks: Ulysses (an all-to-all head split)
    over `ulysses_group`, the ring over `ring_group`.

    Every rank of the grid calls it with its own S / (U R) tokens of the global sequence of S tokens: rank (u, r)
    (rank u of its Ulysses group, rank r of its ring) holds the u-th of U equal consecutive pieces of ring shard r of
    `layout` ("contiguous" or "zigzag" over the R rings ranks, as ring_attn_func's); ringattn.shard, unshard and
    position_ids with ulysses_group=, and ringattn.grid_shard_indices, map between full tensors and these shards. An
    all-to-all over the Ulysses group gives each rank its ring shard (S / R tokens) of Hq / U query heads and of the
    K/V heads they need (nheads_k / U, or with fewer K/V heads than U the one each needs: it travels to U / nheads_k
    ranks); ring_attn_func runs over the ring group on them; an all-to-all brings the output back. With a Ulysses
    degree of 1 the call is ring_attn_func (its checks, errors and bits); with a ring degree of 1 it is pure Ulysses
    (the fused kernel on the whole sequence of the rank's heads).

    Args:
        q: (batch, S_local, nheads, headdim), this rank's shard; nheads divisible by U.
        k, v: (batch, S_local, nheads_k, headdim); nheads % nheads_k == 0, and nheads_k and U divide one another.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs: as in
            ring_attn_func (causal and the window over global positions).
        ulysses_group: the Ulysses group (a ProcessGroup or a 1-D DeviceMesh, mesh["ulysses"]); None: degree 1.
        ring_group: the ring (a ProcessGroup or a 1-D DeviceMesh, mesh["ring"]); None: the world when ulysses_group
            is None too, else degree 1 (pure Ulysses).
        mesh: instead of the groups, a DeviceMesh with dimensions named "ulysses" and "ring" (others, such as "dp",
            may be there too).
        layout: the ring's layout, "contiguous" or "zigzag" (U x S_local must then be even): the one the shards are
            in (ringattn.shard with ulysses_group=); required, as ring_attn_func's.
        return_lse: also return this shard's lse; the same on every rank of the grid (the lse comes back through an
            all-to-all, which a call without it skips).
        learnable_sink: (nheads,) attention sinks, as in ring_attn_func; each rank's gradient is its rows' share for
            its Ulysses heads: sum it over the whole grid.
    Returns:
        out (batch, S_local, nheads, headdim) in q's dtype; with return_lse also lse (batch, nheads, S_local) fp32.
    Raises:
        ValueError: U not dividing nheads, U and nheads_k not dividing one another (naming ulysses_group); groups
            that share a rank other than this one or do not tile their ranks as a U x R grid (naming ulysses_group
            and ring_group); a mesh without dimensions "ulysses" and "ring"; otherwise as ring_attn_func. Raised on
            every rank of the grid alike: the call is agreed over the Ulysses group, then the ring group, before any
            data moves (parallel/grid.py).
        TypeError, RuntimeError: as ring_attn_func.
    """
    grid = grid_groups(ulysses_group, ring_group, mesh)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs)  # fmt: skip
    if grid.ulysses is None:  # degree 1: the ring alone
        ring = grid.ring if grid.ring is not None else _own_group(ring_group, mesh, ulysses_group)
        return ring_attn_func(q, k, v, **options, group=ring, layout=layout, return_lse=return_lse,
                              learnable_sink=learnable_sink)  # fmt: skip
    out, lse = _ulysses_ring("ulysses_ring_attn_func", grid, q, k, v, None, options, layout, learnable_sink,
                             return_lse)  # fmt: skip
    return (out, lse) if return_lse else out


def ulysses_ring_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    ulysses_group: Group = None,
    ring_group: Group = None,
    mesh=None,
    layout: str,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over one packed sequence of documents split over a U x R grid (ulysses_ring_attn_func's
    layout); attention stays inside each document, as in ring_attn_varlen_func. Documents may cross the pieces of a
    ring shard (Ulysses boundaries) and ring shards (ring boundaries) alike.

    Args:
        q: (S_local, nheads, headdim), this rank's shard (2-D layout) of the packed queries; or (B, S_local,
            nheads, headdim), its shard of each of B packed rows, each holding its own documents.
        k, v: (S_local, nheads_k, headdim), or (B, S_local, nheads_k, headdim).
        cu_seqlens: (n_docs + 1,) int32 or int64 global document boundaries, any device: 0, ..., B x S with
            S = S_local x U x R (B = 1 for 3-D inputs), every row start b x S among them, nondecreasing (a
            repeated boundary is an empty document); the same on every rank.
        causal: causal inside each document (default True).
        the rest: as ulysses_ring_attn_func's.
    Returns:
        out shaped like q in q's dtype, and lse (nheads, S_local), or (B, nheads, S_local) for 4-D inputs, fp32
        with return_lse.
    Raises:
        ValueError, TypeError, RuntimeError: as ulysses_ring_attn_func, and for q, k, v that are not all 3-D or all
            4-D or a bad cu_seqlens (not ending at B * S, a row start that is not a boundary); on every rank of the
            grid alike.
    """
    grid = grid_groups(ulysses_group, ring_group, mesh)
    options = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                   softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
                   return_attn_probs=return_attn_probs)  # fmt: skip
    if grid.ulysses is None:  # degree 1: the ring alone
        ring = grid.ring if grid.ring is not None else _own_group(ring_group, mesh, ulysses_group)
        return ring_attn_varlen_func(q, k, v, cu_seqlens, **options, group=ring, layout=layout,
                                     return_lse=return_lse, learnable_sink=learnable_sink)  # fmt: skip
    call = "ulysses_ring_attn_varlen_func"
    out, lse = _ulysses_ring(call, grid, q, k, v, cu_seqlens, options, layout, learnable_sink, return_lse)
    if q.dim() == 3:  # one packed sequence
        out, lse = out[0], None if lse is None else lse[0]
    return (out, lse) if return_lse else out


def _own_group(ring_group: Group, mesh, ulysses_group: Group) -> Group:
    """The ring of a grid whose both degrees are 1: the mesh's, the ring group as given (of one rank), the Ulysses
    group as given (of one rank, when no ring is: a grid of this rank alone), or, neither given, the world's."""
    if mesh is not None:
        return mesh.get_group("ring")
    if ring_group is not None:
        return ring_group
    return or_world(ulysses_group)
