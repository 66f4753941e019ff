"""ringattn.integrations.trainer.RingTrainer on W gloo ranks against plain transformers.Trainer in one process.

A tiny random Llama (hidden 32, 2 layers, 2 heads, 1 KV head, vocab 97), built from a config with the same seed
everywhere (no downloads), trained STEPS SGD steps (gradient clipping on) on the same global batches: by
RingTrainer with ring attention over W ranks (one ring of W, or dp rings of cp), and by Trainer in one process with
eager attention, in fp32 (the plain implementation) and float64 (the reference). The samples count different
numbers of ignored labels, so the rings of a step average different token counts: only the mean over every counted
token of the global batch (Trainer's average_tokens_across_devices) matches.

SGD, not Trainer's default AdamW, so that the parameters after the steps can be held to the tolerance rule: Adam's
first steps move each parameter by about lr * sign(gradient), so the rounding of a gradient near 0 (ring and plain
fp32 alike) decides a whole step there; SGD's parameters are linear in the gradients.
"""

import importlib
import os
import sys

import pytest
import torch

from tests.distributed import run_ranks

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'hf')")
pytest.importorskip("accelerate", reason="accelerate is not installed (extra 'hf')")
# imported here, once: the ranks fork from this process with them loaded (seconds each otherwise)
from transformers import (  # noqa: E402
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    ModernBertConfig,
    ModernBertForMaskedLM,
    Trainer,
    TrainingArguments,
)

import ringattn  # noqa: E402
from ringattn.integrations import hf  # noqa: E402
from ringattn.integrations.trainer import RingTrainer, RingTrainerMixin  # noqa: E402
from ringattn.testing import check_close  # noqa: E402

VOCAB, SEQLEN, STEPS = 97, 21, 5  # 21: padded to a multiple of 2 * cp by shard_batch
EVAL_SAMPLES, EVAL_STEPS = 5, 2  # evaluated at steps 2 and 4, then once after training
PACKED_LENGTH = 24  # TRL's packed rows: up to 24 tokens of documents back to back


