"""The 2-D grid of Ulysses x ring context parallelism: its groups, and the agreement of a call across both of them
(docs/design.md, "Ulysses x ring").

U x R ranks form a grid: rank (u, r) is rank u of its Ulysses group, whose U ranks hold the pieces of one ring
shard, and rank r of its ring group, whose R ranks hold the same heads after the Ulysses exchange. A 2-D DeviceMesh
with dimensions named "ulysses" and "ring" is such a grid; so are two ProcessGroups, when every rank's pair tiles
the ranks they span (checked at a grid's first call: `agree_across_grid`).

A call's agreement runs in two exchanges: over the Ulysses group, then over the ring group, carrying the first
exchange's error as a refusal. In a grid every ring holds one rank of every Ulysses group, so an error found on any
rank is raised by every rank of the grid: the same type and message.
"""

import contextlib
import typing
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .agreement import (
    REFUSALS,
    CrossEntropySignature,
    RingSignature,
    ShardBatchSignature,
    ShardSignature,
    SyncGradientsSignature,
    UnshardSignature,
    check_agreement,
    gather_on_cpu,
)
from .agreement import shared_refusals as _shared_refusals
from .comm import CommunicationError
from .groups import Group, check_live, or_world, ring_group

MESH_DIMS = ("ulysses", "ring")  # the dimension names a 2-D DeviceMesh must have


