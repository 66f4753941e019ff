"""Hugging Face transformers: ring attention as an attention implementation, through its public interfaces.

    from ringattn.integrations import hf
    hf.register(layout="zigzag")                     # once per process, before the model runs
    hf.prepare(model)                                # attn_implementation="ringattn", and each call checked
    sp = ringattn.SequenceParallel(layout="zigzag")  # the same group and layout
    batch = sp.shard_batch(input_ids, labels)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, cu_seq_lens_q=batch.cu_seqlens,
                   cu_seq_lens_k=batch.cu_seqlens, use_cache=False).logits
    loss = sp.cross_entropy(logits, batch.labels)
    # the boundaries are None for rows of one sequence each that needed no padding; documents of their own:
    # packed documents, each row its own: pos (B, S) restarting at 0 at each document of a row; padding:
    # Hugging Face's attention_mask (B, S), left or right padding, and the padding to a multiple of the ranks.
    # The boundaries go to the model, the mask does not
    batch = sp.shard_batch(input_ids, labels, position_ids=pos, attention_mask=mask)

2-D context parallelism (Ulysses x ring): register and shard with the same grid, a DeviceMesh with dimensions
"ulysses" and "ring" or the two groups, and call the model as above:

    mesh = init_device_mesh("cuda", (R, U), mesh_dim_names=("ring", "ulysses"))  # Ulysses groups inside a node
    hf.register(layout="zigzag", mesh=mesh)          # or ulysses_group=mesh["ulysses"], group=mesh["ring"]
    sp = ringattn.SequenceParallel(layout="zigzag", mesh=mesh)

The attention function then runs ulysses_ring_attn_func (ulysses_ring_attn_varlen_func for packed documents, every
row in one exchange and one ring) over the grid (U must divide the query heads, and U and the K/V heads one
another), and prepare's check of each call compares the position ids with the 2-D layout (grid_shard_indices) in
an agreement across the grid (parallel/grid.agree_across_grid: a few small all-gathers per model call, inside the
custom op), so a refusal is raised by every rank of the grid.

`register` adds an attention function under `name` to transformers' AttentionInterface and a mask
function to its AttentionMaskInterface. The attention function is called by each attention layer with
query (batch, heads, S_local, head_dim) and key, value (batch, kv_heads, S_local, head_dim) (GQA: fewer
K/V heads, passed on unrepeated) and runs ring_attn_func (ring_attn_varlen_func for packed documents)
over the group (over a grid, their Ulysses x ring forms). The mask function makes the model build no
mask at all: a dense (S_local, S_local) causal mask over local positions would be wrong for a shard, and the
ring applies the causal mask (and the document boundaries) over global positions itself.

`prepare` selects the implementation for a model and checks each call of it (a forward pre-hook on each
transformers model in it), on every rank alike and before any computation: position_ids are required (without
them the model numbers each rank's shard from 0; an encoder that does not hand them to its attention layers
could not even be checked there), and labels= is refused unless shift_labels and num_items_in_batch come with it
(transformers would shift the labels inside the shard and average over this rank's tokens alone): the loss of
the whole sequence is SequenceParallel.cross_entropy's. The hook of the base model (the innermost transformers
model) then checks the call's values in the custom op ringattn::hf_checked_position_ids, once per forward, and
hands the model the checked position ids: every row must hold this rank's positions in the registered layout
(its global positions, or for packed documents its positions inside the documents of cu_seq_lens_q), the two
boundary tensors must be equal, and a 2-D attention mask must hold no zeros (padding goes to shard_batch, below).
A refusal there is raised by every rank (agreement.shared_refusals). The attention function refuses a model not
prepared.

Contract: every rank of the group calls the model on its shard of input_ids with the matching position_ids
(ShardedBatch.position_ids) and gets the logits the unsharded model gives at those positions. The position
ids are either the tokens' global positions (one sequence per row) or, for packed documents, their positions
inside their documents, restarting at 0 at each document start of each row (RoPE uses them, as Hugging Face's
packed training does), sharded in the registered layout, with the documents' global boundaries passed as
transformers' cu_seq_lens_q and cu_seq_lens_k (ShardedBatch.cu_seqlens, from SequenceParallel.shard_batch(input_ids,
labels, position_ids=...)): the attention function then runs ring_attn_varlen_func, so attention stays inside each
document. With a batch of B rows the boundaries are those of the flattened B * S tokens, every row start b * S one
of them (flash-attn's and transformers' convention for packed rows), and all rows go through one ring. Padding
takes the same road: shard_batch(input_ids, labels, attention_mask=mask) makes each row's padding (left or right)
documents of their own, with their labels ignored, and gives the real tokens the positions they have in the
unpadded row, so the model, called with the boundaries and no mask, trains as on the unpadded rows. The boundaries
are computed once per batch, where the batch is sharded; the model's forward runs no collective of its own (the
ring's custom ops hold every one), so torch.compile(model), with fullgraph=True or not, compiles it whole (on a
Ulysses x ring grid too).

What the model's attention layers pass on is computed as its eager attention computes it: the layer's
`scaling` (Gemma's query_pre_attn_scalar), causal or not (the module's is_causal: encoders such as ModernBERT
are not), a sliding window as the layer's mask applies it in eager attention (read back from the mask function
transformers builds for it, hf_masks.mask_band: Mistral, Qwen2 and Qwen2-MoE with use_sliding_window, Gemma 2 and
3, gpt-oss, ModernBERT's and T5Gemma's local layers, each layer with its own), over global positions; where the mask
is plain causal or bidirectional, the layer's `sliding_window` as flash-attn's window_size = (sliding_window - 1,
sliding_window - 1), cut by causal (transformers' own mapping), `softcap` (Gemma 2's attn_logit_softcapping) and
the attention sinks `s_aux` (gpt-oss: one learned logit per head, its gradient a parameter gradient like any
other, summed over the ranks by SequenceParallel.sync_gradients), and `deterministic` (ModernBERT's
deterministic_flash_attn: gradients with the same bits in every run; for the other models
$FLASH_ATTENTION_DETERMINISTIC=1, as transformers' flash-attn path reads it, which
TrainingArguments(full_determinism=True) sets). Under autocast q, k and v go to the ring in
autocast's dtype, as SDPA takes them (RoPE leaves q and k in fp32 beside a bf16 v).

Refused with ValueError: models whose attention is not transformers' AttentionInterface, with an output per
sequence (a sequence-classification head, a pooler: each rank would pool its own shard), mixing tokens outside
attention (convolutions, state spaces, linear attention) or taking other positions than the global ones (rotary
embeddings of rope type dynamic, RoBERTa's offset positions, a model that takes no position_ids, Llama 4's temperature
on layers without rotary embeddings) (by prepare), dropout > 0,
chunked attention (Llama 4), sparse attention (selected key indices), position biases (ALiBi too), attention masks other
than none/all-ones in the model call (a padding mask, naming shard_batch's attention_mask; custom 4-D masks) or built by
the model from its pad tokens (T5Gemma without an attention_mask; not seen under torch.compile: pass an attention_mask
of ones), mask patterns added on top (image or token-type blocks that hold some token: an image-text model runs on text
alone, under torch.compile without token_type_ids; the bidirectional patterns of Gemma 3 and Step3p7 with
use_bidirectional_attention, EmbeddingGemma's, and Unlimited OCR's reference-sliding layers without a cache are read in
eager calls: hf_masks.MODEL_PATTERNS), layers that attend bidirectionally over a causal eager mask
(use_bidirectional_attention in Gemma 2 and PaliGemma's text models), a KV cache holding earlier tokens or an empty one
passed in (generation), logits_to_keep other than 0 (generate's 1: each rank's last tokens), output_attentions,
input_ids (inputs_embeds) and position_ids of different lengths, position_ids that are not this rank's positions in
the registered layout (e.g. sharded in another layout, rows that differ, packed documents without their boundaries, or
fewer rows than the boundaries hold), cu_seq_lens_q without cu_seq_lens_k or different from it, and boundaries of a
batch whose row starts are not among them. The tokens themselves are not checked: shard them with the positions, in one
shard_batch call.
"""

