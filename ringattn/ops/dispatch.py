"""Which backend, kernel and launch config run an attention call: the one place that decides.

Two backends, by architecture: "portable" (ops/portable.py: Triton, any CUDA GPU and the interpreter) and "sm90"
(ops/sm90.py: Hopper, compute capability 9.x), each with a table of what it takes. A call asks for a backend by
argument (`backend=`: None or "auto", "portable", "sm90"); "auto" is the Hopper backend on a Hopper GPU whose
Triton build has what its kernels use, else the portable one. The Hopper backend hands every call outside its table
to the portable one. What the Triton build has is found once, by feature test, never by its version number, so a
newer Triton keeps the fast path. The one override, `$RINGATTN_KERNELS` (read once): "auto" (the default) or
"portable", every "auto" call on the portable kernels, for debugging and bisecting.

The planners (fwd_launch, bwd_launches) build the launches without running them; with `target` they build them
for a GPU from CPU tensors (launch/tools/kernel_resources.py compiles them so). override_configs swaps a kernel's
launch config (launch/tools/config_sweep.py times candidates so).
"""

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from . import portable, sm90
from .calls import BwdCall, FwdCall, Target
from .launch import KernelLaunch, LaunchConfig

BACKENDS = ("portable", "sm90")
KERNELS = ("portable.fwd", "portable.dkdv", "portable.dq", "sm90.fwd", "sm90.bwd", "sm90.dkdv", "sm90.dq")
OVERRIDE_VARIABLE = "RINGATTN_KERNELS"
OVERRIDES = ("auto", "portable")
# A backward of at most this many score entries (B * Hq * Sq * Sk, halved when causal) runs its dK/dV and dQ
# kernels on two CUDA streams at once: the ring's 8k blocks ran 1.6 to 2.9% faster so on the H200, longer ones as
# fast or up to 3.6% slower (docs/performance.md)
SHORT_BWD_SCORES = 2**32


@dataclass(frozen=True)
class Capabilities:
    """What the installed Triton build offers the Hopper backend.

    gluon_hopper: Gluon with the Hopper ops its kernels use (warpgroup MMA, TMA loads, stores and reduce-adds
        through descriptors made on the host, mbarriers) and warp_specialize over a list of partitions.
    split_kernels: triton's own warp specialisation (tl.range(warp_specialize=...)) and in-kernel tensor
        descriptors (tl.make_tensor_descriptor), which the split backward kernels use.
    """

    gluon_hopper: bool
    split_kernels: bool


def detect_capabilities() -> Capabilities:
    """Test the installed Triton for the features the Hopper kernels use (capabilities() caches the answer)."""
    import triton.language as tl

    split = hasattr(tl, "make_tensor_descriptor") and "warp_specialize" in inspect.signature(tl.range).parameters
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 - the host descriptors
    except ImportError:
        return Capabilities(gluon_hopper=False, split_kernels=split)
    ops = ("warpgroup_mma", "warpgroup_mma_wait", "fence_async_shared", "mbarrier", "tma")
    has_ops = all(hasattr(hopper, name) for name in ops) and all(
        hasattr(hopper.tma, name) for name in ("async_load", "async_store", "async_atomic_add", "store_wait")
    )
    partitions = getattr(gl, "warp_specialize", None)
    first_parameter = next(iter(inspect.signature(partitions).parameters), "") if partitions else ""
    by_list = first_parameter == "functions_and_args"  # warp_specialize([(partition, args), ...], ...)
    return Capabilities(gluon_hopper=has_ops and by_list, split_kernels=split)


@functools.cache
def capabilities() -> Capabilities:
    """detect_capabilities(), once per process."""
    return detect_capabilities()


@functools.cache
def kernel_override() -> str:
    """$RINGATTN_KERNELS, read once: "auto" (unset) or "portable".

    Raises:
        ValueError: another value.
    """
    value = os.environ.get(OVERRIDE_VARIABLE, "auto")
    if value not in OVERRIDES:
        raise ValueError(f"${OVERRIDE_VARIABLE} must be one of {', '.join(OVERRIDES)} (or unset), got {value!r}")
    return value


def hopper_available(target: Target) -> bool:
    """Whether the Hopper backend can run on `target`: a GPU of compute capability 9.x with the Gluon and split
    kernels' features, or the interpreter with the split kernels' (it runs those, not Gluon)."""
    caps = capabilities()
    if not target.gpu:
        return caps.split_kernels
    return target.capability[0] == 9 and caps.gluon_hopper and caps.split_kernels