@dataclass(frozen=True)
class Grid:
    """A rank's two groups; None stands for a group of this rank alone (degree 1)."""

    ulysses: dist.ProcessGroup | None
    ring: dist.ProcessGroup | None

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups of more than this rank, Ulysses first: those a reduction over the grid runs on."""
        return [g for g in (self.ulysses, self.ring) if g is not None]

    @property
    def ulysses_rank(self) -> int:
        return 0 if self.ulysses is None else dist.get_rank(self.ulysses)

    @property
    def ulysses_size(self) -> int:
        return 1 if self.ulysses is None else dist.get_world_size(self.ulysses)

    @property
    def ring_rank(self) -> int:
        return 0 if self.ring is None else dist.get_rank(self.ring)

    @property
    def ring_size(self) -> int:
        return 1 if self.ring is None else dist.get_world_size(self.ring)

    @property
    def size(self) -> int:
        """The grid's number of ranks, U x R."""
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        """This rank's index in the grid, ring rank x U + Ulysses rank: the order of the ranks' tokens in the
        "contiguous" layout."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def _alone_if_single(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    return None if group is None or dist.get_world_size(group) == 1 else group


def grid_groups(
    ulysses_group: Group = None,
    ring_group_: Group = None,
    mesh: DeviceMesh | None = None,
    ring_name: str = "ring_group",
) -> Grid:
    """The Grid a call's `ulysses_group`, `ring_group` and `mesh` arguments stand for; `ring_name` is what the caller
    calls its ring argument (ring_group, or group), for the errors.

    - mesh: a DeviceMesh with dimensions named "ulysses" and "ring" (and possibly others, e.g. "dp"); the groups
      must then be None.
    - otherwise each group is a ProcessGroup or a 1-D DeviceMesh (mesh["ulysses"]); ulysses_group None is degree 1
      (no Ulysses exchange); ring_group None is the world when ulysses_group is None too (ring_attn_func's default),
      and degree 1 otherwise (pure Ulysses).

    Raises:
        ValueError: a mesh without those dimension names, a mesh together with groups, a mesh of several dimensions
            as a group; torch.distributed not initialised.
        TypeError: a mesh or group of another type.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("Ulysses x ring attention needs torch.distributed initialised (dist.init_process_group)")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if ulysses_group is not None or ring_group_ is not None:
            raise ValueError("pass either mesh or process groups (ulysses_group, and ring_group or group), not both")
        names = tuple(mesh.mesh_dim_names or ())
        if not all(name in names for name in MESH_DIMS):
            raise ValueError(
                f"mesh must have dimensions named 'ulysses' and 'ring', got {names or 'unnamed dimensions'}: "
                "init_device_mesh(device, (R, U), mesh_dim_names=('ring', 'ulysses'))"
            )
        ulysses, ring = (check_live(mesh.get_group(dim), f"mesh[{dim!r}]") for dim in ("ulysses", "ring"))
        return Grid(_alone_if_single(ulysses), _alone_if_single(ring))
    ulysses = ring_group(ulysses_group, name="ulysses_group")
    ring = ring_group(ring_group_, name=ring_name)
    if ulysses_group is None:
        return Grid(None, _alone_if_single(or_world(ring)))
    return Grid(_alone_if_single(ulysses), _alone_if_single(ring))


def grid_arguments(
    ulysses_group: Group = None, ring_group_: Group = None, mesh: DeviceMesh | None = None
) -> tuple[Grid, dist.ProcessGroup, dist.ProcessGroup | None]:
    """For the modules and helpers that hold a grid (ringattn.nn.RingAttention, SequenceParallel, the Hugging Face
    integration): the Grid (grid_groups) and the ProcessGroups to pass on as `ulysses_group` and `ring_group` (or
    `group`) to the 2-D functions (ulysses_ring_attn_func, shard, unshard, position_ids), standing for the same grid:
    a mesh's dimensions "ulysses" and "ring", or the groups given (ring None: degree 1).

    Raises:
        ValueError: neither ulysses_group nor mesh given; otherwise as grid_groups.
        TypeError, RuntimeError: as grid_groups.
    """
    if ulysses_group is None and mesh is None:
        raise ValueError("a Ulysses x ring grid needs ulysses_group or a mesh with dimensions 'ulysses' and 'ring'")
    grid = grid_groups(ulysses_group, ring_group_, mesh, ring_name="group")
    if mesh is not None:
        return grid, mesh.get_group("ulysses"), mesh.get_group("ring")
    return grid, ring_group(ulysses_group, name="ulysses_group"), ring_group(ring_group_, name="group")


def grid_all_gather(tensor: torch.Tensor, grid: Grid) -> torch.Tensor:
    """(U R, *tensor.shape): every grid rank's `tensor` (of one shape on every rank), in the order of Grid.rank,
    the same on every rank. A collective on both groups: an all_gather over the Ulysses group, then one of its
    results over the ring."""
    gathered = tensor.contiguous()[None]  # (1, ...)
    for group in (grid.ulysses, grid.ring):  # (U, ...), then (R, U, ...)
        if group is not None:
            parts = [torch.empty_like(gathered) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, gathered, group=group)
            gathered = torch.stack(parts)
        else:
            gathered = gathered[None]
    return gathered.reshape(-1, *tensor.shape)


def check_grid_ranks(grid: Grid) -> None:
    """Raise ValueError, naming the argument, when this rank is outside one of its groups or the two groups share
    another rank (they are then not two dimensions of one grid). Local; no communication."""
    me = dist.get_rank()
    members = {}
    for name, group in (("ulysses_group", grid.ulysses), ("ring_group", grid.ring)):
        if group is None:
            members[name] = {me}
            continue
        if dist.get_rank(group) < 0:
            raise ValueError(f"{name} must contain this process (global rank {me}); it does not")
        members[name] = set(dist.get_process_group_ranks(group))
    shared = members["ulysses_group"] & members["ring_group"]
    if shared != {me}:
        raise ValueError(
            f"ulysses_group and ring_group must share only this rank ({me}), got global ranks {sorted(shared)} in "
            "both: they must be the two dimensions of one grid (a 2-D DeviceMesh's 'ulysses' and 'ring')"
        )


_GRID_FIELDS = (("grid_rank", int), ("ulysses_size", int), ("ring_size", int), ("dimension", str))
_GRID_LABELS = {
    "grid_rank": "rank in the other group (ring rank among a Ulysses group's ranks, Ulysses rank among a ring's)",
    "ulysses_size": "Ulysses degree (ulysses_group's size)",
    "ring_size": "ring degree (ring_group's size)",
    "dimension": "the group's dimension (passed as ulysses_group or as ring_group)",
}
_GRID_EXPECTED = (
    " The ranks of a Ulysses group must hold the same ring rank, those of a ring the same Ulysses rank, and the "
    "groups' sizes must be the same on every rank (ulysses_group and ring_group tiling the ranks as a U x R grid), "
    "each group passed as the same dimension on every rank. A DeviceMesh whose rank tensor does not increase along "
    "each dimension (such as [[0, 1], [3, 2]]) tiles no such grid: each of its groups numbers its ranks in "
    "increasing global rank."
)


def _extended(base: type, name: str, fields: tuple, labels: dict, expected: str) -> type:
    """A signature class of `base`'s fields followed by `fields` ((name, type) pairs), with their labels and the
    sentence `expected` added to base's."""
    hints = typing.get_type_hints(base)
    cls = NamedTuple(name, [(f, hints[f]) for f in base._fields] + list(fields))
    cls.labels = {**base.labels, **labels}
    cls.expected = base.expected + expected
    return cls


def _grid_signature(base: type, name: str) -> type:
    """A signature class of `base`'s fields and the grid's (which must agree over a group: rank in the other group,
    both degrees)."""
    return _extended(base, name, _GRID_FIELDS, _GRID_LABELS, _GRID_EXPECTED)


class _NoFields(NamedTuple):
    """The base of a call that agrees on the grid's fields alone (GridSignature)."""

    labels = {}
    expected = ""


# a 2-D attention call: the ring's fields, whether the lse comes back (an all-to-all over the Ulysses group, which
# every rank of it must join or skip alike), the grid's
UlyssesRingSignature = _grid_signature(
    _extended(RingSignature, "UlyssesSignature", (("return_lse", bool),), {"return_lse": "return_lse"},
              " They must pass the same return_lse: the lse comes back through an all-to-all."),
    "UlyssesRingSignature",
)  # fmt: skip
GridSignature = _grid_signature(_NoFields, "GridSignature")  # a call whose checks return () (agree_across_grid)
GridShardBatchSignature = _grid_signature(ShardBatchSignature, "GridShardBatchSignature")
GridCrossEntropySignature = _grid_signature(CrossEntropySignature, "GridCrossEntropySignature")
GridSyncGradientsSignature = _grid_signature(SyncGradientsSignature, "GridSyncGradientsSignature")
GridShardSignature = _grid_signature(ShardSignature, "GridShardSignature")
GridUnshardSignature = _grid_signature(UnshardSignature, "GridUnshardSignature")


class _NoExchange:
    """Stands for the exchange of a group of this rank alone: nothing to exchange, errors raised as they are."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _refusals(call: str, group: dist.ProcessGroup | None):
    return _NoExchange() if group is None else _shared_refusals(call, group)


@contextlib.contextmanager
def shared_grid_refusals(call: str, grid: Grid):
    """agreement.shared_refusals across a grid: an error of REFUSALS that the local checks in the block raise takes
    part, on the Ulysses group and then on the ring, in the exchanges of the other ranks' next agree_across_grid, so
    that every rank of the grid raises it; without an error, no communication.

    Usage: ``with shared_grid_refusals(call, grid): <local checks>``, where every other rank's next collective on the
    grid is an agree_across_grid (of any call: a refusal goes before the calls' names).
    """
    try:
        yield
    except REFUSALS as refusal:
        # a trace runs no collective: raised on this rank (shared_refusals); nor does any follow a failed exchange
        if torch.compiler.is_compiling() or isinstance(refusal, CommunicationError):
            raise
        carried: Exception = refusal
        for group in (grid.ulysses, grid.ring):
            try:
                with _refusals(call, group):
                    raise carried
            except REFUSALS as err:
                carried = err
        # every rank of the grid now raises (agree_across_grid's ranks without its topology check's exchanges)
        raise carried from refusal


# the name of the exchanges that share a grid's topology problem at its first call, after the call's own
GRID_CHECK = "grid check"


def _agree(call: str, fields: tuple | None, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        check_agreement(call, fields, group)


def _gather_ranks(ranks: list[int], group: dist.ProcessGroup | None, call: str) -> list[list[int]]:
    """Every group rank's `ranks` (all of one length, agreed before), in group-rank order."""
    if group is None:
        return [ranks]
    what = f"{call}'s grid check (all_gather) on group rank {dist.get_rank(group)} of {dist.get_world_size(group)}"
    return gather_on_cpu(torch.tensor(ranks, dtype=torch.int64), group, what).tolist()


def _members(group: dist.ProcessGroup | None) -> list[int]:
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def _grid_problem(rows: list[list[int]], columns: list[list[int]]) -> str | None:
    """None when the ring of every Ulysses rank u (rows[u], global ranks in ring order) and the Ulysses group of
    every ring rank r (columns[r], in Ulysses order) place the same rank at (u, r); else what differs."""
    for u, row in enumerate(rows):
        for r, rank in enumerate(row):
            if columns[r][u] != rank:
                return (
                    f"ulysses_group and ring_group do not tile their ranks as a grid: the ring of Ulysses rank {u} "
                    f"holds global rank {rank} at ring rank {r}, but the Ulysses group of ring rank {r} holds global "
                    f"rank {columns[r][u]} at Ulysses rank {u}; pass the two dimensions of one grid (a DeviceMesh's "
                    "'ulysses' and 'ring')"
                )
    return None


# per grid: the ring group (the Ulysses group where there is no ring, the world where neither) -> the Ulysses groups
# (the key itself where there is none) whose grid with it was checked; weakly held, an entry goes with its groups
_checked: "weakref.WeakKeyDictionary[dist.ProcessGroup, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _checked_key(grid: Grid) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(_checked's key, the member of its set) of a grid."""
    key = next((g for g in (grid.ring, grid.ulysses) if g is not None), dist.group.WORLD)
    return key, key if grid.ulysses is None else grid.ulysses


def agree_across_grid(call: str, grid: Grid, checks, signature: type) -> tuple:
    """Run a collective call's local `checks` (a callable returning its base signature fields) and its agreement
    across the grid; return the fields (the signature class `signature`, with this rank's grid fields).

    First over the Ulysses group (its ranks must hold the same ring rank), then over the ring group (the same
    Ulysses rank), carrying the first exchange's error as this rank's refusal: in a grid every ring holds a rank of
    every Ulysses group, so every rank raises the same error. At a grid's first call the two exchanges also gather
    the groups' members, and each rank checks that they tile their ranks as a grid (_grid_problem); where neither
    exchange raised, two more (Ulysses, ring) carry a problem found, so that every rank raises it.

    Raises:
        ValueError, TypeError, RuntimeError: a rank's checks refused, the ranks disagree, or the groups do not
            form a grid; on every rank of the grid alike (where the groups form a grid).
    """
    key, member = _checked_key(grid)
    checked = _checked.setdefault(key, weakref.WeakSet())
    first = member not in checked
    carried: Exception | None = None
    fields, rows, problem = None, None, None
    try:
        with _refusals(call, grid.ulysses):
            check_grid_ranks(grid)
            fields = signature(*checks(), grid.ring_rank, grid.ulysses_size, grid.ring_size, "ulysses")
        _agree(call, fields, grid.ulysses)
        if first:
            rows = _gather_ranks(_members(grid.ring), grid.ulysses, call)
    except REFUSALS as err:
        carried = err
    try:
        with _refusals(call, grid.ring):
            if carried is not None:
                raise carried
        _agree(call, fields._replace(grid_rank=grid.ulysses_rank, dimension="ring"), grid.ring)
        if first:
            text = _grid_problem(rows, _gather_ranks(_members(grid.ulysses), grid.ring, call))
            problem = None if text is None else ValueError(text)
    except REFUSALS as err:
        carried = err
    # a problem seen by some ranks only reaches the others through two more exchanges. None follows an error: in a
    # grid one reaches every rank through the two exchanges above (so all skip these), and a rank of another form of
    # call (a plain call's, which raised) would never join them
    if first and carried is None:
        for group in (grid.ulysses, grid.ring):
            try:
                with _refusals(call, group):
                    if problem is not None:
                        raise problem
                _agree(GRID_CHECK, None, group)
            except REFUSALS as err:
                problem = carried = err
    if carried is not None:
        raise carried
    if first:
        checked.add(member)
    return fields


def agree_on(call: str, place, checks, signature: type, grid_signature: type) -> tuple:
    """A collective call's local `checks` (a callable returning its base signature's fields) and its agreement on
    `place`, a process group (shared_refusals, then check_agreement on `signature`) or a Grid (agree_across_grid on
    `grid_signature`); returns the agreed fields. Raises as agree_across_grid, on every rank of the place alike."""
    if isinstance(place, Grid):
        return agree_across_grid(call, place, checks, grid_signature)
    with _shared_refusals(call, place):
        fields = signature(*checks())
    check_agreement(call, fields, place)
    return fields