import copy
import functools
import inspect
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

from ..functional import ring_attn_func, ring_attn_varlen_func
from ..nn.attention import in_autocast_dtype
from ..parallel.agreement import shared_refusals
from ..parallel.documents import check_cu_seqlens, check_cu_seqlens_tensor
from ..parallel.grid import Grid, GridSignature, agree_across_grid, grid_arguments, shared_grid_refusals
from ..parallel.groups import Group, or_world, ring_group
from ..parallel.layout import check_layout, check_local_seqlen, grid_shard_indices, shard_indices
from ..sequence_parallel import SequenceParallel, document_positions, sequence_parallel_arguments
from ..ulysses import ulysses_ring_attn_func, ulysses_ring_attn_varlen_func

try:
    from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ringattn.integrations.hf needs transformers: pip install 'ringattn[hf]' (or pip install transformers)"
    ) from e

from .hf_masks import (  # after the check that transformers is there
    CAUSAL,
    FULL,
    Band,
    check_causal_agrees,
    check_no_padding,
    creator_band,
    mask_band,
    top_level_union,
)

NAME = "ringattn"
PREPARED = "_ringattn_prepared"  # set by prepare() on every module of a model
# set by prepare's call check on the rotary embeddings it hooks (_SequenceLength): the call's sequence length
SEQUENCE_LENGTH = "_ringattn_sequence_length"
DETERMINISTIC_ENV = "FLASH_ATTENTION_DETERMINISTIC"  # transformers' switch for its flash-attn backward

# how a padded batch runs under ring attention, for the refusals of a padding mask
_PADDING_HOWTO = (
    "shard the batch with SequenceParallel.shard_batch(input_ids, labels, attention_mask=mask), which makes each "
    "row's padding documents of their own, and call the model with position_ids=batch.position_ids, "
    "cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens and no attention_mask"
)

# keyword arguments some models pass to the attention function for features the ring does not compute
_UNSUPPORTED_KWARGS = {
    "attention_chunk_size": "chunked attention",
    "position_bias": "position biases",
    "indices": "sparse attention (the keys an indexer selected: DeepSeek-V3.2, GLM's DSA)",
    "block_indices": "block-sparse attention (the key blocks selected: MiniMax-M3)",
}


