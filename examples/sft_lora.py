"""Supervised fine-tuning with TRL's SFTTrainer and LoRA, tensor-parallel through autotp.

    torchrun --nproc-per-node 2 examples/sft_lora.py --tp 2        # 2 CPU ranks, no downloads

A tiny Llama built from a config, an in-memory tokenizer and dataset. PEFT's LoRA goes on first (so
its adapters start as they would in one process), then `autotp.wrap` shards the model inside the
PeftModel, and `autotp.hf_trainer.tp_trainer(SFTTrainer)` is SFTTrainer with AutoTPTrainer's data
parallel x tensor parallel behaviour. TRL computes the loss with a fused LM head that reads
`lm_head.weight` itself; with `--vocab-parallel` autotp replaces it by its own head over the vocabulary
shards (`autotp.integrations.fused_head`), which never builds the full-vocabulary logits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def require_sft_extra() -> None:
    """Exit with the install command (printed once, by rank 0) when the `sft` extra is missing, before any import
    of it fails with a traceback on every rank."""
    missing = [name for name in ("datasets", "peft", "trl") if importlib.util.find_spec(name) is None]
    if missing:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"examples/sft_lora.py needs the sft extra ({', '.join(missing)} not installed): "
                f"pip install -e '.[sft]'",
                file=sys.stderr,
            )
        sys.exit(1)


require_sft_extra()

import torch  # noqa: E402  (after the check above)
from data import PatternDataset  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from train_trainer import LossRecorder, tiny_llama, with_lora  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import autotp  # noqa: E402
from autotp.hf_trainer import tp_trainer  # noqa: E402


def tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary, built in memory."""
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")


def dataset(vocab: int, size: int = 32, seq: int = 32) -> Dataset:
    """Already tokenized sequences (SFTTrainer then skips tokenising)."""
    samples = PatternDataset(size=size, seq=seq, vocab=vocab)
    return Dataset.from_dict({"input_ids": [samples[i]["input_ids"].tolist() for i in range(size)]})


def config(output: str, steps: int) -> SFTConfig:
    return SFTConfig(
        output_dir=output,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        max_length=32,
        disable_tqdm=True,
        bf16=False,
    )  # SFTConfig defaults to bf16 autocast; fp32 here, so the test compares to 1e-5


class RecordingSFT(LossRecorder, tp_trainer(SFTTrainer)):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", default="out/autotp-sft")
    parser.add_argument("--losses-out", help="write the per-step losses as JSON (rank 0)")
    parser.add_argument(
        "--vocab-parallel", action="store_true", help="split the LM head by vocabulary (autotp's fused head)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)  # the same base weights and adapters on every rank, and as in one process
    model = with_lora(tiny_llama())
    autotp.wrap(model.base_model.model, tp_size=args.tp, vocab_parallel=args.vocab_parallel)
    vocab = model.config.vocab_size
    trainer = RecordingSFT(
        model=model,
        args=config(args.output, args.steps),
        train_dataset=dataset(vocab),
        processing_class=tokenizer(vocab),
    )
    trainer.train()
    losses = trainer.losses
    trainer.save_model()  # PEFT's adapter, full size
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"SFT with LoRA at tp={args.tp}: losses {[round(x, 4) for x in losses]}; saved {args.output}")
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump({"losses": losses}, f)
    autotp.finish()


if __name__ == "__main__":
    main()
