"""`RingAttention`: ring_attn_func (or, over a Ulysses x ring grid, ulysses_ring_attn_func) as a module, for models
that hold their attention as a layer."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..functional import ring_attn_func, ring_attn_varlen_func
from ..ops.validation import check_flag, check_flash_attn_options, check_softmax_scale
from ..parallel.grid import grid_arguments
from ..parallel.groups import Group, copy_sharing_groups, ring_group
from ..parallel.layout import check_layout
from ..sequence_parallel import SequenceParallel, sequence_parallel_arguments
from ..ulysses import ulysses_ring_attn_func, ulysses_ring_attn_varlen_func


def in_autocast_dtype(t: torch.Tensor) -> torch.Tensor:
    """t in autocast's dtype where autocast is on for its device, else t: q, k and v as SDPA takes them under
    autocast (where RoPE in fp32 leaves q and k in fp32 beside a 16-bit v)."""
    if not isinstance(t, torch.Tensor) or not torch.amp.is_autocast_available(t.device.type):
        return t  # left to the attention's checks (a meta tensor, or no tensor, refused there by name)
    device = t.device.type
    return t.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else t


class RingAttention(nn.Module):
    """Exact attention over one sequence split across the ranks of `group` (ringattn.ring_attn_func), or across a
    U x R grid of ranks given by `ulysses_group` (with `group` the ring) or a 2-D `mesh`
    (ringattn.ulysses_ring_attn_func).

    No parameters: q, k, v come from the model's own projections. Every rank of the group (of the grid) calls
    forward with its shard, over the groups and in the layout its tokens were sharded with: `sp=` takes both from
    the ringattn.SequenceParallel that sharded them; otherwise `layout` has no default (ringattn.shard's, with the
    same groups), since a mismatch of either would give wrong results silently.

    Args:
        causal: causal over global positions.
        softmax_scale: defaults to 1 / sqrt(headdim).
        sp: the ringattn.SequenceParallel that shards the inputs: its groups (group, or ulysses_group and group) and
            its layout, in place of the four arguments below (keyword-only).
        layout: "contiguous" or "zigzag", required without sp (keyword-only).
        group: the process group forming the ring (default: the world; with ulysses_group, no ring: degree 1), or a
            1-D DeviceMesh (a (dp, cp) mesh's mesh["cp"]).
        window_size, softcap, deterministic: a sliding window, logit soft-capping and gradients with the same bits
            in every run, as ring_attn_func's.
        ulysses_group: the Ulysses group of a 2-D grid (a ProcessGroup or a 1-D DeviceMesh), or None: the ring alone.
        mesh: instead of the groups, a DeviceMesh with dimensions named "ulysses" and "ring" (as
            ulysses_ring_attn_func takes).
    Raises (here, not at the first forward):
        ValueError: sp together with layout, group, ulysses_group or mesh; unknown layout; a softmax_scale,
            window_size or softcap out of range (as ring_attn_func); a DeviceMesh of more than one dimension as a
            group; a mesh without dimensions "ulysses" and "ring", or a mesh together with a group.
        TypeError: neither sp nor layout; an sp that is not a SequenceParallel; a causal or deterministic that is not
            a bool; a softmax_scale, window_size or softcap of the wrong type; a group that is not a ProcessGroup, a
            DeviceMesh or None.
        RuntimeError: ulysses_group or mesh without torch.distributed initialised.
    """

    def __init__(
        self,
        causal: bool = False,
        softmax_scale: float | None = None,
        *,
        sp: SequenceParallel | None = None,
        layout: str | None = None,
        group: Group = None,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        deterministic: bool = False,
        ulysses_group: Group = None,
        mesh: DeviceMesh | None = None,
    ):
        super().__init__()
        if sp is not None:
            layout, group, ulysses_group = sequence_parallel_arguments(
                "RingAttention", sp, layout=layout, group=group, ulysses_group=ulysses_group, mesh=mesh
            )
        elif layout is None:
            raise TypeError(
                "RingAttention needs sp= (the SequenceParallel that shards its inputs) or layout= (the layout they "
                "were sharded in, with the same groups)"
            )
        if ulysses_group is None and mesh is None:
            group, self.ulysses_group = ring_group(group), None
        else:  # groups standing for the grid; checked, and the mesh's dimensions taken, here
            _, self.ulysses_group, group = grid_arguments(ulysses_group, group, mesh)
        check_layout(layout)
        check_softmax_scale(softmax_scale)
        causal = check_flash_attn_options(0.0, causal, window_size, softcap, None, deterministic, False)[0]
        self.causal, self.softmax_scale, self.layout, self.group = causal, softmax_scale, layout, group
        self.window_size, self.softcap = tuple(window_size), softcap
        self.deterministic = check_flag(deterministic, "deterministic")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        return_lse: bool = False,
        learnable_sink: torch.Tensor | None = None,
    ):
        """q (batch, S_local, nheads, headdim); k, v (batch, S_local, nheads_k, headdim), nheads % nheads_k == 0
        (over a grid: U divides nheads, and U and nheads_k divide one another). cu_seqlens: the global document
        boundaries of the flattened batch (SequenceParallel.shard_batch(...).cu_seqlens: packed documents and
        padding), attention staying inside each document (ring_attn_varlen_func), or None. learnable_sink: (nheads,)
        attention sinks, the model's parameter (gpt-oss), as ring_attn_func's: each rank's gradient is its rows'
        share (SequenceParallel.sync_gradients sums it), or None.

        Returns out (batch, S_local, nheads, headdim) in q's dtype; with return_lse also
        lse (batch, nheads, S_local) fp32, natural log. Raises as ring_attn_func and ring_attn_varlen_func
        (ulysses_ring_attn_func, ulysses_ring_attn_varlen_func).
        """
        q, k, v = (in_autocast_dtype(t) for t in (q, k, v))
        options = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                       softcap=self.softcap, deterministic=self.deterministic, layout=self.layout,
                       return_lse=return_lse, learnable_sink=learnable_sink)  # fmt: skip
        if self.ulysses_group is None:
            if cu_seqlens is None:
                return ring_attn_func(q, k, v, group=self.group, **options)
            return ring_attn_varlen_func(q, k, v, cu_seqlens, group=self.group, **options)
        groups = dict(ulysses_group=self.ulysses_group, ring_group=self.group)
        if cu_seqlens is None:
            return ulysses_ring_attn_func(q, k, v, **groups, **options)
        return ulysses_ring_attn_varlen_func(q, k, v, cu_seqlens, **groups, **options)

    def __deepcopy__(self, memo: dict) -> "RingAttention":
        """A copy sharing the process groups (which cannot be copied), as an EMA or reference model's copy needs."""
        return copy_sharing_groups(self, memo, (self.group, self.ulysses_group))

    def extra_repr(self) -> str:
        if self.group is None:
            group = "world" if self.ulysses_group is None else "none"
        elif dist.is_available() and dist.is_initialized():
            group = f"{dist.get_world_size(self.group)} ranks"
        else:
            group = "given"
        extra = f", window_size={self.window_size}" if self.window_size != (-1, -1) else ""
        extra += f", softcap={self.softcap}" if self.softcap else ""
        extra += ", deterministic=True" if self.deterministic else ""
        if self.ulysses_group is not None:
            extra += f", ulysses_group={dist.get_world_size(self.ulysses_group)} ranks"
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, layout={self.layout!r}, group={group}{extra}"
