"""Which keys a transformers mask function lets each query see, as the band ring attention applies.

transformers builds a layer's mask from a mask function (masking_utils: the causal or bidirectional pattern, a
sliding window overlay, chunks, packed documents, padding), and its eager attention computes what that mask allows,
whatever the layer passes to the attention function. `mask_band` reads the function's parts back (their closures)
and gives the band, so that the ring applies what eager applies; a part the ring cannot apply is refused. Under
torch.compile, where Dynamo cannot read closures, `creator_band` gives the band from what the mask's creator passes
beside the function (its local_size, bidirectional or not, the config's chunk size).
"""

import functools
import inspect
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import masking_utils as mu


class Band(NamedTuple):
    """Key j is visible from query i when i - left <= j <= i + right, None: no limit on that side."""

    left: int | None
    right: int | None

    def narrowed(self, other: "Band") -> "Band":
        """The pairs both bands allow."""
        return Band(_least(self.left, other.left), _least(self.right, other.right))

    def widened(self, other: "Band") -> "Band":
        """The pairs either band allows (both hold the diagonal: a band again)."""
        return Band(_most(self.left, other.left), _most(self.right, other.right))

    def __getattr__(self, name: str):
        # a model that reads its mask before the attention function (its dtype, flips it) gets this, not a mask
        raise AttributeError(
            f"ring attention hands this model's layers the band of keys their mask allows, not a mask tensor: the "
            f"model reads its attention mask itself (.{name}), which ring attention does not support"
        )


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else max(a, b)


CAUSAL = Band(None, 0)
FULL = Band(None, None)


def _factory(fn: Callable) -> str:
    """The name of the masking_utils function that made the closure fn ("" for a plain function, or a callable that
    is no Python function). Read from the code object's qualified name (Python 3.11 on), which Dynamo traces for any
    function; the function's own __qualname__ it refuses under fullgraph=True for one made outside the compiled code
    (transformers' module-level causal_mask_function, which gpt-oss and ModernBERT layers pass)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    qualname = code.co_qualname if sys.version_info >= (3, 11) else fn.__qualname__
    return qualname.split(".<locals>.")[0] if ".<locals>." in qualname else ""


def _closure(fn: Callable) -> dict:
    return inspect.getclosurevars(fn).nonlocals


# the parts of a mask the ring refuses, by the masking_utils function that makes them
REFUSED = {
    "chunked_overlay": "chunked attention (a query sees the keys of its own chunk)",
    "or_masks": "a union of mask patterns (bidirectional blocks, token types)",
    "packed_sequence_mask_function": (
        "documents of the model's own beside its added mask patterns (e.g. ESMC's sequence_id; pass packed "
        "documents as position_ids restarting at 0, or cu_seqlens)"
    ),
}


def _refuse(feature: str, where: str):
    raise ValueError(f"{where}: this model's attention mask holds {feature}, which ring attention does not apply")


def mask_band(mask_function: Callable, where: str, added_patterns: bool = False) -> Band:
    """The band of keys mask_function lets each query see, with packed documents and padding left out (the ring
    takes documents from their boundaries; padding is checked by the caller). Raises ValueError, naming `where`,
    for a part ring attention cannot apply: chunked attention, a union of patterns (or_masks: bidirectional blocks
    of images, token types; image blocks over text alone add nothing and are left out; a union of bands, each
    transformers' or a model's of MODEL_PATTERNS, is their widest band), any mask function masking_utils did not
    make but MODEL_PATTERNS, and with added_patterns (the model added mask functions of its own: transformers'
    use_vmap) documents of the model's own (ESMC's sequence_id): transformers' marking of the documents in
    position_ids, which the ring finds there too, comes with their positions remapped around the model's patterns
    (remap_positions_for_packed_sequence); documents inside those patterns, or without that remapping, are the
    model's."""
    own_documents = added_patterns and not _holds(mask_function, "remap_positions_for_packed_sequence")
    return _band(mask_function, where, added_patterns, own_documents)


