"""`AutoTPTrainer`: `transformers.Trainer` for a model wrapped by autotp, at data parallel x tensor parallel.

Trainer assumes every rank is a data-parallel replica. Here only the DP group is: gradients are
averaged by DDP over `autotp.dp_group` (never over the world), each DP replica reads its own part
of the data while the TP ranks of a replica read the same batches, the reported batch size counts
DP replicas only, the loss is normalised by the tokens of the whole global batch (summed over DP,
not over every rank), gradients are clipped by the norm of the whole unsharded model, the logged
loss is the mean over replicas, evaluation reads each replica's part of the eval set (its loss weighting each
batch by its samples, as Trainer's does), bf16/fp16
autocast from `TrainingArguments` applies from the first training step, and `save_model` writes a
full checkpoint through `autotp.save_pretrained` on every rank (for a PEFT model, PEFT's full-size
adapter, with only the adapters gathered). Trainer's checkpoints hold that model and the optimizer state as an
`autotp.io.checkpoint.save` directory, so `train(resume_from_checkpoint=...)` resumes at any tp, dp and fully_shard. What
it does for TRL's trainers only (GRPO's generation batches, the fused LM head) is in `autotp.integrations.trl`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler
from transformers import Trainer
from transformers.trainer_pt_utils import find_batch_size

from ..accessors import dp_cp_group, dp_group, dp_rank, dp_size, tp_group, tp_size
from ..compat import check_versions
from ..compat import trainer as trainer_compat
from ..dp.ddp import allreduce_gradients, clip_grad_norm_, data_parallel_sampler
from ..dp.fsdp import fully_shard as autotp_fully_shard
from ..mesh import group_size, named_failure
from ..runtime.collectives import all_gather
from ..runtime.dimension import forward_backward, stepping
from ..runtime.rng import sync_replicated_stream
from ..state import state_of, wrapped_model
from . import trainer_checkpoints
from .batch_rows import refuse_uneven_batch, refuse_uneven_batches, row_multiple
from .trl import adds_aux_loss, check_trl_setup, generates, generation_loader, grpo_eval_loader
from .trl_pipeline import check_pipeline_trainer, runs_pipeline, sync_generators
from .trl_pipeline import pipeline_step as trl_pipeline_step


class _EpochBatches(BatchSampler):
    """A BatchSampler that forwards `set_epoch` to its sampler. A resumed Trainer skips the epoch's first batches
    through accelerate's `skip_first_batches`, a plain DataLoader around this batch sampler, and sets the epoch on
    `loader.batch_sampler.batch_sampler` only: here, so the resumed epoch reads its own order, not epoch 0's."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class _DealtBatches(BatchSamplerShard):
    """Batches dealt over DP replicas in turn (accelerate's shard), forwarding `set_epoch` as `_EpochBatches` does."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _EpochLoader(DataLoader):
    """A DataLoader that forwards `set_epoch` to its batch sampler, as Trainer expects of a prepared one."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _TPOnly(nn.Module):
    """Marks a model as wrapped when there is one replica, so Trainer does not hand it to a world-wide DDP."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@trainer_compat.replace_privates
class AutoTPTrainer(Trainer):
    """Trainer for `autotp.wrap`-ped models (or PEFT models around one); use it like `transformers.Trainer`. The
    methods named in `autotp.compat.trainer.REPLACED` stand in for Trainer's private ones."""

    def __init__(self, *args: Any, fully_shard: bool | dict[str, Any] = False, **kwargs: Any):
        """`fully_shard=True` (or a dict of `autotp.fully_shard` options) shards the wrapped model with FSDP2 over
        the DP group instead of replicating it under DDP: parameters, gradients and optimizer state are then
        split over TP x DP."""
        check_versions()
        super().__init__(*args, **kwargs)
        trainer_compat.own_clipping(self)
        check_trl_setup(self)
        refuse_own_loss(self)
        model = wrapped_model(self.model)
        if fully_shard and not state_of(self.model).fsdp:
            autotp_fully_shard(model, **({} if fully_shard is True else fully_shard))
        sync_replicated_stream(tp_group(self.model))  # a trainer may seed each process apart (TRL's GRPO does)

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer clips with `accelerator.clip_grad_norm_`, which sees only this rank's shards: use the full norm."""
        super().create_accelerator_and_postprocess()
        self.accelerator.clip_grad_norm_ = lambda parameters, max_norm, norm_type=2: clip_grad_norm_(
            self.model, max_norm, float(norm_type)
        )
        unwrap = self.accelerator.unwrap_model  # through `_TPOnly` too (TRL unwraps the model to generate)
        self.accelerator.unwrap_model = lambda m, *a, **k: unwrap(m.module if isinstance(m, _TPOnly) else m, *a, **k)

    def wrap_for_training(
        self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None
    ) -> nn.Module:
        """For training, DDP over DP x CP only (or nothing under FSDP, under expert parallelism, whose experts DDP
        would average with other experts, or with one rank there), never over the world."""
        if not training or isinstance(model, (DistributedDataParallel, _TPOnly)):
            return model
        if not trainer_compat.is_prepared(self, model):  # bf16 / fp16: autocast, as Trainer's prepare does
            self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        group = dp_cp_group(model)  # DP x CP: the average sums over CP (each CP rank's share counts C times)
        state = state_of(model)  # FSDP reduces gradients over DP x CP itself; under EP, `training_step` syncs them
        if group_size(group) > 1 and not state.fsdp and state.allows_ddp():
            device = next(model.parameters()).device
            return DistributedDataParallel(
                model, process_group=group, device_ids=[device] if device.type == "cuda" else None
            )
        return _TPOnly(model)

    def train_sampler(self, train_dataset: Dataset | None = None) -> Sampler:
        """This DP replica's part of the data; the TP ranks of a replica the same. A subclass may override it (its
        sampler is then this replica's: `autotp.data_parallel_sampler` gives one), or override Trainer's
        `_get_train_sampler` instead with a sampler over the whole dataset, whose batches are dealt over DP replicas."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return data_parallel_sampler(dataset, self.model, shuffle=True, seed=self.args.seed)

    def get_train_dataloader(self) -> DataLoader:
        """The DP-aware sampler (`train_sampler`, a subclass's own included), and no `accelerator.prepare`, which would
        shard the data over all ranks again. A subclass's own `_get_train_sampler` (Trainer's hook: a fixed order,
        say) is read as Trainer reads it, its batches dealt over DP replicas in turn as accelerate deals them over
        processes."""
        dataset = self.train_dataset
        own = trainer_compat.own_train_sampler(self, AutoTPTrainer)
        if generates(self):  # TRL's generation batches: a sampler over the whole dataset, dealt over DP
            refuse_replica_sampler(self, "TRL's generation batches, dealt over DP replicas,")
            sampler = (own or trainer_compat.replaced(self, AutoTPTrainer, "train_sampler"))(dataset)
            return generation_loader(self, dataset, sampler)
        sampler = self.train_sampler(dataset) if own is None else own(dataset)
        if own is None:
            check_replica_part(self, sampler, dataset)
        dealt = own is not None and dp_size(self.model) > 1  # each replica's batches are dealt from one sampler's
        refuse_uneven_batches(self, None if dealt else sampler)  # under a pipeline: before the first step
        batches = _EpochBatches(sampler, trainer_compat.train_batch_size(self), self.args.dataloader_drop_last)
        if dealt:
            batches = _DealtBatches(batches, dp_size(self.model), dp_rank(self.model))
        return _EpochLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=trainer_compat.collator(self, "training"),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        """Each DP replica evaluates its own part; the TP ranks of a replica read the same batches."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._replica_loader(dataset, "evaluation")

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return self._replica_loader(test_dataset, "test")

    def _replica_loader(self, dataset: Dataset, description: str) -> DataLoader:
        """In order, over DP replicas only, and not through `accelerator.prepare` (which splits over every rank).

        Trainer averages every gathered loss, so a sampler that padded a replica with repeated samples
        would count them twice: a dataset that does not split evenly is refused instead.
        """
        grpo = grpo_eval_loader(self, dataset, description)
        if grpo is not None:
            return grpo
        dp = dp_size(self.model)
        if len(dataset) % dp:
            raise ValueError(
                f"autotp: the {description} dataset has {len(dataset)} samples, which do not split "
                f"evenly over {dp} data-parallel replicas; the padded duplicates would skew the "
                f"{description} loss. Use a multiple of {dp} samples"
            )
        collator = trainer_compat.collator(self, description)
        return DataLoader(
            dataset,
            batch_size=self.args.eval_batch_size,
            sampler=data_parallel_sampler(dataset, self.model, shuffle=False),
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop, with what each replica evaluated gathered over the DP group (Trainer resets it after)."""
        self.gather_function = self._gather_for_metrics
        self._loss_samples = None
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> Any:
        """Trainer's step; remembers how many samples the batch held, for the loss Trainer gathers next."""
        outputs = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        self._loss_samples = find_batch_size(inputs) if outputs[0] is not None else None
        return outputs

    def _gather_for_metrics(self, value: Any) -> Any:
        """The DP gather; the first value after a step with a loss is that loss, which Trainer repeated
        `eval_batch_size` times: repeated as many times as the batch had samples instead, so that a smaller last
        batch weighs what it holds (accelerate's `gather_for_metrics` drops the surplus in one-process Trainer)."""
        samples, self._loss_samples = self._loss_samples, None
        if samples is not None and torch.is_tensor(value) and value.dim() == 1 and len(value):
            value = value[:1].repeat(samples)
        return self._gather_over_replicas(value)

    def _gather_over_replicas(self, value: Any) -> Any:
        """Losses, logits or labels of every DP replica, concatenated in replica order; TP ranks of a replica
        hold the same, so they are not gathered twice. Sequences are padded to the longest with -100, as
        Trainer pads batches."""
        group = dp_group(self.model)
        if group_size(group) == 1 or value is None:
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(self._gather_over_replicas(v) for v in value)
        if isinstance(value, dict):
            return {k: self._gather_over_replicas(v) for k, v in value.items()}
        shapes: list = [None] * group_size(group)
        with named_failure(group, "AutoTPTrainer's gather of the evaluated shapes over DP"):
            dist.all_gather_object(shapes, tuple(value.shape), group=group)
        if value.dim() > 1:
            longest = max(shape[1] for shape in shapes)
            value = nn.functional.pad(value, (*[0, 0] * (value.dim() - 2), 0, longest - value.shape[1]), value=-100)
        parts = [value.new_empty((shape[0], *value.shape[1:])) for shape in shapes]
        all_gather(parts, value.contiguous(), group)
        return torch.cat(parts)

    def get_tp_size(self) -> int:
        return tp_size(self.model)

    def get_total_train_batch_size(self, args) -> int:
        return trainer_compat.train_batch_size(self) * args.gradient_accumulation_steps * dp_size(self.model)

    @contextmanager
    def _no_world_token_average(self) -> Iterator[bool]:
        """Trainer's token averaging assumes every rank is a replica; inside, autotp does it over DP instead."""
        average = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            yield average
        finally:
            self.args.average_tokens_across_devices = average

    def count_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """This replica's label tokens, summed over the DP group when averaging tokens across devices."""
        with self._no_world_token_average() as average:
            count = trainer_compat.replaced(self, AutoTPTrainer, "count_items_in_batch")(batch_samples, device)
        if not torch.is_tensor(count):
            return count
        count = count * self.get_tp_size()  # Trainer divided by the ranks sharing a batch; this count is ours alone
        group = dp_group(self.model)
        if average and group_size(group) > 1:
            count = count.clone()
            with named_failure(group, "AutoTPTrainer's all-reduce of the batch's label tokens over DP"):
                dist.all_reduce(count, group=group)
        return count

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """With token averaging the loss is this replica's share of the global sum: times the DP size, as DDP averages
        (TRL's SFT with a MoE load-balancing loss: its token count over the DP size instead, see `adds_aux_loss`).
        Under a pipeline, a TRL trainer's training step runs the whole schedule here, its `compute_loss` on the last
        stage per micro-batch (`autotp.integrations.trl_pipeline`), so that its own `training_step` still runs."""
        if runs_pipeline(self):
            refuse_uneven_batch(self, find_batch_size(inputs))
            return trl_pipeline_step(self, inputs, num_items_in_batch, return_outputs)
        shared = self.args.average_tokens_across_devices and num_items_in_batch is not None and adds_aux_loss(self)
        count = num_items_in_batch / dp_size(self.model) if shared else num_items_in_batch
        with self._no_world_token_average() as average:
            result = super().compute_loss(model, inputs, return_outputs, count)
        if shared:
            return result
        if average and num_items_in_batch is not None and (self.model_accepts_loss_kwargs or self.compute_loss_func):
            scale = dp_size(self.model)
            result = (result[0] * scale, result[1]) if return_outputs else result * scale
        return result

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """The usual step, or `autotp.forward_backward` where a dimension runs the step itself (a pipeline's
        schedule); the loss returned for logging is the mean over DP replicas (TP ranks agree already). Under expert
        parallelism (no DDP) the gradients are synced after the accumulation window's last micro-batch, before Trainer
        clips them: `autotp.allreduce_gradients`, the experts over expert-DP."""
        if stepping(self.model) is None or own_loss(self):  # a trainer's own loss: run by its compute_loss
            loss = super().training_step(model, inputs, num_items_in_batch)
        else:
            loss = self._pipeline_step(inputs, num_items_in_batch)
        if not state_of(self.model).allows_ddp() and self.accelerator.sync_gradients:
            allreduce_gradients(wrapped_model(self.model))
        group = dp_group(self.model)
        if group_size(group) > 1:
            loss = loss.clone()
            with named_failure(group, "AutoTPTrainer's all-reduce of the logged loss over DP"):
                dist.all_reduce(loss, group=group)
            loss /= group_size(group)
        return loss

    def _pipeline_step(self, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """Under a pipeline the step is `autotp.forward_backward` (a schedule interleaves its micro-batches' forwards
        and backwards), each gradient accumulation step one schedule over `pp_microbatches` micro-batches of its batch.
        Its loss is divided by the accumulation window's label tokens, as Trainer divides the model's at pp 1 (with
        token averaging: the count over DP, each replica's share times the DP size, which the DP average undoes).
        TRL's trainers keep Trainer's step and run the pipeline from `compute_loss` instead (`compute_loss`)."""
        if num_items_in_batch is None:
            raise NotImplementedError(
                f"AutoTPTrainer at {row_multiple(self)[2]} without num_items_in_batch (a model whose forward "
                f"takes no loss keywords, or batches without labels): a pipeline divides its loss by the label tokens "
                f"Trainer counts"
            )
        refuse_uneven_batch(self, find_batch_size(inputs))
        self.model.train()
        inputs = trainer_compat.prepare_inputs(self, inputs)
        if self.args.average_tokens_across_devices:
            num_items_in_batch = num_items_in_batch / dp_size(self.model)
        with self.compute_loss_context_manager():
            return forward_backward(self.model, **inputs, num_items_in_batch=num_items_in_batch).loss.detach()

    # Trainer's checkpoints, as `autotp.integrations.trainer_checkpoints` writes and reads them
    save_optimizer_and_scheduler = trainer_checkpoints.save_optimizer_and_scheduler
    load_optimizer_and_scheduler = trainer_checkpoints.load_optimizer_and_scheduler
    load_from_checkpoint = trainer_checkpoints.load_from_checkpoint
    load_best_model = trainer_checkpoints.load_best_model
    save_to = trainer_checkpoints.save_to

    def load_rng_state(self, checkpoint: str | None) -> None:
        """Trainer's: each process its own `rng_state_{i}.pth`. At another layout a TP group may mix ranks that read
        different replicas' files, or none (more ranks than saved): each TP group then takes its rank 0's
        generators, as `wrap` does, since its ranks must draw alike."""
        trainer_compat.replaced(self, AutoTPTrainer, "load_rng_state")(checkpoint)
        sync_generators(self)  # under a pipeline, GRPO's stages too
        sync_replicated_stream(tp_group(self.model))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Every rank takes part (`autotp.save_pretrained` is collective); Trainer itself saves on the
        main process only (transformers 5.19 under accelerate's multi-process state), which would leave it
        waiting for the others."""
        self.save_to(output_dir or self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")


def refuse_replica_sampler(trainer: Trainer, reader: str) -> None:
    """A subclass's `train_sampler` (one DP replica's part) where `reader` needs a sampler over the whole dataset."""
    if type(trainer).train_sampler is not AutoTPTrainer.train_sampler:
        raise NotImplementedError(
            f"autotp: {type(trainer).__name__}.train_sampler gives one DP replica's part of the data, but {reader} "
            f"read a sampler over the whole dataset: override _get_train_sampler (Trainer's hook) instead"
        )


def check_replica_part(trainer: Trainer, sampler: Sampler, dataset: Dataset) -> None:
    """A subclass's `train_sampler` that gives more samples than one DP replica's share would have the replicas
    read the same samples (a `SequentialSampler` of the whole dataset, say): refused, naming the fix."""
    dp = dp_size(trainer.model)
    if dp == 1 or not hasattr(sampler, "__len__") or not hasattr(dataset, "__len__"):
        return
    share = -(-len(dataset) // dp)
    if len(sampler) > share:
        raise ValueError(
            f"autotp: {type(trainer).__name__}.train_sampler gave {len(sampler)} samples of the dataset's "
            f"{len(dataset)}, more than one of {dp} data-parallel replicas reads ({share}), so the replicas would "
            f"read the same ones: return this replica's part (autotp.data_parallel_sampler(dataset, model)), or "
            f"override _get_train_sampler (Trainer's hook) with a sampler over the whole dataset, whose batches "
            f"autotp deals over the replicas"
        )


def own_loss(trainer: Trainer) -> list[type]:
    """The classes of `trainer` (TRL's trainers, a user's subclass) that define their own `compute_loss`."""
    return [c for c in type(trainer).__mro__ if "compute_loss" in vars(c) and c not in (AutoTPTrainer, Trainer)]


def refuse_own_loss(trainer: Trainer) -> None:
    """Under a pipeline a subclass's `compute_loss` would never run (the step is the schedule's, the loss the model's
    own): TRL's SFT, DPO and GRPO run theirs on the last stage (`integrations.trl_pipeline`), any other refused there."""
    own = own_loss(trainer)
    if own and stepping(trainer.model) is not None:
        check_pipeline_trainer(trainer, own)


def tp_trainer(trainer_class: type[Trainer]) -> type[Trainer]:
    """`trainer_class` (a Trainer subclass, such as TRL's `SFTTrainer`) with `AutoTPTrainer`'s behaviour mixed in."""
    return type(f"AutoTP{trainer_class.__name__}", (AutoTPTrainer, trainer_class), {})
