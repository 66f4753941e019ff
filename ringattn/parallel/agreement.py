"""Cross-rank agreement: every rank of a ring must call it with the same shapes, dtype, causal,
softmax_scale and layout, or the P2P ops hang or exchange garbage (docs/design.md, section 7).

Before the ring, each rank encodes its call as a fixed-size int64 vector (`encode_signature`)
and one all_gather on the ring's group gives every rank every rank's vector; if they differ,
every rank raises the same ValueError naming what differs and each rank's value
(`describe_disagreement`). Encoding, decoding and the comparison are pure functions, tested
without communication; `check_agreement` is the one exchange.

$RINGATTN_AGREEMENT picks how often the exchange runs (read at every call):
- "once" (default): once per distinct signature per group, then cached on every rank. A rank
  whose signature changes exchanges again; if only some ranks change it, the others skip the
  exchange, and the mismatch surfaces as the P2P timeout of RingComm instead of this error.
- "always": every call (one small all_gather each; on NCCL it also syncs the host with the
  current stream, as the result must be read back).
- "off": never.
"""

import os
import struct
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import p2p_timeout_s, wait_all
from .layout import LAYOUTS

AGREEMENT_ENV = "RINGATTN_AGREEMENT"
AGREEMENT_MODES = ("once", "always", "off")
MAGIC = 0x52_49_4E_47  # "RING": a vector that does not start with it did not come from encode_signature
VERSION = 3
SIGNATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_CACHED_PER_GROUP = 64


class RingSignature(NamedTuple):
    """What every rank of a ring call must agree on."""

    batch: int
    seqlen_local: int
    heads_q: int
    heads_k: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    softmax_scale: float
    layout: str
    requires_grad: bool  # a rank that records no graph never joins the backward ring
    documents: int = 0  # fingerprint of cu_seqlens (ring_attn_varlen_func); 0 for one dense sequence
    window_left: int = -1  # the sliding window's sides, -1 for no limit
    window_right: int = -1
    softcap: float = 0.0
    sinks: bool = False  # whether learnable_sink is given


# how each field is named in errors: the argument it comes from
FIELD_LABELS = {
    "batch": "batch size (q.shape[0])",
    "seqlen_local": "local sequence length (q.shape[1])",
    "heads_q": "query heads (q.shape[2])",
    "heads_k": "key/value heads (k.shape[2])",
    "head_dim": "head dim (q.shape[3])",
    "dtype": "dtype",
    "causal": "causal",
    "softmax_scale": "softmax_scale",
    "layout": "layout",
    "requires_grad": "whether q, k or v require grad",
    "documents": "cu_seqlens (fingerprint)",
    "window_left": "window_size[0]",
    "window_right": "window_size[1]",
    "softcap": "softcap",
    "sinks": "learnable_sink (given or None)",
}
SIGNATURE_LEN = 2 + len(RingSignature._fields)


def ring_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    layout: str,
    documents: int = 0,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    sinks: bool = False,
) -> RingSignature:
    """The signature of one ring call from its (already validated) local arguments; `documents` is
    parallel.documents.fingerprint(cu_seqlens) for packed documents, window the sliding window (None: no limit)."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    batch, seqlen_local, heads_q, head_dim = q.shape
    return RingSignature(
        batch, seqlen_local, heads_q, k.shape[2], head_dim, q.dtype, bool(causal), float(softmax_scale), layout,
        requires_grad, documents, *(-1 if side is None else side for side in window), float(softcap), bool(sinks),
    )  # fmt: skip


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def encode_signature(sig: RingSignature) -> torch.Tensor:
    """int64 (SIGNATURE_LEN,): MAGIC, VERSION, then the fields; dtype and layout as indices into
    SIGNATURE_DTYPES and LAYOUTS, softmax_scale as its float64 bits (exact). Raises ValueError for
    a dtype or layout outside those tables."""
    if sig.dtype not in SIGNATURE_DTYPES:
        raise ValueError(f"dtype must be one of {SIGNATURE_DTYPES}, got {sig.dtype}")
    if sig.layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {sig.layout!r}")
    values = [MAGIC, VERSION]
    values += [sig.batch, sig.seqlen_local, sig.heads_q, sig.heads_k, sig.head_dim]
    values += [SIGNATURE_DTYPES.index(sig.dtype), int(sig.causal), _float_bits(sig.softmax_scale)]
    values += [LAYOUTS.index(sig.layout), int(sig.requires_grad), sig.documents]
    values += [sig.window_left, sig.window_right, _float_bits(sig.softcap), int(sig.sinks)]
    return torch.tensor(values, dtype=torch.int64)


def decode_signature(encoded: torch.Tensor | list[int]) -> RingSignature:
    """The inverse of encode_signature.

    Raises:
        ValueError: not a vector from encode_signature of this version (wrong length, magic or
            version, or a dtype/layout index out of range), e.g. when ranks run different ringattn
            versions or call different collectives.
    """
    values = encoded.tolist() if isinstance(encoded, torch.Tensor) else list(encoded)
    if len(values) != SIGNATURE_LEN or values[0] != MAGIC:
        raise ValueError(
            f"not a ring signature (length {len(values)}, expected {SIGNATURE_LEN} starting with {MAGIC:#x}): "
            "ranks are running different collectives"
        )
    if values[1] != VERSION:
        raise ValueError(f"ring signature version {values[1]}, expected {VERSION}: ranks run different ringattn")
    batch, seqlen, heads_q, heads_k, head_dim, dtype_i, causal, scale_bits, layout_i, grad, documents = values[2:13]
    window_left, window_right, softcap_bits, sinks = values[13:]
    if not (0 <= dtype_i < len(SIGNATURE_DTYPES) and 0 <= layout_i < len(LAYOUTS)):
        raise ValueError(f"ring signature with dtype index {dtype_i} or layout index {layout_i} out of range")
    return RingSignature(
        batch, seqlen, heads_q, heads_k, head_dim, SIGNATURE_DTYPES[dtype_i], bool(causal), _bits_float(scale_bits),
        LAYOUTS[layout_i], bool(grad), documents, window_left, window_right, _bits_float(softcap_bits), bool(sinks),
    )  # fmt: skip


def _show(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value) if isinstance(value, str) else str(value)


def describe_disagreement(signatures: list[RingSignature]) -> str | None:
    """None when all signatures (one per group rank, in group-rank order) are equal; otherwise a message
    naming the function called (ring_attn_varlen_func when some rank passed documents), every field that differs
    and each rank's value, the same text on every rank."""
    if all(s == signatures[0] for s in signatures):
        return None
    parts = []
    for field in RingSignature._fields:
        values = [getattr(s, field) for s in signatures]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(values))
            parts.append(f"{FIELD_LABELS[field]} ({per_rank})")
    function = "ring_attn_varlen_func" if any(s.documents for s in signatures) else "ring_attn_func"
    return (
        f"{function}: the ranks of the group disagree on " + "; ".join(parts) + ". Every rank of the ring "
        "must pass the same shapes, dtype, softmax_scale, causal and layout (and all or none need gradients)."
    )