def _band(mask_function: Callable, where: str, added_patterns: bool, own_documents: bool) -> Band:
    """mask_band's reading of one part; own_documents: a document mask here is the model's own."""
    if mask_function is mu.causal_mask_function:
        return CAUSAL
    if mask_function is mu.bidirectional_mask_function:
        return FULL
    factory = _factory(mask_function)
    if factory == "and_masks":
        band = FULL
        for part in _closure(mask_function)["mask_functions"]:
            band = band.narrowed(_band(part, where, added_patterns, own_documents))
        return band
    if factory == "sliding_window_overlay":  # kv > q - sliding_window
        return Band(_closure(mask_function)["sliding_window"] - 1, None)
    if factory == "sliding_window_bidirectional_overlay":  # |q - kv| <= sliding_window
        window = _closure(mask_function)["sliding_window"]
        return Band(window, window)
    if factory == "remap_positions_for_packed_sequence":  # positions inside a document; the model's patterns inside
        return _band(_closure(mask_function)["mask_function"], where, added_patterns, added_patterns)
    if factory == "add_offsets_to_mask_function":
        return _band(_closure(mask_function)["mask_function"], where, added_patterns, own_documents)
    if factory == "padding_mask_function" and not bool(_closure(mask_function)["padding_mask"].all()):
        raise ValueError(f"{where}: {MODEL_PADDING}")
    if factory == "packed_sequence_mask_function" and own_documents:
        _refuse(REFUSED["packed_sequence_mask_function"], where)
    if factory in ("packed_sequence_mask_function", "padding_mask_function"):
        return FULL
    if factory == "or_masks":  # a union: of one pattern and overlays that add no pair, that pattern
        parts = [part for part in _closure(mask_function)["mask_functions"] if not _adds_nothing(part)]
        if len(parts) == 1:
            return _band(parts[0], where, added_patterns, own_documents)
        bands = [_union_part_band(part, where) for part in parts]
        if None in bands:
            _refuse(f"{REFUSED['or_masks']}: {', '.join(map(_named, parts))}", where)
        return functools.reduce(Band.widened, bands)
    if factory in MODEL_PATTERNS:
        return _model_pattern_band(mask_function, where)
    _refuse(REFUSED.get(factory) or f"the mask function {_named(mask_function)}", where)


# mask functions models define for patterns of their own, which transformers joins to its causal or sliding-window
# pattern by or_masks, by the function that makes them, and the band each gives from its closure (None: none here):
# Gemma 3's and Step3p7's use_bidirectional_attention (EmbeddingGemma), every key for the full layers and
# |i - j| < sliding_window for the sliding ones; Unlimited OCR's reference-sliding layers, every key of the prefill
# (all of them without a cache: the layer is then causal)
MODEL_PATTERNS = {
    "Gemma3TextModel.forward": lambda closure: FULL,
    "Step3p7TextModel.forward": lambda closure: FULL,
    "_bidirectional_window_overlay": lambda closure: Band(closure["sliding_window"] - 1, closure["sliding_window"] - 1),
    "create_reference_sliding_window_causal_mask": lambda closure: (
        FULL if closure["prefill_length"] == float("inf") else None
    ),
}
PROBE_FAR = 1 << 20  # the far query position model patterns are checked at
PROBE_SPAN = 4096  # keys checked past a band's unlimited side


# what a union's part may not hold: documents, padding, chunks, image blocks (each changes what the union means, not
# just its band)
UNION_UNREADABLE = ("packed_sequence_mask_function", "padding_mask_function", "remap_positions_for_packed_sequence",
                    "chunked_overlay", "blockwise_overlay")  # fmt: skip


def _union_part_band(part: Callable, where: str) -> Band | None:
    """The band of one part of a union (_band's reading), or None for a part that holds something of
    UNION_UNREADABLE or a band off the diagonal (a union of bands that hold it is their widest band)."""
    if any(_holds(part, factory) for factory in UNION_UNREADABLE):
        return None
    band = _band(part, where, False, False)
    return band if all(side is None or side >= 0 for side in band) else None


def _model_pattern_band(pattern: Callable, where: str) -> Band:
    """The band a MODEL_PATTERNS function gives, checked by calling it on rows of keys around a query near the start
    and one far out (as transformers calls it, on index tensors), once per function and closure: a model whose
    function of that name means something else is refused."""
    closure = _closure(pattern)
    band = MODEL_PATTERNS[_factory(pattern)](closure)
    if band is None:
        _refuse(f"the mask function {_named(pattern)} (here not a band of keys)", where)
    key = (pattern.__code__, tuple(sorted(closure.items())))
    if key not in _CHECKED_PATTERNS:
        _check_pattern(pattern, band, where)
        _CHECKED_PATTERNS.add(key)
    return band


_CHECKED_PATTERNS: set = set()  # (code, closure) of the model patterns _check_pattern passed


