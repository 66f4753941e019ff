"""Input checks shared by the launchers and the public functions: clear errors, raised early."""

import functools
import math
import operator
import os
import sys

import numpy
import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from ..kernels.portable.attn_fwd import _attn_fwd_kernel
from .dispatch import kernel_override

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_CAPABILITY = (8, 0)  # Triton's supported NVIDIA GPUs: Ampere and newer
MAX_HEAD_DIM = 256
MAX_GRID_DIM = 65535  # batch and heads are CUDA grid dimensions 2 and 1
LSE_DTYPE = torch.float64  # the ops' lse, and the running state's: P = exp(s - lse) needs its digits at large |lse|


def check_no_tangent(t: torch.Tensor, name: str) -> None:
    """Raise NotImplementedError where t carries a forward-mode tangent (torch.func.jvp, torch.autograd.forward_ad):
    ringattn computes no tangents, and its custom ops would drop them, a derivative of zero without a word."""
    if not torch.compiler.is_compiling() and torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
        raise NotImplementedError(
            f"{name} carries a forward-mode AD tangent (torch.func.jvp, torch.autograd.forward_ad): ringattn has no "
            "forward-mode derivative; use reverse mode (backward, torch.autograd.grad)"
        )


def check_attn_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Check q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) for the attention ops.

    Raises:
        TypeError: a non-tensor, a tensor that is not dense (strided: a sparse one), a dtype that is not
            fp16/bf16/fp32, or dtypes that differ.
        ValueError: wrong ranks, mismatched batch/length/head/dim sizes, Hq not divisible by Hkv,
            an empty sequence, a head dim that is not a multiple of 8 up to 256, or devices that differ.
        NotImplementedError: a forward-mode AD tangent on q, k or v (check_no_tangent).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_no_tangent(t, name)
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    if k.shape[:3] == v.shape[:3] and k.shape[3] != v.shape[3]:
        raise ValueError(
            f"v must have k's head dim {k.shape[3]}, got {v.shape[3]} (a value head dim other than the query and key "
            "head dim is not supported)"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have q's batch size {batch}, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have q's head dim {head_dim}, got {k.shape[3]}")
    if seqlen_q == 0 or k.shape[1] == 0:
        raise ValueError(f"sequence lengths must be positive, got q {seqlen_q}, k/v {k.shape[1]}")
    if not (0 < batch <= MAX_GRID_DIM and 0 < heads_q <= MAX_GRID_DIM and k.shape[2] > 0):
        raise ValueError(
            f"batch and head counts must be from 1 to {MAX_GRID_DIM}, got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if heads_q % k.shape[2] != 0:
        raise ValueError(f"q's head count {heads_q} must be divisible by k/v's head count {k.shape[2]} (GQA/MQA)")
    if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be a multiple of 8 from 8 to {MAX_HEAD_DIM}, got {head_dim}")


# Triton picks interpreter or compiler when a kernel is decorated, i.e. when ringattn is imported, from
# $TRITON_INTERPRET: which values it reads as on depends on its version ("1"; recent ones also "true", "on", ...), so
# the kernel is asked what it became.
KERNELS_INTERPRETED = isinstance(_attn_fwd_kernel, InterpretedFunction)
_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET")


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter of `triton_version` cannot run the kernels beside numpy `numpy_version`, or None:
    before triton 3.7 the interpreter turns one-element arrays into Python ints, which numpy 2.4 refuses."""
    if _major_minor(triton_version) < (3, 7) and _major_minor(numpy_version) >= (2, 4):
        return (
            f"Triton {triton_version}'s interpreter cannot run ringattn's kernels with numpy {numpy_version} (it "
            "converts one-element arrays to Python ints, which numpy 2.4 refuses); install triton>=3.7 or numpy<2.4"
        )
    return None


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


_INTERPRETER_PROBLEM = interpreter_problem(triton.__version__, numpy.__version__) if KERNELS_INTERPRETED else None


def interpreter_hint() -> str:
    """How to run the kernels on the CPU, and what $TRITON_INTERPRET was when ringattn was imported."""
    was = "unset" if _INTERPRET_AT_IMPORT is None else f"{_INTERPRET_AT_IMPORT!r}, which this Triton reads as off"
    return (
        "turn Triton's interpreter on in the environment before ringattn is imported: TRITON_INTERPRET=1 (when "
        f"ringattn was imported, TRITON_INTERPRET was {was})"
    )


def gpu_problem(capability: tuple[int, int], name: str, rocm: bool) -> str | None:
    """Why ringattn's kernels cannot run on a GPU of compute capability `capability` named `name` (a ROCm device
    where `rocm`), or None: they are built for NVIDIA GPUs of compute capability 8.0 or newer, those Triton supports.
    Compiled for 7.5 (Turing) they issue no tensor-core products, spill kilobytes of registers and need more shared
    memory than a block gets (launch/tools/kernel_resources.py); a ROCm device reports a capability of its own."""
    if rocm:
        return (
            f"ringattn's kernels run on NVIDIA GPUs (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"newer), got {name}, a ROCm device, which they were not built or tested for"
        )
    if capability < MIN_CAPABILITY:
        return (
            f"ringattn's kernels need an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"newer (Ampere and later, as Triton supports), got {name} of compute capability "
            f"{capability[0]}.{capability[1]}"
        )
    return None


def check_gpu(t: torch.Tensor) -> None:
    """Raise RuntimeError where t is a CUDA tensor on a GPU the kernels cannot run on (gpu_problem)."""
    if t.device.type == "cuda" and (problem := _device_problem(t.device.index)) is not None:
        raise RuntimeError(problem)


@functools.cache
def _device_problem(index: int) -> str | None:
    """gpu_problem of CUDA device `index`, asked once."""
    name = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return gpu_problem(torch.cuda.get_device_capability(index), name, torch.version.hip is not None)


def check_runnable_device(t: torch.Tensor) -> None:
    """Raise when the Triton kernels cannot run on t in this process, or the kernels' setting is bad:
    check_kernel_device and check_gpu, after $RINGATTN_KERNELS (ops/dispatch.py; ValueError for a bad value)."""
    kernel_override()
    check_kernel_device(t)
    check_gpu(t)


def check_kernel_device(t: torch.Tensor) -> None:
    """Raise when the Triton kernels cannot run on t's device and dtype in this process (reads tensor metadata only,
    so that torch.compile traces it).

    Raises:
        RuntimeError: t is not a CUDA tensor and the kernels were not built for the interpreter, or a CUDA tensor
            and they were; or this Triton's interpreter cannot run beside this numpy (interpreter_problem).
        TypeError: a bfloat16 CPU tensor (the Triton interpreter computes bfloat16 wrongly).
    """
    if t.device.type == "cuda" and not KERNELS_INTERPRETED:
        return
    if t.device.type == "cpu" and KERNELS_INTERPRETED:
        if _INTERPRETER_PROBLEM is not None:
            raise RuntimeError(_INTERPRETER_PROBLEM)
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 is not supported by the Triton interpreter on the CPU; use float32 or float16")
        return
    if KERNELS_INTERPRETED:
        raise RuntimeError(
            f"ringattn's kernels run in Triton's interpreter (TRITON_INTERPRET={_INTERPRET_AT_IMPORT} when ringattn "
            f"was imported): they take CPU tensors, got {t.device}"
        )
    raise RuntimeError(
        f"ringattn's Triton kernels need CUDA tensors, got a tensor on {t.device}; to run them on the CPU, "
        + interpreter_hint()
    )


def _as_float(value, name: str, expected: str) -> float:
    """A real-number argument as a float: anything float() takes (a Python or numpy number, a one-element tensor)
    but a bool or a string; an int past float's range as +-inf.

    Raises:
        TypeError: anything else, naming `name` and what it must be (`expected`); a tensor that requires grad (no
            gradient flows to it).
    """
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise TypeError(
            f"{name} must not require grad: ringattn computes no gradient for it (pass a float, or a detached tensor)"
        )
    try:
        if isinstance(value, bool | str | bytes):
            raise TypeError
        return float(value)
    except OverflowError:  # an int past float's range: a number, which the caller's range check then refuses
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}") from None


def check_softmax_scale(softmax_scale) -> float | None:
    """softmax_scale as a float, or None (the default, 1 / sqrt(headdim)).

    Raises:
        TypeError: not a number (_as_float).
        ValueError: not positive and finite, or outside the float32 range of the kernels (check_float32_factor).
    """
    if softmax_scale is None:
        return None
    scale = _as_float(softmax_scale, "softmax_scale", "a number or None")
    if not (scale > 0.0 and scale != float("inf")):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    check_float32_factor(scale, "softmax_scale")
    return scale


def default_softmax_scale(softmax_scale: float | None, head_dim: int, softcap: float = 0.0) -> float:
    """softmax_scale checked (check_softmax_scale), or 1 / sqrt(head_dim) when None; with a (checked) softcap, the
    two checked together (check_softcap)."""
    scale = check_softmax_scale(softmax_scale)
    scale = head_dim**-0.5 if scale is None else scale
    check_softcap(softcap, scale)
    return scale


# The kernels take softmax_scale and softcap as float32 factors, times log2(e) (their softmax is base 2). Outside
# this range a positive factor would become 0 (below float32's smallest normal number: GPUs flush subnormals to
# zero) or inf there, and every output NaN.
FLOAT32_FACTOR_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max / math.log2(math.e))


def check_float32_factor(value: float, name: str) -> None:
    """Raise ValueError naming `name` unless the positive `value` lies in FLOAT32_FACTOR_RANGE."""
    low, high = FLOAT32_FACTOR_RANGE
    if not low <= value <= high:
        raise ValueError(
            f"{name} must be from {low:.3g} to {high:.3g}: the kernels take it in float32, times log2(e); got {value}"
        )


def check_window(window) -> tuple[int | None, int | None]:
    """A kernel call's sliding window (ops/calls.py) as a (left, right) tuple of ints or None.

    Raises:
        TypeError: not a pair of ints (or None).
    """
    if not isinstance(window, tuple | list) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints or None, got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, int)):
            raise TypeError(f"window must be a (left, right) pair of ints or None, got {window!r}")
    return tuple(window)


def check_softcap(softcap, softmax_scale: float | None = None) -> float:
    """softcap as a float: 0 (none) or a positive finite number; with softmax_scale, the two together: the kernels
    take softmax_scale / softcap as a float32 factor too.

    Raises:
        TypeError: not a number (_as_float, as softmax_scale).
        ValueError: negative, NaN or infinite, or positive outside the float32 range of the kernels
            (check_float32_factor); softmax_scale / softcap outside it (in float32 it would be inf, and a score of
            0 capped NaN, or 0 or subnormal, and the capped scores lose their digits).
    """
    value = _as_float(softcap, "softcap", "a number (0 for none)")
    if not (value >= 0.0 and value != float("inf")):
        raise ValueError(f"softcap must be 0 (none) or a positive finite number, got {softcap}")
    if value:
        check_float32_factor(value, "softcap")
        if softmax_scale is not None:
            check_float32_factor(softmax_scale / value, "softmax_scale / softcap")
    return value


def check_flag(value, name: str) -> bool:
    """A boolean argument (causal, deterministic, ...) as a bool: True, False, 1, 0 or a numpy bool.

    Raises:
        TypeError: anything else (a string such as "False" would otherwise read as True, a tensor as ambiguous).
    """
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")):
        return bool(value)  # numpy's bool is named bool_ before numpy 2, bool from it
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def as_int(value) -> int | None:
    """value as an int where Python reads it as an integer (an int, a numpy integer, an integer 0-d tensor: what
    operator.index takes, as flash-attn's C++ arguments do), else None (bools too)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_flash_attn_options(
    dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
) -> tuple[bool, tuple[int | None, int | None], float, bool]:
    """flash-attn's options as the kernels take them: (causal, window, softcap, deterministic), window_size's -1
    (no limit) as None, deterministic also where torch.use_deterministic_algorithms(True) is on (as PyTorch's own
    attention backward honours it).

    Raises:
        TypeError: a flag that is not a bool, a window_size that is not a pair of ints, a softcap that is not a
            number.
        ValueError: dropout_p other than 0 (ringattn has no dropout), alibi_slopes other than None, a window side
            below -1, a negative or non-finite softcap, return_attn_probs True (ringattn never forms the
            probabilities; return_lse=True gives the log-sum-exp).
    """
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: ringattn has no attention dropout, got {dropout_p}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None: ringattn has no ALiBi bias")
    if check_flag(return_attn_probs, "return_attn_probs"):
        raise ValueError(
            "return_attn_probs must be False: ringattn never forms the attention probabilities; "
            "return_lse=True returns the log-sum-exp"
        )
    if not isinstance(window_size, tuple | list) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints (-1: no limit), got {window_size!r}")
    sides = tuple(as_int(side) for side in window_size)
    if None in sides:
        raise TypeError(f"window_size must be a (left, right) pair of ints (-1: no limit), got {window_size!r}")
    if min(sides) < -1:
        raise ValueError(f"window_size's sides must be >= 0, or -1 for no limit, got {sides}")
    # a side no sequence reaches is no limit (past 2**63 - 1 it would not fit the kernels' int64 arguments)
    window = tuple(None if side == -1 or side >= sys.maxsize else side for side in sides)
    deterministic = check_flag(deterministic, "deterministic") or torch.are_deterministic_algorithms_enabled()
    return check_flag(causal, "causal"), window, check_softcap(softcap), deterministic