class RingAttentionForTransformers:
    """The attention function registered in transformers' AttentionInterface (see the module docstring).

    Called as fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs), the
    signature of transformers' attention functions; returns (attn_output (batch, S_local, heads,
    head_dim), None).

    Attributes: group (the ring's ProcessGroup; None: the world, or with ulysses_group degree 1), ulysses_group
    (None: the ring alone) and grid (the parallel.grid.Grid of a 2-D form, else None), layout, name.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        layout: str,
        name: str,
        ulysses_group: dist.ProcessGroup | None = None,
        grid: Grid | None = None,
    ):
        check_layout(layout)
        self.group, self.layout, self.name = group, layout, name
        self.ulysses_group, self.grid = ulysses_group, grid

    def __repr__(self) -> str:
        grid = "" if self.grid is None else f", ulysses_size={self.grid.ulysses_size}, ring_size={self.grid.ring_size}"
        return f"RingAttentionForTransformers(name={self.name!r}, layout={self.layout!r}{grid})"

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if not getattr(module, PREPARED, False):
            raise ValueError(
                f"attn_implementation={self.name!r} runs in models prepared with ringattn.integrations.hf.prepare"
                "(model), on every rank: it checks that each call gives the ranks' position_ids, and no labels= "
                "whose loss would be this rank's shard's alone"
            )
        band = attention_mask if isinstance(attention_mask, Band) else None  # no_mask's: the model's sliding window
        self._refuse_unsupported(module, query, key, None if band else attention_mask, dropout, kwargs)
        if band is None:
            is_causal = kwargs.get("is_causal")
            is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            window = self._window(kwargs.get("sliding_window"))
        else:  # eager's mask: key j visible from query i when i - left <= j <= i + right
            is_causal = band.right == 0
            window = (-1 if band.left is None else band.left, -1 if band.right is None or is_causal else band.right)
        cu_seqlens = self._given_documents(kwargs)
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and position_ids.shape[-1] != query.shape[2]:
            raise ValueError(
                f"attn_implementation={self.name!r}: position_ids must hold {query.shape[2]} positions per row "
                f"(this rank's tokens), got shape {tuple(position_ids.shape)}"
            )
        # (B, H, S, D) -> (B, S, H, D): strided views, no copy
        q, k, v = (in_autocast_dtype(t).transpose(1, 2) for t in (query, key, value))
        sink = kwargs.get("s_aux")
        ring = dict(
            softmax_scale=scaling, causal=is_causal, window_size=window,
            softcap=kwargs.get("softcap") or 0.0, learnable_sink=sink if sink is not None else kwargs.get("sinks"),
            deterministic=self._deterministic(kwargs), layout=self.layout,
        )  # fmt: skip
        if self.grid is not None:  # Ulysses x ring
            ring.update(ulysses_group=self.ulysses_group, ring_group=self.group)
            if cu_seqlens is None:
                return ulysses_ring_attn_func(q, k, v, **ring), None
            return ulysses_ring_attn_varlen_func(q, k, v, cu_seqlens, **ring), None  # every row in one exchange
        if cu_seqlens is None:
            return ring_attn_func(q, k, v, group=self.group, **ring), None
        return ring_attn_varlen_func(q, k, v, cu_seqlens, group=self.group, **ring), None  # every row in one ring

    @staticmethod
    def _deterministic(kwargs: dict) -> bool:
        """The model's deterministic keyword (ModernBERT passes one), else $FLASH_ATTENTION_DETERMINISTIC == "1", as
        transformers' flash-attn path reads them (TrainingArguments(full_determinism=True) sets it)."""
        given = kwargs.get("deterministic")
        return bool(given) if given is not None else os.environ.get(DETERMINISTIC_ENV, "0") == "1"

    def _given_documents(self, kwargs: dict) -> torch.Tensor | None:
        """The global document boundaries passed as transformers' cu_seq_lens_q and cu_seq_lens_k, or None (one
        sequence per row). prepare's check of each call compares their values."""
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None and cu_k is None:
            return None
        if cu_q is None or cu_k is None:
            raise ValueError(
                f"attn_implementation={self.name!r}: packed documents need both cu_seq_lens_q and cu_seq_lens_k, "
                "the global document boundaries (SequenceParallel.shard_batch(...).cu_seqlens); got only one"
            )
        return cu_q

    def _window(self, sliding_window) -> tuple[int, int]:
        """flash-attn's window_size for transformers' sliding_window (a query sees the sliding_window keys up to
        itself, and as many after it unless causal); (-1, -1) for None."""
        if sliding_window is None:
            return (-1, -1)
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(
                f"attn_implementation={self.name!r}: sliding_window must be a positive int or None, got "
                f"{sliding_window!r}"
            )
        return (sliding_window - 1, sliding_window - 1)

    def _refuse_unsupported(self, module, query, key, attention_mask, dropout, kwargs) -> None:
        where = f"attn_implementation={self.name!r} (ring attention)"
        if dropout:
            raise ValueError(f"{where} has no attention dropout, got dropout={dropout}; set attention_dropout=0")
        if kwargs.get("output_attentions"):
            raise ValueError(f"{where} never forms the attention matrix: output_attentions=True is not supported")
        for arg, feature in _UNSUPPORTED_KWARGS.items():
            if kwargs.get(arg) is not None or getattr(module, arg, None) is not None:
                raise ValueError(f"{where} does not support {feature} ({arg} is set)")
        if attention_mask is not None:
            raise ValueError(
                f"{where} supports no attention mask (it applies the causal mask over global positions itself); "
                f"got a mask of shape {tuple(attention_mask.shape)}. Pass attention_mask=None; for padding, "
                f"{_PADDING_HOWTO}"
            )
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                f"{where} needs queries and keys of the same local length, got {query.shape[2]} and {key.shape[2]}: "
                "a KV cache holding earlier tokens (generation) and cross-attention are not supported; "
                "call the model with use_cache=False"
            )

    def sequence_ranks(self) -> int:
        """How many ranks hold a shard of each sequence: the grid's U x R, or the ring's."""
        return self.grid.size if self.grid is not None else dist.get_world_size(or_world(self.group))

    def checked_position_ids(
        self,
        position_ids: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None,
        cu_seqlens_k: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        tokens: int = -1,
    ) -> torch.Tensor:
        """position_ids (batch or 1, S_local), checked by ringattn::hf_checked_position_ids on this group (grid),
        layout and name: a copy, for the model to use in their place, so that the check stays in a compiled graph.
        tokens: the call's tokens a row (input_ids' or inputs_embeds' dim 1), -1 where unknown.

        Raises:
            RuntimeError: torch.distributed not initialised.
            ValueError, TypeError: as hf_checked_position_ids, on every rank alike.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"attn_implementation={self.name!r} needs torch.distributed initialised")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            attention_mask = None  # a 4-D mask reaches the attention function, which refuses it
        if self.grid is not None:  # the grid's groups by name, "" for a dimension of degree 1
            ring, ulysses = (g.group_name if g is not None else "" for g in (self.grid.ring, self.grid.ulysses))
            return checked_position_ids_op(position_ids, cu_seqlens_q, cu_seqlens_k, attention_mask, tokens, ring,
                                           self.layout, self.name, ulysses)  # fmt: skip
        group = or_world(self.group)
        return checked_position_ids_op(position_ids, cu_seqlens_q, cu_seqlens_k, attention_mask, tokens,
                                       group.group_name, self.layout, self.name)  # fmt: skip


@torch.library.custom_op("ringattn::hf_checked_position_ids", mutates_args=())
def checked_position_ids_op(
    position_ids: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    tokens: int,
    group_name: str,
    layout: str,
    name: str,
    ulysses_group_name: str | None = None,
) -> torch.Tensor:
    """prepare's check of the values of a model call, as a custom op (torch.compile sees one call; the check runs at
    every call): a copy of position_ids (batch or 1, S_local), contiguous, after checking, on the group named
    `group_name` (with `ulysses_group_name`, on the grid of that Ulysses group and that ring, "" naming a dimension
    of degree 1), that

    - the call's tokens a row (`tokens`, -1 where unknown) are as many as position_ids';
    - every row holds this rank's positions in `layout` (over a grid, its 2-D layout, grid_shard_indices): its
      global positions (one sequence per row), or, with cu_seqlens_q and cu_seqlens_k (packed documents), the
      positions inside their documents;
    - cu_seqlens_q and cu_seqlens_k, given together, are the same boundaries of the global sequence;
    - a 2-D attention_mask holds no zeros (no padding).

    A refusal is shared (agreement.shared_refusals): every rank raises it, from this op or from the first ring call.
    Over a grid the values are checked in an agreement across the grid (grid.agree_across_grid, a collective at
    every call), so every rank of the grid raises a refusal from this op.

    Raises:
        ValueError, TypeError: as above, naming the attention implementation `name`.
    """
    args = (position_ids, cu_seqlens_q, cu_seqlens_k, attention_mask, tokens)
    if ulysses_group_name is not None:
        grid = Grid(*(_resolve_process_group(n) if n else None for n in (ulysses_group_name, group_name)))

        def checks():
            _check_call_values(*args, _GridPlace(grid), layout, name)
            return ()

        agree_across_grid("hf model call", grid, checks, GridSignature)
        return position_ids.contiguous().clone()
    group = _resolve_process_group(group_name)
    with shared_refusals("hf model call", group):
        _check_call_values(*args, _RingPlace(group), layout, name)
    return position_ids.contiguous().clone()


@checked_position_ids_op.register_fake
def _checked_position_ids_fake(position_ids, *args):
    return torch.empty(position_ids.shape, dtype=position_ids.dtype, device=position_ids.device)


class _RingPlace:
    """This rank's place in a ring: the ranks a sequence is split over and the positions it holds."""

    def __init__(self, group: dist.ProcessGroup):
        self.rank, self.size, self.pieces = dist.get_rank(group), dist.get_world_size(group), 1

    def indices(self, seqlen: int, layout: str) -> torch.Tensor:
        return shard_indices(seqlen, self.rank, self.size, layout)


