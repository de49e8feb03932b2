"""The README's launcher commands run to completion, and Trainer at dp x tp matches a one-process Trainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainingArguments

from readme_commands import ROOT, readme_command, run

sys.path.insert(0, str(ROOT / "examples"))
from train_trainer import LossRecorder, checkpointing_argument  # noqa: E402  (examples/ is on the path from here on)

pytestmark = pytest.mark.slow  # torchrun / accelerate subprocesses and Trainer runs


def test_readme_accelerate_command_matches_one_process() -> None:
    out = run(
        readme_command(
            r"accelerate launch --config_file examples/accelerate_cpu\.yaml examples/train_accelerate\.py --tp 2"
        )
    )
    assert "dp=2 x tp=2" in out and "parity with one process: ok" in out


def test_readme_trainer_command_runs() -> None:
    out = run(readme_command(r"torchrun --nproc-per-node 4 examples/train_trainer\.py --tp 2"))
    assert "total train batch size 4" in out


class OneProcessOrder:
    """Mixed into a one-process Trainer: it reads the data in the order autotp's DP sampler deals it."""

    def _get_train_sampler(self, train_dataset=None):
        return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)


class OneProcessTrainer(OneProcessOrder, LossRecorder, Trainer):
    """Plain transformers.Trainer, in autotp's data order, recording each step's loss."""


def run_trainer_example(tmp_path: Path, *flags: str) -> dict:
    """The README's Trainer command at dp=2 x tp=2 with `flags`; returns what rank 0 recorded."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    argv = readme_command(r"torchrun --nproc-per-node 4 examples/train_trainer\.py --tp 2")
    run(
        argv
        + [
            "--steps",
            "4",
            "--adam-epsilon",
            "1e-6",
            "--losses-out",
            str(tmp_path / "losses.json"),
            "--output",
            str(tmp_path / "tp"),
            *flags,
        ]
    )
    return json.loads((tmp_path / "losses.json").read_text())


def one_process_trainer(
    tmp_path: Path, bf16: bool = False, lora: bool = False, **arguments
) -> tuple[list[float], float]:
    """Plain transformers.Trainer on one process over the same global batches: (step losses, eval loss)."""
    from data import PatternDataset
    from train_trainer import tiny_llama, with_lora

    torch.manual_seed(0)
    model = with_lora(tiny_llama()) if lora else tiny_llama()
    settings = dict(
        output_dir=str(tmp_path / "one"),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        save_strategy="no",
        report_to=[],
        bf16=bf16,
        use_cpu=True,
        per_device_eval_batch_size=2,
    )
    args = TrainingArguments(**{**settings, **arguments})
    vocab = model.config.vocab_size
    trainer = OneProcessTrainer(
        model=model,
        args=args,
        train_dataset=PatternDataset(64, 32, vocab),
        eval_dataset=PatternDataset(16, 32, vocab, seed=1),
    )
    trainer.train()
    return trainer.losses, trainer.evaluate()["eval_loss"]


def test_trainer_dp2_tp2_losses_and_eval_loss_equal_one_process_trainer(tmp_path: Path) -> None:
    got = run_trainer_example(tmp_path, "--eval")
    losses, eval_loss = one_process_trainer(tmp_path)
    # fp32: the two runs differ only in the order of sums (TP partials, DP gradient average); AdamW's eps is
    # 1e-6 for the reason given in autotp.testing.parity.compare_training.
    assert len(got["losses"]) == 4 and max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 1e-5, (got, losses)
    # Evaluation: each replica reads its half of the held-out set, the TP ranks of a replica the same half.
    assert abs(got["eval_loss"] - eval_loss) <= 1e-5, (got["eval_loss"], eval_loss)
    assert got["train_dtypes"] == got["eval_dtypes"] == ["torch.float32"]


def test_trainer_bf16_autocasts_from_the_first_step(tmp_path: Path) -> None:
    got = run_trainer_example(tmp_path, "--eval", "--bf16")
    assert got["train_dtypes"] == got["eval_dtypes"] == ["torch.bfloat16"], got
    losses, eval_loss = one_process_trainer(tmp_path, bf16=True)
    # bf16 autocast: matmuls round to 8 bits of mantissa (relative 4e-3) and TP changes their order of sums, so
    # losses near 5.5 agree to a few hundredths, not to fp32's 1e-5.
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 5e-2, (got["losses"], losses)
    assert abs(got["eval_loss"] - eval_loss) <= 5e-2, (got["eval_loss"], eval_loss)


def test_trainer_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Trainer's own checkpoint (save_steps) at dp=2 x tp=2: resuming from step 2 repeats steps 3 and 4 exactly at
    the same layout, and to fp32 rounding at tp=4 (dp=1, the per-device batch doubled: the same global batches)."""
    whole = run_trainer_example(tmp_path / "whole", "--save-steps", "2")
    checkpoint = tmp_path / "whole" / "tp" / "checkpoint-2"
    assert (checkpoint / "optimizer" / ".metadata").is_file() and not list(checkpoint.glob("optimizer.*"))
    resumed = run_trainer_example(tmp_path / "resumed", "--resume", str(checkpoint))
    # the same ranks, data order and reductions: only the save and reload lie between, so equal to fp32 rounding
    assert len(resumed["losses"]) == 2
    assert max(abs(a - b) for a, b in zip(resumed["losses"], whole["losses"][2:])) <= 1e-6, (resumed, whole)
    # tp=4 on the same 4 ranks: every Adam moment re-cut from the checkpoint's full tensors (k/v now replicated over
    # pairs of ranks), Trainer's skip of 2 steps lands on the same samples. Step 4 depends on the restored moments.
    at_tp4 = run_trainer_example(tmp_path / "tp4", "--tp", "4", "--batch", "4", "--resume", str(checkpoint))
    assert len(at_tp4["losses"]) == 2
    # fp32: TP over 4 ranks and one replica sums in another order than 2 x 2
    assert max(abs(a - b) for a, b in zip(at_tp4["losses"], whole["losses"][2:])) <= 1e-5, (at_tp4, whole)


