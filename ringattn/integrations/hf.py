"""Hugging Face transformers: ring attention as an attention implementation, through its public interfaces.

    from ringattn.integrations import hf
    hf.register(layout="zigzag")                     # once per process, before the model runs
    hf.prepare(model)                                # attn_implementation="ringattn", and each call checked
    sp = ringattn.SequenceParallel(layout="zigzag")  # the same group and layout
    batch = sp.shard_batch(input_ids, labels)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    loss = sp.cross_entropy(logits, batch.labels)
    # packed documents, batch 1: pos (1, S) restarting at 0 at each document start
    batch = sp.shard_batch(input_ids, labels, position_ids=pos)  # then the same two calls

`register` adds an attention function under `name` to transformers' AttentionInterface and a mask
function to its AttentionMaskInterface. The attention function is called by each attention layer with
query (batch, heads, S_local, head_dim) and key, value (batch, kv_heads, S_local, head_dim) (GQA: fewer
K/V heads, passed on unrepeated) and runs ring_attn_func (ring_attn_varlen_func for packed documents)
over the group. The mask function makes the model build no mask at all: a dense (S_local, S_local)
causal mask over local positions would be wrong for a shard, and the ring applies the causal mask (and
the document boundaries) over global positions itself.

`prepare` selects the implementation for a model and checks each call of it (a forward pre-hook on each
transformers model in it), on every rank alike and before any computation: position_ids are required (without
them the model numbers each rank's shard from 0; an encoder that does not hand them to its attention layers
could not even be checked there), and labels= is refused unless shift_labels and num_items_in_batch come with it
(transformers would shift the labels inside the shard and average over this rank's tokens alone): the loss of
the whole sequence is SequenceParallel.cross_entropy's. The attention function refuses a model not prepared.

Contract: every rank of the group calls the model on its shard of input_ids with the matching position_ids
(ShardedBatch.position_ids) and gets the logits the unsharded model gives at those positions. The position
ids are either the tokens' global positions (one sequence per row) or, for packed documents (batch 1), their
positions inside their documents, restarting at 0 at each document start, sharded in the registered layout
(SequenceParallel.shard_batch(input_ids, labels, position_ids=...)). Once per forward, not per layer, the
attention function gathers every rank's position ids: global positions 0 .. S-1 in global order mean one
sequence (ring_attn_func); anything else must be packed documents, whose boundaries it recovers and passes
to ring_attn_varlen_func, so attention stays inside each document (RoPE already uses the in-document
positions, as Hugging Face's packed training does).

What the model's attention layers pass on is computed as its eager attention computes it: the layer's
`scaling` (Gemma's query_pre_attn_scalar), causal or not (the module's is_causal: encoders such as ModernBERT
are not), `sliding_window` as flash-attn's window_size = (sliding_window - 1, sliding_window - 1) over global
positions, cut by causal (transformers' own mapping: Mistral, Qwen2 with use_sliding_window, Gemma 2 and 3,
gpt-oss, ModernBERT's local layers, each layer with its own), `softcap` (Gemma 2's attn_logit_softcapping) and
the attention sinks `s_aux` (gpt-oss: one learned logit per head, its gradient a parameter gradient like any
other, summed over the ranks by SequenceParallel.sync_gradients).

Refused with ValueError: dropout > 0, chunked attention, position biases, attention masks other than none/all-
ones (padding, custom 4-D masks), a KV cache holding earlier tokens (generation), output_attentions,
position_ids that are neither global positions nor packed documents in the registered layout (e.g. sharded in
another layout), rows with different position ids, and packed documents in a batch of more than one row.
Models that do not hand position_ids to their attention layers (ModernBERT) take packed documents as
transformers' cu_seq_lens_q and cu_seq_lens_k keyword arguments instead, holding the global boundaries:
model(..., cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens).
"""

import functools
import inspect
import weakref

import torch
import torch.distributed as dist

from ..functional import ring_attn_func, ring_attn_varlen_func
from ..parallel.agreement import check_agreement, shared_refusals
from ..parallel.documents import cu_seqlens_from_position_ids
from ..parallel.groups import Group, ring_group
from ..parallel.layout import check_layout, check_local_seqlen, shard_indices

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ringattn.integrations.hf needs transformers: pip install 'ringattn[hf]' (or pip install transformers)"
    ) from e

NAME = "ringattn"
PREPARED = "_ringattn_prepared"  # set by prepare() on every module of a model

# keyword arguments some models pass to the attention function for features the ring does not compute
_UNSUPPORTED_KWARGS = {
    "attention_chunk_size": "chunked attention",
    "position_bias": "position biases",
}