class _GridPlace:
    """This rank's place in a U x R grid (the 2-D layout): U pieces of each ring shard."""

    def __init__(self, grid: Grid):
        self.grid, self.size, self.pieces = grid, grid.size, grid.ulysses_size

    def indices(self, seqlen: int, layout: str) -> torch.Tensor:
        g = self.grid
        return grid_shard_indices(seqlen, g.ulysses_rank, g.ulysses_size, g.ring_rank, g.ring_size, layout)


def _check_call_values(position_ids, cu_seqlens_q, cu_seqlens_k, attention_mask, tokens: int, place, layout: str,
                       name: str):  # fmt: skip
    where = f"attn_implementation={name!r}"
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"ring attention takes no padding mask in the model call: {_PADDING_HOWTO}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dim() not in (1, 2):
        raise TypeError(f"{where}: position_ids must be integers (batch, S_local), got {position_ids.dtype} of "
                        f"shape {tuple(position_ids.shape)}")  # fmt: skip
    seqlen_local = position_ids.shape[-1]
    if tokens not in (-1, seqlen_local):
        raise ValueError(
            f"{where}: input_ids (or inputs_embeds) hold {tokens} tokens a row and position_ids {seqlen_local}: pass "
            "each rank its shard of both (SequenceParallel.shard_batch(...).input_ids and .position_ids)"
        )
    # a ring rank holds U pieces of the local length (one, without a grid)
    what = "the local sequence length" if place.pieces == 1 else f"the Ulysses degree {place.pieces} x local length"
    check_local_seqlen(place.pieces * seqlen_local, layout, name=what)
    seqlen = seqlen_local * place.size
    expected = place.indices(seqlen, layout)  # (S_local,) global positions
    rows = position_ids.reshape(-1, seqlen_local).cpu().to(torch.int64)  # (batch or 1, S_local)
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError(f"{where}: packed documents need both cu_seq_lens_q and cu_seq_lens_k; got only one")
        check_cu_seqlens_tensor(cu_seqlens_q, "cu_seq_lens_q")
        last = int(cu_seqlens_q[-1])
        if last != rows.shape[0] * seqlen and last % seqlen == 0:
            packed = last // seqlen
            raise ValueError(
                f"{where}: position_ids hold {rows.shape[0]} rows, cu_seq_lens_q the boundaries of {packed} packed "
                f"row{'s' * (packed != 1)} of {seqlen} tokens: pass one row of positions per packed row ((batch, "
                f"S_local) = ({packed}, {seqlen_local}), SequenceParallel.shard_batch(...).position_ids)"
            )
        total = rows.shape[0] * seqlen  # the flattened batch's tokens: one row of boundaries per row of positions
        check_cu_seqlens(cu_seqlens_q, total, name="cu_seq_lens_q", row=seqlen)
        check_cu_seqlens(cu_seqlens_k, total, name="cu_seq_lens_k", row=seqlen)
        bounds = cu_seqlens_q.cpu()
        if not torch.equal(bounds.to(torch.int64), cu_seqlens_k.cpu().to(torch.int64)):
            raise ValueError(
                f"{where}: cu_seq_lens_q and cu_seq_lens_k must be the same global document boundaries "
                "(SequenceParallel.shard_batch(...).cu_seqlens)"
            )
        expected = document_positions(bounds).reshape(rows.shape[0], seqlen)[:, expected]  # (batch, S_local)
    bad = torch.nonzero((rows != expected).any(dim=1)).flatten()
    if not bad.numel():
        return
    row = int(bad[0])
    want = expected if expected.dim() == 1 else expected[row]
    at = int(torch.nonzero(rows[row] != want)[0])
    got = (f"row {row} differs first at its local position {at}: from there it is {_preview(rows[row, at:])}, "
           f"expected {_preview(want[at:])}")  # fmt: skip
    grid = "" if isinstance(place, _RingPlace) else " over the Ulysses x ring grid"
    if cu_seqlens_q is not None:
        raise ValueError(
            f"{where}: position_ids must be, in every row, this rank's positions inside the documents of "
            f"cu_seq_lens_q, sharded in layout {layout!r}{grid} (SequenceParallel.shard_batch(..., position_ids=...)"
            f".position_ids); {got}"
        )
    raise ValueError(
        f"{where}: position_ids must be, in every row, this rank's global positions in layout {layout!r}{grid} "
        f"(SequenceParallel.shard_batch(...).position_ids, or ringattn.position_ids); {got}. Packed documents "
        "(positions restarting at 0 at each document), and the padding shard_batch adds to a multiple of the ranks "
        "(a document of its own), need their boundaries as well: model(..., cu_seq_lens_q=batch.cu_seqlens, "
        "cu_seq_lens_k=batch.cu_seqlens)"
    )


