"""`AutoTPTrainer`'s training batches where a dimension splits each by rows (a pipeline into `pp_microbatches`
micro-batches: `Dimension.row_multiple`), so their rows must be a multiple of that. Refused before the first step where
the data's length tells (the batch size, or an epoch's short last batch that the run reaches), else on the first such
batch, naming the Trainer's settings that fix it rather than the schedule's."""

from __future__ import annotations

import math

from torch.utils.data import Sampler
from transformers import Trainer

from ..compat import trainer as trainer_compat
from ..state import state_of


def row_multiple(trainer: Trainer) -> tuple[int, str, str]:
    """(the multiple, the option that sets it, where the model is held) of the dimension that splits batches by rows;
    `(1, "", "")` where none does."""
    splits = [d.row_multiple() for d in state_of(trainer.model).dims.values()]
    return next((split for split in splits if split[0] > 1), (1, "", ""))


def refuse_uneven_batches(trainer: Trainer, sampler: Sampler | None) -> None:
    """Before training: the batch size, and the epoch's last batch (of `sampler`'s samples, this replica's) when the
    run reaches it and `dataloader_drop_last` does not drop it."""
    micro, option, where = row_multiple(trainer)
    if micro == 1:
        return
    size = trainer_compat.train_batch_size(trainer)
    if size % micro:
        raise ValueError(
            f"AutoTPTrainer at {where}: per_device_train_batch_size={size} rows do not split evenly into "
            f"{option}={micro} micro-batches; give a batch size that is a multiple of {micro}"
        )
    samples = len(sampler) if sampler is not None and hasattr(sampler, "__len__") else None
    if samples is None or trainer.args.dataloader_drop_last or samples % size % micro == 0:
        return
    args = trainer.args
    batches = math.ceil(samples / size)
    if args.max_steps > 0 and args.max_steps * args.gradient_accumulation_steps < batches:
        return  # the run stops before the epoch's last batch
    raise ValueError(_short(trainer, samples % size, f"{samples} samples per replica"))


def refuse_uneven_batch(trainer: Trainer, rows: int) -> None:
    """At a step: this batch's rows (a dataset whose length was not known before)."""
    if rows % row_multiple(trainer)[0]:
        raise ValueError(_short(trainer, rows, "this batch"))


def _short(trainer: Trainer, rows: int, what: str) -> str:
    micro, option, where = row_multiple(trainer)
    size = trainer_compat.train_batch_size(trainer)
    return (
        f"AutoTPTrainer at {where}: a training batch of {rows} rows ({what}, at per_device_train_batch_size="
        f"{size}) does not split evenly into {option}={micro} micro-batches; set dataloader_drop_last=True "
        f"in TrainingArguments to drop the epoch's short last batch (or give a dataset whose last batch is a multiple "
        f"of {micro} rows)"
    )