class RingAttentionForTransformers:
    """The attention function registered in transformers' AttentionInterface (see the module docstring).

    Called as fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs), the
    signature of transformers' attention functions; returns (attn_output (batch, S_local, heads,
    head_dim), None).
    """

    def __init__(self, group: dist.ProcessGroup | None, layout: str, name: str):
        check_layout(layout)
        self.group, self.layout, self.name = group, layout, name
        # (weakref to position_ids, its _version, their documents): the layers of one forward share them
        self._documents_of = None

    def __repr__(self) -> str:
        return f"RingAttentionForTransformers(name={self.name!r}, layout={self.layout!r})"

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
        self._refuse_unsupported(module, query, key, attention_mask, dropout, kwargs)
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        cu_seqlens = self._given_documents(kwargs)
        position_ids = kwargs.get("position_ids")
        if cu_seqlens is None and position_ids is not None:
            cu_seqlens = self._documents(position_ids, query.shape[2])
        # (B, H, S, D) -> (B, S, H, D): strided views, no copy
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        sink = kwargs.get("s_aux")
        ring = dict(
            softmax_scale=scaling, causal=bool(is_causal), window_size=self._window(kwargs.get("sliding_window")),
            softcap=kwargs.get("softcap") or 0.0, learnable_sink=sink if sink is not None else kwargs.get("sinks"),
            group=self.group, layout=self.layout,
        )  # fmt: skip
        if cu_seqlens is None:
            return ring_attn_func(q, k, v, **ring), None
        if query.shape[0] != 1:
            raise ValueError(
                f"attn_implementation={self.name!r}: packed documents (position_ids restarting at 0 inside the "
                f"sequence) need batch size 1, got batch {query.shape[0]}; pack the samples into one row"
            )
        return ring_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, **ring)[None], None

    def _given_documents(self, kwargs: dict) -> torch.Tensor | None:
        """The global document boundaries passed as transformers' cu_seq_lens_q (and cu_seq_lens_k, the same), or
        None: for models that do not hand position_ids to their attention layers (ModernBERT)."""
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        if cu_q is None and cu_k is None:
            return None
        if cu_q is None or cu_k is None or not torch.equal(cu_q, cu_k):
            raise ValueError(
                f"attn_implementation={self.name!r}: cu_seq_lens_q and cu_seq_lens_k must both be the global "
                "document boundaries (SequenceParallel.shard_batch(...).cu_seqlens), the same tensor values"
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
                f"got a mask of shape {tuple(attention_mask.shape)}. Pass attention_mask=None, and keep padding "
                "at the end of the sequence with its labels set to the ignore index"
            )
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                f"{where} needs queries and keys of the same local length, got {query.shape[2]} and {key.shape[2]}: "
                "a KV cache holding earlier tokens (generation) and cross-attention are not supported; "
                "call the model with use_cache=False"
            )

    def _documents(self, position_ids: torch.Tensor, seqlen_local: int) -> torch.Tensor | None:
        """None for global positions, else the int32 (n_docs + 1,) boundaries (on the CPU) of packed documents.

        position_ids (batch or 1, S_local) hold, on every rank, that rank's positions. A collective the first
        time a position_ids tensor is seen (one all-gather of S_local + 1 integers per rank); every layer of
        one forward gets the same tensor and reuses the answer. Every rank decides from the same gathered
        ids, so all take the same path or raise the same error.

        Raises:
            ValueError: the ids are neither the global positions nor packed documents in this layout, or
                rows of the batch differ.
            RuntimeError: torch.distributed not initialised.
        """
        cached = self._documents_of
        if cached is not None and cached[0]() is position_ids and cached[1] == position_ids._version:
            return cached[2]
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"attn_implementation={self.name!r} needs torch.distributed initialised")
        world_size = dist.get_world_size(self.group)
        check_local_seqlen(seqlen_local, self.layout, name="the local sequence length")
        if position_ids.shape[-1] != seqlen_local:
            raise ValueError(
                f"attn_implementation={self.name!r}: position_ids must hold {seqlen_local} positions per row "
                f"(this rank's tokens), got shape {tuple(position_ids.shape)}"
            )
        gathered = self._gather_positions(position_ids.reshape(-1, seqlen_local), world_size)
        if bool(gathered[:, 0].any()):
            ranks = torch.nonzero(gathered[:, 0]).flatten().tolist()
            raise ValueError(
                f"attn_implementation={self.name!r}: position_ids must be the same row for every sample "
                f"(packed documents: batch size 1); they differ between rows on ranks {ranks}"
            )
        seqlen = seqlen_local * world_size
        positions = torch.empty(seqlen, dtype=torch.int64)  # in global order
        for r in range(world_size):
            positions[shard_indices(seqlen, r, world_size, self.layout)] = gathered[r, 1:]
        if torch.equal(positions, torch.arange(seqlen)):
            cu_seqlens = None
        else:
            try:
                cu_seqlens = cu_seqlens_from_position_ids(positions)
            except ValueError as e:
                raise ValueError(
                    f"attn_implementation={self.name!r}: position_ids must be this rank's global positions in "
                    f"layout {self.layout!r} (SequenceParallel.shard_batch(...).position_ids, or "
                    "ringattn.position_ids), or, for packed documents, this rank's shard in that layout of "
                    "positions restarting at 0 at each document (shard_batch(..., position_ids=...)). Put in "
                    f"global order, the ranks' position_ids are {_preview(positions)}: {e}"
                ) from None
        self._documents_of = (weakref.ref(position_ids), position_ids._version, cu_seqlens)
        return cu_seqlens

    def _gather_positions(self, rows: torch.Tensor, world_size: int) -> torch.Tensor:
        """(W, 1 + S_local) int64 on the CPU: per rank, whether its rows differ, then its first row.

        rows: (batch, S_local) this rank's position ids. One all_gather on the group.
        """
        rows = rows.to(torch.int64)
        rows_differ = (rows != rows[:1]).any().to(torch.int64).reshape(1)
        local = torch.cat([rows_differ, rows[0]])  # (1 + S_local,)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=self.group)
        return torch.stack(gathered).cpu()


