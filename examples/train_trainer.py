"""transformers.Trainer at data parallel x tensor parallel, through autotp.hf_trainer.AutoTPTrainer.

    torchrun --nproc-per-node 4 examples/train_trainer.py --tp 2     # 2 replicas x tp=2 on CPU ranks

AutoTPTrainer averages gradients over the data-parallel group only (DDP on autotp.dp_group), gives
each replica its own part of the data (TP ranks of a replica read the same batches), reports the
batch size and loss over replicas, and saves a full checkpoint with autotp.save_pretrained (with --lora:
PEFT's adapter, full size).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import warnings

import torch
from data import PatternDataset
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

import autotp
from autotp.hf_trainer import AutoTPTrainer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """PEFT's LoRA on all seven projections (r=8), its default initialisation (lora_B zero)."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():  # PEFT 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0))


def tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )
    return AutoModelForCausalLM.from_config(config)


class LossRecorder:
    """Mixed into a Trainer: keeps each step's loss unrounded (Trainer's log rounds to 4 decimals) for comparisons."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class RecordingTrainer(LossRecorder, AutoTPTrainer):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="local HF model directory (default: a tiny Llama built from a config)")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch")
    parser.add_argument("--samples", type=int, default=64, help="training sequences (an epoch)")
    parser.add_argument("--output", default="out/autotp-trainer")
    parser.add_argument("--adam-epsilon", type=float, default=1e-8)
    parser.add_argument("--eval", action="store_true", help="evaluate on 16 held-out sequences after training")
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True): bf16 autocast")
    parser.add_argument("--save-steps", type=int, help="write a resumable Trainer checkpoint every N steps")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--grad-ckpt", action="store_true", help="activation (gradient) checkpointing")
    parser.add_argument(
        "--best-at-end",
        action="store_true",
        help="evaluate and save every --save-steps, keep 1 checkpoint, load the best at the end",
    )
    parser.add_argument(
        "--resume", help="a checkpoint directory to resume from (trainer.train(resume_from_checkpoint=))"
    )
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (PEFT, added before wrap) only")
    parser.add_argument("--fsdp", action="store_true", help="AutoTPTrainer(fully_shard=True): FSDP2 over the DP group")
    parser.add_argument("--losses-out", help="write the per-step losses (and eval loss, head dtypes) as JSON (rank 0)")
    return parser.parse_args(argv)


def checkpointing_argument() -> str:
    """TrainingArguments' name for activation checkpointing: `gradient_checkpointing` is its deprecated alias in the
    transformers releases that have `activation_checkpointing` (5.23), and the only name before them."""
    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-3,
        adam_epsilon=args.adam_epsilon,
        logging_steps=1,
        seed=0,
        bf16=args.bf16,
        per_device_eval_batch_size=args.batch,
        use_cpu=not torch.cuda.is_available(),  # CPU ranks: accelerate then sees MULTI_CPU
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        gradient_accumulation_steps=args.grad_accum,
        **{checkpointing_argument(): args.grad_ckpt},
        load_best_model_at_end=args.best_at_end,
        save_total_limit=1 if args.best_at_end else None,
        eval_strategy="steps" if args.best_at_end else "no",
        eval_steps=args.save_steps,
        report_to=[],
        disable_tqdm=False,
    )


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else tiny_llama()
    if args.lora:  # PEFT first, then wrap the transformers model inside: each adapter is split like its layer
        model = with_lora(model)
        autotp.wrap(model.base_model.model, tp_size=args.tp)
    else:
        model = autotp.wrap(model, tp_size=args.tp)
    training = training_arguments(args)
    dataset = PatternDataset(size=args.samples, seq=32, vocab=model.config.vocab_size)
    held_out = PatternDataset(size=16, seq=32, vocab=model.config.vocab_size, seed=1) if args.eval else None
    trainer = RecordingTrainer(
        model=model, args=training, train_dataset=dataset, eval_dataset=held_out, fully_shard=args.fsdp
    )
    dtypes = []  # the LM head's output dtype at each forward: shows whether bf16 autocast is on
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: dtypes.append(str(out.dtype)))
    trainer.train(resume_from_checkpoint=args.resume)
    record = {"losses": trainer.losses, "train_dtypes": sorted(set(dtypes))}
    if args.eval:
        dtypes.clear()
        record["eval_loss"] = trainer.evaluate()["eval_loss"]
        record["eval_dtypes"] = sorted(set(dtypes))
    trainer.save_model()
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"total train batch size {trainer.get_total_train_batch_size(training)}, "
            f"losses {[round(x, 4) for x in trainer.losses]}"
            + (f", eval loss {record['eval_loss']:.4f}" if args.eval else "")
            + f"; saved {args.output}"
        )
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(record, f)
    autotp.finish()  # every rank: exiting straight after a gloo collective can abort (see autotp.finish)


if __name__ == "__main__":
    main()
