"""transformers.Trainer with each sequence split over a ring of ranks, and data parallelism across the rings.

    from torch.distributed.device_mesh import init_device_mesh
    from ringattn.integrations import hf
    from ringattn.integrations.trainer import RingTrainer
    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))  # dp rings of cp ranks, W = dp * cp
    sp = ringattn.SequenceParallel(mesh.get_group("cp"), layout="zigzag")  # or SequenceParallel(): one ring of all
    hf.register(sp=sp)
    # 2-D: mesh = init_device_mesh("cuda", (dp, R, U), mesh_dim_names=("dp", "ring", "ulysses")), then
    # sp = ringattn.SequenceParallel(mesh=mesh) and hf.register(sp=sp): dp grids of U x R ranks
    model = hf.prepare(model)
    RingTrainer(model=model, args=TrainingArguments(...), train_dataset=dataset, sp=sp).train()

Launched with torchrun, transformers.Trainer (through accelerate) gives each of the W ranks its own batch and wraps
the model in DistributedDataParallel over the W ranks, which averages the gradients. RingTrainer keeps the wrapping
and changes what each rank computes:

- Data: the dataloader is sharded over the rings, not over the ranks (accelerate's shard of the batch sampler, or of
  an iterable dataset, is told the number of rings and this ring's index), so every rank of a ring reads the same
  batch. SequenceParallel.shard_batch checks that it did (a ValueError on every rank otherwise).
- Loss: the batches of an optimizer step (Trainer's get_batch_samples: gradient_accumulation_steps of them) are
  sharded on each rank (sp.shard_batch: labels shifted on the full sequence, padded to the layout's multiple; packed
  documents from the batch's position_ids), and their counted targets are all-reduced over the world once.
  compute_loss runs the model on this rank's shard with its position_ids (and packed documents' boundaries as
  cu_seq_lens_q/k) and takes ringattn's cross_entropy over
  the world (grad_reduction="mean") with the step's counted targets as its num_items_in_batch: the step's losses
  sum, on every rank, to the mean over every counted token of the step's global batch (all rings, all accumulated
  batches), as Trainer's average_tokens_across_devices defines it. Each rank's gradient is its share scaled by
  W, and DistributedDataParallel's average over the W ranks gives the gradient of that
  loss: that of single-process training on the global batch (summed within each ring, averaged across rings).
  The logged loss is that loss.
- Metrics: every rank of a ring sees the same samples, so Trainer's counts are divided by the ring size: the total
  train batch size (per-device batch x accumulation steps x rings, not x ranks; train_samples_per_second comes
  from it), the floating point operations (each rank runs 1 / cp of the tokens) and num_input_tokens_seen.

- Evaluation (evaluate, and Trainer's eval_strategy, eval_on_start, load_best_model_at_end): the eval dataloader is
  sharded over the rings without topping up the short last batches, each rank sums the per-token losses and counts
  of its shards, and one all_reduce over the world gives eval_loss, the mean over every counted token of the eval
  dataset (Trainer's is the mean of each batch's mean); eval_samples_per_second counts each sample once
  (eval_steps_per_second takes Trainer's steps of eval_batch_size x ranks samples). The loss only: compute_metrics
  is refused (it needs every token's logits: gather them with sp.gather), as is predict.

It trains causal language models (labels shifted to the next token; right padding left as it is, as no real token
attends to the padding after it) and encoders with a head per token (PER_TOKEN_HEADS: masked language modelling,
token classification; labels taken as they are, the padding made a document of its own that no real token attends
to); other models are refused. Works with subclasses of Trainer through RingTrainerMixin, e.g. TRL's SFTTrainer (`class
RingSFTTrainer(RingTrainerMixin, SFTTrainer)`), whose compute_loss it replaces (TRL's token accuracy and entropy are
not logged).
"""

import torch
import torch.distributed as dist

try:
    import transformers
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
    from transformers.trainer_utils import EvalLoopOutput
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ringattn.integrations.trainer needs transformers and accelerate: pip install 'ringattn[hf]' "
        "(or pip install transformers accelerate)"
    ) from e

from ..parallel.groups import or_world
from ..sequence_parallel import IGNORE_INDEX, SequenceParallel, ShardedBatch, cross_entropy
from . import hf

