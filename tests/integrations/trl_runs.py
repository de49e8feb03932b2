"""TRL's DPOTrainer and RLOOTrainer on a tiny Llama, on one process or on spawned TP ranks with a vocab-parallel LM
head, for tests/integrations/test_trl_vocab_parallel.py (a helper module beside it, not a test module).

Each run returns what the test compares with one process: every step's loss, what TRL logged at each step, the trained
weights (as `save_model` writes them: autotp's full checkpoint, or PEFT's full-size adapter) and the sizes of every
tensor an op created while TRL computed per-token log-probabilities and trained on them (`Sizes`): under vocab
parallelism the rank's 128 vocabulary rows appear there, the whole vocabulary's 256 never.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

TP = 2
STEPS = 3


class Sizes(TorchDispatchMode):
    """Every dim size of every tensor of 2 or more dims that an op (forward, backward, collective, optimizer step)
    created while active and not paused. Logits of the whole vocabulary, or their transpose in a backward, would put
    the vocabulary size in it; the tiny model has no other dim that large (hidden 64, MLP 172, short sequences)."""

    def __init__(self) -> None:
        super().__init__()
        self.dims: set[int] = set()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() >= 2]
            self.dims.update(n for t in tensors for n in t.shape)
        return out

    def pausing(self, function: Any) -> Any:
        """`function` run with the recording paused (generation, which samples from whole-vocabulary logits)."""

        def paused(*args: Any, **kwargs: Any) -> Any:
            self.paused += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.paused -= 1

        return paused


def _as_ranks(rank: int, world: int) -> None:
    """This forked rank as a fresh torchrun rank looks to accelerate."""
    from accelerate.state import PartialState

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    PartialState._reset_state()


def _train(trainer: Any, output: str, probe: Sizes, **extra: Any) -> dict:
    """Train under `probe`; losses, TRL's per-step logs, the tensor sizes seen, the saved weights (full tensors)."""
    from safetensors.torch import load_file

    with probe:
        trainer.train()
    trainer.save_model(output)
    name = "adapter_model.safetensors" if Path(output, "adapter_model.safetensors").exists() else "model.safetensors"
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {
        "losses": trainer.losses,
        "logs": logs,
        "dims": probe.dims,
        "weights": load_file(str(Path(output, name))),
        **extra,
    }


def forward_name(model: torch.nn.Module) -> str:
    """Where the forward `model` runs was defined (its code's qualified name: `functools.wraps` copies the names)."""
    return getattr(model.forward, "__func__", model.forward).__code__.co_qualname


def preferences(vocab: int, size: int = 12, seed: int = 3):
    """Prompts of 4 random tokens, each with a chosen and a rejected completion of 2 to 4 tokens (ragged, so that
    padding and the completion masks matter); text for DPO to tokenize."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)

    def text(length: int, lead: str = " ") -> list[str]:  # completions open on a space: DPO joins them to the prompt
        rows = torch.randint(2, vocab, (size, length), generator=generator).tolist()
        cut = torch.randint(2, length + 1, (size,), generator=generator).tolist()
        return [lead + " ".join(f"t{i}" for i in row[:n]) for row, n in zip(rows, cut)]

    return Dataset.from_dict({"prompt": text(4, ""), "chosen": text(4), "rejected": text(4)})


def dpo_config(output: str):
    """fp32 (DPOConfig defaults to bf16 on some setups), 2 pairs a step, a learning rate that moves the log-probs."""
    from trl import DPOConfig

    return DPOConfig(
        output_dir=output,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        beta=0.1,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        dataloader_drop_last=True,
    )


def dpo_run(rank: int, world: int, output: str) -> dict:
    """DPOTrainer on a tiny Llama, full fine-tuning against a separate reference model: on one process (`world` 1)
    as a user would run it, or at tp=`world` with `vocab_parallel=True` (policy and reference) through tp_trainer."""
    from grpo_lora import tokenizer
    from train_trainer import LossRecorder, tiny_llama
    from trl import DPOTrainer

    import autotp
    from autotp.hf_trainer import tp_trainer

    if world > 1:
        _as_ranks(rank, world)
    torch.manual_seed(0)
    policy = tiny_llama()
    torch.manual_seed(1)  # a reference unlike the policy, so the first step's rewards are not zero already
    reference = tiny_llama()
    if world > 1:
        for model in (policy, reference):
            autotp.wrap(model, tp_size=world, vocab_parallel=True)
    base = tp_trainer(DPOTrainer) if world > 1 else DPOTrainer
    trainer = type("RecordingDPO", (LossRecorder, base), {})(
        model=policy,
        ref_model=reference,
        args=dpo_config(output),
        train_dataset=preferences(256),
        processing_class=tokenizer(256),
    )
    return _train(trainer, output, Sizes(), forwards=[forward_name(policy), forward_name(reference)])


def rloo_config(output: str, **options: Any):
    """examples/grpo_lora.py's GRPO settings for RLOO: 8 completions a step (2 prompts x 4), 8 tokens at most, a low
    sampling temperature (which the fused head divides the logits by too), a KL penalty against the starting adapter;
    fp32, as the one-process run it is compared with."""
    from trl import RLOOConfig

    return RLOOConfig(
        output_dir=output,
        max_steps=STEPS,
        per_device_train_batch_size=8,
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
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        **options,
    )


def _rloo(output: str, world: int, **options: Any):
    """RLOOTrainer (tp_trainer's at tp=`world`, vocab-parallel) on examples/grpo_lora.py's LoRA model, prompts and
    reward; the reference is the policy with its adapter disabled. Records losses and completions."""
    from grpo_lora import Recorder, dataset, low_tokens, tokenizer
    from train_trainer import tiny_llama, with_lora
    from trl import RLOOTrainer

    import autotp
    from autotp.hf_trainer import tp_trainer

    torch.manual_seed(0)
    model = with_lora(tiny_llama())
    if world > 1:
        autotp.wrap(model.base_model.model, tp_size=world, vocab_parallel=True)
    base = tp_trainer(RLOOTrainer) if world > 1 else RLOOTrainer
    trainer = type("RecordingRLOO", (Recorder, base), {})(
        model=model,
        reward_funcs=low_tokens,
        args=rloo_config(output, **options),
        train_dataset=dataset(256),
        processing_class=tokenizer(256),
    )
    return trainer


def rloo_run(rank: int, world: int, output: str) -> dict:
    """RLOO for STEPS steps on one process (`world` 1) or at tp=`world` with a vocab-parallel LM head."""
    if world > 1:
        _as_ranks(rank, world)
    trainer = _rloo(output, world)
    probe = Sizes()
    trainer._generate_single_turn = probe.pausing(trainer._generate_single_turn)
    return _train(
        trainer, output, probe, completions=trainer.completions, forwards=[forward_name(trainer.model.base_model.model)]
    )


def rloo_refusals(rank: int, world: int, output: str) -> str:
    """What tp_trainer(RLOOTrainer) at tp=`world` says of `normalize_advantages=True`, whose std over every process
    would count each completion tp times."""
    _as_ranks(rank, world)
    try:
        _rloo(output, world, normalize_advantages=True)
    except ValueError as error:
        return str(error)
    return "built"
