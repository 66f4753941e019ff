"""The attention custom ops and the public functions `flash_attn_func`, `flash_attn_varlen_func`,
`ring_attn_func` and `ring_attn_varlen_func`.

Both run as torch.library custom ops with fake implementations: one device as ringattn::flash_attn_fwd (its
backward runs ringattn::attn_bwd), the ring as ringattn::ring_attn_fwd (its backward runs ringattn::ring_attn_bwd),
so that torch.compile, with fullgraph=True or not, sees one call per direction and never the collectives, the
host-side schedule or the launchers (docs/design.md, section 7). The checks
that read only Python values and tensor metadata run before the op, in Python; those that need the group, the
environment or tensor values, and the agreement exchange, run inside it, at every call. flash_attn_varlen_func reads
its boundaries' values in a custom op of its own, ringattn::varlen_doc_ids, for the same reason.

Signatures follow flash-attn's (2.x), in its argument order: tensors are (batch, seqlen, nheads, headdim); GQA/MQA
by passing fewer K/V heads; lse is (batch, nheads, seqlen) fp32 in natural log. flash-attn's dropout_p,
alibi_slopes and return_attn_probs are taken at their no-op values only (anything else is a ValueError, never
ignored); the ring functions take every argument after q, k, v (and cu_seqlens) by keyword only.
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from .ops import KERNEL_OPS, add_sink_, capped_ops, kernel_ops, kernel_override, sink_grad
from .ops.custom_ops import attn_bwd_op, attn_fwd_op
from .ops.validation import (
    LSE_DTYPE,
    as_int,
    check_attn_inputs,
    check_flag,
    check_flash_attn_options,
    check_gpu,
    check_kernel_device,
    check_sink,
    default_softmax_scale,
)
from .parallel import RingComm, check_layout, check_local_seqlen, ring_attn_backward, ring_attn_forward
from .parallel.agreement import (
    agreement_mode,
    check_agreement,
    check_backward,
    number_call,
    ring_signature,
    shared_refusals,
)
from .parallel.comm import p2p_timeout_s
from .parallel.documents import (
    check_cu_seqlens,
    check_cu_seqlens_tensor,
    checked_fingerprint,
    document_ids,
    shard_documents,
)
from .parallel.groups import Group, or_world, ring_group
from .parallel.steps import state_dtype


def public_lse(lse: torch.Tensor) -> torch.Tensor:
    """The lse the public functions return, (B, Hq, S) fp32, from the float64 one the kernels keep for the
    backward."""
    return lse.to(torch.float32)


def _check_not_double_backward() -> None:
    """Raise when a backward runs with create_graph=True: the kernels' gradients carry no graph, so a double
    backward would miss their terms (or find no grad_fn)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "ringattn's attention is differentiable once: double backward (torch.autograd.grad or .backward with "
            "create_graph=True through it) is not supported"
        )