# batch keys RingTrainerMixin.shard passes to sp.shard_batch, and packing metadata that shard_batch recomputes from
# position_ids (TRL's padding-free collator adds it)
INPUT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
RECOMPUTED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
SHARDED = "ringattn_sharded"  # the key get_batch_samples adds to each batch
PER_TOKEN_HEADS = ("ForMaskedLM", "ForTokenClassification")  # an encoder's heads RingTrainer trains (class names)


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of a process group (None: the world)."""
    return dist.get_process_group_ranks(or_world(group))


def _sequence_groups(sp: SequenceParallel) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global ranks of this rank's ring and of its Ulysses group (this rank alone without a grid)."""
    me = (dist.get_rank(),)
    if sp.grid is None:
        return tuple(_ranks(sp.group)), me
    return tuple(me if g is None else _ranks(g) for g in (sp.grid.ring, sp.grid.ulysses))


def ring_index(sp: SequenceParallel) -> tuple[int, int]:
    """(number of rings, index of this rank's ring): the rings are the ranks' SequenceParallel groups (over a
    Ulysses x ring grid, the grids: the ranks a sequence is split over); a collective.

    One all_gather_object over the world of each rank's groups (their global ranks); a grid is the union of the
    Ulysses groups of the ranks of a ring; rings are numbered by their lowest global rank.
    Raises:
        ValueError: the ranks' groups do not split the world into disjoint rings of one size.
    """
    world_size = dist.get_world_size()
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, _sequence_groups(sp))
    groups = [tuple(sorted({m for r in ring for m in gathered[r][1]})) for ring, _ in gathered]  # each rank's
    mine = groups[dist.get_rank()]
    rings = sorted(set(groups))
    if sorted(r for ring in rings for r in ring) != list(range(world_size)) or len({len(r) for r in rings}) != 1:
        raise ValueError(
            "sp: the SequenceParallel groups of the ranks must split the world into disjoint rings of one size "
            f"(e.g. one dimension of a DeviceMesh), got the rings {rings} over {world_size} ranks"
        )
    return len(rings), rings.index(mine)


def _raise_refusals(refusal: str | None, refused: bool) -> None:
    """Where some rank refused its input (`refused`, the same on every rank: from an all_reduce), a ValueError on
    every rank with the refusal of the lowest rank with one (this rank's: `refusal`, or None); one all_gather_object
    over the world then."""
    if refused:
        refusals: list = [None] * dist.get_world_size()
        dist.all_gather_object(refusals, refusal)
        raise ValueError(next(r for r in refusals if r is not None))


