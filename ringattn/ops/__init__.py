"""Attention ops: the launchers, their pure-PyTorch references, the fp32 state merge and the kernel dispatch.

An `AttnOps` bundles the block operations the ring needs, so the ring loop never knows whether it runs the
compiled kernels, the interpreted kernels or the references; kernel_ops(backend) gives the launchers' bundle on a
backend of ops/dispatch.py.
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

from .attn import attn_bwd, attn_bwd_preprocess, attn_fwd, attn_fwd_merge_
from .attn_ref import attn_bwd_preprocess_ref, attn_bwd_ref, attn_fwd_merge_ref_, attn_fwd_ref
from .calls import BwdCall, FwdCall, Target
from .dispatch import (
    BACKENDS,
    KERNELS,
    bwd_launches,
    capabilities,
    fwd_launch,
    kernel_override,
    launch_config,
    override_configs,
)
from .final_rows import FinalRows
from .launch import KernelLaunch, LaunchConfig
from .merge import add_sink_, merge_attn_states_, sink_grad
from .validation import LSE_DTYPE


class AttnOps(NamedTuple):
    """Block operations with the signatures of attn_fwd, attn_bwd, attn_bwd_preprocess and attn_fwd_merge_
    (the ring's forward step: the forward merged into a running state in place)."""

    fwd: Callable
    bwd: Callable
    bwd_preprocess: Callable
    fwd_merge_: Callable


def kernel_ops(backend: str | None = None, deterministic: bool = False) -> AttnOps:
    """The launchers as an AttnOps, every call on `backend` (None or "auto", "portable", "sm90": ops/dispatch.py),
    every backward with `deterministic` (attn_bwd)."""
    if backend is None and not deterministic:
        return KERNEL_OPS
    return AttnOps(
        partial(attn_fwd, backend=backend), partial(attn_bwd, backend=backend, deterministic=deterministic),
        attn_bwd_preprocess, partial(attn_fwd_merge_, backend=backend),
    )  # fmt: skip


def capped_ops(ops: AttnOps, softcap: float) -> AttnOps:
    """ops with every forward and backward soft-capped at `softcap` (ops/calls.py); ops itself for 0."""
    if not softcap:
        return ops
    return AttnOps(
        partial(ops.fwd, softcap=softcap), partial(ops.bwd, softcap=softcap), ops.bwd_preprocess,
        partial(ops.fwd_merge_, softcap=softcap),
    )  # fmt: skip


KERNEL_OPS = AttnOps(attn_fwd, attn_bwd, attn_bwd_preprocess, attn_fwd_merge_)
REFERENCE_OPS = AttnOps(attn_fwd_ref, attn_bwd_ref, attn_bwd_preprocess_ref, attn_fwd_merge_ref_)

__all__ = [
    "BACKENDS",
    "KERNELS",
    "AttnOps",
    "BwdCall",
    "FinalRows",
    "FwdCall",
    "KERNEL_OPS",
    "LSE_DTYPE",
    "KernelLaunch",
    "LaunchConfig",
    "REFERENCE_OPS",
    "Target",
    "add_sink_",
    "attn_bwd",
    "attn_bwd_preprocess",
    "attn_bwd_preprocess_ref",
    "attn_bwd_ref",
    "attn_fwd",
    "attn_fwd_merge_",
    "attn_fwd_merge_ref_",
    "attn_fwd_ref",
    "bwd_launches",
    "capabilities",
    "capped_ops",
    "fwd_launch",
    "kernel_ops",
    "kernel_override",
    "launch_config",
    "merge_attn_states_",
    "override_configs",
    "sink_grad",
]
