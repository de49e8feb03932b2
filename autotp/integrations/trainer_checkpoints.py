"""`AutoTPTrainer`'s checkpoints: the optimizer state as an `autotp.io.checkpoint.save` directory (resumable at any
tp, dp and fully_shard), the scheduler as Trainer writes it, and the full model (or PEFT's full-size adapter) through
`autotp.save_pretrained`. Each function is bound on `AutoTPTrainer` as the method of its name (`trainer` is `self`),
standing in for Trainer's private one (`autotp.compat.trainer.REPLACED`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import Trainer

from ..accessors import dp_rank, dp_size, tp_rank, tp_size
from ..compat.hf import adapter_module
from ..io.checkpoint.legacy import as_params
from ..io.checkpoint.legacy_optimizer import OPTIMIZER_FILE, layout_difference
from ..io.checkpoint.restore import read
from ..io.checkpoint.save import write
from ..io.errors import CheckpointError
from ..io.hf.load import checkpoint_files, load_params
from ..io.hf.save import save_pretrained
from ..state import state_of

_SCHEDULER = "scheduler.pt"  # Trainer's name, so its checkpoint rotation and resume logic find it
_OPTIMIZER = "optimizer"  # the optimizer state's checkpoint directory, inside Trainer's checkpoint-N/
_ADAPTER = "adapter_model.safetensors"  # PEFT's name


def save_optimizer_and_scheduler(trainer: Trainer, output_dir: str) -> None:
    """The optimizer state as one checkpoint directory, `optimizer/` (`autotp.io.checkpoint.save`: every state tensor at
    its full shape under its parameter's name, each rank writing its own rows), which resumes at any tp, dp and
    fully_shard, in place of Trainer's single `optimizer.pt`, which would hold rank 0's shards only. Collective:
    Trainer calls it on every rank. The scheduler as Trainer writes it (the scaler Trainer saves apart)."""
    os.makedirs(output_dir, exist_ok=True)
    write(
        os.path.join(output_dir, _OPTIMIZER),
        trainer.model,
        trainer.optimizer,
        None,
        {},
        overwrite=True,
        weights=False,
        rng=False,
        what="AutoTPTrainer's optimizer save",
    )
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))


def load_optimizer_and_scheduler(trainer: Trainer, checkpoint: str | None) -> None:
    """This rank's part of the optimizer state, at this run's layout whatever the saved one (a checkpoint of
    autotp before `optimizer/`: this rank's own file, at the layout it was saved at only); then the scheduler.
    A checkpoint without optimizer state (`save_only_model=True`) resumes with a fresh one, as Trainer's does."""
    if checkpoint is None:
        return
    if os.path.isdir(os.path.join(checkpoint, _OPTIMIZER)):
        read(os.path.join(checkpoint, _OPTIMIZER), trainer.model, trainer.optimizer, None, weights=False)
    elif any(map(OPTIMIZER_FILE.fullmatch, os.listdir(checkpoint))):
        _read_per_rank_optimizer(trainer, checkpoint)
    scheduler = os.path.join(checkpoint, _SCHEDULER)
    if os.path.isfile(scheduler):
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler, map_location="cpu", weights_only=True))


def _read_per_rank_optimizer(trainer: Trainer, checkpoint: str) -> None:
    """The older format: one file per TP rank (under FSDP, per TP and DP rank), named by this run's layout."""
    fsdp = state_of(trainer.model).fsdp
    name = f"optimizer.tp{tp_rank(trainer.model)}-of-{tp_size(trainer.model)}"
    name += f".dp{dp_rank(trainer.model)}-of-{dp_size(trainer.model)}.pt" if fsdp else ".pt"
    path = os.path.join(checkpoint, name)
    if not os.path.isfile(path):
        found = sorted(f for f in os.listdir(checkpoint) if f.startswith("optimizer"))
        raise CheckpointError(
            f"{path}: missing, so this rank's optimizer state cannot be restored: "
            + layout_difference(found, tp_size(trainer.model), dp_size(trainer.model) if fsdp else None)
        )
    state = torch.load(path, map_location=next(trainer.model.parameters()).device, weights_only=True)
    trainer.optimizer.load_state_dict(as_params(state, trainer.optimizer))


def load_from_checkpoint(trainer: Trainer, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    """The full checkpoint `save_to` wrote, read as this rank's rows into the wrapped model's own parameters; for
    a model holding PEFT adapters, the adapter PEFT wrote, loaded by PEFT."""
    if adapter_module(trainer.model) is not None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(os.path.join(resume_from_checkpoint, _ADAPTER))
        set_peft_model_state_dict(trainer.model, weights)  # each rank keeps its slices (autotp.io.rollout.adapters)
        return
    param = next(trainer.model.parameters())
    load_params(
        trainer.model,
        checkpoint_files(Path(resume_from_checkpoint)),
        param.device,
        param.dtype,
        show=trainer.args.should_save,
        in_place=True,
    )


def load_best_model(trainer: Trainer) -> None:
    """`load_best_model_at_end`: the best checkpoint's full model, read as this rank's rows, in place."""
    trainer.load_from_checkpoint(trainer.state.best_model_checkpoint)


def save_to(trainer: Trainer, output_dir: str | None = None, state_dict: dict | None = None) -> None:
    """Every rank takes part in the gather; rank 0 writes the checkpoint, tokenizer and arguments."""
    output_dir = output_dir or trainer.args.output_dir
    if adapter_module(trainer.model) is not None:  # PEFT's own adapter files, full size (autotp.io.rollout.adapters)
        trainer.model.save_pretrained(output_dir, is_main_process=trainer.args.should_save)
    else:
        save_pretrained(trainer.model, output_dir, into_existing=True)
    if trainer.args.should_save:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))