@torch.library.custom_op("ringattn::flash_attn_fwd", mutates_args=())
def flash_attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    learnable_sink: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    deterministic: bool,
    q_doc_ids: torch.Tensor | None,
    k_doc_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Single-device fused attention as one custom op, differentiable (its backward runs ringattn::attn_bwd, P
    recomputed from the saved lse), so that torch.compile sees one call whatever the tensors (the same tensor as k
    and v included, which an autograd.Function under fullgraph=True refuses).

    Args: q (B, Sq, Hq, D), k, v (B, Sk, Hkv, D), checked by check_attn_inputs; learnable_sink (Hq,) or None; the
        kernels' softmax_scale, causal, window sides (None: no limit), softcap; deterministic, for the backward;
        q_doc_ids (B or 1, Sq), k_doc_ids (B or 1, Sk) int32 or None (flash_attn_varlen_func's documents).
    Returns:
        out (B, Sq, Hq, D) in q's dtype; lse (B, Hq, Sq) float64 (with sinks, counting them); with sinks, the fp32
        out with them merged in, which their gradient is computed from, where it is not out itself (_keeps_state),
        else an empty tensor.
    """
    out_dtype = None if learnable_sink is None else state_dtype(q)
    out, lse = attn_fwd_op(q, k, v, softmax_scale, causal, window_left, window_right, softcap, q_doc_ids, k_doc_ids,
                           out_dtype)  # fmt: skip
    return _sink_outputs(q, out, lse, learnable_sink)


@flash_attn_fwd_op.register_fake
def _flash_attn_fwd_fake(q, k, v, learnable_sink, *options):
    return _fake_outputs(q, learnable_sink)


_FLASH_SINK = 3  # learnable_sink's place among ringattn::flash_attn_fwd's arguments


def _flash_attn_setup_context(ctx, inputs, output) -> None:
    q, k, v, sink, scale, causal, window_left, window_right, softcap, deterministic, q_doc_ids, k_doc_ids = inputs
    out, lse, state = output
    # with sinks that need their gradient, the backward runs on the unrounded out (see _sink_outputs)
    kept = state if state.numel() and ctx.needs_input_grad[_FLASH_SINK] else out
    ctx.save_for_backward(q, k, v, kept, lse, sink, q_doc_ids, k_doc_ids)
    ctx.options = scale, causal, deterministic, window_left, window_right, softcap
    ctx.mark_non_differentiable(lse, state)


def _flash_attn_backward(ctx, dout, _dlse, _dstate):
    _check_not_double_backward()
    q, k, v, out, lse, sink, q_doc_ids, k_doc_ids = ctx.saved_tensors
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):
        dq, dk, dv = attn_bwd_op(dout, q, k, v, out, lse, *ctx.options, q_doc_ids, k_doc_ids)
    dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[_FLASH_SINK] else None
    return dq, dk, dv, dsink, *(None,) * 8


flash_attn_fwd_op.register_autograd(_flash_attn_backward, setup_context=_flash_attn_setup_context)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention with a fused Triton kernel on one device (flash-attn's flash_attn_func).

    Args:
        q: (batch, seqlen_q, nheads, headdim).
        k, v: (batch, seqlen_k, nheads_k, headdim); nheads % nheads_k == 0 (GQA/MQA).
            headdim a multiple of 8 up to 256; fp16, bf16 or fp32; any strides.
        dropout_p: 0.0 (ringattn has no attention dropout).
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: bottom-right aligned causal mask (row i sees keys j <= i + seqlen_k - seqlen_q);
            rows that see no key give zeros.
        window_size: (left, right) sliding window, -1 for no limit on a side: row i sees keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (with causal, right is 0),
            also past the sequence (as FlashAttention-3 and 4; docs/api.md says where FlashAttention-2 differs).
            Sides are ints or what operator.index takes. Key tiles outside every row's window are skipped.
        softcap: scores -> softcap * tanh(scores / softcap), after the scale (Gemma 2's logit soft-capping);
            0 for none.
        alibi_slopes: None (no ALiBi).
        deterministic: gradients with the same bits in every run. The Hopper GPU's fastest backward adds dQ
            atomically, in no fixed order; deterministic takes kernels with one writer per gradient row instead
            (docs/performance.md says what it costs). Other GPUs and the CPU always are. Taken too wherever
            torch.use_deterministic_algorithms(True) is on.
        return_attn_probs: False (the probabilities are never formed; see return_lse).
        return_lse: also return the log-sum-exp of each row.
        learnable_sink: (nheads,) attention sinks (gpt-oss; FlashAttention-4's learnable_sink): a logit per head
            that joins every row's softmax denominator, exp(sink[h]), with no value; it gets its gradient.
    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with return_lse also
        lse (batch, nheads, seqlen_q) fp32, natural log (-inf for rows that see no key; with sinks, counting them).
    Raises:
        ValueError, TypeError: bad shapes, dtypes, devices, scale, window or softcap; a causal, deterministic or
            return_lse that is not a bool; dropout_p, alibi_slopes or return_attn_probs other than their no-op values.
        RuntimeError: CPU tensors without TRITON_INTERPRET=1; in the backward, create_graph=True (no double
            backward).
        NotImplementedError: an input with a forward-mode AD tangent (torch.func.jvp): reverse mode only.
    Meta tensors give meta outputs (and gradients) of these shapes, computing nothing: the custom ops' fake
    implementations, which torch.compile traces with.
    """
    causal, window, softcap, deterministic = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )
    return_lse = check_flag(return_lse, "return_lse")
    check_attn_inputs(q, k, v)
    sink = check_sink(learnable_sink, q)
    scale = default_softmax_scale(softmax_scale, q.shape[-1], softcap)
    out, lse, _ = flash_attn_fwd_op(q, k, v, sink, scale, causal, *window, softcap, deterministic, None, None)
    return (out, public_lse(lse)) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over packed variable-length sequences on one device (flash-attn's flash_attn_varlen_func).

    Sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q, its keys rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v; a query sees only keys of its own sequence. Tiles where
    sequences do not meet are skipped.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); as flash_attn_func's otherwise.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 or int64 sequence boundaries: 0 first, total_q (total_k)
            last, nondecreasing (a sequence may be empty, as in flash-attn), the same number of sequences.
        max_seqlen_q, max_seqlen_k: the longest sequence of each (ints, or what operator.index takes; checked against
            the boundaries).
        causal, window_size: per sequence, as flash_attn_func's; they need cu_seqlens_q equal to cu_seqlens_k
            (each sequence's queries and keys the same tokens, as in training).
        dropout_p, softmax_scale, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse,
            learnable_sink: as flash_attn_func's.
    Returns:
        out (total_q, nheads, headdim) in q's dtype; with return_lse also lse (nheads, total_q) fp32.
    Raises:
        ValueError, TypeError: as flash_attn_func's; q, k, v that are not 3-D; bad boundaries or max_seqlen (meta
            boundaries too: their values are read on the host); causal or a window with cu_seqlens_q != cu_seqlens_k.
        RuntimeError: as flash_attn_func's.
    """
    causal, window, softcap, deterministic = check_flash_attn_options(
        dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )
    return_lse = check_flag(return_lse, "return_lse")
    _check_3d(q, k, v, "total_tokens")
    check_attn_inputs(q[None], k[None], v[None])
    sink = check_sink(learnable_sink, q[None])
    same_bounds = causal or window != (None, None)
    q_doc_ids, k_doc_ids = _varlen_doc_ids(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, same_bounds)
    scale = default_softmax_scale(softmax_scale, q.shape[-1], softcap)
    out, lse, _ = flash_attn_fwd_op(q[None], k[None], v[None], sink, scale, causal, *window, softcap, deterministic,
                                    q_doc_ids, k_doc_ids)  # fmt: skip
    return (out[0], public_lse(lse[0])) if return_lse else out[0]


def _check_3d(q, k, v, rows: str) -> None:
    """Raise ValueError unless q, k, v are 3-D tensors (rows, nheads, headdim), the packed layout."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor ({rows}, nheads, headdim), got {_shape(t)}")


