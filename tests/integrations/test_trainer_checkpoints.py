"""AutoTPTrainer's own checkpoints (save_steps) resumed through `trainer.train(resume_from_checkpoint=...)`: the
samples each resumed step reads, the checkpoints Trainer writes with `save_only_model`, a resume across DDP and FSDP,
older per-rank optimizer files, and the RNG state of a resume on more ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, SequentialSampler
from transformers import Trainer, TrainingArguments

import autotp
from autotp.testing.spawn import run_ranks
from models import Sequences, tiny_model
from trainer_runs import recording_trainer


class OneProcess(Trainer):
    """Plain transformers.Trainer reading the data in the order autotp's sampler deals it to one replica."""

    def _get_train_sampler(self, train_dataset=None):
        return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)


def reading_trainer(path: str, tp: int, steps: int, sequential: bool = False, **arguments):
    """AutoTPTrainer on a tiny Llama at `tp` (0: `OneProcess` without autotp), 8 samples in global batches of 4 (2
    steps an epoch), keeping each step's loss unrounded in `.losses` and the samples it read in `.read`.
    `sequential`: a subclass overriding AutoTPTrainer's public `train_sampler` with the data in order."""
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

    class Sequential(Reading):
        def train_sampler(self, train_dataset=None):
            return SequentialSampler(self.train_dataset)

    args = TrainingArguments(
        output_dir=path,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        **{"save_strategy": "steps", "save_steps": 1, **arguments},
    )
    model = autotp.wrap(tiny_model("llama"), tp_size=tp) if tp else tiny_model("llama")
    return (Sequential if sequential else Reading)(model=model, args=args, train_dataset=dataset)


def resume_in_second_epoch(rank: int, world: int, path: str) -> dict:
    """Four steps at tp=`world` with a checkpoint after each (two epochs), then a resume from checkpoint-3, inside
    the second epoch."""
    whole = reading_trainer(f"{path}/whole", world, 4)
    whole.train()
    resumed = reading_trainer(f"{path}/resumed", world, 4)
    resumed.train(resume_from_checkpoint=f"{path}/whole/checkpoint-3")
    return {"whole": (whole.read, whole.losses), "resumed": (resumed.read, resumed.losses)}


@pytest.mark.slow  # Trainer runs (about 2 s); a Trainer resume stays quick
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


def sequential_reads(rank: int, world: int, path: str) -> dict:
    """Two steps at tp 1 x dp `world` of a trainer given its own `_get_train_sampler` (the data in order); two at tp
    `world` of a subclass overriding `train_sampler` (the data in order); the error of that subclass at dp `world`."""
    trainer = reading_trainer(f"{path}/own", 1, 2, save_strategy="no")
    trainer._get_train_sampler = lambda train_dataset=None: SequentialSampler(trainer.train_dataset)
    trainer.train()
    subclass = reading_trainer(f"{path}/subclass", world, 2, sequential=True, save_strategy="no")
    subclass.train()
    try:
        reading_trainer(f"{path}/replicas", 1, 2, sequential=True, save_strategy="no").train()
        error = "no error"
    except ValueError as err:
        error = str(err)
    return {"own": trainer.read, "subclass": subclass.read, "replicas": error}


@pytest.mark.slow  # Trainer runs (about 2 s); a Trainer resume stays quick
@pytest.mark.timeout(120)
def test_a_trainers_own_sampler_is_dealt_over_dp_replicas(tmp_path: Path) -> None:
    """Before: AutoTPTrainer ignored a `_get_train_sampler` of the user's for its shuffled DP sampler, silently. Now
    its batches are dealt over the DP replicas in turn, as accelerate deals a plain Trainer's over processes. A
    subclass's `train_sampler` (AutoTPTrainer's own public hook: one replica's part) was ignored too; now the model
    reads its order, and where it would give each DP replica the same samples it is refused, naming both hooks."""
    for rank, report in enumerate(run_ranks(sequential_reads, 2, str(tmp_path))):
        assert report["own"] == [list(range(4 * rank, 4 * rank + 4))] * 2, (rank, report)
        assert report["subclass"] == [[0, 1, 2, 3], [4, 5, 6, 7]], (rank, report)
        assert "Sequential.train_sampler gave 8 samples" in report["replicas"], report["replicas"]
        assert "override _get_train_sampler" in report["replicas"], report["replicas"]


def resume_model_only(rank: int, world: int, path: str) -> list[float]:
    """Four steps at tp=`world` saving the model alone (`save_only_model=True`) after each, then a resume from step 2:
    the losses of steps 3 and 4. `world=0`: the same in one process with transformers' Trainer."""
    whole = reading_trainer(f"{path}/whole", world, 4, save_only_model=True)
    whole.train()
    resumed = reading_trainer(f"{path}/resumed", world, 4, save_only_model=True)
    resumed.train(resume_from_checkpoint=f"{path}/whole/checkpoint-2")
    return resumed.losses


@pytest.mark.slow  # Trainer runs (about 3 s); a Trainer resume stays quick
@pytest.mark.timeout(120)
def test_a_checkpoint_of_the_model_alone_resumes_as_trainers_does(tmp_path: Path) -> None:
    """Trainer resumes a `save_only_model=True` checkpoint with a fresh optimizer and scheduler (there is no state to
    load); so does AutoTPTrainer, rather than asking for optimizer files. fp32: only the order of sums differs."""
    expected = resume_model_only(0, 0, str(tmp_path / "one"))
    got = run_ranks(resume_model_only, 2, str(tmp_path / "tp"))[0]
    assert len(got) == len(expected) == 2 and max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5, (got, expected)


