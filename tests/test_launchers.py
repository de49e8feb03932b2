"""The README's launcher commands run to completion, and Trainer at dp x tp matches a one-process Trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainingArguments

from readme_commands import ROOT, readme_command, run

sys.path.insert(0, str(ROOT / "examples"))


def test_readme_accelerate_command_matches_one_process() -> None:
    out = run(readme_command(r"accelerate launch --config_file examples/accelerate_cpu\.yaml examples/train_accelerate\.py --tp 2"))
    assert "dp=2 x tp=2" in out and "parity with one process: ok" in out


def test_readme_trainer_command_runs() -> None:
    out = run(readme_command(r"torchrun --nproc-per-node 4 examples/train_trainer\.py --tp 2"))
    assert "total train batch size 4" in out


class OneProcessTrainer(Trainer):
    """Plain transformers.Trainer, reading the data in the order autotp's DP sampler deals it."""

    losses: list[float] = []

    def _get_train_sampler(self, train_dataset=None):
        return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


def test_trainer_dp2_tp2_losses_equal_one_process_trainer(tmp_path: Path) -> None:
    argv = readme_command(r"torchrun --nproc-per-node 4 examples/train_trainer\.py --tp 2")
    run(argv + ["--steps", "4", "--adam-epsilon", "1e-6", "--losses-out", str(tmp_path / "losses.json"), "--output", str(tmp_path / "tp")])
    got = json.loads((tmp_path / "losses.json").read_text())

    from data import PatternDataset
    from train_trainer import tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path / "one"), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-3, adam_epsilon=1e-6, logging_steps=1, seed=0, save_strategy="no",
                             report_to=[])
    trainer = OneProcessTrainer(model=model, args=args, train_dataset=PatternDataset(64, 32, model.config.vocab_size))
    trainer.losses = []
    trainer.train()
    # fp32: the two runs differ only in the order of sums (TP partials, DP gradient average); AdamW's eps is
    # 1e-6 for the reason given in autotp.testing.parity.compare_training.
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, trainer.losses)) <= 1e-5, (got, trainer.losses)
