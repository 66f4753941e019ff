"""`RingAttention`: ring_attn_func as a module, for models that hold their attention as a layer."""

import torch
import torch.distributed as dist
from torch import nn

from ..functional import ring_attn_func
from ..ops.validation import check_flash_attn_options, check_softmax_scale
from ..parallel.groups import Group, ring_group
from ..parallel.layout import check_layout


class RingAttention(nn.Module):
    """Exact attention over one sequence split across the ranks of `group` (ringattn.ring_attn_func).

    No parameters: q, k, v come from the model's own projections. Every rank of the group calls
    forward with its shard, in the same `layout` its tokens were sharded with
    (ringattn.SequenceParallel or ringattn.shard); a layout mismatch gives wrong results silently.

    Args:
        causal: causal over global positions.
        softmax_scale: defaults to 1 / sqrt(headdim).
        layout: "contiguous" (default, as ring_attn_func) or "zigzag".
        group: the process group forming the ring (default: the world), or a 1-D DeviceMesh (a (dp, cp) mesh's
            mesh["cp"]).
        window_size, softcap: a sliding window and logit soft-capping, as ring_attn_func's.
    Raises (here, not at the first forward):
        ValueError: unknown layout; a softmax_scale, window_size or softcap out of range (as ring_attn_func); a
            DeviceMesh of more than one dimension.
        TypeError: a causal that is not a bool; a softmax_scale, window_size or softcap of the wrong type; a group
            that is not a ProcessGroup, a DeviceMesh or None.
    """

    def __init__(
        self,
        causal: bool = False,
        softmax_scale: float | None = None,
        layout: str = "contiguous",
        group: Group = None,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
    ):
        super().__init__()
        group = ring_group(group)
        check_layout(layout)
        check_softmax_scale(softmax_scale)
        causal = check_flash_attn_options(0.0, causal, window_size, softcap, None, False, False)[0]
        self.causal, self.softmax_scale, self.layout, self.group = causal, softmax_scale, layout, group
        self.window_size, self.softcap = tuple(window_size), softcap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool = False):
        """q (batch, S_local, nheads, headdim); k, v (batch, S_local, nheads_k, headdim), nheads % nheads_k == 0.

        Returns out (batch, S_local, nheads, headdim) in q's dtype; with return_lse also
        lse (batch, nheads, S_local) fp32, natural log. Raises as ring_attn_func.
        """
        return ring_attn_func(
            q, k, v, softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
            softcap=self.softcap, group=self.group, layout=self.layout, return_lse=return_lse,
        )  # fmt: skip

    def extra_repr(self) -> str:
        if self.group is None:
            group = "world"
        elif dist.is_available() and dist.is_initialized():
            group = f"{dist.get_world_size(self.group)} ranks"
        else:
            group = "given"
        extra = f", window_size={self.window_size}" if self.window_size != (-1, -1) else ""
        extra += f", softcap={self.softcap}" if self.softcap else ""
        return f"causal={self.causal}, softmax_scale={self.softmax_scale}, layout={self.layout!r}, group={group}{extra}"
