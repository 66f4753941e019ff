"""Cross-rank agreement: every collective call of ringattn starts by comparing the ranks' calls, so that a rank
that calls differently, or refuses its input, makes every rank raise the same error instead of a hang, a gloo abort
or a silently wrong result (docs/design.md, section 7).

Each rank encodes its call as a header of HEADER_LEN int64 (`encode_header`): the call's name (ring_attn_func,
unshard, ...), whether this rank refuses the call (its local checks raised) and the fields every rank must pass
alike (a NamedTuple per call: RingSignature, ShardSignature, UnshardSignature). One all_gather of the headers on a
CPU channel of the group (`cpu_channel`) gives every rank every header before any of the call's data moves: the
same size for every call, it can neither abort gloo on a size mismatch nor be mistaken for data. Every rank then
decides from the same headers, so all raise the same error:
- a rank refused: a second all_gather carries the refusals' messages, and every rank raises the first refusing
  rank's exception type with every refusal's message (`describe_refusals`);
- the ranks make different calls, or the same call with different fields: a ValueError naming what differs and each
  rank's value (`describe_disagreement`). Ranks making different calls are out of step (one skipped a call, or
  raised alone and went on): no later exchange could tell which calls belong together, so each leaves the group
  unusable (comm.mark_unusable) and every later call on it raises at once.
Encoding, decoding and the descriptions are pure functions, tested without communication.

$RINGATTN_AGREEMENT (read at every call): "always" (default), or "off": no exchange at all, a local refusal raises on
its own rank only and ranks that differ are not caught. Set it alike on every rank.
"""

import contextlib
import functools
import hashlib
import os
import struct
import typing
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import CommunicationError, check_usable, mark_unusable, p2p_timeout_s, wait_all
from .groups import or_world

AGREEMENT_ENV = "RINGATTN_AGREEMENT"
AGREEMENT_MODES = ("always", "off")
MAGIC = 0x52_49_4E_47  # "RING": a vector that does not start with it did not come from encode_header
VERSION = 7
HEADER_LEN = 40  # int64, the same for every call
NAME_SLOTS = 4  # the call's name: up to 32 bytes of UTF-8
FIELD_SLOTS = HEADER_LEN - 4 - NAME_SLOTS  # after magic, version, the name, the refusal and its message's length
MAX_DIMS = 16  # a shape field: its number of dims, then up to MAX_DIMS sizes
TEXT_SLOTS = 2  # a str field (a layout): up to 16 bytes of UTF-8
MAX_MESSAGE_BYTES = 4096
REFUSALS = (ValueError, TypeError, NotImplementedError, RuntimeError)  # what local checks raise (a subclass before
# its base); every rank raises the same type
Shape = tuple[int, ...]


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
    grads: str  # functional.graph_grads: which of q, k, v and the sink the backward (which communicates) serves
    documents: int = 0  # fingerprint of cu_seqlens (ring_attn_varlen_func); 0 for one dense sequence
    window_left: int = -1  # the sliding window's sides, -1 for no limit
    window_right: int = -1
    softcap: float = 0.0
    sinks: bool = False  # whether learnable_sink is given

    labels = {  # how each field is named in errors: the argument it comes from
        "batch": "batch size (q.shape[0])",
        "seqlen_local": "local sequence length (q.shape[1])",
        "heads_q": "query heads (q.shape[2])",
        "heads_k": "key/value heads (k.shape[2])",
        "head_dim": "head dim (q.shape[3])",
        "dtype": "dtype",
        "causal": "causal",
        "softmax_scale": "softmax_scale",
        "layout": "layout",
        "grads": "which of q, k, v and learnable_sink require grad",
        "documents": "cu_seqlens (fingerprint)",
        "window_left": "window_size[0]",
        "window_right": "window_size[1]",
        "softcap": "softcap",
        "sinks": "learnable_sink (given or None)",
    }
    expected = (
        "Every rank of the ring must pass the same shapes, dtype, softmax_scale, causal, window_size, softcap, layout "
        "and learnable_sink or None (and the same of q, k, v and learnable_sink need gradients)."
    )


