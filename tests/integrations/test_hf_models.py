"""Model families whose attention layers pass sliding windows, soft-capping, sinks or no causal mask, through
attn_implementation="ringattn" on W gloo ranks, against the same model with eager attention on the whole
sequence in one process (the contract of test_hf.py, for each family).

Tiny random models (2 layers: one sliding, one full where the family mixes them), built from a config with
the same seed on every rank (no downloads): Mistral (one window for every layer), Qwen2 with
use_sliding_window, Gemma 2 (attention logits soft-capped, query_pre_attn_scalar), Gemma 3, gpt-oss
(attention sinks, mixture of experts), ModernBERT (bidirectional, local and global layers) and Phi-3 with longrope
(rotary frequencies from the sequence's largest position, past 50 or not on a shard alone). Windows of 7 to
21 tokens against shards of 32 (zigzag chunks of 16): shorter and longer than a chunk, crossing rank and chunk
boundaries. Logits, the loss and every parameter gradient summed over the ranks obey the tolerance rule (eager
in fp32 the plain implementation, eager in float64 the reference). Packed documents (position ids restarting
at 0; for ModernBERT, transformers' cu_seq_lens_q / cu_seq_lens_k) against the eager model on each document
alone.
"""

import pytest
import torch

from tests.distributed import run_ranks
from tests.integrations.test_hf import DOCUMENTS, _batch, _per_document, _unsharded, check_step

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

VOCAB = 97
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, attention_dropout=0.0, tie_word_embeddings=False)  # fmt: skip
LAYERS = ["sliding_attention", "full_attention"]


def _config(family: str, seqlen: int):
    """(model class, config) of `family` at max length seqlen."""
    t = transformers
    if family == "mistral":
        return t.MistralForCausalLM, t.MistralConfig(**SMALL, head_dim=16, sliding_window=21,
                                                     max_position_embeddings=seqlen)  # fmt: skip
    if family == "qwen2":
        return t.Qwen2ForCausalLM, t.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=9,
                                                 max_window_layers=1, max_position_embeddings=seqlen)  # fmt: skip
    if family == "gemma2":
        return t.Gemma2ForCausalLM, t.Gemma2Config(**SMALL, head_dim=16, sliding_window=11, layer_types=LAYERS,
                                                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                                   final_logit_softcapping=30.0,
                                                   max_position_embeddings=seqlen)  # fmt: skip
    if family == "gemma3":
        return t.Gemma3ForCausalLM, t.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=13, layer_types=LAYERS,
                                                       query_pre_attn_scalar=16,
                                                       max_position_embeddings=seqlen)  # fmt: skip
    if family == "gemma3_bidirectional":  # EmbeddingGemma's: every key on full layers, |i - j| < 13 on sliding ones
        cls, config = _config("gemma3", seqlen)
        config.use_bidirectional_attention = True
        return cls, config
    if family == "gemma3_multimodal":  # Gemma 3's image-text model (its released checkpoints), called on text
        vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                      patch_size=8)  # fmt: skip
        _, text = _config("gemma3", seqlen)
        return t.Gemma3ForConditionalGeneration, t.Gemma3Config(
            text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
            boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3,
        )  # fmt: skip
    if family == "gemma4_unified":  # its config's default use_bidirectional_attention="vision": causal layers
        return t.Gemma4UnifiedForCausalLM, t.Gemma4UnifiedTextConfig(**SMALL, head_dim=16, global_head_dim=16,
                                                                     sliding_window=13, layer_types=LAYERS,
                                                                     max_position_embeddings=seqlen)  # fmt: skip
    if family == "gpt_oss":
        rope = dict(rope_type="default", rope_theta=10000.0)  # not the YaRN of the released checkpoints
        return t.GptOssForCausalLM, t.GptOssConfig(**SMALL, head_dim=16, sliding_window=7, layer_types=LAYERS,
                                                   num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope,
                                                   experts_implementation="eager",  # grouped_mm: no float64
                                                   max_position_embeddings=seqlen)  # fmt: skip
    if family == "qwen2_moe":  # the window is in its mask alone: its layers pass the attention function none
        return t.Qwen2MoeForCausalLM, t.Qwen2MoeConfig(**SMALL, use_sliding_window=True, sliding_window=9,
                                                       max_window_layers=1, moe_intermediate_size=16,
                                                       shared_expert_intermediate_size=16, num_experts=4,
                                                       num_experts_per_tok=2, experts_implementation="eager",
                                                       max_position_embeddings=seqlen)  # fmt: skip
    if family == "t5gemma":  # an encoder whose mask's window (|i - j| <= 5) is one wider than what its layers pass
        encoder = dict(**SMALL, head_dim=16, sliding_window=5, layer_types=LAYERS, query_pre_attn_scalar=16,
                       attn_logit_softcapping=2.0, max_position_embeddings=seqlen)  # fmt: skip
        config = t.T5GemmaConfig(encoder=encoder, decoder=encoder, vocab_size=VOCAB, attention_dropout=0.0,
                                 dropout_rate=0.0, is_encoder_decoder=False, num_labels=VOCAB)  # fmt: skip
        return t.T5GemmaForTokenClassification, config
    if family == "llama4":  # chunked attention, in its mask alone (without the temperature prepare refuses)
        return t.Llama4ForCausalLM, t.Llama4TextConfig(**SMALL, head_dim=16, attention_chunk_size=8,
                                                       intermediate_size_mlp=96, num_local_experts=2,
                                                       num_experts_per_tok=1, interleave_moe_layer_step=2,
                                                       no_rope_layers=[1, 0], attn_temperature_tuning=False,
                                                       max_position_embeddings=seqlen)  # fmt: skip
    if family == "phi3_longrope":  # frequencies from max(position_ids) + 1: long past 50, a shard's max or not
        rope = dict(rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=50, short_factor=[1.0] * 8,
                    long_factor=[4.0] * 8)  # fmt: skip
        return t.Phi3ForCausalLM, t.Phi3Config(**SMALL, max_position_embeddings=256, rope_parameters=rope,
                                               original_max_position_embeddings=50, pad_token_id=0)  # fmt: skip
    if family == "esmc":  # a protein encoder; its sequence_id marks chains that do not attend to each other
        return t.EsmcModel, t.EsmcConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=seqlen)  # fmt: skip
    assert family == "modernbert", family
    return t.ModernBertForMaskedLM, t.ModernBertConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        local_attention=14, layer_types=LAYERS, attention_dropout=0.0, max_position_embeddings=seqlen,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
    )  # fmt: skip