class RingTrainerMixin:
    """Sequence-parallel training for transformers.Trainer and its subclasses (see the module docstring).

    Put it first: `class MyTrainer(RingTrainerMixin, SomeTrainer)`; construct with the base's arguments plus `sp`,
    on every rank. The model must be prepared for ring attention over sp's group in sp's layout
    (hf.register(sp=sp), then hf.prepare(model)).

    Args:
        sp: the SequenceParallel of this rank's ring (keyword only).
    Raises:
        ValueError: the model is not prepared for ring attention in sp's layout over sp's group; the Trainer does not
            run one process per rank of the world (accelerate's num_processes differs from the world size: launch
            with torchrun); label_smoothing_factor or compute_loss_func given, or average_tokens_across_devices False
            (the loss is ringattn's cross-entropy over every token); compute_metrics given (evaluation gives the loss
            only); the model is neither a causal language model nor an encoder with a head per token; the
            SequenceParallel groups are not disjoint rings of one size (ring_index).
    """

    def __init__(self, *args, sp: SequenceParallel, **kwargs):
        self.sp = sp
        super().__init__(*args, **kwargs)
        self._check_setup()
        self.rings, self.ring = ring_index(sp)
        # the loss is computed here, not by the model, already normalised over the step's batches (get_batch_samples):
        # Trainer counts no items for the model and does not divide by the number of accumulation steps
        self.model_accepts_loss_kwargs, self.loss_is_scaled_for_ga = False, True

    def _check_setup(self) -> None:
        world_size = dist.get_world_size()
        if self.accelerator.num_processes != world_size:
            raise ValueError(
                f"{type(self).__name__} needs one Trainer process per rank of the world ({world_size} ranks), got "
                f"accelerate's num_processes={self.accelerator.num_processes}: launch with torchrun, which sets RANK, "
                "WORLD_SIZE and LOCAL_RANK"
            )
        if self.args.label_smoothing_factor or self.compute_loss_func is not None:
            raise ValueError(
                f"{type(self).__name__} computes the loss with ringattn's cross_entropy: label_smoothing_factor "
                f"must be 0 and compute_loss_func None, got {self.args.label_smoothing_factor} and "
                f"{self.compute_loss_func!r}"
            )
        if not self.args.average_tokens_across_devices:
            raise ValueError(
                f"{type(self).__name__} averages the loss over every counted token of the global batch: "
                "average_tokens_across_devices must be True (the default), got False"
            )
        if self.compute_metrics is not None:
            raise ValueError(
                f"compute_metrics: {type(self).__name__} evaluates the loss only (eval_loss); metrics from the "
                "logits need every token's logits (gather them with sp.gather): pass None, got "
                f"{self.compute_metrics!r}"
            )
        name = self.model.config._attn_implementation
        fn = transformers.AttentionInterface().get(name)
        prepared = isinstance(fn, hf.RingAttentionForTransformers) and getattr(self.model, hf.PREPARED, False)
        if not prepared or fn.layout != self.sp.layout or not self._same_groups(fn):
            raise ValueError(
                f"model: prepare it for ring attention over sp's group in sp's layout ({self.sp.layout!r}) on every "
                "rank: hf.prepare(model, hf.register(name, sp=sp)); got "
                f"attn_implementation={name!r}" + (f" ({fn!r})" if prepared else "")
            )
        self.causal = self._causal_language_model()

    def _causal_language_model(self) -> bool:
        """True for a causal language model (labels shifted to the next token), False for an encoder with a head
        per token (labels its own targets: masked language modelling, token classification).

        Raises:
            ValueError: neither (a model without a head per token, a language model attending both ways).
        """
        kind = type(self.model).__name__
        if self.model.can_generate():
            # the language model alone: a vision tower beside it (Gemma 3's SigLIP) attends both ways on its own tokens
            decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model
            bidirectional = sorted(
                {type(m).__name__ for m in decoder.modules() if getattr(m, "is_causal", None) is False}
            )
            if not bidirectional:
                return True
            why = f"its {', '.join(bidirectional)} attend(s) both ways (is_causal=False) but it generates"
        else:
            ways = {getattr(m, "is_causal", None) for m in self.model.modules()} - {None}
            if ways == {False} and kind.endswith(PER_TOKEN_HEADS):
                return False
            why = (
                "it has neither a head that generates nor an encoder's head per token ("
                + ", ".join(PER_TOKEN_HEADS)
                + ")"
            )
        raise ValueError(
            f"model: {type(self).__name__} trains causal language models (labels shifted to the next token) and "
            f"encoders with a head per token (masked language modelling, token classification: labels unshifted); "
            f"got {kind}: {why}. Train others with SequenceParallel's toolkit (guide.md)"
        )

    def _same_groups(self, fn: "hf.RingAttentionForTransformers") -> bool:
        """Whether the registered attention runs over sp's ring (and Ulysses group)."""
        if (fn.grid is None) != (self.sp.grid is None):
            return False
        if fn.grid is None:
            return _ranks(fn.group) == _ranks(self.sp.group)
        me = [dist.get_rank()]
        pairs = ((fn.grid.ring, self.sp.grid.ring), (fn.grid.ulysses, self.sp.grid.ulysses))
        return all((me if a is None else _ranks(a)) == (me if b is None else _ranks(b)) for a, b in pairs)

    def get_train_dataloader(self):
        """Trainer's dataloader, sharded over the rings instead of the ranks: every rank of a ring reads the same
        batches.

        Raises:
            ValueError: accelerate did not shard it by batch sampler or iterable dataset (e.g. dispatch_batches=True,
                the default for an IterableDataset: pass accelerator_config={"dispatch_batches": False}).
        """
        return self._over_rings(super().get_train_dataloader(), evaluation=False)

    def get_eval_dataloader(self, eval_dataset=None):
        """Trainer's eval dataloader, sharded over the rings as get_train_dataloader's, the last batches not topped up
        (each sample evaluated once).

        Raises:
            ValueError: as get_train_dataloader; an iterable dataset over several ranks (accelerate would complete its
                last batch with its first samples, counted twice).
        """
        return self._over_rings(super().get_eval_dataloader(eval_dataset), evaluation=True)

    def _over_rings(self, loader, evaluation: bool):
        """`loader`, accelerate's shard of a dataloader over the ranks, told the rings instead."""
        if self.accelerator.num_processes == 1:
            return loader  # not sharded
        shard = loader.batch_sampler if isinstance(loader.batch_sampler, BatchSamplerShard) else loader.dataset
        if not isinstance(shard, BatchSamplerShard | IterableDatasetShard):
            raise ValueError(
                f"{type(self).__name__} shards accelerate's BatchSamplerShard or IterableDatasetShard over the rings; "
                f"got a {type(loader).__name__} over a {type(loader.dataset).__name__}. For an IterableDataset pass "
                'TrainingArguments(accelerator_config={"dispatch_batches": False})'
            )
        if evaluation and isinstance(shard, IterableDatasetShard):
            raise ValueError(
                f"eval_dataset: {type(self).__name__} evaluates a dataset with a length (map-style); over an "
                "IterableDataset accelerate completes the last batch with its first samples, which the loss would "
                "count twice"
            )
        shard.num_processes, shard.process_index = self.rings, self.ring
        if isinstance(shard, BatchSamplerShard) and (evaluation or self.rings == 1):
            shard.even_batches = False  # the short last batches as they are (one ring: those of one process)
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches: int, device):
        """Trainer's batches of one optimizer step, each sharded here, with the step's counted tokens.

        Adds to each batch (a dict every rank of the ring holds in full, see `shard`) the key SHARDED: (this rank's
        ShardedBatch, int): the number of counted targets of all the step's batches over every rank's shard (all
        rings). One all_reduce of two float64 over the world.
        Returns:
            (the batches, None): the count is in SHARDED, not in Trainer's num_items_in_batch (which would count
            a ring's tokens once per rank); no batches where the data ran out (Trainer then starts it again), as
            on every rank.
        Raises (on every rank, the refusal of the lowest rank with one):
            ValueError: as `shard`.
        """
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # counted targets, refusals
        try:
            sharded = [self.shard(inputs) for inputs in batch_samples]  # refused on every rank of this ring alike
            refusal = None
        except ValueError as e:  # raised below on every rank: the other rings go on to the all_reduce
            sharded, refusal, totals[1] = [], str(e), 1
        for batch in sharded:
            totals[0] += (batch.labels != IGNORE_INDEX).sum()
        dist.all_reduce(totals)  # the step's counted targets over the world
        _raise_refusals(refusal, bool(totals[1]))
        for inputs, batch in zip(batch_samples, sharded, strict=True):
            inputs[SHARDED] = (batch, int(totals[0]))
        return batch_samples, None

    def shard(self, inputs) -> ShardedBatch:
        """This rank's shard of a batch (sp.shard_batch); a collective over the ring.

        Args:
            inputs: the batch every rank of the ring holds in full: input_ids (batch, S) and labels (batch, S) (-100
                where no loss is wanted; a causal language model's the tokens, shifted by shard_batch, an encoder's
                its targets), optional position_ids (1, S) for packed documents, and an optional attention_mask
                (batch, S) that is all ones or right padding (an encoder's padding becomes documents of its own that
                no real token attends to; a causal model's real tokens never attend to the padding after them).
        Raises:
            ValueError: no labels; keys other than INPUT_KEYS and RECOMPUTED_KEYS; an attention_mask with zeros
                that is not right padding or whose padded positions have labels other than -100; as shard_batch
                (on every rank alike when the ranks of the ring were given different batches).
        """
        unknown = set(inputs) - set(INPUT_KEYS) - set(RECOMPUTED_KEYS) - {SHARDED}
        labels = inputs.get("labels")
        if unknown or labels is None or "input_ids" not in inputs:
            raise ValueError(
                f"inputs: {type(self).__name__} needs input_ids and labels, with optional position_ids (packed "
                f"documents) and attention_mask (right padding); got keys {sorted(inputs)}"
            )
        mask = inputs.get("attention_mask")
        padded = mask is not None and not bool(mask.all())
        if padded:
            right_padding = bool((mask[:, 1:] <= mask[:, :-1]).all())
            if not right_padding or bool((labels[mask == 0] != IGNORE_INDEX).any()):
                raise ValueError(
                    "inputs: an attention_mask with zeros must be right padding (each row ones, then zeros) with "
                    f"labels {IGNORE_INDEX} on the padding, as the model numbers a row's tokens from its first"
                )
        return self.sp.shard_batch(
            inputs["input_ids"], labels, position_ids=inputs.get("position_ids"), shift=self.causal,
            attention_mask=mask if padded and not self.causal else None,
        )  # fmt: skip

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This batch's part of the step's loss, from this rank's shard (see the module docstring); a collective.

        Args:
            inputs: a batch from get_batch_samples (with its SHARDED entry), or a batch as `shard` takes it (then
                the loss is this batch's mean).
            num_items_in_batch: unused (the step's count is in SHARDED).
        Returns:
            the 0-dim fp32 loss: sum of this batch's per-token losses over every rank's shard / the step's number
            of counted targets; with return_outputs, also the model's outputs (this rank's logits).
        Raises:
            ValueError: as `shard`.
        """
        batch, step_count = inputs[SHARDED] if SHARDED in inputs else (self.shard(inputs), None)
        outputs = self._forward(model, batch)
        # the batch's sum over every rank's tokens / the step's count, its gradient this rank's share x W for DDP's
        # mean over W ranks
        loss = cross_entropy(outputs.logits, batch.labels, grad_reduction="mean", num_items_in_batch=step_count)
        return (loss, outputs) if return_outputs else loss

    @staticmethod
    def _forward(model, batch: ShardedBatch):
        """The model's outputs on this rank's shard, with its positions (and packed documents' boundaries)."""
        documents = (
            {} if batch.cu_seqlens is None else dict(cu_seq_lens_q=batch.cu_seqlens, cu_seq_lens_k=batch.cu_seqlens)
        )
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **documents)

    def get_total_train_batch_size(self, args) -> int:
        """Samples per optimizer step: per-device batch x accumulation steps x rings (Trainer's x ranks / ring size)."""
        return super().get_total_train_batch_size(args) // self.sp.world_size

    def floating_point_ops(self, inputs) -> float:
        """This rank's share of Trainer's estimate for the batch: each rank of a ring runs 1 / ring size of it."""
        return super().floating_point_ops(inputs) / self.sp.world_size

    def _track_num_input_tokens(self, inputs) -> None:
        # Trainer sums the batch's token count over the ranks, and every rank of a ring counts the same batch
        seen = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = seen + (self.state.num_input_tokens_seen - seen) // self.sp.world_size

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # fmt: skip
        """Trainer.evaluate's loop: eval_loss, the mean loss over every counted token of the dataloader's batches
        (get_eval_dataloader: each sample on one ring), from every rank's shards; the model under accelerate's
        autocast. Each batch's forward and loss (sp.cross_entropy: the ring's mean, times this rank's count) are
        collectives over its ring, then one all_reduce of four float64 over the world sums the rings; a refused batch
        is skipped and its refusal raised after it, on every rank.

        Returns:
            EvalLoopOutput without predictions or labels: metrics {metric_key_prefix + "_loss": the mean} and
            num_samples, the samples over the rings.
        Raises (on every rank, the first refusal of the lowest rank with one):
            ValueError: as `shard` and sp.cross_entropy (a label outside the logits' vocabulary that is not -100); no
                counted label in the whole dataset.
        """
        model = self.model
        model.eval()
        self.callback_handler.eval_dataloader = dataloader
        totals = torch.zeros(4, dtype=torch.float64, device=self.args.device)  # loss sum, count, samples, refusals
        refusal = None  # this rank's first, raised after the all_reduce on every rank: the other rings go on to it
        for inputs in dataloader:
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
            try:  # refused on every rank of this ring alike
                batch = self.shard(inputs)
                with torch.no_grad(), self.accelerator.autocast():
                    mean = self.sp.cross_entropy(self._forward(model, batch).logits, batch.labels)  # the ring's
            except ValueError as e:
                totals[3], refusal = totals[3] + 1, refusal or str(e)
                continue
            count = (batch.labels != IGNORE_INDEX).sum()
            totals[0] += mean.double() * count  # summed over the ring's ranks: the ring's loss sum
            totals[1] += count
            totals[2] += inputs["input_ids"].shape[0] / self.sp.world_size  # each rank of a ring holds the batch
        dist.all_reduce(totals)
        loss_sum, count, samples, refused = totals.tolist()
        _raise_refusals(refusal, bool(refused))
        if not count:
            raise ValueError("eval_dataset: no counted label (every label -100): the mean loss is undefined")
        metrics = {f"{metric_key_prefix}_loss": loss_sum / count}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=round(samples))

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} does not predict: run the model on every rank's shard (sp.shard_batch) and "
            "gather the logits with sp.gather, as in the ringattn guide"
        )


class RingTrainer(RingTrainerMixin, transformers.Trainer):
    """transformers.Trainer with each sequence split over the ring `sp` (RingTrainerMixin; the module docstring).

    Construct it like Trainer, plus `sp=`: RingTrainer(model=model, args=args, train_dataset=dataset, sp=sp).
    """