def resolve_backend(backend: str | None, target: Target) -> str:
    """The backend a call asking for `backend` runs on (before the Hopper backend's per-call fallback).

    Raises:
        ValueError: an unknown backend; "sm90" where hopper_available is False; a bad $RINGATTN_KERNELS.
    """
    if backend in (None, "auto"):
        if kernel_override() == "portable" or not target.gpu:
            return "portable"
        return "sm90" if hopper_available(target) else "portable"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'auto', 'portable' or 'sm90', got {backend!r}")
    if backend == "sm90" and not hopper_available(target):
        where = f"compute capability {target.capability}" if target.gpu else "the interpreter"
        raise ValueError(f"backend 'sm90' needs a Hopper GPU and a Triton with its kernels' features; not on {where}")
    return backend


_overrides: dict[str, LaunchConfig] = {}


@contextlib.contextmanager
def override_configs(configs: dict[str, LaunchConfig]) -> Iterator[None]:
    """Within the block, launches of each kernel named in `configs` (KERNELS) use its config, at any head dim the
    kernel is taken at, any dtype and on any target: for timing candidate configs, and for testing tile shapes the
    interpreter would not use.

    Raises:
        ValueError: a name not in KERNELS.
    """
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"configs names unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def launch_config(
    kernel: str, head_dim: int, dtype: torch.dtype, target: Target, softcapped: bool = False
) -> LaunchConfig | None:
    """The config the launch of `kernel` (a name of KERNELS) at `head_dim` and `dtype` on `target`, soft-capped or
    not, uses: an override_configs one, else its backend's table's; None where the Hopper table does not take it.

    Raises:
        ValueError: a name not in KERNELS.
    """
    backend, op = kernel.split(".")
    if backend == "sm90" and op not in sm90.TABLE or backend == "portable" and op not in portable.CONFIGS_16BIT:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel in _overrides:
        taken = backend == "portable" or head_dim in sm90.TABLE[op]
        return _overrides[kernel] if taken else None
    if backend == "portable":
        return portable.launch_config(op, head_dim, dtype, target)
    return sm90.launch_config(op, head_dim, target, softcapped)


def fwd_launch(call: FwdCall, backend: str | None = None, target: Target | None = None) -> KernelLaunch:
    """The forward launch of `call` on `backend` (resolve_backend), for `target` (default: the tensors' device)."""
    target = target or Target.of(call.q)
    head_dim, dtype = call.q.shape[-1], call.q.dtype
    if resolve_backend(backend, target) == "sm90" and sm90.fwd_supported(call, target):
        return sm90.fwd_launch(call, launch_config("sm90.fwd", head_dim, dtype, target))
    return portable.fwd_launch(call, launch_config("portable.fwd", head_dim, dtype, target), target)


def bwd_launches(call: BwdCall, backend: str | None = None, target: Target | None = None) -> tuple[KernelLaunch, ...]:
    """The backward's launches of `call` on `backend`, for `target`, as fwd_launch, to run in order: the Hopper
    backward (one launch per group of kv heads: ops/sm90.py's bwd_launches), or the (dK/dV, dQ) pair."""
    target = target or Target.of(call.q)
    head_dim, dtype = call.q.shape[-1], call.q.dtype
    hopper = resolve_backend(backend, target) == "sm90"
    if hopper and sm90.bwd_supported(call, target):
        return sm90.bwd_launches(call, launch_config("sm90.bwd", head_dim, dtype, target, bool(call.softcap)))
    split_dkdv = hopper and sm90.dkdv_supported(call, target)
    split_dq = hopper and sm90.dq_supported(call, target)
    positions = sm90.mask_positions(call) if split_dkdv or split_dq else None
    if split_dkdv:
        dkdv = sm90.dkdv_launch(call, launch_config("sm90.dkdv", head_dim, dtype, target), positions)
    else:
        dkdv = portable.dkdv_launch(call, launch_config("portable.dkdv", head_dim, dtype, target), target)
    if split_dq:
        dq = sm90.dq_launch(call, launch_config("sm90.dq", head_dim, dtype, target), positions)
    else:
        dq = portable.dq_launch(call, launch_config("portable.dq", head_dim, dtype, target), target)
    return dkdv, dq


def preprocess_launch(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor) -> KernelLaunch:
    """The backward's preprocess, the row stats (ops/attn.py's attn_bwd_preprocess), on every backend
    (ops/portable.py)."""
    return portable.preprocess_launch(out, dout, lse, stats)


def short_backward(call: BwdCall) -> bool:
    """Whether the backward of `call` has at most SHORT_BWD_SCORES score entries (B * Hq * Sq * Sk, halved when
    causal)."""
    batch, seqlen_q, heads_q, _ = call.q.shape
    scores = batch * heads_q * seqlen_q * call.k.shape[1]
    return (scores // 2 if call.causal else scores) <= SHORT_BWD_SCORES


def bwd_on_two_streams(call: BwdCall, launches: tuple[KernelLaunch, ...]) -> bool:
    """Whether the backward `launches` of `call` run on two CUDA streams at once: a (dK/dV, dQ) pair of a short
    backward on a GPU."""
    pair = len(launches) == 2 and launches[0].name.endswith(".dkdv")
    return pair and call.q.is_cuda and short_backward(call)