def check_sink(sink, q: torch.Tensor) -> torch.Tensor | None:
    """learnable_sink: None, or a (Hq,) floating tensor (one logit per query head) on q's device.

    Raises:
        TypeError: not a floating tensor.
        ValueError: another shape or device.
        NotImplementedError: a forward-mode AD tangent (check_no_tangent).
    """
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor) or not sink.is_floating_point():
        raise TypeError(f"learnable_sink must be a floating tensor or None, got {getattr(sink, 'dtype', type(sink))}")
    check_no_tangent(sink, "learnable_sink")
    if tuple(sink.shape) != (q.shape[2],):
        raise ValueError(f"learnable_sink must have shape ({q.shape[2]},) (one logit per query head), got "
                         f"{tuple(sink.shape)}")  # fmt: skip
    if sink.device != q.device:
        raise ValueError(f"learnable_sink must be on {q.device}, got {sink.device}")
    return sink


def check_doc_ids(
    q_doc_ids: torch.Tensor | None, k_doc_ids: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Check optional per-row document ids on q's device, both or neither: int32 (Sq,) and (Sk,), one row of ids
    for every batch row, or (B, Sq) and (B, Sk), each batch row its own (packed rows of a batch).

    Returns them as (B, Sq) and (B, Sk) with contiguous rows (the kernels take a batch stride: 0 for the broadcast
    1-D form; views with a row stride, such as a range of columns of a larger (B, S) tensor, are not copied).
    Non-decreasing order along each row is the caller's promise (the kernels skip tiles by their first and last
    id); it is not checked here, to keep launches free of host syncs.
    Raises:
        ValueError, TypeError: one given without the other, wrong shape, dtype or device.
    """
    if (q_doc_ids is None) != (k_doc_ids is None):
        raise ValueError("q_doc_ids and k_doc_ids must be given together or not at all")
    if q_doc_ids is None:
        return None, None
    batch = q.shape[0]
    checked = []
    for name, ids, seqlen in (("q_doc_ids", q_doc_ids, q.shape[1]), ("k_doc_ids", k_doc_ids, k.shape[1])):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.shape not in ((seqlen,), (batch, seqlen)):
            raise ValueError(f"{name} must have shape ({seqlen},) or ({batch}, {seqlen}), got {tuple(ids.shape)}")
        if ids.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {ids.device}")
        ids = ids if ids.dim() == 2 else ids.expand(batch, seqlen)
        checked.append(ids if ids.stride(-1) == 1 or seqlen == 1 else ids.contiguous())
    return checked[0], checked[1]


def _check_stat(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device, what: str) -> None:
    """One per-row tensor of a call: a `dtype` tensor of `shape` on `device` with a contiguous last dim."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        dtype_name = str(dtype).removeprefix("torch.")
        raise TypeError(f"{name} ({what}) must be a {dtype_name} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} ({what}) must have shape {shape}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} ({what}) must be on {device}, got {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} ({what}) must have a contiguous last dim, got strides {t.stride()}")