def _preview(t: torch.Tensor, n: int = 8) -> str:
    """The first n values of t, and how many there are when more."""
    flat = t.reshape(-1).tolist()
    return str(flat) if len(flat) <= n else f"[{', '.join(map(str, flat[:n]))}, ...] ({len(flat)} positions)"


def no_mask(
    *args,
    attention_mask: torch.Tensor | None = None,
    mask_function=None,
    use_vmap: bool = False,
    group: dist.ProcessGroup | None = None,
    grid: Grid | None = None,
    **kwargs,
) -> Band | None:
    """The mask function registered in AttentionMaskInterface, bound to the registered group (or grid): build no
    mask, but say which band of keys the model's mask lets each query see (hf_masks.mask_band), as its eager
    attention applies it.

    Returns None for the plain causal or bidirectional pattern (the layer's is_causal and sliding_window then decide, as
    in transformers' flash-attention path), else the Band (a sliding window, or any band where the model added mask
    patterns of its own: use_vmap), which the layer hands the attention function as its attention_mask and the ring
    applies whatever else the layer passes. The ring applies it and the document boundaries over global positions
    itself; prepare's check of each call has refused a padding mask with zeros (ringattn::hf_checked_position_ids).
    Raises ValueError for a padding mask the model made from its inputs or a pattern the ring cannot apply (chunks,
    or_masks that add pairs, a mask function of the model's own not in MODEL_PATTERNS); a refusal shared by every rank
    (agreement.shared_refusals, or over a grid grid.shared_grid_refusals). Under torch.compile the band comes from the
    creator's arguments (hf_masks.creator_band), a pattern the model adds on top (transformers then asks for a
    vmap-built mask) is refused, and a union of patterns is seen only at the top of the mask function: a padding mask
    the model built from its pad tokens, and image blocks under packed documents, are refused in eager calls only.
    """
    refusals = (
        shared_refusals("hf attention mask", group) if grid is None else shared_grid_refusals("hf attention mask", grid)
    )
    where = "ring attention (the model's attention mask)"
    band = CAUSAL
    with refusals:
        if torch.compiler.is_compiling():  # Dynamo reads no closure: the creator's arguments say the band
            if use_vmap:  # a pattern of the model's own, which only the closures say
                raise ValueError(
                    "ring attention computes causal (or full) attention with the layer's sliding window: under "
                    "torch.compile, a mask pattern the model adds on top of it (the mask's or_mask_function, "
                    "and_mask_function) is not supported"
                )
            band = creator_band(kwargs.get("local_size"), "allow_is_bidirectional_skip" in kwargs, kwargs.get("config"),
                                where)  # fmt: skip
            if mask_function is not None:
                top_level_union(mask_function, where)
        else:
            check_no_padding(attention_mask, where)
            if mask_function is not None:
                band = mask_band(mask_function, where, added_patterns=use_vmap)
        check_causal_agrees(band, kwargs.get("config"), where)
    # the model's own patterns (use_vmap) make the mask it built, not the layer's is_causal, what eager applies
    return None if band in (CAUSAL, FULL) and not use_vmap else band


def _ring(implementation) -> RingAttentionForTransformers | None:
    """The RingAttentionForTransformers an attn_implementation name selects, or None."""
    fn = AttentionInterface().get(implementation)
    return fn if isinstance(fn, RingAttentionForTransformers) else None


