"""hf_masks.mask_band: the band read back from transformers' mask functions is the pattern they compute, and the
parts ring attention cannot apply are refused."""

import inspect

import pytest
import torch

mu = pytest.importorskip("transformers.masking_utils", reason="transformers is not installed (extra 'hf')")

from ringattn.integrations import hf_masks  # noqa: E402

N = 24
ONE_ROW = torch.zeros(1, N, dtype=torch.long)  # packed-sequence ids / positions of a row of one document
TEXT = torch.full((1, N), -1)  # the block ids of a row without image tokens

MASKS = {
    "causal": (mu.causal_mask_function, hf_masks.CAUSAL),
    "bidirectional": (mu.bidirectional_mask_function, hf_masks.FULL),
    "sliding causal 5": (mu.sliding_window_causal_mask_function(5), hf_masks.Band(4, 0)),  # Mistral, Gemma, gpt-oss
    "sliding causal 1": (mu.sliding_window_causal_mask_function(1), hf_masks.Band(0, 0)),
    "sliding bidirectional 3": (
        mu.sliding_window_bidirectional_mask_function(3),
        hf_masks.Band(3, 3),
    ),  # T5Gemma, ModernBERT
    "packed sliding": (
        mu.and_masks(
            mu.remap_positions_for_packed_sequence(mu.sliding_window_causal_mask_function(6), torch.arange(N)[None]),
            mu.packed_sequence_mask_function(ONE_ROW),
        ),
        hf_masks.Band(5, 0),
    ),
    "offsets": (mu.add_offsets_to_mask_function(mu.sliding_window_causal_mask_function(3), 0, 0), hf_masks.Band(2, 0)),
    # an image-text model (Gemma 3) on text alone: image blocks (block ids >= 0) that hold no token
    "image blocks on text": (mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(TEXT)), hf_masks.CAUSAL),
    "image blocks on text, sliding": (
        mu.and_masks(mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(TEXT)), mu.sliding_window_overlay(5)),
        hf_masks.Band(4, 0),
    ),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_the_band_is_what_the_mask_function_computes(name):
    fn, band = MASKS[name]
    assert hf_masks.mask_band(fn, "test") == band
    q, kv = torch.arange(N)[:, None], torch.arange(N)[None, :]
    computed = fn(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    left, right = (N if side is None else side for side in band)
    assert torch.equal(computed.expand(N, N), (kv >= q - left) & (kv <= q + right))


@pytest.mark.parametrize(
    "fn,feature",
    [
        (mu.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)), "chunked attention"),  # Llama 4
        (
            mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ONE_ROW)),
            r"a union of mask patterns \(.*\): 'causal_mask_function', 'blockwise_overlay",
        ),  # its parts named
        (
            mu.and_masks(mu.causal_mask_function, lambda b, h, q, kv: kv >= 0),
            "the mask function '<lambda>' of tests.integrations.test_hf_masks",
        ),  # the module says the model
        (mu.padding_mask_function(torch.tensor([[1, 1, 0]], dtype=torch.bool)), "masks the padding it finds"),
    ],
    ids=["chunked", "or_masks", "unknown", "padding"],
)
def test_what_the_ring_cannot_apply_is_refused(fn, feature):
    with pytest.raises(ValueError, match=f"^where: .*{feature}"):
        hf_masks.mask_band(fn, "where")


