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


def build_at_tp2(rank: int, world: int, output: str) -> dict:
    """What tp_trainer(GRPOTrainer) does when it is built on 2 ranks at tp=2, and what it refuses."""
    import os

    from accelerate.state import PartialState
    from grpo_lora import config, dataset, low_tokens, tokenizer
    from train_trainer import tiny_llama, with_lora
    from trl import GRPOTrainer

    import autotp
    from autotp.hf_trainer import tp_trainer

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    PartialState._reset_state()  # accelerate's process state, as a fresh process under torchrun finds it

    def build(vocab_parallel: bool = False, **options):
        torch.manual_seed(0)
        model = with_lora(tiny_llama())
        autotp.wrap(model.base_model.model, tp_size=2, vocab_parallel=vocab_parallel)
        args = config(output, 1)
        for name, value in options.items():
            setattr(args, name, value)
        try:
            return tp_trainer(GRPOTrainer)(
                model=model,
                reward_funcs=low_tokens,
                args=args,
                train_dataset=dataset(256),
                processing_class=tokenizer(256),
            )
        except ValueError as error:
            return str(error)

    trainer = build()
    assert trainer.accelerator.num_processes == world and trainer.accelerator.process_index == rank
    trainer.args.per_device_eval_batch_size = 2  # half a group of num_generations_eval=4
    try:
        trainer.get_eval_dataloader(dataset(256, 4))
    except ValueError as error:
        split_eval = str(error)
    return {
        "generators": torch.get_rng_state(),
        "generation_batch": trainer.args.generation_batch_size,
        "unwrapped": trainer.accelerator.unwrap_model(trainer.wrap_for_training(trainer.model)) is trainer.model,
        "split_eval": split_eval,
        "batch_std": build(scale_rewards="batch"),
        "split_groups": build(per_device_train_batch_size=2),
        "vocab_parallel": build(vocab_parallel=True).model.base_model.model.forward.__code__.co_qualname,
    }


@pytest.mark.timeout(180)
def test_grpo_trainer_at_tp2_draws_alike_counts_replicas_refuses_what_tp_would_change_and_splits_the_fused_head(
    tmp_path: Path,
) -> None:
    from autotp.testing.spawn import run_ranks

    ranks = run_ranks(build_at_tp2, 2, str(tmp_path))
    # TRL seeds each process apart (seed + process index) so that replicas sample apart; TP ranks must not
    assert torch.equal(ranks[0]["generators"], ranks[1]["generators"])
    # 8 completions per step on the one replica, as one process; TRL counted 16 (per device x every process)
    assert ranks[0]["generation_batch"] == 8
    assert ranks[0]["unwrapped"]  # TRL's generation unwraps Trainer's wrapper to call `generate`
    for rank in ranks:
        assert "scale_rewards='batch'" in rank["batch_std"] and "'group'" in rank["batch_std"]
        assert "whole groups of num_generations=4" in rank["split_groups"]
        assert "4 prompts x 4 completions in batches of 2" in rank["split_eval"]
        assert rank["vocab_parallel"] == "_fused_forward.<locals>.forward"  # autotp's fused head, not TRL's


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
    trainer = OneProcessGRPO(
        model=model,
        reward_funcs=low_tokens,
        args=config(str(output), steps),
        train_dataset=dataset(vocab),
        eval_dataset=dataset(vocab, 4, seed=2),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    return trainer, trainer.evaluate()


@pytest.mark.slow  # a torchrun subprocess and a one-process GRPO run
@pytest.mark.parametrize("vocab_parallel", [False, True])  # True: per-token log-probs from the vocabulary shards
def test_grpo_with_lora_at_tp2_samples_and_trains_as_one_process(tmp_path: Path, vocab_parallel: bool) -> None:
    from grpo_lora import step_metrics
    from safetensors.torch import load_file

    steps = 6
    argv = readme_command(r"torchrun --nproc-per-node 2 examples/grpo_lora\.py --tp 2")
    argv += ["--vocab-parallel"] if vocab_parallel else []
    run(argv + ["--steps", str(steps), "--output", str(tmp_path / "tp"), "--record-out", str(tmp_path / "tp.json")])
    got = json.loads((tmp_path / "tp.json").read_text())
    one, one_evaluation = one_process_grpo(tmp_path / "one", steps)

    # The TP ranks share the sampler's random stream (autotp gives them TP rank 0's generators after TRL seeds each
    # process apart), so they sample the same completions: one generation batch of 8 per step, then the evaluation's
    # 4 batches (4 held-out prompts x 4).
    rank0, rank1 = got["completions"]
    assert rank0 == rank1 and len(rank0) == len(one.completions) == steps + 4

    # One process samples them too, unless reduction-order noise in the fp32 logits flips a draw; from such a step
    # on the runs train on other data. Losses and the log-probabilities' statistics compare where they agree.
    agree = [step for step in range(steps + 4) if rank0[step] == one.completions[step]]
    print(f"completions equal to one process's in {len(agree)} of {steps} training + 4 evaluation batches")
    assert len(agree) >= steps + 3, (agree, rank0, one.completions)
    losses, metrics, one_metrics = got["losses"], got["metrics"], step_metrics(one)
    trained = [s for s in agree if s < steps]
    gaps = {"loss": max(abs(losses[s] - one.losses[s]) for s in trained)}
    for name in ("entropy", "kl", "reward_std", "rewards/low_tokens/std"):  # TP ranks repeat a replica's rewards
        gaps[name] = max(abs(metrics[s][name] - one_metrics[s][name]) for s in trained)
    same_so_far = [s for s in trained if s < len(agree) and agree[s] == s]  # no earlier step sampled apart
    # the tokens seen so far, counted once per replica (TRL counted each of the 2 TP ranks' copies)
    gaps["num_tokens"] = max(
        (abs(metrics[s]["num_tokens"] - one_metrics[s]["num_tokens"]) for s in same_so_far), default=0.0
    )
    if set(range(steps, steps + 4)) <= set(agree):  # the evaluation: each prompt's group of completions on one replica
        gaps.update(
            {
                name: abs(got["evaluation"][name] - one_evaluation[name])
                for name in ("eval_loss", "eval_reward", "eval_reward_std", "eval_kl", "eval_entropy")
            }
        )
    print(f"largest differences from one process on those steps: {gaps}")
    assert max(gaps.values()) <= 1e-5, (gaps, losses, one.losses, metrics, one_metrics)
    assert max(abs(x) for x in losses) > 1e-2 and max(m["kl"] for m in metrics) > 1e-3  # not a trivially zero curve

    if len(trained) == steps:  # the same data throughout: the trained adapters equal one process's (PEFT's full size)
        adapter = load_file(str(tmp_path / "tp" / "adapter_model.safetensors"))
        expected = {name.replace(".default", ""): p for name, p in one.model.named_parameters() if ".default." in name}
        assert adapter.keys() == expected.keys()
        # Adam normalises each gradient, so fp32 sum-order noise in small ones moves a weight by up to ~1e-5 over the
        # run; 1e-4 is 1% of one step (lr=1e-2)
        gap = max((adapter[k] - expected[k].detach()).abs().max().item() for k in expected)
        print(f"largest adapter difference from one process: {gap:.2e}")
        assert gap <= 1e-4, gap