class ShardSignature(NamedTuple):
    """What every rank of shard must agree on: the full tensor x's shape and dtype, dim (in [0, x.dim())), layout."""

    shape: Shape
    dtype: torch.dtype
    dim: int
    layout: str

    labels = {"shape": "x.shape", "dtype": "x.dtype", "dim": "dim", "layout": "layout"}
    expected = "Every rank must pass the same full tensor x, dim and layout."


class UnshardSignature(ShardSignature):
    """What every rank of unshard must agree on: the same fields, of its shard x_local."""

    labels = {"shape": "x_local.shape", "dtype": "x_local.dtype", "dim": "dim", "layout": "layout"}
    expected = "Every rank must pass a shard of the same shape and dtype, with the same dim and layout."


class ShardBatchSignature(NamedTuple):
    """What every rank of SequenceParallel.shard_batch must agree on besides the batch's tensors (compared by digest
    apart from this): its scalar options."""

    shift: bool
    ignore_index: int
    pad_id: int

    labels = {"shift": "shift", "ignore_index": "ignore_index", "pad_id": "pad_id"}
    expected = "Every rank must pass the same shift, ignore_index and pad_id."


class CrossEntropySignature(NamedTuple):
    """What every rank of cross_entropy must agree on: its scalar options and the vocab (the rows may differ: over a
    data-parallel group each ring has its own batches)."""

    ignore_index: int
    grad_reduction: str
    vocab: int
    num_items_in_batch: float  # -inf: None (else an int, exact below 2^53)

    labels = {"ignore_index": "ignore_index", "grad_reduction": "grad_reduction", "vocab": "logits.shape[-1] (vocab)",
              "num_items_in_batch": "num_items_in_batch (-inf: None)"}  # fmt: skip
    expected = (
        "Every rank must pass logits over the same vocab, and the same ignore_index, grad_reduction and "
        "num_items_in_batch."
    )


class SyncGradientsSignature(NamedTuple):
    """What every rank of sync_gradients must agree on: its parameters."""

    parameters: int
    layout: int  # CRC32 of the parameters' shapes and dtypes, in order

    labels = {"parameters": "the number of parameters", "layout": "the parameters' shapes and dtypes (their CRC32)"}
    expected = "Every rank must pass the same parameters, in the same order."


class BackwardSignature(NamedTuple):
    """What every rank of a backward that communicates must agree on: the forward call it differentiates, numbered in
    the order the group's ranks made those calls (number_call)."""

    forward_call: int

    distinct = True  # every call's fields differ: not worth keeping its encoding (_own_header)
    labels = {"forward_call": "the forward call whose backward this is (numbered in call order)"}
    expected = (
        "Every rank must run the backwards of the same calls in the same order: backward the same losses in the "
        "same order on every rank."
    )


# per group (the object, not its name: a group made after another's destroy_process_group may take its name), per
# kind of call on it: the calls counted so far; an entry goes with its group
_calls: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, int]]" = weakref.WeakKeyDictionary()