def _tiny_llama(dtype=torch.float32):
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def _dataset(n, seed=1):
    """n samples {input_ids, labels} (SEQLEN,), each with its own number of ignored labels."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        input_ids = torch.randint(0, VOCAB, (SEQLEN,), generator=gen)
        labels = input_ids.clone()
        labels[: 3 * i % 11] = -100  # a prompt of 0 .. 10 tokens left out of the loss
        samples.append({"input_ids": input_ids, "labels": labels})
    return samples


def _tiny_modernbert(dtype=torch.float32):
    """A tiny ModernBERT masked LM: a global layer, then a sliding one (8 keys wide, within the sequences); queries
    and keys scaled up, so that the scores are a few units (what a token attends to shows in the loss)."""
    config = ModernBertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
        local_attention=8, global_attn_every_n_layers=2, attention_dropout=0.0, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.Wqkv.weight[: 2 * config.hidden_size] *= 8.0
    return model.to(dtype)


def _masked_lm_dataset(n, seed):
    """n samples {input_ids, attention_mask, labels} (SEQLEN,) of 21, 17, 13 or 9 tokens padded on the right, the
    labels the tokens at every third position (-100 elsewhere and on the padding)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        mask = (torch.arange(SEQLEN) < SEQLEN - 4 * (i % 4)).long()
        input_ids = torch.randint(3, VOCAB, (SEQLEN,), generator=gen) * mask
        scored = (torch.arange(SEQLEN) % 3 == i % 3) & (mask == 1)
        samples.append({"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.where(scored, -100)})
    return samples


class _Stream(torch.utils.data.IterableDataset):
    """The samples as an iterable dataset (no length: Trainer starts it again when it runs out before max_steps)."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def _train_dataset(global_batch, accumulation, streamed):
    """The samples of STEPS steps as a list; or, `streamed`, that many samples as a _Stream."""
    return _Stream(_dataset(streamed)) if streamed else _dataset(STEPS * global_batch * accumulation)


def _args(out_dir, batch_size, config=TrainingArguments, accumulation=1, **overrides):
    return config(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=batch_size, optim="sgd", learning_rate=0.5,
        gradient_accumulation_steps=accumulation,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, train_sampling_strategy="sequential",
        disable_tqdm=True, include_num_input_tokens_seen="all", **overrides,
    )  # fmt: skip


def _eval_args(batch_size):
    """Evaluation every EVAL_STEPS steps, batch_size samples a batch."""
    return dict(eval_strategy="steps", eval_steps=EVAL_STEPS, per_device_eval_batch_size=batch_size)


def _result(trainer, output):
    """The logged losses (training's, evaluation's), the parameters after training, the metrics of training and of
    a last evaluation (if the trainer has an eval dataset)."""
    if trainer.eval_dataset is not None:
        output.metrics.update(trainer.evaluate())
    losses = [[log[key] for log in trainer.state.log_history if key in log] for key in ("loss", "eval_loss")]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, params, {**output.metrics, "total_flos": trainer.state.total_flos}  # the logger pops total_flos


def _single_process(rank, world_size, out_dir, dtype, global_batch, accumulation, streamed=0):
    """Plain Trainer, eager attention, the global batch in one process; evaluated on EVAL_SAMPLES samples in one
    batch, so that its eval_loss (the mean of each batch's mean) is the mean over every counted token."""
    model = _tiny_llama(dtype)
    model.set_attn_implementation("eager")
    args = _args(out_dir, global_batch, accumulation=accumulation, **_eval_args(EVAL_SAMPLES))
    trainer = Trainer(model=model, args=args, train_dataset=_train_dataset(global_batch, accumulation, streamed),
                      eval_dataset=_dataset(EVAL_SAMPLES, seed=3))  # fmt: skip
    return _result(trainer, trainer.train())


def _launched_by_torchrun(rank, world_size):
    """The variables torchrun sets, which accelerate reads (the process group is already initialised)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _ring(world_size, cp, ulysses=1):
    """This rank's SequenceParallel: one ring of every rank, rings of cp ranks on a (dp, cp) DeviceMesh, or with
    ulysses > 1 grids of cp ranks, U x R = ulysses x cp / ulysses, on a (dp, ulysses, ring) DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if ulysses > 1:
        shape = (world_size // cp, ulysses, cp // ulysses)
        return ringattn.SequenceParallel(mesh=init_device_mesh("cpu", shape, mesh_dim_names=("dp", "ulysses", "ring")))
    if cp == world_size:
        return ringattn.SequenceParallel()

    return ringattn.SequenceParallel(
        init_device_mesh("cpu", (world_size // cp, cp), mesh_dim_names=("dp", "cp")).get_group("cp")
    )


def _ring_trainer(rank, world_size, out_dir, cp, global_batch, accumulation, ulysses=1, streamed=0):
    _launched_by_torchrun(rank, world_size)
    sp, dp = _ring(world_size, cp, ulysses), world_size // cp
    name = hf.register("ringattn-trainer", sp=sp)  # sp's groups (a ring, or a Ulysses x ring grid) and layout
    with pytest.raises(ValueError, match="hf.register takes its groups and layout from sp: pass sp without layout"):
        hf.register("ringattn-bad", sp=sp, layout=sp.layout)
    with pytest.raises(TypeError, match="name must be a str .* got SequenceParallel: pass a SequenceParallel as sp="):
        hf.register(sp)  # sp where the name goes
    model = hf.prepare(_tiny_llama(), name)
    args = _args(out_dir, global_batch // dp, accumulation=accumulation, accelerator_config={"dispatch_batches": False},
                 **_eval_args(1))  # fmt: skip
    dataset = _train_dataset(global_batch, accumulation, streamed)
    evaluated = _dataset(EVAL_SAMPLES, seed=3)  # a sample a batch: the rings evaluate different numbers of tokens
    trainer = RingTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=evaluated, sp=sp)
    assert (trainer.rings, trainer.ring) == (dp, rank // cp)
    result = _result(trainer, trainer.train())
    if dp > 1:  # on every rank, from one ring's batch or from none
        bad = _dataset(2, seed=3)
        bad[1]["labels"][-1] = VOCAB  # in the second ring's batch only
        outside = rf"labels must be in \[0, {VOCAB}\) \(logits' vocab\) or ignore_index \(-100\), got {VOCAB}"
        with pytest.raises(ValueError, match=outside):
            trainer.evaluate(bad)
        left_padded = dict(bad[0], attention_mask=torch.arange(SEQLEN) > 0)  # the first ring's batch only
        with pytest.raises(ValueError, match="an attention_mask with zeros must be right padding"):
            trainer.evaluate([left_padded, bad[0]])
        trainer.train_dataset = [bad[0], left_padded] * global_batch  # the second ring's batches refused
        with pytest.raises(ValueError, match="an attention_mask with zeros must be right padding"):
            trainer.train()
        ignored = [{"input_ids": bad[0]["input_ids"], "labels": torch.full((SEQLEN,), -100)}]  # the second: none
        with pytest.raises(ValueError, match="eval_dataset: no counted label"):
            trainer.evaluate(ignored)
    with pytest.raises(ValueError, match="eval_dataset: .* over an IterableDataset accelerate completes"):
        trainer.evaluate(_Stream(evaluated))
    return result


def _encoder(rank, world_size, out_dir, dtype, ring):
    """ModernBERT's masked LM on right-padded batches of 2 samples: by RingTrainer over every rank, or by plain
    Trainer in one process with eager attention (the padding masked, EVAL_SAMPLES evaluated in one batch)."""
    args = dict(accelerator_config={"dispatch_batches": False}, **_eval_args(1 if ring else EVAL_SAMPLES))
    datasets = dict(train_dataset=_masked_lm_dataset(STEPS * 2, seed=4),
                    eval_dataset=_masked_lm_dataset(EVAL_SAMPLES, seed=5))  # fmt: skip
    if ring:
        _launched_by_torchrun(rank, world_size)
        sp = ringattn.SequenceParallel()
        model = hf.prepare(_tiny_modernbert(), hf.register("ringattn-encoder", sp=sp))
        trainer = RingTrainer(model=model, args=_args(out_dir, 2, **args), sp=sp, **datasets)
        assert trainer.causal is False
    else:
        model = _tiny_modernbert(dtype)
        model.set_attn_implementation("eager")
        trainer = Trainer(model=model, args=_args(out_dir, 2, **args), **datasets)
    return _result(trainer, trainer.train())


def test_an_encoder_trains_as_in_one_process(tmp_path):
    """Masked language modelling (labels unshifted) on right-padded batches: the padding a document of its own that
    no real token attends to, through ModernBERT's global and sliding layers; on 2 ranks against plain Trainer in
    one process, every logged loss (training's and evaluation's) within 1e-5, the parameters under the tolerance
    rule."""
    single = [run_ranks(_encoder, 1, str(tmp_path), dtype, False)[0] for dtype in (torch.float32, torch.float64)]
    check_training(run_ranks(_encoder, 2, str(tmp_path), torch.float32, True, timeout=240), single, STEPS * 2)


def check_training(ranks, single_process, samples):
    """Each rank's (losses, parameters, metrics) against the single-process (fp32, float64) runs; `samples` the
    number trained on."""
    ((plain_losses, plain_eval), plain, plain_metrics), (_, ref, _) = single_process
    for rank, ((losses, eval_losses), params, metrics) in enumerate(ranks):
        assert len(losses) == STEPS
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=0, atol=1e-5)
        assert len(eval_losses) == len(plain_eval)
        torch.testing.assert_close(torch.tensor(eval_losses), torch.tensor(plain_eval), rtol=0, atol=1e-5)
        for name, p in params.items():
            check_close(f"rank {rank} {name} after {STEPS} steps", p, plain[name], ref[name])
        assert metrics["num_input_tokens_seen"] == plain_metrics["num_input_tokens_seen"]
        assert metrics["total_flos"] == pytest.approx(plain_metrics["total_flos"], rel=1e-6)
        counted = metrics["train_samples_per_second"] * metrics["train_runtime"]  # each rounded, to 1e-3 at most
        assert counted == pytest.approx(samples, rel=1e-2), metrics
        if plain_eval:  # samples evaluated, each rounded as above
            evaluated, plain_evaluated = (
                m["eval_samples_per_second"] * m["eval_runtime"] for m in (metrics, plain_metrics)
            )
            assert evaluated == pytest.approx(plain_evaluated, rel=1e-2, abs=0.2), metrics


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """(global batch, accumulation steps, streamed samples or 0) -> (fp32, float64) runs of plain Trainer, each in a
    process of its own (accelerate's state is per process)."""
    out_dir = str(tmp_path_factory.mktemp("single"))
    runs = {}

    def get(*key):
        if key not in runs:
            runs[key] = [run_ranks(_single_process, 1, out_dir, d, *key)[0] for d in (torch.float32, torch.float64)]
        return runs[key]

    return get


# batches of 1 sample (1 per ring with dp 2: the two rings of a step count different numbers of targets); W2
# accumulates 2 per step (the two batches of a step count different numbers of targets)
@pytest.mark.parametrize(
    "world_size,cp,global_batch,accumulation,ulysses",
    [(2, 2, 1, 2, 1), (4, 4, 1, 1, 1), (4, 2, 2, 1, 1), (4, 2, 2, 1, 2)],
    ids=["W2-cp2-accumulate2", "W4-cp4", "W4-dp2xcp2", "W4-dp2xU2xR1"],
)
def test_ring_trainer_matches_single_process_training(
    single_process, tmp_path, world_size, cp, global_batch, accumulation, ulysses
):
    """Regression: transformers.Trainer under DDP gave each rank its own samples, the ring mixed them and training
    went on silently wrong (logged losses off by 1e-2); and counted every sample W times in its throughput. With
    RingTrainer every logged loss matches single-process training within 1e-5, the parameters after the steps
    obey the tolerance rule, and samples, tokens and flops are counted once. W4-dp2xU2xR1: two Ulysses x ring grids
    (a (dp, ulysses, ring) mesh), the data sharded over the grids."""
    ranks = run_ranks(_ring_trainer, world_size, str(tmp_path), cp, global_batch, accumulation, ulysses, timeout=240)
    samples = STEPS * global_batch * accumulation
    check_training(ranks, single_process(global_batch, accumulation), samples)
    assert ranks[0][2]["num_input_tokens_seen"] == samples * SEQLEN


def test_an_iterable_dataset_that_runs_out_before_max_steps_starts_again(single_process, tmp_path):
    """Regression: an iterable dataset of 3 samples, batches of 1, 5 steps: Trainer's fourth step finds the data run
    out (no batches) and starts it again, but RingTrainer stacked the counts of no batches and raised on every rank.
    Now it trains as single-process Trainer does."""
    ranks = run_ranks(_ring_trainer, 2, str(tmp_path), 2, 1, 1, 1, 3, timeout=240)
    check_training(ranks, single_process(1, 1, 3), STEPS)


def _tokenizer():
    """A word-level tokenizer over the model's vocabulary ("t0" .. "t96"), built here: no downloads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")


def _sft(rank, world_size, out_dir, dtype, ring):
    """TRL's SFTTrainer, packing documents into rows of PACKED_LENGTH tokens (position ids restarting at 0 at each
    document): with ring attention over every rank, or plain with eager attention in one process."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class RingSFTTrainer(RingTrainerMixin, SFTTrainer):
        pass

    if ring:
        _launched_by_torchrun(rank, world_size)  # before the arguments: they set up accelerate's state
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 13, 5, 22, 4, 2, 17, 9, 11, 3, 8, 19, 6, 7, 14]  # 1 to 22 tokens; 141 in all, 6 rows
    dataset = Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in lengths]})
    evaluation = _eval_args(1 if ring else 6)  # plain: the 6 packed rows in one batch, its mean over every token
    # SFTConfig turns gradient checkpointing on
    args = _args(out_dir, 1, SFTConfig, packing=True, max_length=PACKED_LENGTH, bf16=False, **evaluation)
    model = _tiny_llama(dtype)
    datasets = dict(train_dataset=dataset, eval_dataset=dataset, processing_class=_tokenizer())
    if ring:
        sp = ringattn.SequenceParallel()
        model = hf.prepare(model, hf.register("ringattn-sft", layout=sp.layout, group=sp.group))
        trainer = RingSFTTrainer(model=model, args=args, sp=sp, **datasets)
    else:
        model.set_attn_implementation("eager")
        trainer = SFTTrainer(model=model, args=args, **datasets)
    return _result(trainer, trainer.train())