FAMILIES = ["mistral", "qwen2", "gemma2", "gemma3", "gpt_oss", "modernbert"]


def _model(family: str, seed: int, seqlen: int):
    """The family's tiny model in train mode, the same weights on every rank; queries and keys scaled up so that
    the scores are a few units (soft-capping bends them, windows and sinks change the softmax visibly), sinks
    drawn at that scale too."""
    cls, config = _config(family, seqlen)
    torch.manual_seed(seed)
    model = cls(config).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "Wqkv.weight")):
                p.mul_(12.0)
            elif family.startswith("gemma4") and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(3.0)  # Gemma 4 normalises q and k and does not scale their product
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape))
    if family == "gemma3_bidirectional":  # its layers told they are causal, as Step3p7's are under the same mask:
        for layer in model.model.layers:  # eager applies the mask, and so must the ring
            layer.self_attn.is_causal = True
    return model


def _family_matches_eager(rank, world_size, families, layouts, packed, padded=()):
    import ringattn
    from ringattn.integrations import hf

    seqlen = 32 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    for family in families:
        plain = _unsharded(_model(family, 0, seqlen), input_ids, labels, torch.float32)
        ref = _unsharded(_model(family, 0, seqlen), input_ids, labels, torch.float64)
        for layout in layouts:
            name = hf.register(f"ringattn-{layout}", layout=layout)
            sp = ringattn.SequenceParallel(layout=layout)
            model = hf.prepare(_model(family, 0, seqlen), name)
            batch = sp.shard_batch(input_ids, labels)
            pos = batch.position_ids[0]
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
            loss = sp.cross_entropy(out.logits, batch.labels)
            loss.backward()
            sp.sync_gradients(model)
            check_step(f"{family} {layout} rank {rank}", out.logits, loss, model, plain, ref, pos)
        if family in packed:
            _packed_family_matches_per_document(rank, world_size, family, layouts[0])
        if family in padded:
            _padded_family_matches_eager(rank, world_size, family, layouts[0])
    return True


