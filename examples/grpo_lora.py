"""RL post-training with TRL's GRPOTrainer and LoRA, tensor-parallel through autotp.

    torchrun --nproc-per-node 2 examples/grpo_lora.py --tp 2       # 2 CPU ranks, no downloads

A tiny Llama built from a config, an in-memory word-level tokenizer, prompts of random tokens and a rule-based
reward: the share of a completion's tokens in the lower quarter of the vocabulary. GRPO samples `num_generations`
completions per prompt with the model itself (`use_vllm=False`), on every TP rank alike, and scores them against
each other; after training it evaluates on held-out prompts. PEFT's LoRA goes on first, then `autotp.wrap` shards
the model inside the PeftModel; `autotp.hf_trainer.tp_trainer(GRPOTrainer)` is GRPOTrainer with AutoTPTrainer's
data parallel x tensor parallel behaviour. GRPO scores completions with TRL's fused LM head, which reads
`lm_head.weight` itself; with `--vocab-parallel` the LM head is split by vocabulary and autotp puts its own fused head
in TRL's place (per-token log-probabilities from the vocabulary shards, `autotp.vocab.logprobs`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

if missing := [name for name in ("datasets", "peft", "trl") if importlib.util.find_spec(name) is None]:
    if os.environ.get("RANK", "0") == "0":  # printed once, before an import fails on every rank
        print(
            f"examples/grpo_lora.py needs the sft extra ({', '.join(missing)} not installed): pip install -e '.[sft]'",
            file=sys.stderr,
        )
    sys.exit(1)

import torch  # noqa: E402  (after the check above)
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from train_trainer import LossRecorder, tiny_llama, with_lora  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import autotp  # noqa: E402
from autotp.hf_trainer import tp_trainer  # noqa: E402


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary ("t0 t17 t5"), built in memory."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", padding_side="left")


def dataset(vocab: int, size: int = 16, length: int = 6, seed: int = 1) -> Dataset:
    """Prompts of random tokens (fixed seed), as text: GRPO tokenizes them itself."""
    ids = torch.randint(2, vocab, (size, length), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in row.tolist()) for row in ids]})


def low_tokens(completion_ids: list[list[int]], **_) -> list[float]:
    """The rule-based reward: the share of each completion's tokens below a quarter of the vocabulary (256)."""
    return [sum(t < 64 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def config(output: str, steps: int) -> GRPOConfig:
    """8 completions a step (2 prompts x 4), 8 tokens each at most; evaluation one prompt's 4 at a time. The
    untrained model's next-token distribution is almost flat, so the sampling temperature sharpens it (what is
    sampled then depends on the model), and a KL term (beta) holds the policy near its starting adapter. fp32
    (GRPOConfig defaults to bf16), as the one-process run it is compared with."""
    return GRPOConfig(
        output_dir=output,
        max_steps=steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        temperature=0.1,
        beta=0.04,
        learning_rate=1e-2,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        gradient_checkpointing=False,
    )


class Recorder(LossRecorder):
    """Mixed into a GRPO trainer: keeps each step's loss and the completions it sampled (token ids; each training
    step's generation batch, then each evaluation batch's)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completions: list[list[list[int]]] = []

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        ids, mask = batch["completion_ids"], batch["completion_mask"].bool()
        self.completions.append([row[keep].tolist() for row, keep in zip(ids, mask)])
        return batch


def step_metrics(trainer: GRPOTrainer) -> list[dict[str, float]]:
    """What GRPO logged at each step of the log-probabilities it computed: the policy's entropy and its KL to the
    reference (a frozen copy of the starting adapter, which GRPO adds to a PeftModel when beta > 0); and of its
    generation: the tokens seen so far and the rewards' standard deviations."""
    names = ("entropy", "kl", "num_tokens", "reward_std", "rewards/low_tokens/std")
    return [{k: log[k] for k in names} for log in trainer.state.log_history if "kl" in log]


class RecordingGRPO(Recorder, tp_trainer(GRPOTrainer)):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", default="out/autotp-grpo")
    parser.add_argument("--vocab-parallel", action="store_true", help="split the LM head by vocabulary too")
    parser.add_argument("--record-out", help="write the per-step losses and every rank's completions as JSON (rank 0)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same base weights and adapters on every rank, and as in one process
    model = with_lora(tiny_llama())
    autotp.wrap(model.base_model.model, tp_size=args.tp, vocab_parallel=args.vocab_parallel)
    vocab = model.config.vocab_size
    trainer = RecordingGRPO(
        model=model,
        reward_funcs=low_tokens,
        args=config(args.output, args.steps),
        train_dataset=dataset(vocab),
        eval_dataset=dataset(vocab, 4, seed=2),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    evaluation = trainer.evaluate()  # 4 held-out prompts, 4 completions each
    trainer.save_model()  # PEFT's adapter, full size
    completions = [trainer.completions]
    if torch.distributed.is_initialized():  # every rank's, to show the TP ranks sampled alike
        completions = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(completions, trainer.completions)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        rewards = [sum(low_tokens(step)) / len(step) for step in trainer.completions[: args.steps]]
        print(
            f"GRPO with LoRA at tp={args.tp}: losses {[round(x, 4) for x in trainer.losses]}, mean reward per step "
            f"{[round(r, 3) for r in rewards]}, held-out reward {evaluation['eval_reward']:.3f}; saved {args.output}"
        )
        if args.record_out:
            with open(args.record_out, "w") as f:
                json.dump(
                    {
                        "losses": trainer.losses,
                        "metrics": step_metrics(trainer),
                        "evaluation": evaluation,
                        "completions": completions,
                    },
                    f,
                )
    autotp.finish()


if __name__ == "__main__":
    main()