def number_call(group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """This call's number among the calls of `kind` ("ring", ...) counted on `group` (0, 1, ...), a 0-dim int64 CPU
    tensor: the same on every rank of a group whose calls are agreed one by one in the same order. Its backward
    agrees on it (check_backward)."""
    calls = _calls.setdefault(group, {})
    number = calls.get(kind, 0)
    calls[kind] = number + 1
    return torch.tensor(number)


def check_backward(call: str, number: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Raise the same ValueError on every rank of `group` unless every rank is differentiating the forward call
    numbered `number` (number_call); a collective, as check_agreement."""
    check_agreement(call, BackwardSignature(int(number)), group)


def ring_signature(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    layout: str,
    grads: str,
    documents: int = 0,
    window: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    sinks: bool = False,
) -> RingSignature:
    """The signature of one ring call from its (already validated) local arguments; `grads` which of q, k, v and the
    sink require grad in a call that records a graph (functional.graph_grads), `documents`
    parallel.documents.fingerprint(cu_seqlens) for packed documents, window the sliding window (None: no limit)."""
    batch, seqlen_local, heads_q, head_dim = q.shape
    return RingSignature(
        batch, seqlen_local, heads_q, k.shape[2], head_dim, q.dtype, bool(causal), float(softmax_scale), layout,
        grads, documents, *(-1 if side is None else side for side in window), float(softcap),
        bool(sinks),
    )  # fmt: skip


class Header(NamedTuple):
    """A decoded header: the call, the type a refusing rank raised (None: it does not refuse) with its message's
    length in bytes, whether that message is already an agreed description (`is_described`), and the raw field
    slots (decode_fields reads them)."""

    call: str
    refusal: type[Exception] | None
    message_bytes: int
    fields: tuple[int, ...]
    described: bool = False


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


@functools.cache
def _dtype_code(dtype: torch.dtype) -> int:
    """A stable int64 naming the dtype (ranks need not number dtypes alike)."""
    return int.from_bytes(hashlib.blake2b(str(dtype).encode(), digest_size=8).digest(), "little", signed=True)


_DTYPE_OF_CODE = {_dtype_code(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


@functools.cache
def _kinds(cls: type) -> tuple[tuple[str, type], ...]:
    """(field, type) of a signature class, in field order."""
    hints = typing.get_type_hints(cls)
    return tuple((name, hints[name]) for name in cls._fields)


def _encode_text(text: str, slots: int, label: str) -> list[int]:
    """`text` as UTF-8 in `slots` int64. Raises ValueError when longer than slots * 8 bytes."""
    raw = text.encode()
    if len(raw) > slots * 8:
        raise ValueError(f"{label} must be at most {slots * 8} bytes of UTF-8, got {text!r}")
    raw = raw.ljust(slots * 8, b"\0")
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]


def _decode_text(slots: list[int]) -> str:
    raw = b"".join(v.to_bytes(8, "little", signed=True) for v in slots)
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def _encode_value(kind, value, label: str) -> list[int]:
    if kind == Shape:
        if len(value) > MAX_DIMS:
            raise ValueError(f"{label} must have at most {MAX_DIMS} dims, got {len(value)}")
        return [len(value), *value, *[0] * (MAX_DIMS - len(value))]
    if kind is float:
        return [_float_bits(value)]
    if kind is torch.dtype:
        return [_dtype_code(value)]
    if kind is str:
        return _encode_text(value, TEXT_SLOTS, label)
    return [int(value)]  # int, bool


def _decode_value(kind, slots: list[int]):
    """The value of one field from its slots (as many as _encode_value wrote), and how many slots it took."""
    if kind == Shape:
        ndim = slots[0]
        if not 0 <= ndim <= MAX_DIMS:
            raise ValueError(f"ringattn call header with a shape of {ndim} dims: ranks run different ringattn")
        return tuple(slots[1 : 1 + ndim]), 1 + MAX_DIMS
    if kind is float:
        return _bits_float(slots[0]), 1
    if kind is torch.dtype:
        return _DTYPE_OF_CODE.get(slots[0], f"unknown dtype {slots[0]:#x}"), 1
    if kind is str:
        return _decode_text(slots[:TEXT_SLOTS]), TEXT_SLOTS
    return kind(slots[0]), 1


def encode_header(call: str, fields: tuple | None = None, refusal: BaseException | None = None) -> torch.Tensor:
    """int64 (HEADER_LEN,): MAGIC, VERSION, the call's name, the refusal (0, or 1 + its index in REFUSALS, plus
    len(REFUSALS) when its message is already an exchange's description: is_described) and its message's length
    in bytes, then the fields (none when refusing): floats as their float64 bits (exact), dtypes by name, strings
    (layouts) as UTF-8, shapes as their length and up to MAX_DIMS sizes.

    Raises:
        ValueError: a name of more than NAME_SLOTS * 8 bytes, a str field of more than TEXT_SLOTS * 8, a shape of
            more than MAX_DIMS dims; fields taking more than FIELD_SLOTS slots.
    """
    values = [MAGIC, VERSION, *_encode_text(call, NAME_SLOTS, "the call's name")]
    values += [_refusal_kind(refusal), len(_message(refusal))]
    if fields is not None and refusal is None:
        slots = []
        for name, kind in _kinds(type(fields)):
            slots += _encode_value(kind, getattr(fields, name), type(fields).labels[name])
        if len(slots) > FIELD_SLOTS:
            raise ValueError(f"{type(fields).__name__} takes {len(slots)} slots of a header's {FIELD_SLOTS}")
        values += slots
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def _refusal_kind(refusal: BaseException | None) -> int:
    if refusal is None:
        return 0
    index = next(i for i, kind in enumerate(REFUSALS) if isinstance(refusal, kind))
    return 1 + index + (len(REFUSALS) if is_described(refusal) else 0)


_DESCRIBED = "ringattn_described"  # the attribute that marks an error raised with an exchange's description


def described_error(kind: type[Exception], message: str) -> Exception:
    """The error an exchange raises on every rank: `kind(message)`, marked as a description (is_described)."""
    err = kind(message)
    setattr(err, _DESCRIBED, True)
    return err


def is_described(err: BaseException) -> bool:
    """Whether `err` was raised by an agreement exchange (described_error: its message describes a group's
    refusals): shared again on another group (a grid's ring after its Ulysses group), it is kept whole."""
    return getattr(err, _DESCRIBED, False)


def _message(refusal: BaseException | None) -> bytes:
    return b"" if refusal is None else str(refusal).encode()[:MAX_MESSAGE_BYTES]


def decode_header(encoded: torch.Tensor | list[int]) -> Header:
    """The inverse of encode_header, leaving the fields encoded.

    Raises:
        ValueError: not a vector from encode_header of this version (wrong length, magic, version or refusal),
            e.g. when ranks run different ringattn versions, or one runs a collective of its own.
    """
    values = encoded.tolist() if isinstance(encoded, torch.Tensor) else list(encoded)
    if len(values) != HEADER_LEN or values[0] != MAGIC:
        got = f"length {len(values)}" if len(values) != HEADER_LEN else f"starting with {values[0]:#x}"
        raise ValueError(
            f"not a ringattn call header ({got}, expected {HEADER_LEN} int64 starting with {MAGIC:#x}): "
            "ranks are running different collectives"
        )
    if values[1] != VERSION:
        raise ValueError(f"ringattn call header version {values[1]}, expected {VERSION}: ranks run different ringattn")
    refusal, message_bytes = values[2 + NAME_SLOTS : 4 + NAME_SLOTS]
    if not 0 <= refusal <= 2 * len(REFUSALS) or not 0 <= message_bytes <= MAX_MESSAGE_BYTES:
        raise ValueError(f"ringattn call header with refusal {refusal} of {message_bytes} bytes out of range")
    call = _decode_text(values[2 : 2 + NAME_SLOTS])
    kind = REFUSALS[(refusal - 1) % len(REFUSALS)] if refusal else None
    return Header(call, kind, message_bytes, tuple(values[4 + NAME_SLOTS :]), refusal > len(REFUSALS))


def decode_fields(cls: type, slots: tuple[int, ...]) -> tuple:
    """The fields of signature class `cls` from a Header's field slots. Raises ValueError for slots out of range."""
    values, offset = [], 0
    for _, kind in _kinds(cls):
        value, width = _decode_value(kind, list(slots[offset:]))
        values.append(value)
        offset += width
    return cls(*values)


def _show(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value) if isinstance(value, str) else str(value)


def describe_disagreement(headers: list[Header], cls: type | None) -> str | None:
    """None when every rank (one header per group rank, in group-rank order) makes the same call with the same
    fields of signature class `cls` (None: a call without fields); otherwise a message naming the calls, or every
    field that differs, with each rank's value: the same text on every rank."""
    calls = [h.call for h in headers]
    if any(c != calls[0] for c in calls):
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        return (
            f"the ranks of the group make different collective calls ({per_rank}): every rank must make the same "
            "ringattn calls in the same order. Ranks out of step (one skipped a call, or an error raised on some "
            "ranks alone, in their own code or a backward, and a loop that went on) cannot be paired up again: "
            "later calls on this group raise; exit, or destroy the group and create a new one on every rank"
        )
    if cls is None or all(h.fields == headers[0].fields for h in headers):
        return None
    signatures = [decode_fields(cls, h.fields) for h in headers]
    parts = []
    for field in cls._fields:
        values = [getattr(s, field) for s in signatures]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {_show(v)}" for r, v in enumerate(values))
            parts.append(f"{cls.labels[field]} ({per_rank})")
    if not parts:  # the slots past this call's fields differ: another rank's signature is longer, a grid's
        parts.append("the call's form (some ranks call it over a Ulysses x ring grid, some not: every rank must "
                     "pass the same ulysses_group, or a mesh)")  # fmt: skip
    return f"{calls[0]}: the ranks of the group disagree on " + "; ".join(parts) + ". " + cls.expected


_ON_EVERY_RANK = " (raised on every rank of the group)"


def describe_refusals(
    headers: list[Header], messages: list[str], global_ranks: list[int] | None = None
) -> tuple[type[Exception], str]:
    """The error every rank raises when some refused (headers and messages in group-rank order): the type the
    first refusing rank raised, and each refusal's call, group ranks (with their global ranks, `global_ranks` of
    each group rank, where the group is not the world in rank order: a ring or Ulysses group of a grid) and message.
    A message that is already such a description (header.described: a refusal shared on another group first, as
    grid.shared_grid_refusals does) is kept as it is."""
    by_refusal: dict[tuple[str, str, bool], list[int]] = {}
    for rank, (header, message) in enumerate(zip(headers, messages, strict=True)):
        if header.refusal is not None:
            by_refusal.setdefault((header.call, message, header.described), []).append(rank)
    parts = []
    for (call, message, described), ranks in by_refusal.items():
        if described:
            parts.append(message.removesuffix(_ON_EVERY_RANK))
            continue
        which = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        which += f" of {len(headers)}"
        if global_ranks is not None:
            which += f" (global rank{'s' if len(ranks) > 1 else ''} {', '.join(str(global_ranks[r]) for r in ranks)})"
        parts.append(f"{call} refused on group {which}: {message}")
    kind = next(h.refusal for h in headers if h.refusal is not None)
    return kind, "; ".join(parts) + _ON_EVERY_RANK


def agreement_mode() -> str:
    """$RINGATTN_AGREEMENT, default "always". Raises ValueError for a value not in AGREEMENT_MODES."""
    mode = os.environ.get(AGREEMENT_ENV, "").strip().lower() or "always"
    if mode not in AGREEMENT_MODES:
        raise ValueError(f"${AGREEMENT_ENV} must be one of {AGREEMENT_MODES}, got {os.environ[AGREEMENT_ENV]!r}")
    return mode


# ring group -> (its gloo twin, or None for the group itself: a value must not hold its key, which would then live
# past destroy_process_group; the twin's rank of each group rank, or None when they are the same), and per world
# (a new one after destroy_process_group) the gloo twins by their ranks
_channels: "weakref.WeakKeyDictionary[dist.ProcessGroup, tuple[dist.ProcessGroup | None, list[int] | None]]"
_channels = weakref.WeakKeyDictionary()
_twins: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[int, ...], dist.ProcessGroup]]"
_twins = weakref.WeakKeyDictionary()


def cpu_channel(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, list[int] | None]:
    """Where `group`'s headers travel, as CPU tensors: (channel, the channel rank of each group rank, or None when
    they are the same).

    The group itself when its backend carries CPU tensors (gloo, or "cpu:gloo,cuda:nccl"); otherwise (NCCL) a gloo
    group of the same ranks, created at the first call on the group (only its ranks take part: _gloo_twin, whose one
    all_gather on the group is the only GPU work) and shared by the groups of the same ranks: no wait for the stream
    at the calls after.
    """
    group = or_world(group)
    found = _channels.get(group)
    if found is None:
        if "gloo" in str(dist.get_backend(group)).lower():
            found = (None, None)
        else:
            ranks = dist.get_process_group_ranks(group)  # in group-rank order
            twin_ranks = tuple(sorted(ranks))
            twins = _twins.setdefault(dist.group.WORLD, {})
            if twin_ranks not in twins:
                twins[twin_ranks] = _gloo_twin(group, twin_ranks)
            order = [twin_ranks.index(r) for r in ranks]
            found = (twins[twin_ranks], None if order == list(range(len(order))) else order)
        _channels[group] = found
    return group if found[0] is None else found[0], found[1]


def _gloo_twin(group: dist.ProcessGroup, ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A gloo group of `ranks` (group's, sorted), made by those ranks alone (use_local_synchronization). torch names
    such a group by its ranks and the number of groups this process belongs to, which differs between ranks that
    belong to different other groups (a subgroup of some ranks only): the names would differ, and the group's
    rendezvous never complete. So the ranks first agree on that number over `group` itself (one all_gather, on the
    GPU for NCCL) and bring theirs up to the largest with groups of their own rank alone."""
    registered = dist.distributed_c10d._world.pg_names  # what torch's name counts
    device = group.bound_device_id  # init_process_group(device_id=...)'s, else the process's current GPU
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mine = torch.tensor([len(registered)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(counts, mine, group=group)
    largest = int(torch.stack(counts).max())  # one read back
    while len(registered) < largest:
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
    return dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)


def _all_gather(local: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float, what: str) -> torch.Tensor:
    """(W, n): every group rank's `local` (a CPU tensor of n elements on every rank), in group-rank order, through
    cpu_channel(group). Raises RuntimeError when a rank does not take part within timeout_s."""
    channel, order = cpu_channel(group)
    gathered = local.new_empty(dist.get_world_size(channel), local.numel())  # one buffer, a row per rank
    wait_all([dist.all_gather(list(gathered), local, group=channel, async_op=True)], timeout_s, what, None, group)
    return gathered if order is None else gathered[order]


def gather_on_cpu(local: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> torch.Tensor:
    """(W, n): every group rank's `local` (a CPU tensor of n elements on every rank), in group-rank order, over the
    group's CPU channel (cpu_channel): metadata a collective must agree on before its data moves. Raises
    RuntimeError naming `what` when a rank does not take part within the P2P timeout."""
    return _all_gather(local, group, p2p_timeout_s(), what)


def _exchanges(group: dist.ProcessGroup | None) -> bool:
    """Whether calls on `group` exchange headers: $RINGATTN_AGREEMENT is not "off", torch.distributed is
    initialised, and `group` is None or a ProcessGroup of 2 or more ranks. Raises ValueError for an unknown
    $RINGATTN_AGREEMENT."""
    if agreement_mode() == "off" or not (dist.is_available() and dist.is_initialized()):
        return False
    return (group is None or isinstance(group, dist.ProcessGroup)) and dist.get_world_size(group) > 1


@functools.lru_cache(maxsize=256)
def _own_header(call: str, fields: tuple | None) -> tuple[torch.Tensor, list[int]]:
    """encode_header(call, fields) as a tensor and a list (neither modified by their users): a rank's calls repeat
    (every layer's alike), so each distinct call is encoded once. Raises ValueError as encode_header."""
    header = encode_header(call, fields)
    return header, header.tolist()


def _exchange(call: str, fields: tuple | None, refusal: Exception | None, group) -> None:
    """One exchange of headers on `group`, then the agreed error on every rank, if any (always, when refusing).
    Raises ValueError for a bad P2P timeout (the exchange's) before any communication."""
    timeout_s = p2p_timeout_s()
    what = f"{call}'s agreement check (all_gather) on group rank {dist.get_rank(group)}"
    what += f" of {dist.get_world_size(group)}"
    check_usable(group, what)
    try:
        if refusal is not None:
            header, own = encode_header(call, None, refusal), None
        elif getattr(fields, "distinct", False):
            header = encode_header(call, fields)
            own = header.tolist()
        else:
            header, own = _own_header(call, fields)
    except ValueError as err:  # a field that cannot travel (a shape of too many dims): refused like a local check
        refusal, header, own = err, encode_header(call, None, err), None
    rows = _all_gather(header, group, timeout_s, what).tolist()
    if all(row == own for row in rows):  # every rank sent this rank's header: no refusal, the same call
        return
    headers = [decode_header(row) for row in rows]
    if any(h.refusal is not None for h in headers):
        local = torch.zeros(max(1, *(h.message_bytes for h in headers)), dtype=torch.uint8)  # gloo: not empty
        own_message = _message(refusal)
        local[: len(own_message)] = torch.tensor(list(own_message), dtype=torch.uint8)
        texts = [bytes(t[: h.message_bytes].tolist()).decode("utf-8", "replace") for t, h in
                 zip(_all_gather(local, group, timeout_s, what), headers, strict=True)]  # fmt: skip
        # global ranks where they are not the group ranks (a subgroup), and only where they map the rows one to one
        in_order = list(range(len(headers)))
        global_ranks = in_order if group is None else dist.get_process_group_ranks(group)
        named = len(global_ranks) == len(headers) and global_ranks != in_order
        kind, message = describe_refusals(headers, texts, global_ranks if named else None)
        raise described_error(kind, message) from refusal
    message = describe_disagreement(headers, None if fields is None else type(fields))
    if message is not None:
        if any(h.call != headers[0].call for h in headers):  # out of step: no later call could pair them up
            calls = ", ".join(f"rank {r}: {h.call}" for r, h in enumerate(headers))
            mark_unusable(group, f"its ranks fell out of step at an earlier call ({calls})")
        raise described_error(ValueError, message)


def check_agreement(call: str, fields: tuple | None, group: dist.ProcessGroup | None) -> None:
    """Raise the same ValueError on every rank when the ranks of `group` do not all make call `call` with the same
    `fields` (a signature NamedTuple, or None for a call without fields).

    A collective on `group` (every rank must call it, before the call's data moves) unless $RINGATTN_AGREEMENT is
    "off", torch.distributed is not initialised or the group has one rank. A rank whose local checks refused the
    call takes part through `shared_refusals` instead, and every rank then raises its error.
    Raises:
        ValueError: the ranks disagree (describe_disagreement), or $RINGATTN_AGREEMENT is invalid.
        ValueError, TypeError, RuntimeError: another rank refused the call (describe_refusals).
        RuntimeError: a rank did not take part within the P2P timeout.
    """
    if _exchanges(group):
        _exchange(call, fields, None, group)


@contextlib.contextmanager
def shared_refusals(call: str, group: dist.ProcessGroup | None):
    """Run the local checks of collective `call` on `group`: an error of REFUSALS they raise takes part in the
    agreement exchange, so that every rank raises it (the same type and message) from the check_agreement it is in.

    Usage: ``with shared_refusals("unshard", group): <local checks>`` then ``check_agreement("unshard", fields,
    group)``. Where there is no exchange (agreement "off", one rank, or no valid group to exchange on: the error
    names that) the error is raised on its own rank, unchanged. So it is while torch.compile traces the checks (a
    trace runs no collective): without fullgraph the call then runs eagerly, and shares its refusal; with
    fullgraph=True Dynamo raises it on this rank (torch._dynamo.exc.Unsupported, "Observed exception", naming it),
    and the other ranks' exchange fails when this one stops or at the P2P timeout.
    """
    try:
        yield
    except REFUSALS as refusal:
        if torch.compiler.is_compiling() or isinstance(refusal, CommunicationError):  # no exchange after a failed one
            raise
        try:
            exchanges = _exchanges(group)
        except REFUSALS:  # the setting or the group is what is wrong: this rank cannot exchange
            exchanges = False
        if not exchanges:
            raise
        _exchange(call, None, refusal, group)
