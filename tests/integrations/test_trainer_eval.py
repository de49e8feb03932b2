"""AutoTPTrainer's evaluation loss against one-process Trainer: a smaller last batch weighs its own samples, at
dp=1 x tp=2 and across DP replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Trainer, TrainingArguments

import autotp
from autotp.testing.spawn import run_ranks
from models import Sequences, tiny_model


def eval_arguments(output: str) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output,
        per_device_eval_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )


def evaluate_rank(rank: int, world: int, output: str, samples: int, tp: int) -> float:
    from autotp.hf_trainer import AutoTPTrainer

    model = autotp.wrap(tiny_model("llama"), tp_size=tp)
    trainer = AutoTPTrainer(model=model, args=eval_arguments(output), eval_dataset=Sequences(samples))
    return trainer.evaluate()["eval_loss"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 1])
def test_eval_loss_weights_a_smaller_last_batch_as_one_process_trainer(tmp_path: Path, tp: int) -> None:
    """14 samples in batches of 4: at dp=1 x tp=2 the last batch holds 2 and must weigh 2 samples, not 4; at
    dp=2 x tp=1 each replica's 7 samples end in a batch of 3, gathered over the DP group."""
    got = run_ranks(evaluate_rank, 2, str(tmp_path / "tp"), 14, tp)
    expected = Trainer(
        model=tiny_model("llama"), args=eval_arguments(str(tmp_path / "one")), eval_dataset=Sequences(14)
    ).evaluate()["eval_loss"]
    # fp32: TP changes only the order of sums in the forward; the batch-mean slip this guards against is ~1e-4
    assert got[0] == got[1] and abs(got[0] - expected) <= 1e-5, (got, expected)