def _varlen_doc_ids(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k, same_bounds: bool):
    """The (total_q,) and (total_k,) int32 sequence ids of flash_attn_varlen_func's rows, after checking its
    boundaries and max lengths; same_bounds (causal or a window) needs cu_seqlens_q equal to cu_seqlens_k. The checks
    of metadata run here (traced by torch.compile), those of values in ringattn::varlen_doc_ids."""
    max_lens = []
    for name, cu, max_name, max_len, t in (
        ("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, q),
        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, k),
    ):
        check_cu_seqlens_tensor(cu, name)
        if cu.device != t.device:
            raise ValueError(f"{name} must be on {t.device}, got {cu.device}")
        max_lens.append(as_int(max_len))
        if max_lens[-1] is None:
            raise TypeError(f"{max_name} must be an int, got {type(max_len).__name__}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got {cu_seqlens_q.numel() - 1} "
            f"and {cu_seqlens_k.numel() - 1}"
        )
    return varlen_doc_ids_op(cu_seqlens_q, cu_seqlens_k, *max_lens, q.shape[0], k.shape[0], same_bounds)


@torch.library.custom_op("ringattn::varlen_doc_ids", mutates_args=())
def varlen_doc_ids_op(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    total_q: int,
    total_k: int,
    same_bounds: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's checks of the boundaries' values (each from 0 to its total, nondecreasing,
    no sequence longer than its max_seqlen; the same with same_bounds), then the (total_q,), (total_k,) int32
    sequence id of every row, on the boundaries' device."""
    bounds = []
    for name, cu, max_name, max_len, total in (
        ("cu_seqlens_q", cu_seqlens_q, "max_seqlen_q", max_seqlen_q, total_q),
        ("cu_seqlens_k", cu_seqlens_k, "max_seqlen_k", max_seqlen_k, total_k),
    ):
        check_cu_seqlens(cu, total, name=name)
        bounds.append(cu.cpu().to(torch.int64))
        longest = int((bounds[-1][1:] - bounds[-1][:-1]).max())
        if max_len < longest:
            raise ValueError(f"{max_name} must be at least the longest sequence of {name}, {longest}; got {max_len}")
    if same_bounds and not torch.equal(*bounds):
        raise ValueError(
            "causal and window_size need cu_seqlens_q equal to cu_seqlens_k (per-sequence bottom-right alignment "
            "of different query and key lengths is not supported)"
        )
    return document_ids(cu_seqlens_q, total_q), document_ids(cu_seqlens_k, total_k)


@varlen_doc_ids_op.register_fake
def _varlen_doc_ids_fake(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k, same_bounds):
    return tuple(torch.empty(n, dtype=torch.int32, device=cu_seqlens_q.device) for n in (total_q, total_k))


def check_ring_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    layout: str,
    softmax_scale: float | None = None,
    sink: torch.Tensor | None = None,
    call: str = "ring_attn_func",
    softcap: float = 0.0,
) -> tuple[float, str]:
    """The local checks of a ring call that read only Python values and tensor metadata (shapes, dtypes, devices,
    layout, scale (with the checked softcap), sinks, the group's type, torch.distributed initialised); returns the
    softmax scale to use and the name of the group (the world's for None), which the ring's custom op takes.

    The ring functions run them, and check_flash_attn_options, under agreement.shared_refusals before calling the
    custom op ringattn::ring_attn_fwd (under torch.compile: while tracing). The op runs, at every call, the checks
    that need the group, the environment or tensor values (check_ring_group, the boundaries of
    ring_attn_varlen_func), then agreement.check_agreement with the call's signature: one small all_gather on a CPU
    channel of `group` before the ring's first P2P op (skipped with $RINGATTN_AGREEMENT=off), after which every rank
    raises the same error if a rank's checks raised, or if the ranks' shapes, dtype, causal, softmax_scale, layout,
    window, softcap, whether they pass sinks or (ring_attn_varlen_func's) document boundaries differ.

    Raises:
        ValueError, TypeError: bad local inputs, an unknown layout, an odd local length with "zigzag", a group that is
            not a ProcessGroup.
        RuntimeError: torch.distributed is not initialised (naming `call`); a device the kernels cannot run on.
    """
    check_attn_inputs(q, k, v)
    check_kernel_device(q)
    check_layout(layout)
    check_sink(sink, q)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q, k and v must hold the same local sequence length in a ring, got q {q.shape[1]}, k/v {k.shape[1]}"
        )
    check_local_seqlen(q.shape[1], layout, name="q.shape[1]")
    scale = default_softmax_scale(softmax_scale, q.shape[-1], softcap)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{call} needs torch.distributed initialised (dist.init_process_group); for one device use flash_attn_func"
        )
    return scale, or_world(group).group_name