def test_trl_sft_trainer_with_packing_matches_single_process_training(tmp_path):
    """TRL's SFTTrainer through RingTrainerMixin, packed documents (batch 1 rows, position ids restarting at 0 at
    each document) and SFTConfig's gradient checkpointing (each layer's ring attention runs again in the backward),
    on 2 ranks against SFTTrainer in one process with eager attention (which keeps each document to itself from the
    same position ids); evaluated on the packed rows too."""
    pytest.importorskip("trl", reason="TRL is not installed")
    single = [run_ranks(_sft, 1, str(tmp_path), dtype, False)[0] for dtype in (torch.float32, torch.float64)]
    check_training(run_ranks(_sft, 2, str(tmp_path), torch.float32, True, timeout=240), single, STEPS)  # 1 row a step


def _refusals(rank, world_size, out_dir):
    sp, args, dataset = ringattn.SequenceParallel(), _args(out_dir, 1), _dataset(1)
    with pytest.raises(ValueError, match="model: prepare it for ring attention"):
        RingTrainer(model=_tiny_llama(), args=args, train_dataset=dataset, sp=sp)
    contiguous = hf.prepare(_tiny_llama(), hf.register("ringattn-contiguous", layout="contiguous"))
    with pytest.raises(ValueError, match=r"in sp's layout \('zigzag'\)"):
        RingTrainer(model=contiguous, args=args, train_dataset=dataset, sp=sp)
    model = hf.prepare(_tiny_llama(), hf.register("ringattn-trainer", layout=sp.layout))
    # regression: an encoder (bidirectional attention) or a model without a head that generates, trained with
    # next-token labels
    encoder = hf.prepare(_tiny_llama(), hf.register("ringattn-trainer", layout=sp.layout))
    for layer in encoder.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match=r"trains causal language models .* LlamaAttention attend\(s\) both ways"):
        RingTrainer(model=encoder, args=args, train_dataset=dataset, sp=sp)
    # a vision tower beside the language model is not asked (Gemma 3's SigLIP attends both ways on its own tokens)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=VOCAB)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    RingTrainer(model=hf.prepare(Gemma3ForConditionalGeneration(config), "ringattn-trainer"), args=args, sp=sp)
    headless = hf.prepare(_tiny_llama().model, "ringattn-trainer")  # no logits: an AttributeError in compute_loss
    with pytest.raises(ValueError, match="got LlamaModel: it has neither a head that generates nor an encoder's"):
        RingTrainer(model=headless, args=args, train_dataset=dataset, sp=sp)
    headless_encoder = hf.prepare(_tiny_modernbert().model, "ringattn-trainer")
    with pytest.raises(ValueError, match=r"got ModernBertModel: .* head per token \(ForMaskedLM, ForTokenClassif"):
        RingTrainer(model=headless_encoder, args=args, train_dataset=dataset, sp=sp)
    with pytest.raises(ValueError, match="average_tokens_across_devices must be True"):
        RingTrainer(model=model, args=_args(out_dir, 1, average_tokens_across_devices=False), sp=sp)
    with pytest.raises(ValueError, match="compute_metrics: RingTrainer evaluates the loss only"):
        RingTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset, sp=sp,
                    compute_metrics=lambda prediction: {})  # fmt: skip
    trainer = RingTrainer(model=model, args=args, train_dataset=dataset, sp=sp)
    with pytest.raises(NotImplementedError, match="does not predict: .* gather the logits with sp.gather"):
        trainer.predict(dataset)
    ids = dataset[0]["input_ids"][None]  # (1, S)
    with pytest.raises(ValueError, match="needs input_ids and labels"):
        trainer.shard({"input_ids": ids})
    with pytest.raises(ValueError, match="needs input_ids and labels"):
        trainer.shard({"labels": ids})
    with pytest.raises(ValueError, match="needs input_ids and labels"):
        trainer.shard({"input_ids": ids, "labels": ids, "token_type_ids": ids})
    left_padded = torch.ones_like(ids)
    left_padded[:, 0] = 0
    labels = ids.masked_fill(left_padded == 0, -100)
    with pytest.raises(ValueError, match="must be right padding"):
        trainer.shard({"input_ids": ids, "labels": labels, "attention_mask": left_padded})
    with pytest.raises(ValueError, match="with labels -100 on the padding"):
        trainer.shard({"input_ids": ids, "labels": ids, "attention_mask": left_padded.flip(1)})
    right_padded = trainer.shard({"input_ids": ids, "labels": labels.flip(1), "attention_mask": left_padded.flip(1)})
    assert torch.equal(right_padded.input_ids[:, :SEQLEN], ids)  # a ring of one: every token; the mask dropped
    return True