def _check_pattern(pattern: Callable, band: Band, where: str) -> None:
    """Refuse pattern, naming it, unless it computes band on the probe rows."""
    for q0 in (0, PROBE_FAR):
        left = PROBE_SPAN if band.left is None else band.left
        right = PROBE_SPAN if band.right is None else band.right
        kv = torch.cat([torch.arange(max(q0 - left - 8, 0), q0 + right + 9), torch.tensor([0, 2 * PROBE_FAR])])
        q = torch.full_like(kv, q0)
        try:
            given = torch.as_tensor(pattern(0, 0, q, kv)).expand(kv.shape)
        except (RuntimeError, TypeError):  # not a function of index tensors: not the pattern of that name
            _refuse(f"the mask function {_named(pattern)}", where)
        visible = torch.ones_like(given) if band.left is None else kv >= q - band.left
        if band.right is not None:
            visible = visible & (kv <= q + band.right)
        if not torch.equal(given, visible):
            _refuse(f"the mask function {_named(pattern)}", where)


def _named(mask_function: Callable) -> str:
    """A mask function's name and, when not masking_utils', its module (which says the model)."""
    name = repr(getattr(mask_function, "__qualname__", mask_function))
    module = getattr(mask_function, "__module__", None)
    return name if module in (None, mu.__name__) else f"{name} of {module}"


def _holds(mask_function: Callable, factory: str) -> bool:
    """Whether mask_function is, or combines, a closure that masking_utils' `factory` made."""
    if _factory(mask_function) == factory:
        return True
    closure = _closure(mask_function) if _factory(mask_function) else {}
    parts = closure.get("mask_functions", ()) or [closure.get("mask_function")]
    return any(callable(part) and _holds(part, factory) for part in parts)


def _adds_nothing(mask_function: Callable) -> bool:
    """Whether mask_function is an overlay of image blocks (blockwise_overlay, from token_type_ids) over tokens
    of which none is in a block: text alone, as a multimodal model's text-only batch."""
    return _factory(mask_function) == "blockwise_overlay" and not bool(
        (_closure(mask_function)["block_sequence_ids"] >= 0).any()
    )


def top_level_union(mask_function: Callable, where: str) -> None:
    """Raise ValueError, naming `where`, when mask_function is a union of patterns (or_masks: bidirectional blocks of
    images), the part of mask_band that Dynamo can trace (a function's name, not its closure)."""
    if _factory(mask_function) == "or_masks":
        _refuse(REFUSED["or_masks"], where)


def check_causal_agrees(band: Band, config, where: str) -> None:
    """Raise ValueError, naming `where`, for a model whose layers attend bidirectionally (use_bidirectional_attention)
    while the mask transformers builds for its eager attention is causal (Gemma 2, PaliGemma's text models): its
    attention paths disagree, and ring attention does not pick one. Gemma 4's "vision" (bidirectional image blocks,
    causal layers) is not such a model; its "all" is."""
    if band == CAUSAL and getattr(config, "use_bidirectional_attention", False) in (True, "all"):
        raise ValueError(f"{where}: this model's layers attend bidirectionally (use_bidirectional_attention) but its "
                         "mask for eager attention is causal; ring attention does not pick one of the two")  # fmt: skip


def creator_band(local_size: int | None, bidirectional: bool, config, where: str) -> Band:
    """The band of transformers' mask creators from their arguments (create_sliding_window_causal_mask and
    create_bidirectional_sliding_window_mask pass the window as local_size, create_chunked_causal_mask the chunk
    size): a causal window of local_size keys up to the query, a bidirectional one of local_size keys each side.
    Raises ValueError, naming `where`, for chunked attention."""
    if local_size is None:
        return FULL if bidirectional else CAUSAL
    if not bidirectional and getattr(config, "attention_chunk_size", None) == local_size:
        _refuse(REFUSED["chunked_overlay"], where)
    return Band(local_size, local_size) if bidirectional else Band(local_size - 1, 0)


# a padding mask the model made itself (T5Gemma's from the pad tokens in input_ids), which the call's check never saw
MODEL_PADDING = (
    "this model masks the padding it finds in its inputs (pad_token_id in input_ids, when no attention_mask is "
    "passed), which ring attention does not apply; shard the batch with SequenceParallel.shard_batch(input_ids, "
    "labels, attention_mask=mask), which makes each row's padding documents of their own, and call the model with "
    "the batch's position_ids and cu_seqlens and an attention_mask of ones"
)


def check_no_padding(attention_mask: torch.Tensor | None, where: str) -> None:
    """Raise ValueError, naming `where`, when the 2-D mask transformers hands the mask interface marks some key as
    padding (a zero)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(f"{where}: {MODEL_PADDING}")
