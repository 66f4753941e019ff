"""Hugging Face transformers with attn_implementation="ringattn" on W spawned ranks (gloo on CPU; NCCL on GPUs
where there are enough), against the same model with eager attention on the whole sequence in one process.

A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads: GQA, head dim 16, vocab 97), built from a
config with the same seed on every rank (no downloads). Each rank feeds its shard of input_ids with the
global position_ids; its logits, the sequence-parallel loss and the parameter gradients summed over the
ranks must obey the tolerance rule: eager attention in fp32 is the plain implementation, eager in float64
the reference.

Packed documents (position ids restarting at 0 at each document, one row, or a batch of rows each holding its
own documents) and padded batches (left, right or no padding, through shard_batch's attention_mask) are checked
against the same eager model run on each document alone.
"""

import copy
import io
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringattn.parallel import LAYOUTS
from tests.distributed import rank_device, run_ranks, skip_without_gpus

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")

WORLD_SIZES = [2, 4]
BATCH, VOCAB, IGNORE = 2, 97, -100
# packed document lengths: length 1, documents shorter than W, crossing rank and chunk boundaries; the
# totals (46, 75) are padded to a multiple of 2W, the padding a document of its own
DOCUMENTS = {2: [1, 13, 5, 1, 22, 4], 4: [1, 13, 5, 1, 22, 4, 2, 17, 1, 9]}


def _tiny_llama(seed: int, seqlen: int, device="cpu", **overrides):
    config = transformers.LlamaConfig(**{
        **dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=VOCAB, max_position_embeddings=seqlen, attention_dropout=0.0, tie_word_embeddings=False),
        **overrides,
    })  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device).train()  # built on the CPU: the same weights anywhere


def _batch(seqlen: int, device):
    """input_ids (B, S) and labels (B, S) with some ignored positions; the same on every rank."""
    gen = torch.Generator().manual_seed(seqlen)
    input_ids = torch.randint(0, VOCAB, (BATCH, seqlen), generator=gen).to(device)
    labels = input_ids.clone()
    labels[0, : seqlen // 3] = IGNORE  # e.g. a prompt left out of the loss
    labels[1, 5::7] = IGNORE
    return input_ids, labels


def _unsharded(model, input_ids, labels, dtype):
    """Eager attention on the whole sequence in `dtype`: logits, mean loss over shifted labels, gradients."""
    model = model.to(dtype)
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits  # (B, S, V)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check_step(where: str, logits, loss, model, plain, ref, rows) -> None:
    """A sharded step against the unsharded one under the tolerance rule: logits (B, n, V) against the plain and
    reference logits at global positions `rows` (n,), the loss, and every parameter's gradient (none where the
    step leaves a parameter out everywhere, as a multimodal model's vision tower on text)."""
    from ringattn.testing import check_close

    check_close(f"{where} logits", logits, plain[0][:, rows], ref[0][:, rows])
    check_close(f"{where} loss", loss, plain[1], ref[1])
    for n, p in model.named_parameters():
        if p.grad is None and plain[2][n] is None and ref[2][n] is None:
            continue
        check_close(f"{where} grad {n}", p.grad, plain[2][n], ref[2][n])


def _hf_matches_eager(rank, world_size, backend, layouts):
    import ringattn
    from ringattn.integrations import hf
    from ringattn.testing import check_close

    device = rank_device(rank, backend)
    seqlen = 32 * world_size
    layers = 2 if world_size <= 2 else 1  # layers after the first on two ranks; W = 4 costs 16 steps a layer
    input_ids, labels = _batch(seqlen, device)
    plain = _unsharded(_tiny_llama(0, seqlen, device, num_hidden_layers=layers), input_ids, labels, torch.float32)
    ref = _unsharded(_tiny_llama(0, seqlen, device, num_hidden_layers=layers), input_ids, labels, torch.float64)

    for layout in layouts:
        name = hf.register(f"ringattn-{layout}", layout=layout)
        sp = ringattn.SequenceParallel(layout=layout)
        model = hf.prepare(_tiny_llama(0, seqlen, device, num_hidden_layers=layers), name)
        batch = sp.shard_batch(input_ids, labels)
        pos = batch.position_ids[0]  # (S_local,) this rank's global positions

        out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        loss = sp.cross_entropy(out.logits, batch.labels)
        loss.backward()
        sp.sync_gradients(model)
        where = f"{layout} rank {rank}"
        check_step(where, out.logits, loss, model, plain, ref, pos)
        # the full logits, gathered, on every rank
        check_close(f"{where} gathered logits", sp.gather(out.logits.detach()), plain[0], ref[0])

        # transformers' own loss with pre-shifted labels and the global token count: this rank's share
        count = (batch.labels != IGNORE).sum()
        dist.all_reduce(count)
        with torch.no_grad():
            hf_loss = model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                labels=batch.labels, shift_labels=batch.labels, num_items_in_batch=count,
            ).loss  # fmt: skip
        dist.all_reduce(hf_loss)
        check_close(f"{where} transformers loss, summed", hf_loss, plain[1], ref[1])

        if layout == "zigzag" or world_size == 2:
            _refusals(model, batch, name, rank)
        if layout == "zigzag" or world_size == 2:
            _packed_matches_per_document(rank, world_size, name, sp, device)
    return True