def _preview(t: torch.Tensor, n: int = 8) -> str:
    flat = t.reshape(-1, t.shape[-1])[0].tolist()
    return str(flat) if len(flat) <= n else f"[{', '.join(map(str, flat[:n]))}, ...] ({len(flat)} positions)"


def no_mask(
    *args,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    group: dist.ProcessGroup | None = None,
    **kwargs,
) -> None:
    """The mask function registered in AttentionMaskInterface, bound to the registered group: build no mask.

    Returns None for no mask or an all-ones 2-D padding mask. Raises ValueError for a padding mask with
    zeros, and when the model adds its own mask pattern on top of the causal one (transformers then
    asks for a vmap-built mask): the ring could not apply either. A collective on `group` (every rank
    builds its masks in each forward), so that a refusal on one rank (padding in its shard only) is
    raised by every rank, before the first layer.
    """
    with shared_refusals("hf attention mask", group):
        if use_vmap:
            raise ValueError(
                "ring attention computes causal (or full) attention with the layer's sliding window: this model adds "
                "its own mask pattern on top of it, which is not supported"
            )
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "ring attention does not support padding masks: pass attention_mask=None and put padding at the end "
                "of the sequence with its labels set to the ignore index (SequenceParallel.shard_batch does)"
            )
    check_agreement("hf attention mask", None, group)
    return None


def _is_ring(implementation) -> bool:
    """Whether an attn_implementation name selects a RingAttentionForTransformers."""
    return isinstance(AttentionInterface().get(implementation), RingAttentionForTransformers)


def _check_call(model: torch.nn.Module):
    """prepare's forward pre-hook for `model` (a transformers model): raises ValueError, while ring attention is
    selected, for a call without position_ids, or with labels but without shift_labels and num_items_in_batch."""
    positional = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]

    def check(module, args, kwargs) -> None:
        implementation = module.config._attn_implementation
        if not _is_ring(implementation):
            return
        call = {**dict(zip(positional, args, strict=False)), **kwargs}
        where = f"attn_implementation={implementation!r}"
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

    return check


def prepare(model: torch.nn.Module, name: str = NAME) -> torch.nn.Module:
    """Run `model` with the ring attention registered as `name`, checking each of its calls.

    Sets the model's attn_implementation to `name` (model.set_attn_implementation) and installs, once, a forward
    pre-hook on each transformers model in it (the model and, e.g., its base model) that raises ValueError
    while a ring attention is selected: for a call without position_ids, and for labels= without shift_labels
    and num_items_in_batch (see the module docstring). Call it on every rank, after `register`.

    Returns:
        model.
    Raises:
        ValueError: `name` is not registered as ring attention (`register`).
    """
    if not _is_ring(name):
        raise ValueError(
            f"{name!r} is not a ring attention registered with transformers: call "
            f"ringattn.integrations.hf.register({name!r}, ...) first"
        )
    model.set_attn_implementation(name)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not getattr(module, PREPARED, False):
            module.register_forward_pre_hook(_check_call(module), with_kwargs=True)
    for module in model.modules():
        setattr(module, PREPARED, True)
    return model


def register(name: str = NAME, *, layout: str = "zigzag", group: Group = None) -> str:
    """Register ring attention with transformers under `name` (global to the process; registering again replaces).

    After this, `prepare(model, name)` selects it for a model (or `from_pretrained(..., attn_implementation=name)`,
    then `prepare(model, name)`). Shard inputs with the same group and layout (ringattn.SequenceParallel(group,
    layout)).
    Register two names to use two layouts or groups side by side.

    Args:
        name: the attn_implementation name.
        layout: "zigzag" (default) or "contiguous".
        group: the sequence-parallel process group (default: the world), or a 1-D DeviceMesh (a (dp, cp) mesh's
            mesh["cp"]).
    Returns:
        name.
    Raises:
        ValueError: unknown layout; a DeviceMesh of more than one dimension.
        TypeError: a group that is not a ProcessGroup, a DeviceMesh or None.
    """
    group = ring_group(group)
    fn = RingAttentionForTransformers(group, layout, name)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, functools.partial(no_mask, group=group))
    return name
