"""The process group a ring runs on, from what a caller may pass as `group`: None (the default group, the world),
a torch.distributed ProcessGroup, or a DeviceMesh of one dimension, such as the named dimension of a larger mesh
(`mesh["cp"]` of a (dp, cp) mesh), whose ranks then form the ring in the mesh's order."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

Group = dist.ProcessGroup | DeviceMesh | None  # what a `group` argument takes


def or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """group, or the world's ProcessGroup for None (the default group)."""
    return group if group is not None else dist.group.WORLD


def ring_group(group: Group, name: str = "group") -> dist.ProcessGroup | None:
    """The ProcessGroup (None: the default group) that `group` stands for.

    Raises:
        ValueError: a DeviceMesh of more than one dimension (the message names its dimensions: pass one of them);
            the placeholder dist.new_group returns on the ranks outside the new group; a group that
            dist.destroy_process_group took down (check_live).
        TypeError: anything but None, a ProcessGroup or a DeviceMesh.
    """
    if group is None:
        return group
    if isinstance(group, dist.ProcessGroup):
        return check_live(group, name)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{name} does not hold this process (rank {dist.get_rank()}): dist.new_group returns a placeholder on the "
            "ranks outside the new group; call ring attention on the group's own ranks only"
        )
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            dims = ", ".join(repr(d) for d in group.mesh_dim_names or ()) or "unnamed"
            raise ValueError(
                f"{name} must be a 1-D DeviceMesh, got one of {group.ndim} dimensions ({dims}): pass the ring's "
                "dimension, mesh[name]"
            )
        return check_live(group.get_group(), name)
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
    )


def check_live(group: dist.ProcessGroup, name: str = "group") -> dist.ProcessGroup:
    """group, where torch.distributed still knows it by its name: the ring's ops take a group by name, and after
    destroy_process_group and a new init the name of a group made before may stand for another group.

    Raises:
        ValueError: a group that is no longer registered under its name (destroyed).
    """
    if torch.compiler.is_compiling() or not dist.is_initialized():  # the callers say what an uninitialised one lacks
        return group
    try:
        live = _resolve_process_group(group.group_name) is group
    except (RuntimeError, ValueError):  # no group of that name
        live = False
    if not live:
        raise ValueError(
            f"{name} is a process group that dist.destroy_process_group took down: make the group again after "
            "dist.init_process_group (and the modules that hold it)"
        )
    return group


def copy_sharing_groups(obj, memo: dict, groups) -> object:
    """A deep copy of obj (its __deepcopy__) sharing `groups`, process groups that cannot be copied: the copy an
    EMA or a reference model takes."""
    for g in groups:
        if g is not None:
            memo[id(g)] = g
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    new.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    return new