def check_attn_state(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor) -> None:
    """Check a running (out, lse) state for q (attn_fwd_merge_): out (B, Sq, Hq, D) fp32 and lse (B, Hq, Sq)
    float64 on q's device, each with a contiguous last dim (views into a larger state are fine).

    Raises:
        TypeError: a non-tensor or another dtype.
        ValueError: a wrong shape, device or last-dim stride.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    _check_stat("out", out, torch.float32, tuple(q.shape), q.device, "running state")
    _check_stat("lse", lse, LSE_DTYPE, (batch, heads_q, seqlen_q), q.device, "running state")


def check_lse(lse: torch.Tensor, out: torch.Tensor) -> None:
    """Check the lse (B, Hq, Sq) float64 of the forward whose output out (B, Sq, Hq, D) a backward takes.

    Raises:
        TypeError, ValueError: as check_attn_state.
    """
    batch, seqlen_q, heads_q, _ = out.shape
    _check_stat("lse", lse, LSE_DTYPE, (batch, heads_q, seqlen_q), out.device, "the forward's normaliser")


def check_bwd_stats(stats: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The backward's row stats (3, B, Hq, Sq) fp32 (attn_bwd_preprocess) checked against q (B, Sq, Hq, D), made
    contiguous (a copy, for the rows of a view).

    Raises:
        TypeError, ValueError: as check_attn_state.
    """
    batch, seqlen_q, heads_q, _ = q.shape
    _check_stat("stats", stats, torch.float32, (3, batch, heads_q, seqlen_q), q.device, "attn_bwd_preprocess's")
    return stats.contiguous()