def check_ring_group(q: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The checks of a ring call that need its group or the environment, run by the ring's custom op at every call.

    Raises:
        ValueError: a group that does not contain this rank, a device the group's backend cannot carry, a bad
            $RINGATTN_KERNELS, $RINGATTN_P2P_TIMEOUT_S or $RINGATTN_AGREEMENT.
        RuntimeError: a GPU the kernels cannot run on (check_gpu: older than compute capability 8.0, or ROCm).
    """
    if dist.get_rank(group) < 0:
        raise ValueError(f"group must contain this process (global rank {dist.get_rank()}); it does not")
    backend = str(dist.get_backend(group)).lower()
    if q.is_cuda and "nccl" not in backend and "cuda" not in backend:
        raise ValueError(f"q, k, v are CUDA tensors but the group's backend {backend!r} cannot carry them; use nccl")
    if not q.is_cuda and backend == "nccl":
        raise ValueError(f"q, k, v are on {q.device} but the group's backend is nccl; move them to the rank's GPU")
    kernel_override()  # the environment's settings, checked before the first collective
    check_gpu(q)
    p2p_timeout_s()
    agreement_mode()


def _keeps_state(q: torch.Tensor, sink: torch.Tensor | None) -> bool:
    """Whether ringattn::flash_attn_fwd and ringattn::ring_attn_fwd return the unrounded output apart from out: with
    sinks, for inputs narrower than the fp32 state (in fp32, out is that output)."""
    return sink is not None and state_dtype(q) != q.dtype


def _sink_outputs(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None):
    """The forward ops' (out, lse, state) from the kernels' (out, lse), out in the fp32 state with sinks: the sinks
    merged in once (ops.add_sink_), out rounded to q's dtype once, and the unrounded out as state, which the backward
    keeps when the sinks need their gradient (it sums P_sink * rowsum(dout * out) over every row, where out's
    rounding would cost it up to twice plain PyTorch's error); state is an empty tensor without sinks, and where out
    is already unrounded (fp32 inputs: _keeps_state), so that no output aliases another."""
    none = out.new_empty(0, dtype=state_dtype(q))  # the fake implementations' (_fake_outputs)
    if sink is None:
        return out, lse, none
    lse = lse.clone()
    add_sink_(out, lse, sink)
    return out.to(q.dtype), lse, out if _keeps_state(q, sink) else none


def _fake_outputs(q: torch.Tensor, sink: torch.Tensor | None):
    """_sink_outputs' shapes and dtypes for the forward ops' fake implementations."""
    batch, seqlen, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seqlen), dtype=LSE_DTYPE)
    state = q.new_empty(q.shape if _keeps_state(q, sink) else (0,), dtype=state_dtype(q))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse, state


def _ring_documents(
    cu_seqlens: torch.Tensor | None,
    q: torch.Tensor,
    group: dist.ProcessGroup,
    layout: str,
    digest: int | None = None,
):
    """The ShardDocuments of checked global boundaries for a ring over `group` (cached: every layer passes the same
    boundaries; digest: their fingerprint where the caller has it), or None."""
    if cu_seqlens is None:
        return None
    world_size = dist.get_world_size(group)
    return shard_documents(cu_seqlens, q.shape[1], world_size, layout, q.device, q.shape[0], digest)


@torch.library.custom_op("ringattn::ring_attn_fwd", mutates_args=())
def ring_attn_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    learnable_sink: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    deterministic: bool,
    group_name: str,
    layout: str,
    grads: str,
    call: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's forward as one custom op, differentiable (its backward runs ringattn::ring_attn_bwd), so that
    torch.compile sees one call and never the collectives, the host-side schedule or the launchers.

    At every call, on the group named `group_name`: check_ring_group and the boundaries' values (cu_seqlens), as
    shared refusals, then the agreement exchange of the call's signature (`call` names it: "ring_attn_func",
    "ring_attn_varlen_func"; `grads`: graph_grads(q, k, v, learnable_sink), so that every rank joins the backward's
    ring, or none does), then the ring, then the sinks merged once into the global result.

    Args: q (B, S_local, Hq, D), k, v (B, S_local, Hkv, D), checked by check_ring_inputs; cu_seqlens
        (n_docs + 1,) global document boundaries of the flattened B rows (every row start one) or None;
        learnable_sink (Hq,) or None; softmax_scale, causal, the window's sides (None: no limit), softcap as the
        kernels take them; deterministic: for the backward (saved by the autograd registration).
    Returns:
        out (B, S_local, Hq, D) in q's dtype, contiguous; lse (B, Hq, S_local) float64 (with sinks, counting them);
        the fp32 out with the sinks merged in, for their gradient, where it is not out itself (_keeps_state),
        else an empty tensor; and the call's number on the group (number_call), a 0-dim int64 CPU tensor, which
        the backward's ranks agree on.
    Raises:
        ValueError, TypeError, RuntimeError: as ring_attn_func, on every rank alike.
    """
    group = _resolve_process_group(group_name)
    window = (window_left, window_right)
    with shared_refusals(call, group):
        check_ring_group(q, group)
        documents = checked_fingerprint(cu_seqlens, q.shape[0], q.shape[1] * dist.get_world_size(group))
    signature = ring_signature(q, k, v, softmax_scale, causal, layout, grads, documents, window, softcap,
                               learnable_sink is not None)  # fmt: skip
    check_agreement(call, signature, group)
    number = number_call(group, "ring")
    ops = capped_ops(KERNEL_OPS, softcap)
    out, lse = ring_attn_forward(RingComm(group), ops, q, k, v, softmax_scale, causal, layout,
                                 _ring_documents(cu_seqlens, q, group, layout, documents), window,
                                 keep_state=learnable_sink is not None)  # fmt: skip
    return *_sink_outputs(q, out, lse, learnable_sink), number  # the sinks once, after the ring: the lse is global


@ring_attn_fwd_op.register_fake
def _ring_attn_fwd_fake(q, k, v, cu_seqlens, learnable_sink, *options):
    return *_fake_outputs(q, learnable_sink), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("ringattn::ring_attn_bwd", mutates_args=())
def ring_attn_bwd_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    forward_call: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    window_left: int | None,
    window_right: int | None,
    softcap: float,
    deterministic: bool,
    group_name: str,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ring's backward as one custom op: (dq, dk, dv) shaped like q, k, v, contiguous, in q's dtype, from the
    forward's out (with sinks, merged in), lse and call number (`forward_call`, agreed across the ranks first: a
    rank differentiating another call raises on every rank) and the same arguments."""
    group = _resolve_process_group(group_name)
    check_backward("ring attention backward", forward_call, group)
    ops = capped_ops(kernel_ops(deterministic=True) if deterministic else KERNEL_OPS, softcap)
    grads = ring_attn_backward(RingComm(group), ops, dout, q, k, v, out, lse, softmax_scale, causal, layout,
                               _ring_documents(cu_seqlens, q, group, layout), (window_left, window_right))  # fmt: skip
    return tuple(g.contiguous() for g in grads)


@ring_attn_bwd_op.register_fake
def _ring_attn_bwd_fake(dout, q, k, v, *options):
    return tuple(torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v))


_SINK = 4  # learnable_sink's place among ringattn::ring_attn_fwd's arguments


def _ring_attn_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, sink, *options = inputs
    out, lse, state, number = output
    # with sinks that need their gradient, the backward runs on the unrounded out (see _sink_outputs)
    kept = state if state.numel() and ctx.needs_input_grad[_SINK] else out
    ctx.save_for_backward(q, k, v, kept, lse, cu_seqlens, sink)
    # the call's number kept on ctx, not saved: under activation checkpointing (without reentry) a saved one would be
    # the recomputation's, a new call's, and the backward would agree on that instead of the call it differentiates
    ctx.number = number
    ctx.options = options[:-2]  # softmax_scale .. layout, the backward's; not grads, call
    ctx.mark_non_differentiable(lse, state, number)


def _ring_attn_backward(ctx, dout, _dlse, _dstate, _dnumber):
    _check_not_double_backward()  # on every rank alike, before the ring
    q, k, v, out, lse, cu_seqlens, sink = ctx.saved_tensors
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):  # the ranks agreed on it (graph_grads): all run the ring, or none (sinks alone)
        dq, dk, dv = ring_attn_bwd_op(dout, q, k, v, out, lse, ctx.number, cu_seqlens, *ctx.options)
    # this rank's rows' share, as for any parameter the ranks hold alike (SequenceParallel.sync_gradients)
    dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[_SINK] else None
    return dq, dk, dv, None, dsink, *(None,) * 10


ring_attn_fwd_op.register_autograd(_ring_attn_backward, setup_context=_ring_attn_setup_context)


def graph_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None) -> str:
    """Which of q, k, v and the sink need gradients from a call's backward, "q,k,v,sink" or a part of it, "none" with
    grad mode off. Part of a ring call's signature: the ranks must agree on it, since the backward communicates for q,
    k and v (the ring, or Ulysses' all-to-alls, q's apart from k's and v's) and not for the sinks alone (a sink
    requiring grad on some ranks only made them part ways)."""
    if not torch.is_grad_enabled():
        return "none"
    tensors = {"q": q, "k": k, "v": v, "sink": sink}
    return ",".join(name for name, t in tensors.items() if t is not None and t.requires_grad) or "none"


def _ring_attn(call, q, k, v, cu_seqlens, sink, scale, causal, window, softcap, deterministic, group_name, layout):
    """(out, lse) of ringattn::ring_attn_fwd for checked arguments."""
    out, lse, *_ = ring_attn_fwd_op(q, k, v, cu_seqlens, sink, scale, causal, *window, softcap, deterministic,
                                    group_name, layout, graph_grads(q, k, v, sink), call)  # fmt: skip
    return out, lse


def ring_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Group = None,
    layout: str,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over one global sequence split across the ranks of `group`.

    Every rank of the group calls it with its own shard of the global sequence of
    S = W * S_local tokens (W ranks). With layout "contiguous", group rank r holds global tokens
    [r * S_local, (r + 1) * S_local). With layout "zigzag", the sequence is cut into 2W chunks
    of C = S_local / 2 tokens and rank r holds chunk r followed by chunk 2W - 1 - r, which
    balances causal work over the ranks (docs/design.md, section 4). ringattn.shard,
    ringattn.unshard and ringattn.position_ids map between full tensors and shards.
    Every argument after q, k, v is keyword-only, so that a positional flash-attn call cannot land
    in the wrong one.

    Under torch.compile (fullgraph=True or not) it is one call of the custom op ringattn::ring_attn_fwd, whose
    backward is ringattn::ring_attn_bwd: the checks of the Python arguments and of the tensors' shapes, dtypes and
    devices run while tracing; the agreement exchange and the checks of the group, the environment and (varlen)
    cu_seqlens' values run inside the op, at every call. A check that fails while tracing raises as
    agreement.shared_refusals says: on every rank without fullgraph (the frame runs eagerly), on its own rank with.

    Args:
        q: (batch, S_local, nheads, headdim), this rank's shard of the queries.
        k, v: (batch, S_local, nheads_k, headdim), this rank's shards; nheads % nheads_k == 0.
        dropout_p, alibi_slopes, return_attn_probs: as flash_attn_func's (their no-op values only).
        softmax_scale: defaults to 1 / sqrt(headdim).
        causal: causal over global positions.
        window_size: (left, right) sliding window over global positions, -1 for no limit (with causal, right is
            0). Steps whose K/V block lies outside every local query's window run no kernel, and K/V travel only
            as far as the windows reach, one way round the ring or both, in the rows they read
            (parallel.ring_streams): a window costs what the window costs, in either layout.
        softcap: as flash_attn_func's.
        learnable_sink: (nheads,) attention sinks, as flash_attn_func's, merged once into the global result; the
            gradient each rank gets is its own rows' share (sum it over the ring's ranks, as SequenceParallel's
            sync_gradients does for every parameter the ranks hold alike).
        deterministic: gradients with the same bits in every run, as in flash_attn_func (the ring's own order of
            accumulation is always fixed).
        group: the process group forming the ring (default: the world), or a 1-D DeviceMesh (a (dp, cp) mesh's
            mesh["cp"]: its ranks form the ring in the mesh's order). NCCL for CUDA tensors, gloo for CPU tensors
            (with TRITON_INTERPRET=1).
        layout: "contiguous" or "zigzag" (S_local must then be even), the layout the shards are in (ringattn.shard's,
            SequenceParallel.layout); all ranks pass the same. Required: with the shards in the other layout, a
            causal, windowed or packed call would be silently wrong.
        return_lse: also return this shard's lse.
    Returns:
        out (batch, S_local, nheads, headdim) in q's dtype, this rank's shard of the global
        attention output; with return_lse also lse (batch, nheads, S_local) fp32, natural log.
    Raises:
        ValueError, TypeError: bad local inputs on any rank, or ranks whose shapes, dtype, softmax_scale, causal,
            window_size, softcap or layout differ: the same error on every rank, from one small all_gather before
            the ring ($RINGATTN_AGREEMENT=always|off; with off, bad local inputs raise on their own rank only).
        RuntimeError: torch.distributed not initialised; tensors on a device the kernels cannot
            run on (CPU tensors need TRITON_INTERPRET=1 before ringattn is imported); on gloo, a
            peer that dies or does not arrive within $RINGATTN_P2P_TIMEOUT_S (default 300 s), in the
            forward or the backward, naming the peer and the ring step. On NCCL the process group's
            timeout and watchdog apply instead. In the backward, create_graph=True (no double backward).
    """
    group = ring_group(group)
    with shared_refusals("ring_attn_func", group):  # a rank's refusal raised by every rank, before the ring
        causal, window, softcap, deterministic = check_flash_attn_options(
            dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
        )
        return_lse = check_flag(return_lse, "return_lse")
        scale, group_name = check_ring_inputs(q, k, v, group, layout, softmax_scale, learnable_sink, softcap=softcap)
    out, lse = _ring_attn("ring_attn_func", q, k, v, None, learnable_sink, scale, causal, window, softcap,
                          deterministic, group_name, layout)  # fmt: skip
    return (out, public_lse(lse)) if return_lse else out


def ring_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    group: Group = None,
    layout: str,
    return_lse: bool = False,
    learnable_sink: torch.Tensor | None = None,
):
    """Exact attention over packed sequences of documents split across the ranks of `group`.

    Attention stays inside each document (and, causal, does not look ahead). Documents may have
    any length, cross rank and chunk boundaries, and be shorter than the world size. Sub-blocks
    whose documents never meet are skipped, not computed and masked. Every argument after
    cu_seqlens is keyword-only.

    One packed sequence: q, k, v are 3-D, this rank's shard of its tokens. A batch of B packed rows, each
    holding its own documents: q, k, v are 4-D (B, S_local, ...), this rank's shard of every row, and cu_seqlens
    follows flash-attn's (and Hugging Face's) convention: the boundaries of the flattened B * S tokens (row b's
    token t is token b * S + t, S = S_local * world_size), every row start b * S one of them. All rows travel the
    ring together: one K/V transfer per step, as ring_attn_func's batches.

    Args:
        q: (S_local, nheads, headdim), or (B, S_local, nheads, headdim): this rank's shard (in `layout`) of the
            packed queries.
        k, v: (S_local, nheads_k, headdim), or (B, S_local, nheads_k, headdim); nheads % nheads_k == 0.
        cu_seqlens: (n_docs + 1,) int32 or int64 global document boundaries: 0, ..., B * S_local * world_size
            (B = 1 for 3-D inputs), nondecreasing (a repeated boundary is an empty document, as flash-attn's),
            every multiple of S_local * world_size among them; the
            same on every rank. ringattn.cu_seqlens_from_position_ids builds it from packed position ids;
            ringattn.pad_cu_seqlens pads the total length; SequenceParallel.shard_batch builds it for a batch
            (ShardedBatch.cu_seqlens), padding masks included.
        causal: causal inside each document (default True).
        window_size: a sliding window inside each document, as ring_attn_func's.
        dropout_p, softmax_scale, softcap, alibi_slopes, deterministic, return_attn_probs, group, learnable_sink:
            as in ring_attn_func.
        layout: as in ring_attn_func (required).
        return_lse: also return lse (nheads, S_local), or (B, nheads, S_local) for 4-D inputs, fp32.
    Returns:
        out shaped like q, in q's dtype, and lse with return_lse.
    Raises:
        ValueError, TypeError: as ring_attn_func; q, k, v that are not all 3-D or all 4-D; a bad cu_seqlens (not
            ending at B * S, a row start that is not a boundary).
        RuntimeError: as ring_attn_func.
    """
    group = ring_group(group)
    call = "ring_attn_varlen_func"
    with shared_refusals(call, group):  # a rank's refusal raised by every rank, before the ring
        causal, window, softcap, deterministic = check_flash_attn_options(
            dropout_p, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
        )
        return_lse = check_flag(return_lse, "return_lse")
        rows = _check_varlen_ring_dims(q, k, v)
        if rows:
            q, k, v = q[None], k[None], v[None]
        scale, group_name = check_ring_inputs(q, k, v, group, layout, softmax_scale, learnable_sink, call, softcap)
        check_cu_seqlens_tensor(cu_seqlens)  # its values: in the op, at every call
    out, lse = _ring_attn(call, q, k, v, cu_seqlens, learnable_sink, scale, causal, window, softcap, deterministic,
                          group_name, layout)  # fmt: skip
    if rows:
        out, lse = out[0], lse[0]
    return (out, public_lse(lse)) if return_lse else out


def _check_varlen_ring_dims(q, k, v) -> bool:
    """Whether q, k, v are 3-D (one packed sequence) rather than 4-D (a batch of packed rows); raise ValueError
    unless they are tensors, all 3-D or all 4-D."""
    dims = [t.dim() if isinstance(t, torch.Tensor) else None for t in (q, k, v)]
    if dims not in ([3] * 3, [4] * 3):
        raise ValueError(
            "q, k and v must all be 3-D (S_local, nheads, headdim), one packed sequence, or all 4-D (batch, S_local, "
            f"nheads, headdim), a batch of packed rows; got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}"
        )
    return dims[0] == 3


def _shape(t) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
