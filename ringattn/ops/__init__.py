"""Attention ops: Triton launchers, their pure-PyTorch references and the fp32 state merge.

An `AttnOps` bundles the block operations the ring needs, so the ring loop never
knows whether it runs the compiled kernel, the interpreted kernel or the reference.
"""

from collections.abc import Callable
from typing import NamedTuple

from .attn import attn_bwd, attn_bwd_preprocess, attn_fwd, attn_fwd_merge_, fwd_tma_enabled
from .attn_ref import attn_bwd_preprocess_ref, attn_bwd_ref, attn_fwd_merge_ref_, attn_fwd_ref
from .final_rows import FinalRows
from .gluon_fwd import gluon_mode
from .merge import merge_attn_states_
from .streams import bwd_streams_enabled
from .warp_spec import ws_mode


class AttnOps(NamedTuple):
    """Block operations with the signatures of attn_fwd, attn_bwd, attn_bwd_preprocess and attn_fwd_merge_
    (the ring's forward step: the forward merged into a running state in place)."""

    fwd: Callable
    bwd: Callable
    bwd_preprocess: Callable
    fwd_merge_: Callable


KERNEL_OPS = AttnOps(attn_fwd, attn_bwd, attn_bwd_preprocess, attn_fwd_merge_)
REFERENCE_OPS = AttnOps(attn_fwd_ref, attn_bwd_ref, attn_bwd_preprocess_ref, attn_fwd_merge_ref_)

__all__ = [
    "AttnOps",
    "FinalRows",
    "KERNEL_OPS",
    "REFERENCE_OPS",
    "attn_bwd",
    "attn_bwd_preprocess",
    "attn_bwd_preprocess_ref",
    "attn_bwd_ref",
    "attn_fwd",
    "attn_fwd_merge_",
    "attn_fwd_merge_ref_",
    "attn_fwd_ref",
    "bwd_streams_enabled",
    "ws_mode",
    "fwd_tma_enabled",
    "gluon_mode",
    "merge_attn_states_",
]