def _per_document(model, input_ids, labels, cu_seqlens, dtype):
    """Eager attention on each document alone in `dtype`: logits (1, T, V), mean loss over the documents'
    shifted labels, gradients."""
    model = model.to(dtype)
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    logits, loss_sum, count = [], 0.0, 0
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        doc_logits = model(input_ids=input_ids[:, start:end], use_cache=False).logits  # (1, n, V)
        targets = F.pad(labels[:, start + 1 : end], (0, 1), value=IGNORE)  # shifted inside the document
        loss_sum = loss_sum + F.cross_entropy(doc_logits[0], targets[0], ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
        logits.append(doc_logits.detach())
    loss = loss_sum / count
    loss.backward()
    return torch.cat(logits, 1), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _packed_matches_per_document(rank, world_size, name, sp, device):
    """Packed documents: position ids inside the documents and their boundaries as transformers' cu_seq_lens_q and
    cu_seq_lens_k keep attention inside each document; position ids restarting at 0 without the boundaries are
    refused, naming the boundaries."""
    import ringattn
    from ringattn.integrations import hf

    lengths = DOCUMENTS[world_size]
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(total)
    input_ids = torch.randint(0, VOCAB, (1, total), generator=gen).to(device)
    labels = input_ids.clone()
    labels[0, 14:17] = IGNORE
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]  # (1, T) restarting per doc
    plain = _per_document(_tiny_llama(1, total, device), input_ids, labels, cu_seqlens, torch.float32)
    ref = _per_document(_tiny_llama(1, total, device), input_ids, labels, cu_seqlens, torch.float64)

    model = hf.prepare(_tiny_llama(1, total, device), name)
    batch = sp.shard_batch(input_ids, labels, position_ids=position_ids)
    with pytest.raises(ValueError, match=r"Packed documents .* need their boundaries as well: model\(\.\.\., cu_seq"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    documents = dict(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **documents)
    loss = sp.cross_entropy(out.logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)

    idx = ringattn.shard_indices(batch.seqlen, rank, world_size, sp.layout, device=device)
    real = idx < total  # the padding's logits are not compared
    check_step(f"packed {sp.layout} rank {rank}", out.logits[:, real], loss, model, plain, ref, idx[real])

    with pytest.raises(ValueError, match=r"position_ids hold 2 rows, cu_seq_lens_q the boundaries of 1 packed row "):
        ids, pos = batch.input_ids.expand(2, -1), batch.position_ids.expand(2, -1)  # one row's boundaries for two
        model(input_ids=ids, position_ids=pos, use_cache=False, **documents)
    with pytest.raises(ValueError, match=r"hold 1 rows, .* of 2 packed rows .*: pass one row of positions per"):
        two_rows = torch.cat([batch.cu_seqlens, batch.cu_seqlens[1:] + batch.seqlen])
        model(input_ids=ids, position_ids=batch.position_ids, use_cache=False, cu_seq_lens_q=two_rows,
              cu_seq_lens_k=two_rows)  # fmt: skip
    with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k must be the same global document bound"):
        other = dict(documents, cu_seq_lens_k=torch.tensor([0, batch.seqlen], dtype=torch.int32))
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **other)


def _segments(lengths, start=0):
    """[(start, end)] of documents of `lengths` back to back from `start`."""
    bounds = [start, *(start + torch.tensor(lengths).cumsum(0)).tolist()]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# batches of T = 37 tokens a row, each row its own documents: (segments of each row's real documents, whether
# position_ids describe them, attention_mask); lengths 1, shorter than W, crossing rank and chunk boundaries
ROW_LENGTH = 37
HF_BATCHES = {
    "packed-B2": ([_segments([1, 13, 5, 1, 17]), _segments([20, 4, 13])], True, None),
    "padded-B3": ([[(5, 37)], [(0, 30)], [(0, 37)]], False, [[0] * 5 + [1] * 32, [1] * 30 + [0] * 7, [1] * 37]),
}


