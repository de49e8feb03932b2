"""AutoTPTrainer's own checkpoints (save_steps) resumed through `trainer.train(resume_from_checkpoint=...)`: the
samples each resumed step reads, and the checkpoints Trainer writes with `save_only_model`."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainingArguments

import autotp
from autotp.testing.spawn import run_ranks
from models import Sequences, tiny_model


class OneProcess(Trainer):
    """Plain transformers.Trainer reading the data in the order autotp's sampler deals it to one replica."""

    def _get_train_sampler(self, train_dataset=None):
        return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)


def reading_trainer(path: str, tp: int, steps: int, **arguments):
    """AutoTPTrainer on a tiny Llama at `tp` (0: `OneProcess` without autotp), 8 samples in global batches of 4 (2
    steps an epoch), keeping each step's loss unrounded in `.losses` and the samples it read in `.read`."""
    from autotp.hf_trainer import AutoTPTrainer

    dataset = Sequences(8, seq=8)

    class Reading(AutoTPTrainer if tp else OneProcess):
        losses: list[float] = []
        read: list[list[int]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses = [*self.losses, loss.item()]
            self.read = [*self.read, dataset.index_of(inputs["input_ids"])]
            return loss

    args = TrainingArguments(output_dir=path, per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3,
                             adam_epsilon=1e-6, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
                             save_strategy="steps", save_steps=1, **arguments)
    model = autotp.wrap(tiny_model("llama"), tp_size=tp) if tp else tiny_model("llama")
    return Reading(model=model, args=args, train_dataset=dataset)


def resume_in_second_epoch(rank: int, world: int, path: str) -> dict:
    """Four steps at tp=`world` with a checkpoint after each (two epochs), then a resume from checkpoint-3, inside
    the second epoch."""
    whole = reading_trainer(f"{path}/whole", world, 4)
    whole.train()
    resumed = reading_trainer(f"{path}/resumed", world, 4)
    resumed.train(resume_from_checkpoint=f"{path}/whole/checkpoint-3")
    return {"whole": (whole.read, whole.losses), "resumed": (resumed.read, resumed.losses)}


@pytest.mark.timeout(120)
def test_a_resume_inside_the_second_epoch_reads_that_epochs_samples(tmp_path: Path) -> None:
    """Trainer skips the resumed epoch's first batches with accelerate's `skip_first_batches` and sets the epoch on the
    batch sampler under it: the resumed step 4 must read the second epoch's last batch, not the first epoch's."""
    report = run_ranks(resume_in_second_epoch, 2, str(tmp_path))[0]
    (read, losses), (resumed_read, resumed_losses) = report["whole"], report["resumed"]
    assert sorted(read[0] + read[1]) == sorted(read[2] + read[3]) == list(range(8)) and read[:2] != read[2:], read
    assert resumed_read == read[3:], (resumed_read, read)
    # the same ranks, data and reductions; only the save and reload lie between: equal to fp32 rounding
    assert len(resumed_losses) == 1 and abs(resumed_losses[0] - losses[3]) <= 1e-6, (resumed_losses, losses)


def resume_model_only(rank: int, world: int, path: str) -> list[float]:
    """Four steps at tp=`world` saving the model alone (`save_only_model=True`) after each, then a resume from step 2:
    the losses of steps 3 and 4. `world=0`: the same in one process with transformers' Trainer."""
    whole = reading_trainer(f"{path}/whole", world, 4, save_only_model=True)
    whole.train()
    resumed = reading_trainer(f"{path}/resumed", world, 4, save_only_model=True)
    resumed.train(resume_from_checkpoint=f"{path}/whole/checkpoint-2")
    return resumed.losses


@pytest.mark.timeout(120)
def test_a_checkpoint_of_the_model_alone_resumes_as_trainers_does(tmp_path: Path) -> None:
    """Trainer resumes a `save_only_model=True` checkpoint with a fresh optimizer and scheduler (there is no state to
    load); so does AutoTPTrainer, rather than asking for optimizer files. fp32: only the order of sums differs."""
    expected = resume_model_only(0, 0, str(tmp_path / "one"))
    got = run_ranks(resume_model_only, 2, str(tmp_path / "tp"))[0]
    assert len(got) == len(expected) == 2 and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5, (got, expected)