@pytest.mark.parametrize("lora", [False, True])
def test_trainer_resumes_inside_a_later_epoch_bit_for_bit(tmp_path: Path, lora: bool) -> None:
    """8 samples in global batches of 4 at dp=2 x tp=2: two steps an epoch. Resumed from step 3, inside the second
    epoch, step 4 reads that epoch's last batch (Trainer sets the epoch on the batch sampler under accelerate's
    `skip_first_batches`), so it repeats the uninterrupted run's step 4 (fp32 rounding, as above)."""
    flags = ("--samples", "8", *(("--lora",) if lora else ()))
    whole = run_trainer_example(tmp_path / "whole", *flags, "--save-steps", "1")
    resumed = run_trainer_example(tmp_path / "resumed", *flags, "--resume", str(tmp_path / "whole/tp/checkpoint-3"))
    assert len(resumed["losses"]) == 1 and abs(resumed["losses"][0] - whole["losses"][3]) <= 1e-6, (resumed, whole)


def test_trainer_gradient_accumulation_and_checkpointing(tmp_path: Path) -> None:
    """gradient_accumulation_steps=2 and gradient_checkpointing=True at dp=2 x tp=2 against one process (fp32)."""
    got = run_trainer_example(tmp_path, "--grad-accum", "2", "--grad-ckpt")
    losses, _ = one_process_trainer(tmp_path, gradient_accumulation_steps=2, **{checkpointing_argument(): True})
    assert len(got["losses"]) == len(losses) == 8  # Trainer records each micro-batch's loss
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 1e-5, (got["losses"], losses)


def test_trainer_load_best_model_at_end_with_save_total_limit(tmp_path: Path) -> None:
    """Evaluate and save every step, keep one checkpoint: the best model comes back as each rank's rows."""
    got = run_trainer_example(tmp_path, "--save-steps", "1", "--best-at-end", "--eval")
    _, eval_loss = one_process_trainer(
        tmp_path,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        save_total_limit=1,
    )
    checkpoints = sorted(p.name for p in (tmp_path / "tp").glob("checkpoint-*"))
    assert 1 <= len(checkpoints) <= 2, checkpoints  # the limit, plus the best one when it is not the last
    assert abs(got["eval_loss"] - eval_loss) <= 1e-5, (got["eval_loss"], eval_loss)