def agreement_mode() -> str:
    """$RINGATTN_AGREEMENT, default "once". Raises ValueError for a value not in AGREEMENT_MODES."""
    mode = os.environ.get(AGREEMENT_ENV, "").strip().lower() or "once"
    if mode not in AGREEMENT_MODES:
        raise ValueError(f"${AGREEMENT_ENV} must be one of {AGREEMENT_MODES}, got {os.environ[AGREEMENT_ENV]!r}")
    return mode


_validated: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[RingSignature, None]]" = weakref.WeakKeyDictionary()


def clear_agreement_cache() -> None:
    """Forget every signature validated so far (the next call on each group exchanges again)."""
    _validated.clear()


def _exchange_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    """CPU when the group's backend carries CPU tensors (gloo, or a gloo+nccl group): no GPU sync."""
    backend = str(dist.get_backend(group)).lower()
    return torch.device("cpu") if "gloo" in backend else device


def exchange_signatures(
    sig: RingSignature, group: dist.ProcessGroup, device: torch.device, timeout_s: float | None = None
) -> list[RingSignature]:
    """All ranks' signatures, in group-rank order: one all_gather of SIGNATURE_LEN int64 per rank.

    Raises:
        RuntimeError: on CPU (gloo), the exchange did not complete within timeout_s (default as RingComm).
        ValueError: a rank sent something that is not a signature (decode_signature).
    """
    world_size = dist.get_world_size(group)
    device = _exchange_device(group, device)
    local = encode_signature(sig).to(device)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    work = dist.all_gather(gathered, local, group=group, async_op=True)
    if device.type == "cpu":
        what = f"ring_attn_func's agreement check (all_gather) on group rank {dist.get_rank(group)} of {world_size}"
        wait_all([work], p2p_timeout_s(timeout_s), what)
    else:
        work.wait()
    return [decode_signature(t.cpu()) for t in gathered]


def check_agreement(
    sig: RingSignature, group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None
) -> None:
    """Raise the same ValueError on every rank when the ranks of `group` called with different signatures.

    A collective on `group` (every rank must call it) unless $RINGATTN_AGREEMENT is "off", or "once"
    (the default) and `sig` was already validated on this group.
    Raises:
        ValueError: the ranks disagree (describe_disagreement), or $RINGATTN_AGREEMENT is invalid.
        RuntimeError: a rank did not arrive within the timeout (gloo).
    """
    mode = agreement_mode()
    if mode == "off":
        return
    group = group if group is not None else dist.group.WORLD
    cached = _validated.setdefault(group, {})
    if mode == "once" and sig in cached:
        return
    message = describe_disagreement(exchange_signatures(sig, group, device, timeout_s))
    if message is not None:
        raise ValueError(message)
    cached[sig] = None
    if len(cached) > MAX_CACHED_PER_GROUP:  # bounded: the oldest signature is validated again if it returns
        del cached[next(iter(cached))]
