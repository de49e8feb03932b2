"""TRL's SFTTrainer and GRPOTrainer on a tiny Qwen3-MoE (4 experts, hidden 64), in one process or on spawned ranks at
tp x ep, for tests/integrations/test_trl_expert_parallel.py (a helper module beside it, not a test module).

Each run returns what the test compares with one process: every step's loss, what TRL logged, and the trained
parameters as full tensors (the experts gathered over EP, TP shards over TP; under PEFT, the adapters only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

STEPS = 3
GLOBAL_BATCH = 4  # SFT: sequences a step, over every DP replica
LENGTHS = [12, 20, 9, 16, 17, 11, 14, 19, 10, 15, 13, 18]  # ragged: padding and the global token count matter
ATTENTION = ["q_proj", "v_proj"]  # LoRA on attention only: adapters on the experts are refused at ep > 1


def _as_rank(rank: int, world: int) -> None:
    """This forked rank as a fresh torchrun rank looks to accelerate."""
    from accelerate.state import PartialState

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    PartialState._reset_state()


def _moe(tp: int, ep: int, adapters: bool = False, timeout: float | None = None) -> torch.nn.Module:
    """tests/ep's tiny qwen3_moe (seed 0), LoRA on attention first when `adapters` (seed 1, lora_B non-zero), then
    `autotp.wrap` at tp x ep inside it (ep 0: one process, not wrapped)."""
    import autotp
    from ep_workers import moe_model

    model = moe_model("qwen3_moe")
    if adapters:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, lora_dropout=0.0))
    if ep:
        options = {} if timeout is None else {"timeout": timeout}
        autotp.wrap(model.base_model.model if adapters else model, tp, ep_size=ep, **options)
    return model


def _params(model: torch.nn.Module, ep: int, trainable: bool = False) -> dict[str, torch.Tensor]:
    """Every (trainable) parameter as a full tensor, under its one-process name."""
    from autotp.state import wrapped_model
    from ep_workers import whole

    inner = wrapped_model(model) if ep else None
    return {
        n: (whole(p, p, inner) if ep else p.detach().clone())
        for n, p in model.named_parameters()
        if p.requires_grad or not trainable
    }


def sft_data(vocab: int, alike: bool = False):
    """Already tokenized sequences of several lengths (SFTTrainer then skips tokenizing), no pad or eos token; with
    `alike`, the first one 12 times (every replica's rows then have the whole batch's router statistics)."""
    from datasets import Dataset

    from models import batch

    rows = [
        batch(vocab, size=(1, n), seed=0 if alike else i)[0].clamp(min=2).tolist()
        for i, n in enumerate([LENGTHS[0]] * len(LENGTHS) if alike else LENGTHS)
    ]
    return Dataset.from_dict({"input_ids": rows})


def sft_run(rank: int, world: int, output: str, tp: int, ep: int, aux: bool = True, alike: bool = False) -> dict:
    """SFTTrainer for STEPS steps (global batch 4, AdamW, Trainer's clipping at 1.0): at ep 0 TRL's own trainer in one
    process reading the global batches in autotp's DP sampler's order (a one-replica DistributedSampler), else
    `tp_trainer(SFTTrainer)` on the model wrapped at tp x ep, each DP replica its share of every global batch.
    `aux`: TRL's MoE load-balancing loss at the config's coefficient (1e-3), else `router_aux_loss_coef=0.0`."""
    from sft_lora import tokenizer
    from torch.utils.data import DistributedSampler
    from train_trainer import LossRecorder
    from trl import SFTConfig, SFTTrainer

    import autotp
    from autotp.hf_trainer import tp_trainer

    _as_rank(rank, world)

    class OneProcessSFT(LossRecorder, SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)

    class ExpertParallelSFT(LossRecorder, tp_trainer(SFTTrainer)):
        pass

    model = _moe(tp, ep)
    replicas = autotp.dp_size(model) if ep else 1
    args = SFTConfig(
        output_dir=output,
        max_steps=STEPS,
        per_device_train_batch_size=GLOBAL_BATCH // replicas,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_length=32,
        disable_tqdm=True,
        bf16=False,
        router_aux_loss_coef=None if aux else 0.0,
    )
    trainer = (ExpertParallelSFT if ep else OneProcessSFT)(
        model=model,
        args=args,
        train_dataset=sft_data(model.config.vocab_size, alike),
        processing_class=tokenizer(model.config.vocab_size),
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"losses": trainer.losses, "logs": logs, "params": _params(model, ep)}


def grpo_run(rank: int, world: int, output: str, tp: int, ep: int, eos: int | None = None) -> dict:
    """examples/grpo_lora.py's GRPO (8 completions a step, 2 prompts x 4, sampled by the model itself at temperature
    0.1; KL against the starting adapter; fp32) on the tiny MoE with LoRA on attention: plain GRPOTrainer in one
    process (ep 0), or `tp_trainer(GRPOTrainer)` at tp x ep. With `eos`: one greedy step (top_k 1) of one prompt x 2
    per replica, `t{eos}` ending a completion, and a 60 s collective timeout (a rank left waiting fails, not hangs).
    Records losses, completions, logs, the adapters, and what autotp's `generate` passed on for `synced_gpus` (TRL
    calls `generate` with keyword arguments of its own)."""
    from grpo_lora import Recorder, config, dataset, low_tokens, tokenizer
    from trl import GRPOTrainer

    from autotp.hf_trainer import tp_trainer

    _as_rank(rank, world)
    torch.manual_seed(0)
    model = _moe(tp, ep, adapters=True, timeout=60 if eos is not None else None)
    synced: list[Any] = []
    if ep:  # autotp's SyncedGenerate around transformers' generate
        synced_generate = model.base_model.model.generate
        original = synced_generate.generate

        def recording(*args: Any, **kwargs: Any) -> Any:
            synced.append(kwargs.get("synced_gpus"))
            return original(*args, **kwargs)

        synced_generate.generate = recording
    args, words = config(output, STEPS), tokenizer(model.config.vocab_size)
    if eos is not None:
        args.max_steps, args.per_device_train_batch_size, args.num_generations = 1, 2, 2
        args.generation_kwargs = {"top_k": 1}
        words.eos_token = f"t{eos}"
    base = tp_trainer(GRPOTrainer) if ep else GRPOTrainer
    trainer = type("RecordingGRPO", (Recorder, base), {})(
        model=model,
        reward_funcs=low_tokens,
        args=args,
        train_dataset=dataset(model.config.vocab_size),
        processing_class=words,
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "kl" in log]
    return {
        "losses": trainer.losses,
        "completions": trainer.completions,
        "logs": logs,
        "synced": synced,
        "adapters": _params(model, ep, trainable=True),
    }