def _rows_per_document(model, input_ids, labels, segments, dtype):
    """Eager attention on each document of each row alone in `dtype`: logits (B, T, V) (zeros at padding), the mean
    loss over every row's labels shifted inside their documents, gradients."""
    model = model.to(dtype)
    model.set_attn_implementation("eager")
    model.zero_grad(set_to_none=True)
    logits = torch.zeros(*input_ids.shape, VOCAB, dtype=dtype, device=input_ids.device)
    targets = torch.full_like(labels, IGNORE)
    for b, docs in enumerate(segments):
        for start, end in docs:
            logits[b, start:end] = model(input_ids=input_ids[b : b + 1, start:end], use_cache=False).logits[0]
            targets[b, start:end] = F.pad(labels[b, start + 1 : end], (0, 1), value=IGNORE)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _batch_of_rows_matches_eager(rank, world_size, backend, layouts):
    """A batch of packed rows (position_ids (B, T), each row its own documents) and a padded batch (left, right
    and no padding: attention_mask to shard_batch, the model called with the boundaries and no mask) against the
    eager model on each document alone: the real tokens' logits, the loss and the gradients."""
    import ringattn
    from ringattn.integrations import hf
    from ringattn.testing import check_close

    device = rank_device(rank, backend)
    layers = 2 if world_size <= 2 else 1  # layers after the first on two ranks; W = 4 costs 16 steps a layer
    for case, (segments, packed, mask) in HF_BATCHES.items():
        batch_size = len(segments)
        gen = torch.Generator().manual_seed(batch_size)
        input_ids = torch.randint(0, VOCAB, (batch_size, ROW_LENGTH), generator=gen).to(device)
        labels = input_ids.clone()
        labels[0, 14:17] = IGNORE
        real = torch.zeros(batch_size, ROW_LENGTH, dtype=torch.bool)
        positions = torch.zeros(batch_size, ROW_LENGTH, dtype=torch.int64)
        for b, docs in enumerate(segments):
            for start, end in docs:
                real[b, start:end] = True
                positions[b, start:end] = torch.arange(end - start)
        given = dict(position_ids=positions.to(device)) if packed else {}
        if mask is not None:
            given["attention_mask"] = torch.tensor(mask, device=device)
        max_len = ROW_LENGTH + 2 * world_size
        plain = _rows_per_document(
            _tiny_llama(1, max_len, device, num_hidden_layers=layers), input_ids, labels, segments, torch.float32
        )
        ref = _rows_per_document(
            _tiny_llama(1, max_len, device, num_hidden_layers=layers), input_ids, labels, segments, torch.float64
        )

        for layout in layouts:
            name = hf.register(f"ringattn-rows-{layout}", layout=layout)
            sp = ringattn.SequenceParallel(layout=layout)
            model = hf.prepare(_tiny_llama(1, max_len, device, num_hidden_layers=layers), name)
            batch = sp.shard_batch(input_ids, labels, **given)
            documents = dict(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens)
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **documents)
            loss = sp.cross_entropy(out.logits, batch.labels)
            loss.backward()
            sp.sync_gradients(model)

            where = f"{case} {layout} rank {rank}"
            idx = ringattn.shard_indices(batch.seqlen, rank, world_size, layout)
            local_real = F.pad(real, (0, batch.seqlen - ROW_LENGTH))[:, idx].to(device)  # (B, S_local)
            cols = idx.clamp(max=ROW_LENGTH - 1).to(device)
            logits = out.logits[local_real]
            check_close(f"{where} logits", logits, plain[0][:, cols][local_real], ref[0][:, cols][local_real])
            check_close(f"{where} loss", loss, plain[1], ref[1])
            for n, p in model.named_parameters():
                check_close(f"{where} grad {n}", p.grad, plain[2][n], ref[2][n])
    return True


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_llama_batch_of_packed_or_padded_rows_matches_eager(backend, world_size):
    """Both layouts at W = 2, zigzag at W = 4, as test_llama_ring_matches_eager."""
    skip_without_gpus(backend, world_size)
    layouts = LAYOUTS if world_size == 2 else ["zigzag"]
    ranks = run_ranks(_batch_of_rows_matches_eager, world_size, backend, layouts, backend=backend, timeout=600)
    assert ranks == [True] * world_size


def _refusals(model, batch, name, rank):
    """What the ring cannot compute raises ValueError with a message, before any communication."""
    ids, pos = batch.input_ids, batch.position_ids
    with pytest.raises(ValueError, match="position_ids must be, in every row, this rank's global positions"):
        # rank 0's positions are 0..S_local-1 only in the contiguous layout; every rank tries a wrong row
        wrong = pos + 1
        model(input_ids=ids, position_ids=wrong, use_cache=False)
    with pytest.raises(ValueError, match=r"in every row, this rank's global positions .*; row 1 differs first at its "
                       r"local position 0: from there it is \[\d+"):  # fmt: skip
        model(input_ids=ids.expand(2, -1), position_ids=torch.stack([pos[0], pos[0] + 1]), use_cache=False)
    with pytest.raises(ValueError, match=r"takes no padding mask .*\.shard_batch\(input_ids, labels, attention_mask"):
        mask = torch.ones_like(ids)
        mask[:, -1] = 0
        model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False)
    with pytest.raises(ValueError, match="output_attentions"):
        model(input_ids=ids, position_ids=pos, use_cache=False, output_attentions=True)
    cache = model(input_ids=ids, position_ids=pos, use_cache=True).past_key_values  # a forward with use_cache: runs
    for key in ("cache", "past_key_values"):  # transformers 5's name, and 4's
        for given, step in ((cache, (ids[:, -1:], pos[:, -1:] + 1)), (transformers.DynamicCache(), (ids, pos))):
            with pytest.raises(ValueError, match=r"a KV cache passed in \(generation: generate's first step"):
                # regression: a decode step was refused naming the layout or the positions, not the cache, and
                # generate's first step (an empty cache) ran, each rank continuing from its own last token
                model(input_ids=step[0], position_ids=step[1], use_cache=True, **{key: given})
    with pytest.raises(ValueError, match="a KV cache passed in"):
        model.generate(input_ids=ids, position_ids=pos, max_new_tokens=1, do_sample=False)
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match="no attention dropout"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    model.eval()  # dropout is 0 outside training: runs
    model(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=torch.ones_like(ids))
    model.model.layers[0].self_attn.attention_chunk_size = 16  # Llama 4's chunked attention
    with pytest.raises(ValueError, match="chunked attention"):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    del model.model.layers[0].self_attn.attention_chunk_size
    for arg, feature in (("indices", "sparse attention"), ("block_indices", "block-sparse attention")):
        setattr(model.model.layers[0].self_attn, arg, torch.zeros(1, dtype=torch.int64))  # as a sparse model passes
        with pytest.raises(ValueError, match=rf"does not support {feature} .*\({arg} is set\)"):
            model(input_ids=ids, position_ids=pos, use_cache=False)
        delattr(model.model.layers[0].self_attn, arg)


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=[f"W{w}" for w in WORLD_SIZES])
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_llama_ring_matches_eager(backend, world_size):
    """Both layouts in one set of ranks at W = 2 (spawning ranks that import transformers is the slow part), zigzag
    at W = 4. In fp32 and float64 on NCCL too: the plain and reference implementations are eager attention in
    those dtypes."""
    skip_without_gpus(backend, world_size)
    layouts = LAYOUTS if world_size == 2 else ["zigzag"]  # the contiguous layout at W = 4: test_hf_models.py
    ranks = run_ranks(_hf_matches_eager, world_size, backend, layouts, backend=backend, timeout=600)
    assert ranks == [True] * world_size