def test_trainer_trains_and_resumes_lora_adapters(tmp_path: Path) -> None:
    """LoRA (PEFT before wrap) at dp=2 x tp=2 against one-process PEFT under Trainer; its checkpoints hold PEFT's
    full-size adapter and the adapters' optimizer state (optimizer/), and resuming repeats the steps."""
    from safetensors.torch import load_file

    got = run_trainer_example(tmp_path / "whole", "--lora", "--eval", "--save-steps", "2")
    losses, eval_loss = one_process_trainer(tmp_path, lora=True)
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 1e-5, (got["losses"], losses)
    assert abs(got["eval_loss"] - eval_loss) <= 1e-5, (got["eval_loss"], eval_loss)
    checkpoint = tmp_path / "whole" / "tp" / "checkpoint-2"
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (8, 172)  # full width
    assert adapter["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 8)
    assert not (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "optimizer" / ".metadata").is_file() and not list(checkpoint.glob("optimizer.*"))
    resumed = run_trainer_example(tmp_path / "resumed", "--lora", "--resume", str(checkpoint))
    assert max(abs(a - b) for a, b in zip(resumed["losses"], got["losses"][2:])) <= 1e-6, (resumed, got)


@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["whole-head", "vocab-parallel"])
def test_trl_sft_with_lora_matches_one_process(tmp_path: Path, vocab_parallel: bool) -> None:
    """examples/sft_lora.py (TRL's SFTTrainer through tp_trainer, LoRA) on 2 CPU ranks at tp=2: the loss curve of
    one-process SFT with the same adapters and batches, within fp32 rounding. With vocab parallelism TRL's fused LM
    head (which reads lm_head.weight whole) is replaced by autotp's over the vocabulary shards."""
    from sft_lora import config, dataset, tokenizer
    from train_trainer import tiny_llama, with_lora
    from trl import SFTTrainer

    argv = readme_command(r"torchrun --nproc-per-node 2 examples/sft_lora\.py --tp 2")
    run(
        argv
        + ["--output", str(tmp_path / "tp"), "--losses-out", str(tmp_path / "losses.json")]
        + (["--vocab-parallel"] if vocab_parallel else [])
    )
    got = json.loads((tmp_path / "losses.json").read_text())["losses"]

    class OneProcessSFT(OneProcessOrder, LossRecorder, SFTTrainer):
        pass

    torch.manual_seed(0)
    model = with_lora(tiny_llama())
    vocab = model.config.vocab_size
    trainer = OneProcessSFT(
        model=model,
        args=config(str(tmp_path / "one"), 4),
        train_dataset=dataset(vocab),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    assert len(got) == len(trainer.losses) == 4
    assert max(abs(a - b) for a, b in zip(got, trainer.losses)) <= 1e-5, (got, trainer.losses)


def test_trainer_fully_sharded_equals_one_process_and_resumes(tmp_path: Path) -> None:
    """AutoTPTrainer(fully_shard=True) at dp=2 x tp=2: FSDP2 over the DP group. Losses and eval loss as one process;
    each TP x DP rank writes its own optimizer rows into optimizer/, and resuming from step 2 repeats steps 3 and 4."""
    whole = run_trainer_example(tmp_path / "whole", "--fsdp", "--eval", "--save-steps", "2")
    losses, eval_loss = one_process_trainer(tmp_path)
    assert max(abs(a - b) for a, b in zip(whole["losses"], losses)) <= 1e-5, (whole["losses"], losses)
    assert abs(whole["eval_loss"] - eval_loss) <= 1e-5, (whole["eval_loss"], eval_loss)
    checkpoint = tmp_path / "whole" / "tp" / "checkpoint-2"
    assert (checkpoint / "optimizer" / ".metadata").is_file() and not list(checkpoint.glob("optimizer.*"))
    assert len(list((checkpoint / "optimizer").glob("*.distcp"))) == 4  # one data file per rank
    resumed = run_trainer_example(tmp_path / "resumed", "--fsdp", "--resume", str(checkpoint))
    assert max(abs(a - b) for a, b in zip(resumed["losses"], whole["losses"][2:])) <= 1e-6, (resumed, whole)


def test_trainer_fully_sharded_bf16_autocasts_from_the_first_step(tmp_path: Path) -> None:
    """bf16=True under FSDP x TP: every forward of training and evaluation in bf16 (FSDP keeps fp32 parameters),
    losses as a one-process bf16 Trainer's to bf16's few hundredths (see test_trainer_bf16_autocasts_from_the_first_step)."""
    got = run_trainer_example(tmp_path, "--fsdp", "--eval", "--bf16")
    assert got["train_dtypes"] == got["eval_dtypes"] == ["torch.bfloat16"], got
    losses, eval_loss = one_process_trainer(tmp_path, bf16=True)
    assert max(abs(a - b) for a, b in zip(got["losses"], losses)) <= 5e-2, (got["losses"], losses)
    assert abs(got["eval_loss"] - eval_loss) <= 5e-2, (got["eval_loss"], eval_loss)
