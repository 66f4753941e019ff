"""When the forward and backward run the warp-specialised kernels (kernels/attn_fwd_ws.py, kernels/attn_bwd_ws.py),
and the scratch memory their in-kernel tensor descriptors need.

Triton's Hopper partitioner splits those kernels into a TMA producer warpgroup and two consumer warpgroups; it has
also turned correct-looking code into wrong results (kernels/attn_bwd_ws.py's docstring says how). So each form of
them (forward, dK/dV or dQ; causal or not; GQA for dK/dV, merging into the ring's state for the forward, adding
into an accumulator for dQ; WS_FORMS names them all) is taken on a GPU only once it has been checked there, and
only where it was timed faster than the default kernel: CHECKED_FORMS lists the forms that passed
launch/ws_form_check.py and the test suite on the H200 with triton 3.9 (docs/performance.md, "Warp-specialised
kernels"), FASTER_HEAD_DIMS where each kernel was faster, and only triton 3.9 takes any (3.6, the GPU image's, fails
in the partitioner). The interpreter has no partitioner, so its CPU tests run every form. Calls with documents,
fp32 on a GPU, rows the ring finishes into another buffer, dK/dV added into accumulators and layouts the
descriptors cannot address keep the other kernels.
"""

import contextvars
import functools
import os
from collections.abc import Callable

import torch
import triton

WS_TRITON = (3, 9)  # the triton (major, minor) whose Hopper partitioner was checked to split the kernels right
WS_HEAD_DIMS = (64, 128)  # the head dims with a measured launch config


def ws_form(
    kernel: str, causal: bool, grouped: bool = False, fp32: bool = False, accumulate: bool = False, merge: bool = False
) -> str:
    """The name of a form of the warp-specialised kernels: "fwd", "dkdv" or "dq", then " causal", " gqa" (dK/dV over a
    group of q heads), " fp32" (results stored in fp32 from 16-bit inputs: the ring's state and shares),
    " accumulate" (dQ added into an fp32 accumulator) and " merge" (the forward merged into the ring's fp32 state)
    where they apply, e.g. "dkdv causal gqa fp32"."""
    extras = (("causal", causal), ("gqa", grouped), ("fp32", fp32), ("accumulate", accumulate), ("merge", merge))
    return " ".join([kernel] + [name for name, on in extras if on])


WS_FORMS = tuple(  # every form the kernels have, by ws_form's names
    ws_form(kernel, causal, **extras)
    for kernel, extra_sets in (
        ("fwd", [{}, {"fp32": True}, {"merge": True}]),
        ("dkdv", [{}, {"grouped": True}, {"fp32": True}, {"grouped": True, "fp32": True}]),
        ("dq", [{}, {"fp32": True}, {"accumulate": True}]),
    )
    for extras in extra_sets
    for causal in (False, True)
)
# the forms that passed launch/ws_form_check.py and the GPU test suite on the H200 (docs/performance.md, "Ninth
# session"; the causal backward's again in the tenth, with the mask after the FMA): all of them
CHECKED_FORMS = frozenset(WS_FORMS)
# per kernel and causal setting, the head dims at which the split kernel was timed faster than the default one on the
# H200, each alone at its default config (triton 3.9; docs/performance.md, "Ninth session"): without $RINGATTN_WS a
# GPU call takes a checked form only there. The ring's forms (fp32, merge, accumulate) run the same loop.
FASTER_HEAD_DIMS = {
    "fwd": (128,),
    "fwd causal": (),
    "dkdv": (64, 128),
    "dkdv causal": (64, 128),
    "dq": (128,),
    "dq causal": (128,),
}
WS_MODES = ("0", "1", "all")


def ws_mode() -> str | None:
    """$RINGATTN_WS, checked: unset (None), a GPU forward or backward takes the checked forms of the
    warp-specialised kernels where they apply (Hopper GPUs with triton 3.9) at the head dims where they were timed
    faster, and the interpreter (CPU tensors) none; "1", a GPU takes the checked forms at any head dim, and the
    interpreter every form (the CPU tests); "all", a GPU too (to check forms not yet checked); "0", none."""
    value = os.environ.get("RINGATTN_WS")
    if value is not None and value not in WS_MODES:
        raise ValueError(f"$RINGATTN_WS must be one of {', '.join(WS_MODES)} (or unset), got {value!r}")
    return value