def _padding_in_one_shard(rank, world_size):
    import ringattn
    from ringattn.integrations import hf

    name = hf.register("ringattn-padding", layout="zigzag")
    sp = ringattn.SequenceParallel(layout="zigzag")
    seqlen = 16 * world_size
    model = hf.prepare(_tiny_llama(0, seqlen), name)
    batch = sp.shard_batch(*_batch(seqlen, "cpu"))
    mask = torch.ones(BATCH, seqlen, dtype=torch.int64)
    mask[:, -3:] = 0  # padding at the end: in zigzag, on rank 0's second chunk only
    local_mask = sp.shard(mask)
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=local_mask, use_cache=False)
    return str(err.value), time.monotonic() - start, bool(local_mask.all())


def test_a_padding_mask_in_one_shard_is_refused_by_every_rank():
    """Regression: with a padding mask whose zeros lie in one rank's shard, only that rank raised the ValueError;
    its peer went on into the first layer's collective and got gloo's "Connection closed by peer". Now prepare's
    check of the call shares its refusal: both ranks raise the same ValueError, naming the rank that holds the
    padding."""
    results = run_ranks(_padding_in_one_shard, 2)
    assert [all_ones for _, _, all_ones in results] == [False, True]
    assert results[0][0] == results[1][0]
    assert results[0][0].startswith(
        "hf model call refused on group rank 0 of 2: ring attention takes no padding mask in the model call: shard "
        "the batch with SequenceParallel.shard_batch(input_ids, labels, attention_mask=mask)"
    )
    assert all(elapsed < 5.0 for _, elapsed, _ in results), results


def test_attn_implementation_selected_by_name(tmp_path):
    """from_pretrained(..., attn_implementation="ringattn") and hf.prepare select it; no process group is needed
    until the model runs."""
    from ringattn.integrations import hf

    assert hf.register() == "ringattn"
    model = _tiny_llama(0, 64)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="ringattn")
    assert loaded.config._attn_implementation == "ringattn"
    config = model.config
    assert hf.prepare(model) is model
    assert model.config._attn_implementation == "ringattn"
    # regression: transformers writes a new model's attn_implementation into the config object it is made from, so a
    # reference model made from the prepared one's config switched it to eager (each rank attending within its shard,
    # the loss off, the call checks off). The prepared model's modules hold one copy of their own now
    assert transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").config is config
    held = {id(m.config): m.config for m in model.modules() if isinstance(getattr(m, "config", None), type(config))}
    assert [c._attn_implementation for c in held.values()] == ["ringattn"] and config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="'eager' is not a ring attention registered with transformers"):
        hf.prepare(model, "eager")
    fn = transformers.AttentionInterface._global_mapping["ringattn"]
    assert fn.layout == "zigzag" and fn.group is None
    with pytest.raises(ValueError, match="layout must be one of"):
        hf.register("ringattn-bad", layout="striped")
    with pytest.raises(TypeError, match="sp must be a ringattn.SequenceParallel or None, got str"):
        hf.register("ringattn-bad", sp="zigzag")
    # regression: prepare left a model whose attention is its own code on eager, without a word (each rank then
    # attended within its shard), and Falcon's ALiBi failed inside transformers with an AttributeError
    bloom_config = transformers.BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    bloom = transformers.BloomForCausalLM(bloom_config)
    with pytest.raises(ValueError, match=r"BloomForCausalLM runs its own attention code, not transformers' Atten"):
        hf.prepare(bloom)
    falcon_config = transformers.FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              vocab_size=VOCAB, alibi=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"FalconForCausalLM adds ALiBi position biases \(config.alibi=True\)"):
        hf.prepare(transformers.FalconForCausalLM(falcon_config))
    # regression: heads with one output per sequence ran, each rank pooling its own shard (logits off by up to 2)
    bert_config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=VOCAB)  # fmt: skip
    with pytest.raises(ValueError, match=r"BertForSequenceClassification pools each sequence into one output, but"):
        hf.prepare(transformers.BertForSequenceClassification(bert_config))
    llama_head = transformers.LlamaForSequenceClassification(_tiny_llama(0, 64).config)
    with pytest.raises(ValueError, match=r"LlamaForSequenceClassification pools each sequence into one output"):
        hf.prepare(llama_head)
    with pytest.raises(ValueError, match=r"BertModel has a pooler .* \(add_pooling_layer=False\), or run the"):
        hf.prepare(transformers.BertModel(bert_config))
    for per_token in (
        transformers.BertModel(bert_config, add_pooling_layer=False),
        transformers.BertForMaskedLM(bert_config),
        transformers.BertForTokenClassification(bert_config),
    ):
        assert hf.prepare(per_token) is per_token  # fmt: skip


