"""The process group a ring runs on, from what a caller may pass as `group`: None (the default group, the world),
a torch.distributed ProcessGroup, or a DeviceMesh of one dimension, such as the named dimension of a larger mesh
(`mesh["cp"]` of a (dp, cp) mesh), whose ranks then form the ring in the mesh's order."""

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

Group = dist.ProcessGroup | DeviceMesh | None  # what a `group` argument takes


def ring_group(group: Group, name: str = "group") -> dist.ProcessGroup | None:
    """The ProcessGroup (None: the default group) that `group` stands for.

    Raises:
        ValueError: a DeviceMesh of more than one dimension (the message names its dimensions: pass one of them);
            the placeholder dist.new_group returns on the ranks outside the new group.
        TypeError: anything but None, a ProcessGroup or a DeviceMesh.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
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
        return group.get_group()
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
    )
