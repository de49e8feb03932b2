"""Pipeline parallelism composed with FSDP2, sequence and context parallelism, LoRA and the Trainer: the rank workers
of tests/pp/test_pp_compose.py (a helper module beside them; the parity harness itself is `pp_workers.pp_parity`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import TrainingArguments

import autotp
from autotp.pp.cut import find_cut, owner
from models import batch, tiny_model
from pp_workers import pp_parity


def trainer_arguments(path: str, **options: Any) -> TrainingArguments:
    """The pipeline Trainer runs' arguments: batches of 4 rows on the CPU, no reports, saves or progress bars."""
    return TrainingArguments(
        output_dir=path,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        **options,
    )


def counted_pp_parity(rank: int, world: int, *args: object) -> dict:
    """`pp_parity`, and how many reduce-scatters FSDP ran over its steps (`reduce_scatters`)."""
    calls = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*a: object, **k: object) -> object:
        calls.append(1)
        return reduce_scatter(*a, **k)

    dist.reduce_scatter_single = counted
    try:
        result = pp_parity(rank, world, *args)
    finally:
        dist.reduce_scatter_single = reduce_scatter
    return {**result, "reduce_scatters": len(calls)}


def pp_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """`pp_parity` for each (family, tp, pp, options) in one set of ranks (one start-up for several layouts)."""
    return [pp_parity(rank, world, *case) for case in cases]


class Padded(Dataset):
    """`size` token sequences labelled with themselves, each row's last tokens padding (attention_mask 0, labels
    -100) by a different amount, so that batches and micro-batches hold different label counts."""

    def __init__(self, size: int = 16, seq: int = 16):
        self.ids = batch(size=(size, seq), seed=3)
        self.pads = [(3 * i) % 10 for i in range(size)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        mask = torch.ones_like(self.ids[index])
        mask[len(mask) - self.pads[index] :] = 0
        return {
            "input_ids": self.ids[index],
            "attention_mask": mask,
            "labels": self.ids[index].masked_fill(mask == 0, -100),
        }


def trainer_run(rank: int, world: int, path: str, pp: int) -> dict:
    """AutoTPTrainer on a tiny llama at `pp` (one rank at pp 1): each gradient accumulation step's loss, and the
    parameters this rank's stage trains after the run (2 optimizer steps of 2 accumulation steps of 4 rows, the
    gradient norm clipped)."""
    from autotp.hf_trainer import AutoTPTrainer

    class Recording(AutoTPTrainer):
        losses: list[float] = []

        def training_step(self, *args: object, **kwargs: object) -> torch.Tensor:
            loss = super().training_step(*args, **kwargs)
            self.losses = [*self.losses, loss.item()]
            return loss

    model = autotp.wrap(tiny_model("llama"), 1, pp_size=pp, pp_microbatches=2)
    args = trainer_arguments(path, gradient_accumulation_steps=2, max_steps=2, max_grad_norm=0.5)
    trainer = Recording(model=model, args=args, train_dataset=Padded())
    trainer.train()
    stage = owner(model, find_cut(tiny_model("llama"), pp, None)) if pp > 1 else (lambda name: 0)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if stage(n) == autotp.pp_rank(model)}
    refused = None

    class OwnLoss(AutoTPTrainer):  # a loss the pipeline would not run (as TRL's trainers compute theirs)
        def compute_loss(self, *args: object, **kwargs: object) -> torch.Tensor:
            return super().compute_loss(*args, **kwargs) * 2

    try:
        OwnLoss(model=model, args=args, train_dataset=Padded())
    except NotImplementedError as err:
        refused = str(err)
    return {"losses": trainer.losses, "params": params, "own loss": refused}