def _tiny_causal_lm(model_type: str, **overrides):
    """A two-layer causal LM of `model_type` from its default config, made tiny."""
    sizes = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **{**sizes, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config)


# (model type, its config beyond _tiny_causal_lm's, what its refusal names): each ran silently wrong, logits off by
# 4e-4 to 0.7 against eager on 2 ranks
OWN_POSITIONS = {
    "lfm2-conv": ("lfm2", dict(layer_types=["conv", "full_attention"]), "of type 'conv'"),
    "jamba-mamba": ("jamba", dict(attn_layer_period=2, attn_layer_offset=1, num_experts=1, mamba_d_state=8,
                                  mamba_dt_rank=4, use_mamba_kernels=False),
                    "of type 'linear_attention', which carry a state along the sequence"),
    "llama-dynamic-rope": ("llama", dict(rope_parameters=dict(rope_type="dynamic", factor=4.0, rope_theta=1e4)),
                           "rope_type 'dynamic', whose frequencies follow the longest call so far"),
    "roberta": ("roberta", dict(is_decoder=True, pad_token_id=1), r"counts its positions from padding_idx \+ 1"),
    "bart-decoder": ("bart", dict(decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=96),
                     "BartDecoder takes no position_ids"),
    "llama4-temperature": ("llama4_text", dict(head_dim=16, attention_chunk_size=None, intermediate_size_mlp=96,
                                               num_local_experts=1, no_rope_layers=[1, 0],
                                               attn_temperature_tuning=True),
                           "scales the queries of its layers without rotary embeddings by their positions"),
}  # fmt: skip


@pytest.mark.parametrize("case", OWN_POSITIONS)
def test_models_that_would_number_each_shard_on_their_own_are_refused(case):
    """Regression: models mixing tokens outside attention (convolutions, state spaces, linear attention) or taking
    other positions than the global ones a call passes (RoBERTa's offset positions, BART's decoder numbering each
    call from 0, Llama 4's temperature on local positions, dynamic rotary frequencies from the largest position
    seen) ran on 2 ranks without an error, each rank computing its shard as a sequence of its own: logits off by 4e-4
    (LFM2's convolutions) to 0.7 (BART). prepare refuses them now, naming why; models mixing tokens through attention
    alone, with per-layer rotary embeddings or layers without them (SmolLM3), still prepare. (Longrope's frequencies,
    from the call's largest position: test_hf_models.py runs them.)"""
    from ringattn.integrations import hf

    hf.register()
    model_type, config, reason = OWN_POSITIONS[case]
    with pytest.raises(ValueError, match=reason):
        hf.prepare(_tiny_causal_lm(model_type, **config))
    for model in (_tiny_causal_lm("smollm3", no_rope_layers=[1, 0]), _tiny_causal_lm("gemma3_text")):
        assert hf.prepare(model) is model


def test_longrope_hooks_hand_the_length_under_ring_attention_only():
    """prepare's hooks on a longrope rotary embedding: under another attention implementation (a length left there
    from a ring call, which would pick the long factors at 20 positions) the model gives its own logits."""
    from ringattn.integrations import hf

    hf.register()
    rope = dict(rope_type="longrope", rope_theta=1e4, original_max_position_embeddings=50, short_factor=[1.0] * 8,
                long_factor=[4.0] * 8)  # fmt: skip
    torch.manual_seed(0)
    model = _tiny_causal_lm("phi3", max_position_embeddings=256, original_max_position_embeddings=50,
                            rope_parameters=rope)  # fmt: skip
    twin = copy.deepcopy(model)
    hf.prepare(model).set_attn_implementation("eager")
    setattr(model.model.rotary_emb, hf.SEQUENCE_LENGTH, 1000)
    tokens = torch.randint(0, VOCAB, (1, 20))
    torch.testing.assert_close(model(tokens, use_cache=False).logits, twin(tokens, use_cache=False).logits)
    assert getattr(model.model.rotary_emb, hf.SEQUENCE_LENGTH) is None


