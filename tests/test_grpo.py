"""RL post-training: examples/grpo_lora.py (TRL's GRPOTrainer through tp_trainer, LoRA, generation by the model
itself) at tp=2 samples the completions one process samples, on every TP rank alike, and trains to its losses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from readme_commands import ROOT, readme_command, run

sys.path.insert(0, str(ROOT / "examples"))

pytestmark = pytest.mark.slow  # a torchrun subprocess and a one-process GRPO run


def one_process_grpo(output: Path, steps: int):
    """Plain GRPOTrainer on one process, built as a user would, with the example's model, seed and data."""
    from grpo_lora import Recorder, config, dataset, low_tokens, tokenizer
    from train_trainer import tiny_llama, with_lora
    from trl import GRPOTrainer

    class OneProcessGRPO(Recorder, GRPOTrainer):
        pass

    torch.manual_seed(0)
    model = with_lora(tiny_llama())
    vocab = model.config.vocab_size
    trainer = OneProcessGRPO(model=model, reward_funcs=low_tokens, args=config(str(output), steps),
                             train_dataset=dataset(vocab), processing_class=tokenizer(vocab))
    trainer.train()
    return trainer


def test_grpo_with_lora_at_tp2_samples_and_trains_as_one_process(tmp_path: Path) -> None:
    from grpo_lora import step_metrics
    from safetensors.torch import load_file

    steps = 6
    argv = readme_command(r"torchrun --nproc-per-node 2 examples/grpo_lora\.py --tp 2")
    run(argv + ["--steps", str(steps), "--output", str(tmp_path / "tp"), "--record-out", str(tmp_path / "tp.json")])
    got = json.loads((tmp_path / "tp.json").read_text())
    one = one_process_grpo(tmp_path / "one", steps)

    # The TP ranks share the sampler's random stream (autotp gives them TP rank 0's generators after TRL seeds each
    # process apart), so they sample the same completions: one generation batch of 8 per step.
    rank0, rank1 = got["completions"]
    assert rank0 == rank1 and len(rank0) == len(one.completions) == steps

    # One process samples them too, unless reduction-order noise in the fp32 logits flips a draw; from such a step
    # on the runs train on other data. Losses and the log-probabilities' statistics compare where they agree.
    agree = [step for step in range(steps) if rank0[step] == one.completions[step]]
    print(f"completions equal to one process's at {len(agree)} of {steps} steps")
    assert len(agree) >= steps - 1, (agree, rank0, one.completions)
    losses, metrics, one_metrics = got["losses"], got["metrics"], step_metrics(one)
    for step in agree:
        assert abs(losses[step] - one.losses[step]) <= 1e-5, (step, losses, one.losses)
        for name in ("entropy", "kl"):
            assert abs(metrics[step][name] - one_metrics[step][name]) <= 1e-5, (step, metrics, one_metrics)
    assert max(abs(x) for x in losses) > 1e-2 and max(m["kl"] for m in metrics) > 1e-3  # not a trivially zero curve

    if len(agree) == steps:  # the same data throughout: the trained adapters equal one process's (PEFT's full size)
        adapter = load_file(str(tmp_path / "tp" / "adapter_model.safetensors"))
        expected = {name.replace(".default", ""): p for name, p in one.model.named_parameters() if ".default." in name}
        assert adapter.keys() == expected.keys()
        assert max((adapter[k] - expected[k].detach()).abs().max().item() for k in expected) <= 1e-5
