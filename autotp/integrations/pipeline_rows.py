"""`AutoTPTrainer`'s training batches under a pipeline: each is split by rows into `pp_microbatches` micro-batches, so
its rows must be a multiple of them. Refused before the first step where the data's length tells (the batch size, or
an epoch's short last batch that the run reaches), else on the first such batch, naming the Trainer's settings that fix
it rather than the schedule's."""

from __future__ import annotations

import math

from torch.utils.data import Sampler
from transformers import Trainer

from ..accessors import pp_size
from ..compat import trainer as trainer_compat
from ..state import state_of


def microbatches(trainer: Trainer) -> int:
    """The wrapped model's micro-batches per schedule (`pp_microbatches`, by default `pp_size`)."""
    return state_of(trainer.model).options.pp_microbatches or pp_size(trainer.model)


def refuse_uneven_batches(trainer: Trainer, sampler: Sampler | None) -> None:
    """Before training: the batch size, and the epoch's last batch (of `sampler`'s samples, this replica's) when the
    run reaches it and `dataloader_drop_last` does not drop it."""
    pp = pp_size(trainer.model)
    if pp == 1:
        return
    size, micro = trainer_compat.train_batch_size(trainer), microbatches(trainer)
    if size % micro:
        raise ValueError(
            f"AutoTPTrainer at pp_size={pp}: per_device_train_batch_size={size} rows do not split evenly into "
            f"pp_microbatches={micro} micro-batches; give a batch size that is a multiple of {micro}"
        )
    samples = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else None
    if samples is None or trainer.args.dataloader_drop_last or samples % size % micro == 0:
        return
    args = trainer.args
    batches = math.ceil(samples / size)
    if args.max_steps > 0 and args.max_steps * args.gradient_accumulation_steps < batches:
        return  # the run stops before the epoch's last batch
    raise ValueError(_short(pp, samples % size, size, micro, f"{samples} samples per replica"))


def refuse_uneven_batch(trainer: Trainer, rows: int) -> None:
    """At a step: this batch's rows (a dataset whose length was not known before)."""
    micro = microbatches(trainer)
    if rows % micro:
        size = trainer_compat.train_batch_size(trainer)
        raise ValueError(_short(pp_size(trainer.model), rows, size, micro, "this batch"))


def _short(pp: int, rows: int, size: int, micro: int, what: str) -> str:
    return (
        f"AutoTPTrainer at pp_size={pp}: a training batch of {rows} rows ({what}, at per_device_train_batch_size="
        f"{size}) does not split evenly into pp_microbatches={micro} micro-batches; set dataloader_drop_last=True "
        f"in TrainingArguments to drop the epoch's short last batch (or give a dataset whose last batch is a multiple "
        f"of {micro} rows)"
    )