class _CallCheck:
    """prepare's forward pre-hook for a transformers model (a class, not a closure, so that a prepared model can be
    pickled): raises ValueError, while ring attention is selected, for a call with a KV cache holding earlier
    tokens, with logits_to_keep other than 0, without position_ids, or with labels but without shift_labels and
    num_items_in_batch; with `check_values` (a model holding no other transformers model: the one that hands the
    attention layers their arguments) it then checks the call's values (and its tokens' count a row) with
    RingAttentionForTransformers.checked_position_ids, hands the model the checked position_ids and sets the
    sequence's length on `rotaries` (_SequenceLength: the longest document's with document boundaries, else the
    local length times the ranks of a sequence), which it clears while another attention is selected."""

    def __init__(self, model: torch.nn.Module, check_values: bool, rotaries: list[torch.nn.Module] = ()):
        self.check_values = check_values
        self.rotaries = list(rotaries)
        self.positional = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]

    def __call__(self, module, args, kwargs):
        implementation = module.config._attn_implementation
        fn = _ring(implementation)
        if fn is None:
            self._set_length(None)
            return None
        call = {**dict(zip(self.positional, args, strict=False)), **kwargs}
        where = f"attn_implementation={implementation!r}"
        caches = [call.get(key) for key in ("cache", "past_key_values")]  # transformers 5's name, and 4's
        if any(c is not None for c in caches):
            raise ValueError(
                f"{where}: a KV cache passed in (generation: generate's first step passes an empty one, a decode "
                "step one holding earlier tokens) is not supported: the ring attends each rank's whole shard to the "
                "others' in one call, and each rank's last token is a different one; generate with the unsharded "
                "model, and call this one with use_cache=False"
            )
        keep = call.get("logits_to_keep")
        if isinstance(keep, torch.Tensor) or isinstance(keep, int) and not isinstance(keep, bool) and keep != 0:
            kept = f"the last {keep}" if isinstance(keep, int) else "the positions a tensor of them names"
            raise ValueError(
                f"{where}: logits_to_keep={keep} keeps {kept} of each rank's own tokens, not the sequence's "
                "(generate passes 1, and without a KV cache each rank would continue from a different token): "
                "generate with the unsharded model, and call this one with logits_to_keep=0 (all positions)"
            )
        if call.get("position_ids") is None:
            raise ValueError(
                f"{where} needs position_ids in every call: each rank's tokens' positions "
                "(SequenceParallel.shard_batch(...).position_ids); without them the model numbers each rank's shard "
                "from 0"
            )
        if call.get("labels") is not None and (
            call.get("shift_labels") is None or call.get("num_items_in_batch") is None
        ):
            raise ValueError(
                f"{where}: with labels= alone the model's loss is this rank's shard's (transformers shifts the labels "
                "inside the shard and averages over its tokens). Compute the loss with sp.cross_entropy(logits, "
                "batch.labels) (ringattn.SequenceParallel), or pass labels with shift_labels (batch.labels, shifted "
                "on the full sequence) and num_items_in_batch (the group's count of labels that are not -100) for "
                "this rank's share"
            )
        if not self.check_values:
            return None
        tokens = next((t for t in (call.get("input_ids"), call.get("inputs_embeds")) if t is not None), None)
        row_tokens = tokens.shape[1] if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 else -1
        bounds = (call.get("cu_seq_lens_q"), call.get("cu_seq_lens_k"))
        checked = fn.checked_position_ids(call["position_ids"], *bounds, call.get("attention_mask"), row_tokens)
        if self.rotaries:
            documents = bounds[0]  # checked: the global boundaries
            if documents is not None:
                self._set_length(int((documents[1:] - documents[:-1]).max()))
            else:
                self._set_length(checked.shape[-1] * fn.sequence_ranks())
        if "position_ids" in kwargs:
            return args, {**kwargs, "position_ids": checked}
        i = self.positional.index("position_ids")
        return (*args[:i], checked, *args[i + 1 :]), kwargs

    def _set_length(self, length: int | None) -> None:
        for rotary in self.rotaries:
            setattr(rotary, SEQUENCE_LENGTH, length)


# heads whose output is one per sequence (a pooled token, or an average over the sequence)
_SEQUENCE_HEADS = ("ForSequenceClassification", "ForMultipleChoice", "ForNextSentencePrediction")


def _check_per_token(module: PreTrainedModel) -> None:
    """Raise ValueError where `module` computes something per sequence, which a rank holding a shard of each
    sequence would compute from its shard alone (silently other than the unsharded model's): a sequence-level head
    (a class named ...ForSequenceClassification and the like: it pools the first token, the last real one or an
    average) or a pooler (BERT's, which reads each sequence's first token)."""
    kind = type(module).__name__
    advice = (
        "run the per-token model prepared (the base model, model.base_model), gather its hidden states over the "
        "ranks (SequenceParallel.gather) and apply the pooling and head to the whole sequence"
    )
    if kind.endswith(_SEQUENCE_HEADS):
        raise ValueError(
            f"{kind} pools each sequence into one output, but ring attention gives each rank the outputs at its own "
            f"positions only: {advice}"
        )
    if isinstance(getattr(module, "pooler", None), torch.nn.Module):
        raise ValueError(
            f"{kind} has a pooler (it reads each sequence's first token, which one rank holds): build it without one "
            f"(add_pooling_layer=False), or {advice}"
        )


# layer types (transformers' config.layer_types) that carry a state along the sequence: a causal convolution, a
# state space or linear-attention recurrence, or one beside attention in the same layer
_RECURRENT_LAYER_TYPES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")
# rotary embeddings whose frequencies follow the largest position a call sees (transformers' dynamic_rope_update):
# longrope's from the call's alone (prepare hands them the sequence's length: _SequenceLength), dynamic's from the
# longest call so far (a state that a call refused on some ranks after their rotary ran would leave unequal)
_SEQUENCE_ROPE = ("longrope",)
_STATEFUL_ROPE = ("dynamic",)


