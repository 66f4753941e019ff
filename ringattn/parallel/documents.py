"""Packed variable-length documents in the ring: boundaries, per-token document ids, and which
(query rows, key rows) blocks can meet at all (docs/design.md, "Packed documents").

A packed sequence of S tokens holds documents back to back; `cu_seqlens` (int32 or int64, n_docs + 1
entries, 0 first, S last, nondecreasing) gives their boundaries. Token t belongs to
document d when cu_seqlens[d] <= t < cu_seqlens[d + 1]; a repeated boundary is an empty document (static-shape
packing pads the boundaries so), which holds no token and changes nothing. A query sees only keys of its own
document. A batch of B packed rows of S tokens each follows flash-attn's convention: `cu_seqlens` gives the
boundaries of the flattened B * S tokens (row b's token t is token b * S + t), and every row start b * S is
a boundary, so no document crosses rows. Every rank can compute the document ids of every other rank's shard
from the global cu_seqlens, so ids never travel the ring.
"""

import hashlib
import struct
from typing import NamedTuple

import torch

from .layout import check_multiple, shard_indices

_SHARD_DOCUMENTS: dict[tuple, "ShardDocuments"] = {}


def check_cu_seqlens_tensor(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> None:
    """Raise unless `cu_seqlens` is a 1-D int32 or int64 tensor of at least 2 entries whose values can be read: the
    checks of check_cu_seqlens that read no value (no host sync; torch.compile traces them).

    Raises:
        TypeError: not a tensor, or not int32 or int64.
        ValueError: not 1-D with at least 2 entries, or on the meta device (no values to read).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with n_docs + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    check_readable(cu_seqlens, name)


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str = "cu_seqlens", row: int | None = None) -> None:
    """Raise unless `cu_seqlens` is a 1-D int32 or int64 tensor of document boundaries of a `total`-token sequence;
    with `row`, of total / row packed rows of `row` tokens each, flattened: every row start a boundary. Documents
    may be empty (a boundary repeated), as flash-attn's.

    Raises:
        TypeError: not a tensor, or not int32 or int64.
        ValueError: not 1-D with at least 2 entries, on the meta device (no values to read), not starting at 0,
            decreasing, or not ending at `total`; a row
            start that is not a boundary (a document crossing rows).
    """
    check_cu_seqlens_tensor(cu_seqlens, name)
    bounds = cu_seqlens.cpu()
    if bounds[0].item() != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0].item()}")
    if not bool((bounds[1:] >= bounds[:-1]).all()):
        raise ValueError(f"{name} must be nondecreasing (documents of length >= 0), got {bounds.tolist()}")
    if bounds[-1].item() != total:
        rows = "" if row is None or row == total else f" ({total // row} rows of {row} tokens)"
        raise ValueError(f"{name} must end at the global length {total}{rows}, got {bounds[-1].item()}")
    if row is not None and row < total:
        starts = torch.arange(row, total, row, dtype=bounds.dtype)
        missing = starts[~torch.isin(starts, bounds)]
        if missing.numel():
            raise ValueError(
                f"{name} must hold every row start of the flattened batch (multiples of the row length {row}) as a "
                f"document boundary: a document cannot cross rows; missing {missing[:4].tolist()}"
            )


def fingerprint(cu_seqlens: torch.Tensor) -> int:
    """A nonzero int64 fingerprint of the boundaries, for the cross-rank agreement check."""
    bounds = cu_seqlens.cpu().to(torch.int64).tolist()  # no numpy: it is not a dependency
    digest = hashlib.blake2b(struct.pack(f"<{len(bounds)}q", *bounds), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) | 1


def checked_fingerprint(cu_seqlens: torch.Tensor | None, batch: int, row: int) -> int:
    """A ring call's `documents` signature field: 0 for one dense sequence a row (None), else the boundaries of `batch`
    packed rows of `row` tokens checked (check_cu_seqlens) and their fingerprint, read to the host once.
    Raises as check_cu_seqlens."""
    if cu_seqlens is None:
        return 0
    check_cu_seqlens_tensor(cu_seqlens)
    bounds = cu_seqlens.cpu()
    check_cu_seqlens(bounds, batch * row, row=row)
    return fingerprint(bounds)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) int32 document id of every global token, on cu_seqlens' device."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # contiguous: searchsorted copies (and warns about) a strided sorted sequence
    return (torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)).to(torch.int32)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed sequence from its position ids, checking that they count 0, 1, 2, ...
    inside every document: each token's position is its predecessor's + 1, or 0 where the next document starts.

    Args:
        position_ids: (S,) or (1, S) integer positions, as packed-sequence trainers pass them.
    Returns:
        cu_seqlens (n_docs + 1,) int32 on position_ids' device.
    Raises:
        TypeError: not an integer tensor.
        ValueError: not one sequence of S > 0 positions, or on the meta device; a first position other than 0, or
            a later one that is neither 0 nor its predecessor's + 1 (named: its token, its position, the one before).
    """
    if (
        not isinstance(position_ids, torch.Tensor)
        or position_ids.dtype == torch.bool
        or position_ids.is_floating_point()
        or position_ids.is_complex()
    ):
        raise TypeError(f"position_ids must be an integer tensor, got {getattr(position_ids, 'dtype', position_ids)}")
    pos = position_ids.reshape(-1) if position_ids.dim() == 2 and position_ids.shape[0] == 1 else position_ids
    if pos.dim() != 1 or pos.numel() == 0:
        raise ValueError(f"position_ids must be (S,) or (1, S) with S > 0, got shape {tuple(position_ids.shape)}")
    pos = host_values(pos, "position_ids").to(torch.int64)
    follows = torch.cat([pos.new_zeros(1), pos[:-1] + 1])  # each token's position if it continues its document
    bad = torch.nonzero((pos != 0) & (pos != follows)).flatten()
    if bad.numel():
        t = int(bad[0])
        if t == 0:
            raise ValueError(f"position_ids must start at 0 (the first document's first token), got {int(pos[0])}")
        raise ValueError(
            "position_ids must count 0, 1, 2, ... inside each document and restart at 0 at the next one; token "
            f"{t} has position {int(pos[t])} after {int(pos[t - 1])} (expected {int(pos[t - 1]) + 1}, or 0)"
        )
    starts = torch.nonzero(pos == 0).flatten()
    return torch.cat([starts, torch.tensor([pos.numel()])]).to(device=position_ids.device, dtype=torch.int32)


def check_readable(t: torch.Tensor, name: str) -> None:
    """Raise ValueError, naming `name`, when t is on the meta device: it holds no values to read on the host."""
    if t.is_meta:
        raise ValueError(f"{name} must hold values (they are read on the host), got a tensor on the meta device")


def host_values(t: torch.Tensor, name: str) -> torch.Tensor:
    """t on the CPU, to read its values on the host.

    Raises:
        ValueError: t is on the meta device (it holds no values), naming `name`.
    """
    check_readable(t, name)
    return t.cpu()


def pad_cu_seqlens(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """Extend the boundaries so the total length is a multiple of `multiple`.

    The padding tokens form one extra document of their own, so they never attend to real tokens
    (pad the token tensors to the same length, e.g. with ringattn.pad_to_multiple, and leave the
    padding out of the loss). Returns (padded cu_seqlens, number of padding tokens).

    Raises:
        TypeError, ValueError: cu_seqlens not 1-D int32 or int64 boundaries from 0, nondecreasing
            (check_cu_seqlens); multiple not an int >= 1.
    """
    check_cu_seqlens_tensor(cu_seqlens)
    multiple = check_multiple(multiple)
    total = int(cu_seqlens[-1].item())
    check_cu_seqlens(cu_seqlens, total)
    pad = (-total) % multiple
    if pad == 0:
        return cu_seqlens, 0
    tail = torch.tensor([total + pad], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.cat([cu_seqlens, tail]), pad


_CACHE_SIZE = 8


def shard_documents(
    cu_seqlens: torch.Tensor,
    seqlen_local: int,
    world_size: int,
    layout: str,
    device,
    batch: int = 1,
    digest: int | None = None,
) -> "ShardDocuments":
    """ShardDocuments for these boundaries, reused across calls (every layer of a model passes the same
    cu_seqlens): keyed by the boundaries' fingerprint (`digest` where the caller has it, so that the boundaries
    are not read to the host again), the sizes, the layout and the device."""
    digest = fingerprint(cu_seqlens) if digest is None else digest
    key = (digest, int(cu_seqlens.numel()), seqlen_local, world_size, layout, str(device), batch)
    docs = _SHARD_DOCUMENTS.pop(key, None) or ShardDocuments(
        cu_seqlens, seqlen_local, world_size, layout, device, batch
    )
    _SHARD_DOCUMENTS[key] = docs  # most recently used last
    while len(_SHARD_DOCUMENTS) > _CACHE_SIZE:
        _SHARD_DOCUMENTS.pop(next(iter(_SHARD_DOCUMENTS)))
    return docs


class Meeting(NamedTuple):
    """How a block's query rows and key rows meet in their documents (ShardDocuments.meeting)."""

    meet: bool  # in some batch row, some query row shares a document with some key row; else the block is skipped
    one: bool  # in every batch row, all of them lie in one and the same document: the block needs no document mask


class ShardDocuments:
    """Document ids of every rank's shard of B packed rows, on the device for the kernels and on the host for
    deciding, without a device sync, whether a (query rows, key rows) block can meet at all in some row.

    The ids number the documents of the flattened batch (row b's ids above row b - 1's), so they are
    non-decreasing along each row of each shard, as the kernels need.

    Args:
        cu_seqlens: global boundaries of the flattened batch * seqlen_local * world_size tokens, every row start a
            boundary (checked with check_cu_seqlens).
        seqlen_local: tokens per row per rank; a row holds seqlen_local * world_size tokens.
        world_size, layout: the ring's.
        device: where the kernels run.
        batch: the number of rows B.
    """

    def __init__(
        self, cu_seqlens: torch.Tensor, seqlen_local: int, world_size: int, layout: str, device, batch: int = 1
    ):
        seqlen = seqlen_local * world_size
        ids = document_ids(cu_seqlens.cpu(), batch * seqlen).reshape(batch, seqlen)
        self.chunk = seqlen_local // 2 if layout == "zigzag" else seqlen_local  # ids are monotone within a chunk
        self.host = [ids[:, shard_indices(seqlen, r, world_size, layout)] for r in range(world_size)]  # (B, S_local)
        self.device = [h.to(device) for h in self.host]

    def ids(self, rank: int, rows: range) -> torch.Tensor:
        """(B, len(rows)) int32 device ids of `rank`'s local rows (a view: its batch stride is S_local)."""
        return self.device[rank][:, rows.start : rows.stop]

    def _spans(self, rank: int, rows: range) -> list[tuple[list[int], list[int]]]:
        """(first, last) document ids, one per batch row each, of each piece of `rows` inside one chunk; each piece
        covers, in each batch row, all ids between."""
        ids, spans = self.host[rank], []
        start = rows.start
        while start < rows.stop:
            stop = min(rows.stop, (start // self.chunk + 1) * self.chunk)
            spans.append((ids[:, start].tolist(), ids[:, stop - 1].tolist()))
            start = stop
        return spans

    def meeting(self, q_rank: int, q_rows: range, kv_rank: int, kv_rows: range) -> "Meeting":
        """How the documents of `q_rank`'s query rows and `kv_rank`'s key rows meet, from one look at their spans."""
        q_spans, k_spans = self._spans(q_rank, q_rows), self._spans(kv_rank, kv_rows)
        meet = any(
            k_last >= q_first and k_first <= q_last
            for q_firsts, q_lasts in q_spans
            for k_firsts, k_lasts in k_spans
            for q_first, q_last, k_first, k_last in zip(q_firsts, q_lasts, k_firsts, k_lasts, strict=True)
        )
        ids = q_spans[0][0]
        return Meeting(meet, all(first == ids and last == ids for first, last in q_spans + k_spans))