def _one_ring_batches(rank, world_size, out_dir):
    _launched_by_torchrun(rank, world_size)
    sp = ringattn.SequenceParallel()
    model = hf.prepare(_tiny_llama(), hf.register("ringattn-trainer", layout=sp.layout))
    trainer = RingTrainer(model=model, args=_args(out_dir, 2), train_dataset=_dataset(5), sp=sp)
    return list(trainer.get_train_dataloader().batch_sampler)


def test_one_ring_takes_the_batches_of_one_process(tmp_path):
    """Regression: with one ring, accelerate's even_batches topped the epoch's short last batch up from its first
    samples ([4] became [4, 0]): the last step trained on other samples than single-process training. Sequential
    sampling, 5 samples, batches of 2, one ring of 2 ranks: [0, 1], [2, 3], [4] on both."""
    assert run_ranks(_one_ring_batches, 2, str(tmp_path)) == [[[0, 1], [2, 3], [4]]] * 2


def test_ring_trainer_refuses_what_it_would_train_wrongly(tmp_path):
    """A model not prepared for this ring, a model neither a causal LM nor an encoder with a head per token, a loss
    other than the mean over every token, metrics, inputs the ring cannot attend like the model (left padding, unknown
    per-token inputs): errors naming the argument, on 1 rank."""
    assert run_ranks(_refusals, 1, str(tmp_path)) == [True]


def test_missing_accelerate_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate.data_loader", None)  # import accelerate.data_loader fails
    monkeypatch.delitem(sys.modules, "ringattn.integrations.trainer")
    with pytest.raises(ImportError, match=r"needs transformers and accelerate: pip install 'ringattn\[hf\]'"):
        importlib.import_module("ringattn.integrations.trainer")