def ws_allowed(form: str, device: torch.device, head_dim: int) -> bool:
    """Whether $RINGATTN_WS (ws_mode) lets a call on `device` with head dim `head_dim` take the kernel form `form`:
    unset, on a GPU the checked forms where FASTER_HEAD_DIMS has the head dim; "1", the checked forms at any head
    dim on a GPU (the GPU tests) and every form in the interpreter; "all", every form; "0", none."""
    mode = ws_mode()
    if mode == "0":
        return False
    if mode == "all" or (mode == "1" and device.type != "cuda"):
        return True
    if device.type != "cuda" or form not in CHECKED_FORMS:
        return False
    return mode == "1" or head_dim in FASTER_HEAD_DIMS[_timed_as(form)]


def _timed_as(form: str) -> str:
    """FASTER_HEAD_DIMS's key of a form: its kernel, and " causal" if it is causal."""
    kernel, *extras = form.split()
    return kernel + " causal" if "causal" in extras else kernel


@functools.cache
def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def descriptor_aligned(t: torch.Tensor) -> bool:
    """Whether TMA descriptors can address t's rows: the last dim contiguous, the base address and every other
    stride 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st * size % 16 == 0 for st in t.stride()[:-1])


def _ws_taken(form: str, q: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether a call of kernel form `form` on q (B, Sq, Hq, D) takes its warp-specialised kernel, given what the
    form itself needs: the form allowed (ws_allowed), triton 3.9, D of 64 or 128, Sq a multiple of 4 (each head's
    row of stats 16-byte aligned), on a GPU a Hopper one (compute capability 9.0) and fp16 or bf16 (fp32 would
    multiply in tf32 there), and every tensor of the call (the (B, Hq, Sq) stats included) one the descriptors can
    address."""
    if not ws_allowed(form, q.device, q.shape[-1]) or _triton_version() != WS_TRITON:
        return False
    if q.shape[-1] not in WS_HEAD_DIMS or q.shape[1] % 4:
        return False
    if q.is_cuda and (
        torch.cuda.get_device_capability(q.device) != (9, 0) or q.dtype not in (torch.float16, torch.bfloat16)
    ):
        return False
    return all(descriptor_aligned(t) for t in tensors)


def fwd_ws_ready(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    has_docs: bool,
    merge_state: bool,
    has_final: bool,
) -> bool:
    """Whether the forward of q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) into out like q and lse (B, Hq, Sq) (merged into
    them with merge_state) takes the warp-specialised kernel: no documents, no rows finished into another buffer
    (has_final), and what _ws_taken checks."""
    form = ws_form("fwd", causal, fp32=not merge_state and out.dtype != q.dtype, merge=merge_state)
    return not (has_docs or has_final) and _ws_taken(form, q, (q, k, v, out, lse))


def dkdv_ws_ready(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    has_docs: bool,
    add_dkdv: bool,
) -> bool:
    """Whether the backward of q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), dout like q and contiguous lse, delta
    (B, Hq, Sq), into dk, dv like k, takes the warp-specialised dK/dV kernel: no documents, dK and dV stored rather
    than added (add_dkdv False: the ring's shares, or no accumulators), for GQA q's and dout's heads packed (head
    stride D), and what _ws_taken checks."""
    grouped = q.shape[2] != k.shape[2]
    form = ws_form("dkdv", causal, grouped=grouped, fp32=dk.dtype != k.dtype)
    heads_packed = q.stride(2) == q.shape[-1] and dout.stride(2) == dout.shape[-1]  # GQA's descriptors need it
    return not (has_docs or add_dkdv or (grouped and not heads_packed)) and _ws_taken(
        form, q, (q, k, v, dout, lse, delta, dk, dv)
    )


def dq_ws_ready(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
    causal: bool,
    has_docs: bool,
    add_dq: bool,
    has_final: bool,
) -> bool:
    """Whether that backward, into dq like q (add_dq: added into it), takes the warp-specialised dQ kernel: no
    documents, no rows finished into another buffer (has_final: the ring's last step), and what _ws_taken checks."""
    form = ws_form("dq", causal, fp32=not add_dq and dq.dtype != q.dtype, accumulate=add_dq)
    return not (has_docs or has_final) and _ws_taken(form, q, (q, k, v, dout, lse, delta, dq))


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for a launch, from PyTorch's caching allocator on the current device and stream (its blocks
    are 512-byte aligned, more than triton asks)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _launch_with_torch_scratch(launch: Callable[[], None]) -> None:
    triton.set_allocator(_torch_scratch)
    launch()


def run_with_scratch(launch: Callable[[], None]) -> None:
    """Run launch() with PyTorch's allocator as triton's scratch allocator, set in a copy of the current context,
    so that an allocator the caller set is neither needed nor replaced."""
    contextvars.copy_context().run(_launch_with_torch_scratch, launch)