def resume_in_other_layout(rank: int, world: int, path: str, saved_fsdp: bool) -> tuple[list[float], list[float]]:
    """Three steps at dp=2 x tp=1 with a checkpoint after each, under one layout (DDP or FSDP); then a resume from
    step 1 under the other. Returns both runs' losses."""
    whole = recording_trainer(path, 1, saved_fsdp, steps=3, save=True)
    whole.train()
    resumed = recording_trainer(f"{path}/resumed", 1, not saved_fsdp, steps=3)
    resumed.train(resume_from_checkpoint=f"{path}/checkpoint-1")
    return whole.losses, resumed.losses


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_fsdp", [True, False])
def test_trainer_resumes_across_ddp_and_fsdp(tmp_path: Path, saved_fsdp: bool) -> None:
    """A Trainer checkpoint saved with fully_shard resumes without it, and the other way: FSDP's rows of each Adam
    moment are not DDP's whole tensors, so the optimizer state is re-cut on load. Step 3's loss depends on it."""
    (whole, resumed), _ = run_ranks(resume_in_other_layout, 2, str(tmp_path), saved_fsdp)
    assert (tmp_path / "checkpoint-1" / "optimizer" / ".metadata").is_file()
    assert not list((tmp_path / "checkpoint-1").glob("optimizer.*"))
    # fp32: FSDP's reduce-scatter and DDP's all-reduce sum the two replicas' gradients in another order
    assert len(whole) == 3 and len(resumed) == 2
    assert max(abs(a - b) for a, b in zip(resumed, whole[1:])) <= 1e-5, (resumed, whole)


def old_format_resume(rank: int, world: int, path: str, saved_fsdp: bool) -> tuple[bool, str]:
    """One step at tp=2, then this rank's optimizer state saved as autotp wrote it before `optimizer/` (one file per TP
    rank, per TP and DP rank under FSDP); loaded at the same layout (is it the saved state?), then at the other."""
    from autotp.io.checkpoint.legacy import local_optimizer_state

    saved = recording_trainer(path, world, saved_fsdp)
    saved.train()
    state = local_optimizer_state(saved.optimizer.state_dict())
    torch.save(state, f"{path}/optimizer.tp{rank}-of-2{'.dp0-of-1' if saved_fsdp else ''}.pt")
    torch.distributed.barrier()
    same = recording_trainer(path, world, saved_fsdp)
    same.create_optimizer_and_scheduler(num_training_steps=1)
    same.load_optimizer_and_scheduler(path)  # what train(resume_from_checkpoint=path) calls
    loaded = local_optimizer_state(same.optimizer.state_dict())["state"]
    equal = loaded.keys() == state["state"].keys() and all(
        torch.equal(loaded[i][k].cpu(), v) for i, entry in state["state"].items() for k, v in entry.items()
    )
    other = recording_trainer(path, world, not saved_fsdp)
    other.create_optimizer_and_scheduler(num_training_steps=1)
    try:
        other.load_optimizer_and_scheduler(path)
    except autotp.CheckpointError as err:
        return equal, str(err)
    return equal, "loaded"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_fsdp", [True, False])
def test_trainer_old_per_rank_optimizer_files_load_at_their_layout_only(tmp_path: Path, saved_fsdp: bool) -> None:
    """Checkpoints of autotp before `optimizer/` still resume at their own layout; at another, a clear error that names
    the files found and both layouts (here the tp size is the same: it is fully_shard that differs)."""
    for equal, message in run_ranks(old_format_resume, 2, str(tmp_path), saved_fsdp):
        assert equal
        saved = "optimizer.tp0-of-2.dp0-of-1.pt" if saved_fsdp else "optimizer.tp0-of-2.pt"
        expected = "optimizer.tp{}-of-2.pt" if saved_fsdp else "optimizer.tp{}-of-2.dp0-of-1.pt"
        assert any(expected.format(r) + ": missing" in message for r in (0, 1)) and saved in message, message
        layouts = ("tp=2, fully_shard at dp=1", "tp=2 without fully_shard")
        assert f"saved at {layouts[not saved_fsdp]}" in message and f"this run has {layouts[saved_fsdp]}" in message
        assert "resume at any tp, dp and fully_shard" in message, message


def load_rng_of_fewer_ranks(rank: int, world: int, path: str) -> torch.Tensor:
    """Trainer's RNG file for rank 0 and none for rank 1, as when a checkpoint of fewer ranks resumes on more, loaded
    at tp=2. (Trainer under run_ranks is not in its distributed mode, so each rank is given its own directory.)"""
    import random

    import numpy as np

    trainer = recording_trainer(path, world, False)
    mine = Path(path, f"rank{rank}")
    mine.mkdir()
    if rank == 0:
        generator = torch.Generator().manual_seed(123)
        torch.save(
            {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": generator.get_state()},
            mine / "rng_state.pth",
        )
    trainer._load_rng_state(str(mine))  # what Trainer calls when it resumes
    return torch.get_rng_state()


@pytest.mark.timeout(120)
def test_trainer_resume_on_more_ranks_gives_a_tp_group_one_random_state(tmp_path: Path) -> None:
    """Rank 1 has no RNG file of its own: it takes its TP group's rank 0's generator, which wrap requires of TP ranks
    (their replicated dropout masks must agree), instead of keeping another state."""
    states = run_ranks(load_rng_of_fewer_ranks, 2, str(tmp_path))
    assert torch.equal(states[0], torch.Generator().manual_seed(123).get_state())
    assert torch.equal(states[1], states[0])