def _padded_family_matches_eager(rank, world_size, family, layout):
    """A sequence 3 tokens short of a multiple of 2W: shard_batch's padding is a document of its own, so that with
    the boundaries passed no real token attends to it (an encoder's tokens would, were it in their document), and
    without them the model refuses the positions (which restart at the padding) on every rank."""
    import ringattn
    from ringattn.integrations import hf

    seqlen = 32 * world_size - 3
    input_ids, labels = _batch(seqlen, "cpu")
    plain = _unsharded(_model(family, 2, seqlen), input_ids, labels, torch.float32)
    ref = _unsharded(_model(family, 2, seqlen), input_ids, labels, torch.float64)
    name = hf.register(f"ringattn-{layout}", layout=layout)
    sp = ringattn.SequenceParallel(layout=layout)
    model = hf.prepare(_model(family, 2, seqlen + 3), name)
    batch = sp.shard_batch(input_ids, labels)
    with pytest.raises(ValueError, match="cu_seq_lens"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    _step_with_boundaries_matches(f"{family} padded {layout} rank {rank}", model, sp, batch, seqlen, plain, ref)


def _step_with_boundaries_matches(where, model, sp, batch, real_tokens, plain, ref):
    """The model's step on a ShardedBatch with its document boundaries against the unsharded plain and reference
    steps, at the global positions before `real_tokens` (check_step)."""
    import ringattn

    given = dict(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **given)
    loss = sp.cross_entropy(out.logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    idx = ringattn.shard_indices(batch.seqlen, sp.rank, sp.world_size, sp.layout)
    real = idx < real_tokens
    check_step(where, out.logits[:, real], loss, model, plain, ref, idx[real])


def _packed_family_matches_per_document(rank, world_size, family, layout):
    import ringattn
    from ringattn.integrations import hf

    lengths = DOCUMENTS[world_size]
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(total)
    input_ids = torch.randint(0, VOCAB, (1, total), generator=gen)
    labels = input_ids.clone()
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    plain = _per_document(_model(family, 1, total), input_ids, labels, cu_seqlens, torch.float32)
    ref = _per_document(_model(family, 1, total), input_ids, labels, cu_seqlens, torch.float64)

    name = hf.register(f"ringattn-{layout}", layout=layout)
    sp = ringattn.SequenceParallel(layout=layout)
    model = hf.prepare(_model(family, 1, total), name)
    batch = sp.shard_batch(input_ids, labels, position_ids=position_ids)
    # the boundaries go as transformers' packed kwargs (ModernBERT hands its attention layers no position_ids)
    _step_with_boundaries_matches(f"{family} packed {layout} rank {rank}", model, sp, batch, total, plain, ref)


# W = 2: every family in both layouts (a case each, so that test workers share them), packed documents for three, a
# padded sequence for a decoder and the encoder;
# the families whose window is in their mask alone (Qwen2-MoE), or wider there than what their layers pass (T5Gemma);
# a bidirectional model whose mask is a union of transformers' pattern and the model's own (EmbeddingGemma), packed too;
# W = 4: a mixed sliding / full family with soft-capping in zigzag, the family with sinks in the contiguous layout
# (rank counts cost the most CPU time)
CASES = {
    "W2-zigzag": (2, FAMILIES, ["zigzag"], ["mistral", "gpt_oss", "modernbert"]),
    "W2-contiguous": (2, FAMILIES, ["contiguous"], [], ["mistral", "modernbert"]),
    "W2-mask-windows": (2, ["qwen2_moe", "t5gemma", "gemma4_unified"], ["zigzag"], []),
    "W2-bidirectional": (2, ["gemma3_bidirectional"], ["zigzag"], ["gemma3_bidirectional"]),
    "W2-longrope": (2, ["phi3_longrope"], ["zigzag", "contiguous"], [], ["phi3_longrope"]),
    "W4-zigzag": (4, ["gemma2"], ["zigzag"], []),
    "W4-contiguous": (4, ["gpt_oss"], ["contiguous"], ["gpt_oss"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_families_with_windows_softcap_sinks_and_encoders_match_eager(case):
    world_size, families, layouts, packed, *padded = CASES[case]
    ranks = run_ranks(_family_matches_eager, world_size, families, layouts, packed, *padded, timeout=600)
    assert ranks == [True] * world_size


def _mask_patterns_the_ring_cannot_apply_are_refused(rank, world_size):
    import ringattn
    from ringattn.integrations import hf

    seqlen = 32 * world_size
    name = hf.register("ringattn-zigzag", layout="zigzag")
    sp = ringattn.SequenceParallel(layout="zigzag")
    input_ids, labels = _batch(seqlen, "cpu")
    batch = sp.shard_batch(input_ids, labels)
    call = dict(input_ids=batch.input_ids, position_ids=batch.position_ids)
    with pytest.raises(ValueError, match="chunked attention"):  # was full causal attention, logits off by 0.7
        hf.prepare(_model("llama4", 0, seqlen), name)(**call, use_cache=False)
    # T5Gemma masks the pad tokens (id 0) it finds when no attention_mask is passed: refused on every rank, though
    # only rank 0 holds one (the ring had attended to it: logits off by 2e-2); with a mask of ones the model runs
    padded = batch.input_ids.clone()
    if rank == 0:
        padded[0, 3] = 0
    model = hf.prepare(_model("t5gemma", 0, seqlen), name)
    with pytest.raises(ValueError, match="pad_token_id in input_ids"):
        model(input_ids=padded, position_ids=batch.position_ids)
    model(input_ids=padded, position_ids=batch.position_ids, attention_mask=torch.ones_like(padded))
    # Gemma 2 with use_bidirectional_attention (PaliGemma's text models): its layers say bidirectional, its eager
    # mask is causal (the ring had attended bidirectionally: logits off by 0.85)
    gemma = _model("gemma2", 0, seqlen)
    gemma.config.use_bidirectional_attention = True
    for layer in gemma.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match="attend bidirectionally"):
        hf.prepare(gemma, name)(**call, use_cache=False)
    # ESMC's chains (sequence_id), documents of the model's own that the ring does not see
    chains = (torch.arange(seqlen) >= seqlen // 2).long().expand(batch.input_ids.shape[0], -1)
    with pytest.raises(ValueError, match="sequence_id"):
        hf.prepare(_model("esmc", 0, seqlen), name)(**call, sequence_id=sp.shard(chains))
    return True


def _text_of_a_multimodal_model_matches_eager(rank, world_size):
    import ringattn
    from ringattn.integrations import hf

    seqlen = 32 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    plain = _unsharded(_model("gemma3_multimodal", 0, seqlen), input_ids, labels, torch.float32)
    ref = _unsharded(_model("gemma3_multimodal", 0, seqlen), input_ids, labels, torch.float64)
    name = hf.register("ringattn-zigzag", layout="zigzag")
    sp = ringattn.SequenceParallel(layout="zigzag")
    model = hf.prepare(_model("gemma3_multimodal", 0, seqlen), name)
    batch = sp.shard_batch(input_ids, labels)
    token_types = torch.zeros_like(batch.input_ids)  # text alone, as the model's processor marks it
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, token_type_ids=token_types,
                use_cache=False)  # fmt: skip
    loss = sp.cross_entropy(out.logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    check_step(f"gemma3 text rank {rank}", out.logits, loss, model, plain, ref, batch.position_ids[0])
    if rank == 0:  # an image token on one rank: its block attends bidirectionally, which the ring does not apply
        token_types[0, 4] = 1
    with pytest.raises(ValueError, match="a union of mask patterns"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, token_type_ids=token_types,
              use_cache=False)  # fmt: skip
    return True


def test_text_of_a_multimodal_model_matches_eager():
    """Gemma 3's image-text model on text alone (token_type_ids all 0: its mask's image-block overlay adds no pair)
    runs as its text model; with an image token on some rank it is refused on every rank."""
    assert run_ranks(_text_of_a_multimodal_model_matches_eager, 2, timeout=300) == [True, True]


def test_mask_patterns_the_ring_cannot_apply_are_refused_on_every_rank():
    """Chunked attention (Llama 4), a padding mask the model builds from its pad tokens (T5Gemma) and a causal eager
    mask under bidirectional layers (Gemma 2 with use_bidirectional_attention) live in the mask transformers builds,
    not in what the layers pass: read from it and refused by every rank."""
    assert run_ranks(_mask_patterns_the_ring_cannot_apply_are_refused, 2, timeout=300) == [True, True]