def _sequence_rotaries(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The rotary embeddings in `module` whose frequencies follow the largest position a call sees: transformers'
    ...RotaryEmbedding modules of rope_type longrope (one, or one per layer type)."""
    found = []
    for m in module.modules():
        types = getattr(m, "rope_type", None)
        if types is None or not type(m).__name__.endswith("RotaryEmbedding"):
            continue
        types = set(types.values()) if isinstance(types, dict) else {types}
        if types & set(_SEQUENCE_ROPE):
            found.append(m)
    return found


class _SequenceLength:
    """prepare's hooks on a rotary embedding whose frequencies follow the largest position a call sees (longrope's:
    transformers' dynamic_rope_update takes them from max(position_ids) + 1). While the model's call check (_CallCheck)
    has set the sequence's length on the module (SEQUENCE_LENGTH), the positions it gets gain a column at that
    length - 1, so that it takes its frequencies from the sequence's largest position, as the unsharded model does,
    and its cos and sin lose that column again; unset (another attention implementation), the module runs as it
    is."""

    def before(self, module, args, kwargs):
        length = getattr(module, SEQUENCE_LENGTH, None)
        if length is None:
            return None
        if len(args) >= 2:  # forward(x, position_ids, ...)
            return (args[0], _with_last_position(args[1], length), *args[2:]), kwargs
        return args, {**kwargs, "position_ids": _with_last_position(kwargs["position_ids"], length)}

    def after(self, module, args, kwargs, output):
        if getattr(module, SEQUENCE_LENGTH, None) is None:
            return None
        return tuple(t[..., :-1, :] for t in output)  # cos, sin: (batch, positions, dim)


def _with_last_position(position_ids: torch.Tensor, length: int) -> torch.Tensor:
    """position_ids (..., S_local) and one position more, length - 1, at the end of each row."""
    last = position_ids.new_full((*position_ids.shape[:-1], 1), length - 1)
    return torch.cat([position_ids, last], dim=-1)


def _rope_types(config) -> set[str]:
    """The rope types of config's rotary embeddings (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    nested = [p for p in params.values() if isinstance(p, dict)] if isinstance(params, dict) else []
    return {str(p.get("rope_type", p.get("type", ""))) for p in (nested or [params]) if isinstance(p, dict)}


def _innermost(module: PreTrainedModel) -> bool:
    """Whether `module` holds no other transformers model (the base model, not a head wrapping it)."""
    return not any(isinstance(m, PreTrainedModel) for m in module.modules() if m is not module)


def _check_global_positions(module: PreTrainedModel) -> None:
    """Raise ValueError where `module` mixes tokens outside attention or takes positions other than the global ones a
    rank's call passes, so that each rank would compute its shard as a sequence of its own: layers carrying a state
    along the sequence (convolutions, state spaces, linear attention: Jamba, LFM2, Qwen3-Next, Falcon-H1, ...), rotary
    frequencies kept from the longest call so far (rope type dynamic), longrope's where no rotary module prepare can
    hook holds them (_sequence_rotaries), positions counted from the input ids past the padding index (RoBERTa's), an
    innermost model that takes tokens but no position_ids (BART's decoder numbers each call from 0), and Llama 4's
    attention temperature on layers without rotary embeddings (scaled by local positions)."""
    kind = type(module).__name__
    config = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
    kinds = list(getattr(config, "layer_types", None) or []) + list(getattr(config, "block_types", None) or [])
    recurrent = sorted({t for t in kinds if t in _RECURRENT_LAYER_TYPES or t == "recurrent"})
    if recurrent:
        raise ValueError(
            f"{kind} has layers of type {', '.join(map(repr, recurrent))}, which carry a state along the sequence "
            "(a convolution, a state space or a linear-attention recurrence): each rank would start it afresh at its "
            "shard's first token. Ring attention runs models whose layers mix tokens through attention alone"
        )
    rope = _rope_types(config)
    if rope & set(_STATEFUL_ROPE):
        raise ValueError(
            f"{kind} uses rotary embeddings of rope_type 'dynamic', whose frequencies follow the longest call so far "
            "(transformers' dynamic_rope_update keeps them across calls): a call refused on some ranks after their "
            "rotary embeddings ran would leave the ranks with different frequencies"
        )
    if rope & set(_SEQUENCE_ROPE) and not _sequence_rotaries(module):
        raise ValueError(
            f"{kind} uses rotary embeddings of rope_type 'longrope', whose frequencies follow the largest position a "
            "call sees, in no rotary module of transformers' (a ...RotaryEmbedding with a rope_type) that prepare can "
            "hand the sequence's length: each rank would take them from its own shard's positions"
        )
    if any(hasattr(m, "create_position_ids_from_input_ids") for m in module.modules()):
        raise ValueError(
            f"{kind} counts its positions from padding_idx + 1 (RoBERTa's position embeddings), where the ring's calls "
            "pass the tokens' global positions from 0: its embeddings would be read at other positions than the "
            "unsharded model's"
        )
    takes = inspect.signature(module.forward).parameters
    if _innermost(module) and ("input_ids" in takes or "inputs_embeds" in takes) and "position_ids" not in takes:
        raise ValueError(
            f"{kind} takes no position_ids: it numbers the tokens of each call from 0, so each rank would number its "
            "shard as a sequence of its own"
        )
    if getattr(config, "attn_temperature_tuning", False) and 0 in (getattr(config, "no_rope_layers", None) or []):
        raise ValueError(
            f"{kind} scales the queries of its layers without rotary embeddings by their positions in the call "
            "(attn_temperature_tuning), not their global ones: set attn_temperature_tuning=False, or keep every "
            "layer's rotary embedding"
        )


def _own_configs(model: torch.nn.Module) -> None:
    """Give model's modules their own copies of the configs they hold (the sub-configs shared as they were):
    transformers writes a new model's attn_implementation into the config object it was made from, so a second
    model made from the same object (an eager reference, a copy to evaluate) would switch this one's attention to
    its own, each rank attending within its shard, and its checks off."""
    memo: dict = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            module.config = copy.deepcopy(config, memo)  # one copy of each config object, however many hold it


def prepare(model: torch.nn.Module, name: str = NAME) -> torch.nn.Module:
    """Run `model` with the ring attention registered as `name`, checking each of its calls.

    Gives the model its own copy of its config (_own_configs: a second model made from the same config object
    would otherwise switch this one's attention), sets its attn_implementation to `name`
    (model.set_attn_implementation) and installs, once, a forward
    pre-hook on each transformers model in it (the model and, e.g., its base model) that raises ValueError
    while a ring attention is selected: for a call without position_ids, and for labels= without shift_labels
    and num_items_in_batch (see the module docstring). The hook of the innermost transformers model (the base model,
    which hands the attention layers their arguments) also checks the call's values, on every rank alike: the
    position ids, the document boundaries and a padding mask (ringattn::hf_checked_position_ids, a custom op, so
    that torch.compile(model) keeps the check), and hands the model's longrope rotary embeddings the sequence's
    length (_SequenceLength), so that they pick the unsharded model's frequencies. Call it on every rank, after
    `register`.

    Returns:
        model.
    Raises:
        ValueError: `name` is not registered as ring attention (`register`); a transformers model in `model` whose
            attention does not go through transformers' AttentionInterface (its attn_implementation cannot be set,
            e.g. Bloom), that adds ALiBi biases (Falcon with alibi=True), that computes an output per sequence
            (a sequence classification or multiple-choice head, a pooler), or that mixes tokens outside attention
            or takes other positions than the global ones (_check_global_positions): each rank would compute it
            from its shard alone.
    """
    if _ring(name) is None:
        raise ValueError(
            f"{name!r} is not a ring attention registered with transformers: call "
            f"ringattn.integrations.hf.register({name!r}, ...) first"
        )
    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    for module in models:
        if getattr(module.config, "alibi", False) is True:  # Falcon's: a bias added to the mask the ring does not build
            raise ValueError(
                f"{type(module).__name__} adds ALiBi position biases (config.alibi=True): ring attention computes "
                "no position biases"
            )
        _check_per_token(module)
    _own_configs(model)
    model.set_attn_implementation(name)
    for module in models:
        if module.config._attn_implementation != name:
            raise ValueError(
                f"{type(module).__name__} runs its own attention code, not transformers' AttentionInterface, so "
                f"attn_implementation={name!r} does not reach it (its attn_implementation is still "
                f"{module.config._attn_implementation!r}): ring attention cannot run this model"
            )
        _check_global_positions(module)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not getattr(module, PREPARED, False):
            innermost = _innermost(module)
            rotaries = _sequence_rotaries(module) if innermost else []
            module.register_forward_pre_hook(_CallCheck(module, innermost, rotaries), with_kwargs=True)
            for rotary in rotaries:
                hooks = _SequenceLength()
                rotary.register_forward_pre_hook(hooks.before, with_kwargs=True)
                rotary.register_forward_hook(hooks.after, with_kwargs=True)
    for module in model.modules():
        setattr(module, PREPARED, True)
    return model


def register(
    name: str = NAME,
    *,
    sp: SequenceParallel | None = None,
    layout: str | None = None,
    group: Group = None,
    ulysses_group: Group = None,
    mesh: DeviceMesh | None = None,
) -> str:
    """Register ring attention with transformers under `name` (global to the process; registering again replaces).

    After this, `prepare(model, name)` selects it for a model (or `from_pretrained(..., attn_implementation=name)`,
    then `prepare(model, name)`). Shard inputs with the same group (groups) and layout
    (ringattn.SequenceParallel(group, layout, ulysses_group=..., mesh=...)), or pass that SequenceParallel as `sp`.
    Register two names to use two layouts or groups side by side.

    Args:
        name: the attn_implementation name.
        sp: the ringattn.SequenceParallel that shards the inputs: its groups and layout, in place of the four
            arguments below.
        layout: "zigzag" (None: the default) or "contiguous".
        group: the sequence-parallel process group, the ring (default: the world; with ulysses_group, no ring: degree
            1), or a 1-D DeviceMesh (a (dp, cp) mesh's mesh["cp"]).
        ulysses_group: the Ulysses group of a 2-D grid (a ProcessGroup or a 1-D DeviceMesh): the attention then runs
            ulysses_ring_attn_func (its varlen form for packed documents) over it and the ring `group`, and each call
            is checked against the 2-D layout (grid_shard_indices).
        mesh: instead of the groups, a DeviceMesh with dimensions named "ulysses" and "ring".
    Returns:
        name.
    Raises:
        ValueError: sp together with layout, group, ulysses_group or mesh; unknown layout; a DeviceMesh of more than
            one dimension as a group; a mesh without dimensions "ulysses" and "ring", or a mesh together with groups.
        TypeError: a name that is not a str; an sp that is not a SequenceParallel; a group that is not a
            ProcessGroup, a DeviceMesh or None.
        RuntimeError: ulysses_group or mesh without torch.distributed initialised.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (the attn_implementation name), got {type(name).__name__}: pass a "
                        "SequenceParallel as sp=sp")  # fmt: skip
    if sp is not None:
        layout, group, ulysses_group = sequence_parallel_arguments(
            "hf.register", sp, layout=layout, group=group, ulysses_group=ulysses_group, mesh=mesh
        )
    elif layout is None:
        layout = "zigzag"
    if ulysses_group is None and mesh is None:
        group = ring_group(group)
        fn = RingAttentionForTransformers(group, layout, name)
        mask = functools.partial(no_mask, group=group)
    else:
        grid, ulysses, group = grid_arguments(ulysses_group, group, mesh)
        fn = RingAttentionForTransformers(group, layout, name, ulysses_group=ulysses, grid=grid)
        mask = functools.partial(no_mask, grid=grid)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask)
    return name