def _mask_functions(model_cls, config) -> dict:
    """The mask functions a model's forward hands the attention mask interface, by whether the creator passed a
    window ("sliding") or not ("full")."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    seen = {}

    def capture(*args, mask_function=None, **kwargs):
        seen["sliding" if kwargs.get("local_size") else "full"] = mask_function

    AttentionMaskInterface.register("ringattn-test-capture", capture)
    AttentionInterface.register("ringattn-test-capture", lambda module, q, k, v, mask, **kw: (q.transpose(1, 2), None))
    config._attn_implementation = "ringattn-test-capture"
    model_cls(config)(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    return seen


TINY_TEXT = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=11)  # fmt: skip


def _bidirectional_window_overlay(sliding_window):  # a pattern named as Gemma 3's, with another meaning
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= sliding_window

    return inner_mask


def create_reference_sliding_window_causal_mask(prefill_length):  # Unlimited OCR's pattern, under a cache
    kv_offset = 0

    def prefill_overlay(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx - kv_offset < prefill_length

    return prefill_overlay


def test_a_union_with_a_models_own_patterns_is_read():
    """Gemma 3's and Step3p7's use_bidirectional_attention (EmbeddingGemma) join patterns of the model's own to
    transformers' (every key; |i - j| < sliding_window) by or_masks, as Unlimited OCR's reference-sliding layers do
    (the prefill's keys): the band is their union. A function of such a pattern's name that computes something else
    is refused."""
    from transformers import Gemma3TextConfig, Gemma3TextModel, UnlimitedOcrTextConfig, UnlimitedOcrTextModel

    # EmbeddingGemma's: its config's window 9 made 9 // 2 + 1 keys each side
    gemma = Gemma3TextConfig(**TINY_TEXT, sliding_window=9, layer_types=["sliding_attention", "full_attention"],
                             use_bidirectional_attention=True)  # fmt: skip
    masks = _mask_functions(Gemma3TextModel, gemma)
    window = gemma.sliding_window
    cases = [(masks["full"], hf_masks.FULL), (masks["sliding"], hf_masks.Band(window - 1, window - 1))]
    # Unlimited OCR's reference-sliding layers, without a cache: every key of the prefill, so causal
    ocr = UnlimitedOcrTextConfig(**TINY_TEXT, sliding_window=3, layer_types=["reference_sliding_attention"] * 2)
    cases.append((_mask_functions(UnlimitedOcrTextModel, ocr)["sliding"], hf_masks.CAUSAL))
    q, kv = torch.arange(N)[:, None], torch.arange(N)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    for fn, band in cases:
        assert hf_masks.mask_band(fn, "where", added_patterns=True) == band
        left, right = (N if side is None else side for side in band)
        assert torch.equal(fn(zero, zero, q, kv).expand(N, N), (kv >= q - left) & (kv <= q + right))
    other = mu.or_masks(mu.sliding_window_causal_mask_function(5), _bidirectional_window_overlay(5))
    with pytest.raises(ValueError, match="^where: .*the mask function '_bidirectional_window_overlay.<locals>"):
        hf_masks.mask_band(other, "where", added_patterns=True)
    cached = mu.or_masks(mu.sliding_window_causal_mask_function(5), create_reference_sliding_window_causal_mask(7))
    with pytest.raises(ValueError, match="^where: .*'create_reference_sliding_window_causal_mask.* not a band"):
        hf_masks.mask_band(cached, "where", added_patterns=True)


def test_documents_beside_a_models_own_mask_patterns_are_refused():
    """transformers marks documents it found in position_ids, which the ring finds there too; a model that adds mask
    functions of its own may mark documents the ring never sees (ESMC's sequence_id: chains that must not attend to
    each other)."""
    chains = mu.and_masks(mu.bidirectional_mask_function, mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1]])))
    assert hf_masks.mask_band(chains, "where") == hf_masks.FULL
    # transformers' own documents (found in position_ids: the positions remapped around the model's patterns, the
    # documents' mask outside) beside the model's chains inside, and beside a pattern that holds no documents
    positions = torch.tensor([[0, 1, 0]])
    theirs = mu.packed_sequence_mask_function(torch.tensor([[0, 0, 1]]))
    both = mu.and_masks(mu.remap_positions_for_packed_sequence(chains, positions), theirs)
    window = mu.and_masks(mu.bidirectional_mask_function, mu.sliding_window_bidirectional_overlay(2))
    plain = mu.and_masks(mu.remap_positions_for_packed_sequence(window, positions), theirs)
    assert hf_masks.mask_band(plain, "where", added_patterns=True) == hf_masks.Band(2, 2)
    for fn in (chains, both):
        with pytest.raises(ValueError, match="^where: .*documents of the model's own .*sequence_id"):
            hf_masks.mask_band(fn, "where", added_patterns=True)


def test_a_padding_mask_the_model_made_is_refused():
    hf_masks.check_no_padding(None, "where")
    hf_masks.check_no_padding(torch.ones(2, 5, dtype=torch.bool), "where")
    with pytest.raises(ValueError, match="pad_token_id in input_ids"):
        hf_masks.check_no_padding(torch.tensor([[1, 1, 0, 1]]), "where")


CREATORS = ["create_causal_mask", "create_bidirectional_mask", "create_sliding_window_causal_mask",
            "create_bidirectional_sliding_window_mask"]  # fmt: skip


@pytest.mark.parametrize("creator", CREATORS)
def test_what_the_creators_pass_beside_the_function_says_its_band(creator):
    """creator_band (under torch.compile, where Dynamo reads no closure) from the arguments transformers' creators
    hand the mask interface gives what mask_band reads from their mask functions."""
    from transformers import MistralConfig
    from transformers.masking_utils import AttentionMaskInterface

    seen = {}

    def capture(*args, mask_function=None, **kwargs):
        seen.update(kwargs, mask_function=mask_function)

    AttentionMaskInterface.register("ringattn-test-capture", capture)
    config = MistralConfig(sliding_window=5, attention_chunk_size=None)
    config._attn_implementation = "ringattn-test-capture"
    embeds = torch.zeros(1, N, 8)
    create = getattr(mu, creator)
    cache = {name: None for name in ("cache", "past_key_values") if name in inspect.signature(create).parameters}
    create(config, embeds, attention_mask=None, position_ids=torch.arange(N)[None], **cache)
    bidirectional = "allow_is_bidirectional_skip" in seen
    band = hf_masks.creator_band(seen.get("local_size"), bidirectional, config, "where")
    assert band == hf_masks.mask_band(seen["mask_function"], "where") and bidirectional == ("bidirectional" in creator)
    with pytest.raises(ValueError, match="chunked attention"):
        hf_masks.creator_band(8, False, MistralConfig(attention_chunk_size=8), "where")


def test_a_model_that_reads_its_mask_gets_a_clear_error():
    """Models that read the mask before the attention function (Doge: its dtype) get the band: a clear error, not
    'Band' object has no attribute 'dtype'."""
    with pytest.raises(AttributeError, match=r"reads its attention mask itself \(\.dtype\)"):
        hf_masks.Band(4, 0).dtype  # noqa: B018


def test_what_dynamo_can_check_is_checked():
    """Under torch.compile: a union of patterns at the top of the mask function (PaliGemma's image prefix), and layers
    that attend bidirectionally over a causal eager mask (Gemma 2 with use_bidirectional_attention)."""
    from transformers import Gemma2Config

    union = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ONE_ROW))
    with pytest.raises(ValueError, match="a union of mask patterns"):
        hf_masks.top_level_union(union, "where")
    hf_masks.top_level_union(mu.sliding_window_causal_mask_function(4), "where")
    with pytest.raises(ValueError, match="attend bidirectionally .use_bidirectional_attention."):
        hf_masks.check_causal_agrees(hf_masks.CAUSAL, Gemma2Config(use_bidirectional_attention=True), "where")
    hf_masks.check_causal_agrees(hf_masks.FULL, Gemma2Config(use_bidirectional_attention=True), "where")
    hf_masks.check_causal_agrees(hf_masks.CAUSAL, Gemma2Config(), "where")


@pytest.mark.parametrize("case", ["causal", "bidirectional", "sliding", "union"])
def test_top_level_union_traces_with_fullgraph_for_any_mask_function(case):
    """Regression: under torch.compile(fullgraph=True) a mask function made outside the compiled code failed in
    Dynamo ("'getset_descriptor' object is not iterable", reading its __qualname__): transformers' module-level
    causal and bidirectional mask functions (gpt-oss's full layers, ModernBERT's global ones) broke a prepared model's
    compile. Now each traces, and the union is still refused, its message in Dynamo's error."""
    mask_function = {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding": mu.sliding_window_causal_mask_function(4),
        "union": mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ONE_ROW)),
    }[case]

    def step(x):
        hf_masks.top_level_union(mask_function, "where")
        return x + 1

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    if case == "union":
        with pytest.raises(Exception, match="a union of mask patterns"):
            compiled(torch.zeros(1))
    else:
        assert compiled(torch.zeros(1)).item() == 1.0