def test_what_the_layer_passes_reaches_the_ring(monkeypatch):
    """The layer's scaling, causality, window, soft-cap, sinks and deterministic (ModernBERT's
    deterministic_flash_attn, ignored before; else $FLASH_ATTENTION_DETERMINISTIC) reach ring_attn_func as its
    arguments."""
    from ringattn.integrations import hf

    calls = []
    monkeypatch.setattr(hf, "ring_attn_func", lambda q, k, v, **kwargs: calls.append(kwargs) or (q, None))
    fn = hf.RingAttentionForTransformers(None, "zigzag", "ringattn-args")
    module = torch.nn.Module()
    setattr(module, hf.PREPARED, True)
    query = torch.zeros(1, 4, 8, 16)  # (B, H, S, D)
    sink = torch.zeros(4)
    fn(module, query, query[:, :2], query[:, :2], None, scaling=0.5, is_causal=False, sliding_window=8, softcap=30.0,
       s_aux=sink, deterministic=True)  # fmt: skip
    assert calls == [dict(softmax_scale=0.5, causal=False, window_size=(7, 7), softcap=30.0, learnable_sink=sink,
                          deterministic=True, layout="zigzag", group=None)]  # fmt: skip
    # without the keyword, transformers' $FLASH_ATTENTION_DETERMINISTIC, as its flash-attn path reads it
    # (TrainingArguments(full_determinism=True) sets it; regression: no model but ModernBERT got deterministic=True)
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", value)
        fn(module, query, query[:, :2], query[:, :2], None, is_causal=True)
        assert calls[-1]["deterministic"] is expected
    fn(module, query, query[:, :2], query[:, :2], None, is_causal=True, deterministic=False)  # the keyword first
    assert calls[-1]["deterministic"] is False
    # under autocast, q, k, v in its dtype (regression: bf16 training refused q, k in fp32 beside a bf16 v, as RoPE
    # leaves them); outside it, as given
    seen = []
    monkeypatch.setattr(hf, "ring_attn_func", lambda q, k, v, **kwargs: seen.append((q.dtype, k.dtype, v.dtype)) or
                        (q, None))  # fmt: skip
    with torch.autocast("cpu", dtype=torch.float16):
        fn(module, query, query[:, :2], query[:, :2].half(), None, is_causal=True)
    fn(module, query, query[:, :2], query[:, :2], None, is_causal=True)
    assert seen == [(torch.float16,) * 3, (torch.float32,) * 3]


def _calls_that_were_silently_wrong_raise(rank, world_size):
    import ringattn
    from ringattn.integrations import hf
    from tests.integrations.test_hf_models import _model

    seqlen = 32 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    input_ids, labels = input_ids[:1], labels[:1]  # batch 1: the contiguous layout read each shard as a document
    for layout in LAYOUTS:
        name = hf.register(f"ringattn-{layout}", layout=layout)
        batch = ringattn.SequenceParallel(layout=layout).shard_batch(input_ids, labels)
        ids, pos = batch.input_ids, batch.position_ids
        llama = _tiny_llama(0, seqlen)
        llama.set_attn_implementation(name)
        with pytest.raises(ValueError, match=r"runs in models prepared with ringattn.integrations.hf.prepare\(model"):
            llama(input_ids=ids, position_ids=pos, use_cache=False)
        hf.prepare(llama, name)
        for call in (llama, llama.model):  # the model, and its base model called alone
            with pytest.raises(ValueError, match=f"attn_implementation='{name}' needs position_ids in every call"):
                call(input_ids=ids, use_cache=False)
        for given in (dict(labels=batch.labels), dict(labels=batch.labels, shift_labels=batch.labels)):
            with pytest.raises(ValueError, match=r"with labels= alone .* Compute the loss with sp.cross_entropy"):
                llama(input_ids=ids, position_ids=pos, use_cache=False, **given)
        # generate without a cache: each rank continued from its own last token (logits_to_keep=1)
        with pytest.raises(ValueError, match=r"logits_to_keep=1 keeps the last 1 of each rank's own tokens"):
            llama.generate(input_ids=ids, position_ids=pos, max_new_tokens=1, do_sample=False, use_cache=False)
        with pytest.raises(ValueError, match=r"keeps the positions a tensor of them names of each rank's own tokens"):
            llama(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=torch.tensor([0]))
        # a prepared model pickles, its checks with it (regression: the hook was a closure, which pickle refused)
        buffer = io.BytesIO()
        torch.save(llama, buffer)
        buffer.seek(0)
        with pytest.raises(ValueError, match=f"attn_implementation='{name}' needs position_ids in every call"):
            torch.load(buffer, weights_only=False)(input_ids=ids, use_cache=False)
        # every token on one rank, its positions sharded: RoPE's shape error before, naming nothing
        tokens = input_ids if dist.get_rank() == 1 else ids
        lengths = rf"input_ids \(or inputs_embeds\) hold {seqlen} tokens a row and position_ids {seqlen // world_size}"
        with pytest.raises(ValueError, match=rf"refused on group rank 1 of 2: .* {lengths}: pass each rank its shard"):
            llama(input_ids=tokens, position_ids=pos, use_cache=False)
        bert = hf.prepare(_model("modernbert", 0, seqlen), name)  # an encoder: no position_ids reach its attention
        with pytest.raises(ValueError, match="needs position_ids in every call"):
            bert(input_ids=ids)
    assert llama(ids, None, pos, use_cache=False).logits.shape == (1, seqlen // world_size, VOCAB)  # positional
    llama.set_attn_implementation("eager")
    llama(input_ids=ids, use_cache=False)  # the checks are ring attention's only
    return True


def test_calls_that_were_silently_wrong_raise_on_every_rank():
    """Regression: without position_ids the model numbered each rank's shard from 0, and in the contiguous layout
    with batch 1 the ring read each shard as a document of its own (rank 1's logits off by 0.40, no error); an
    encoder without position_ids (ModernBERT, which hands none to its attention layers) was wrong in both layouts;
    model(labels=...) gave the loss of each rank's shard alone, slightly wrong, without a word; generate without a
    cache gave each rank but one a different wrong token; unsharded input_ids with sharded positions failed in RoPE
    without naming them."""
    assert run_ranks(_calls_that_were_silently_wrong_raise, 2, timeout=300) == [True, True]


def _ring_step(model, call, sp, batch):
    """One sequence-parallel step of `model` through `call` (the model, or a compiled or wrapped form of it) on this
    rank's shard `batch`: logits, loss and every parameter's gradient summed over the ranks."""
    model.zero_grad(set_to_none=True)
    logits = call(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    loss = sp.cross_entropy(logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _compiled_llama_equals_eager(rank, world_size):
    import ringattn
    from ringattn.integrations import hf
    from ringattn.testing import check_close

    seqlen = 16 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    ref = _unsharded(_tiny_llama(0, seqlen, num_hidden_layers=1), input_ids, labels, torch.float64)
    name = hf.register("ringattn-compiled", layout="zigzag")
    sp = ringattn.SequenceParallel(layout="zigzag")
    batch = sp.shard_batch(input_ids, labels)
    rows = batch.position_ids[0]  # this rank's global positions
    model = hf.prepare(_tiny_llama(0, seqlen, num_hidden_layers=1), name)

    eager = _ring_step(model, model, sp, batch)
    for where, options in (("fullgraph", dict(fullgraph=True)), ("default", dict(backend="aot_eager"))):
        torch._dynamo.reset()
        compiled = torch.compile(model, **options)
        logits, loss, grads = _ring_step(model, compiled, sp, batch)
        where = f"torch.compile {where} rank {rank}"
        check_close(f"{where} logits", logits, eager[0], ref[0][:, rows])
        check_close(f"{where} loss", loss, eager[1], ref[1])
        for n, grad in grads.items():
            check_close(f"{where} grad {n}", grad, eager[2][n], ref[2][n])
        with pytest.raises(ValueError, match="position_ids must be, in every row, this rank's global positions"):
            compiled(input_ids=batch.input_ids, position_ids=batch.position_ids + 1, use_cache=False)
    return True


@pytest.mark.timeout(150)
def test_compiled_llama_equals_eager_on_2_ranks():
    """Regression: torch.compile(model) of a Hugging Face Llama with attn_implementation="ringattn" failed (Dynamo
    met the launchers' KernelLaunch objects, and with fullgraph=True the ring's and the integration's collectives).
    Now torch.compile(model, fullgraph=True) (inductor) and torch.compile(model) (default, with the aot_eager backend:
    Dynamo and AOTAutograd as in training, without a second inductor build) give the logits, the sequence-parallel
    loss and every parameter's gradient (summed over the ranks) of the eager ring model, under the tolerance rule:
    the eager ring model in fp32 is the plain implementation, eager attention on the whole sequence in float64 the
    reference. prepare's check of each call (ringattn::hf_checked_position_ids) runs in the compiled model: wrong
    position ids are refused."""
    assert run_ranks(_compiled_llama_equals_eager, 2, timeout=140) == [True, True]


def _checkpointed_llama_equals_plain(rank, world_size):
    import ringattn
    from ringattn.integrations import hf
    from ringattn.testing import check_close

    seqlen = 16 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    ref = _unsharded(_tiny_llama(0, seqlen), input_ids, labels, torch.float64)
    name = hf.register("ringattn-checkpointed", layout="zigzag")
    sp = ringattn.SequenceParallel(layout="zigzag")
    batch = sp.shard_batch(input_ids, labels)
    rows = batch.position_ids[0]  # this rank's global positions

    plain_model = hf.prepare(_tiny_llama(0, seqlen), name)
    plain = _ring_step(plain_model, plain_model, sp, batch)
    for reentrant in (False, True):
        model = hf.prepare(_tiny_llama(0, seqlen), name)
        # transformers 5.25's name; gradient_checkpointing_enable, its deprecated alias, before (the same arguments)
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(dict(use_reentrant=reentrant))
        logits, loss, grads = _ring_step(model, model, sp, batch)
        where = f"checkpointed (use_reentrant={reentrant}) rank {rank}"
        check_close(f"{where} loss", loss, plain[1], ref[1])
        check_close(f"{where} logits", logits, plain[0], ref[0][:, rows])
        for n, grad in grads.items():  # the same kernels on the same inputs: the same bits as without checkpoints
            assert torch.equal(grad, plain[2][n]), f"{where} grad {n}"
            check_close(f"{where} grad {n}", grad, plain[2][n], ref[2][n])
    return True


@pytest.mark.timeout(150)
def test_activation_checkpointing_recomputes_the_ring_in_the_backward():
    """model.activation_checkpointing_enable() (use_reentrant False and True) on a prepared Llama over 2 gloo ranks:
    each layer's ring attention runs again inside the backward (its agreement, transfers and numbered backward check
    among the recomputation's collectives), and the gradients are the bits of the same model without checkpoints,
    the loss and logits within the tolerance rule of eager attention in float64."""
    assert run_ranks(_checkpointed_llama_equals_plain, 2, timeout=140) == [True, True]


def _hf_grid_matches_eager(rank, world_size):
    """A 2 x 2 Ulysses x ring grid (register(ulysses_group=..., group=...), SequenceParallel(mesh=...)): rows of
    one sequence each against eager attention on the whole sequence, eagerly and with the model and the loss
    compiled (fullgraph=True), a batch of packed rows against eager on each document alone; wrong position ids
    refused on every rank of the grid alike."""
    from torch.distributed.device_mesh import init_device_mesh

    import ringattn
    from ringattn.integrations import hf

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))  # as the docs build it
    u, r = mesh.get_local_rank("ulysses"), mesh.get_local_rank("ring")
    name = hf.register("ringattn-grid", layout="zigzag", ulysses_group=mesh["ulysses"], group=mesh["ring"])
    sp = ringattn.SequenceParallel(layout="zigzag", mesh=mesh)
    assert repr(transformers.AttentionInterface().get(name)).endswith("ulysses_size=2, ring_size=2)")

    seqlen = 8 * world_size
    input_ids, labels = _batch(seqlen, "cpu")
    plain = _unsharded(_tiny_llama(0, seqlen), input_ids, labels, torch.float32)
    ref = _unsharded(_tiny_llama(0, seqlen), input_ids, labels, torch.float64)
    model = hf.prepare(_tiny_llama(0, seqlen), name)
    batch = sp.shard_batch(input_ids, labels)
    pos = batch.position_ids[0]
    assert torch.equal(pos, ringattn.grid_shard_indices(seqlen, u, 2, r, 2, "zigzag"))
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    loss = sp.cross_entropy(out.logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    check_step(f"grid rank ({u}, {r})", out.logits, loss, model, plain, ref, pos)
    # the model and the grid's loss under torch.compile(fullgraph=True): no graph break, the same step
    model.zero_grad(set_to_none=True)
    compiled, compiled_loss = (torch.compile(f, fullgraph=True, backend="aot_eager") for f in (model, sp.cross_entropy))
    logits = compiled(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    loss = compiled_loss(logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    check_step(f"compiled grid rank ({u}, {r})", logits, loss, model, plain, ref, pos)
    wrong_start = time.monotonic()
    with pytest.raises(ValueError) as wrong:  # each rank's shard in the ring's 1-D layout: not the grid's
        ring_pos = ringattn.shard_indices(seqlen, sp.rank, world_size, "zigzag")[None].expand(BATCH, -1)
        model(input_ids=batch.input_ids, position_ids=ring_pos if r == 1 else pos, use_cache=False)
    wrong_seconds = time.monotonic() - wrong_start

    segments, _, _ = HF_BATCHES["packed-B2"]
    input_ids = torch.randint(0, VOCAB, (len(segments), ROW_LENGTH), generator=torch.Generator().manual_seed(2))
    labels = input_ids.clone()
    labels[0, 14:17] = IGNORE
    positions = torch.zeros(len(segments), ROW_LENGTH, dtype=torch.int64)
    for b, docs in enumerate(segments):
        for start, end in docs:
            positions[b, start:end] = torch.arange(end - start)
    max_len = ROW_LENGTH + 2 * world_size
    plain = _rows_per_document(_tiny_llama(1, max_len), input_ids, labels, segments, torch.float32)
    ref = _rows_per_document(_tiny_llama(1, max_len), input_ids, labels, segments, torch.float64)
    model = hf.prepare(_tiny_llama(1, max_len), name)
    batch = sp.shard_batch(input_ids, labels, position_ids=positions)
    documents = dict(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens)
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **documents)
    loss = sp.cross_entropy(out.logits, batch.labels)
    loss.backward()
    sp.sync_gradients(model)
    idx = ringattn.grid_shard_indices(batch.seqlen, u, 2, r, 2, "zigzag")
    real = idx < ROW_LENGTH  # every row's documents fill it: the padding is at the end
    check_step(f"grid packed rows rank ({u}, {r})", out.logits[:, real], loss, model, plain, ref, idx[real])
    return str(wrong.value), wrong_seconds


def test_llama_over_a_ulysses_ring_grid_matches_eager():
    """attn_implementation registered with the Ulysses group and the ring of a 2 x 2 mesh: logits, the loss and
    every gradient (summed over the grid) against eager attention (fp32 plain, float64 reference), for rows of one
    sequence, eagerly and with the model and SequenceParallel.cross_entropy under torch.compile(fullgraph=True) (a
    regression: the Ulysses x ring call and the grid's loss broke the graph at their agreement), and for packed rows
    (B 2); position ids in the ring's layout on the ranks of one ring are refused by every rank with one message."""
    results = run_ranks(_hf_grid_matches_eager, 4, timeout=400)
    messages = {message for message, _ in results}
    assert len(messages) == 1, messages
    assert (
        "position_ids must be, in every row, this rank's global positions in layout 'zigzag' over the Ulysses x "
        "ring grid" in messages.pop()
    )
    assert all(seconds < 5.0 for _, seconds in results), results
