"""TRL's SFTTrainer (padded and packed), DPOTrainer and GRPOTrainer under a pipeline, for
tests/integrations/test_trl_pipeline.py (a helper module beside it, not a test module).

Each run is `tp_trainer(...)` on examples/train_trainer.py's tiny Llama (2 layers: one a stage at pp 2) wrapped at
pp x tp, or TRL's own trainer in one process (pp 0), as a user runs either. It returns every step's loss, what TRL
logged at each step, and the trained weights as `save_model` writes them (full tensors, every stage's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

STEPS = 3
LENGTHS = [12, 20, 9, 16, 17, 11, 14, 19, 10, 15, 13, 18]  # ragged: padding and the token count matter


def _as_rank(rank: int, world: int) -> None:
    """This forked rank as a fresh torchrun rank looks to accelerate."""
    from accelerate.state import PartialState

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    PartialState._reset_state()


def _policy(pp: int, tp: int, seed: int = 0) -> torch.nn.Module:
    from train_trainer import tiny_llama

    import autotp

    torch.manual_seed(seed)
    model = tiny_llama()
    if pp:
        autotp.wrap(model, tp_size=tp, pp_size=pp)
    return model


class OneProcessOrder:
    """Mixed into TRL's own trainer in one process: it reads the batches in autotp's sampler's order (a one-replica
    DistributedSampler with the same seed), as a user comparing the two would set it."""

    def _get_train_sampler(self, train_dataset=None):
        from torch.utils.data import DistributedSampler

        return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)


def _trainer(name: str, trl_class: type, pp: int) -> type:
    """`tp_trainer(trl_class)` under a pipeline, else TRL's own in one process; recording each step's loss."""
    from train_trainer import LossRecorder

    from autotp.hf_trainer import tp_trainer

    return type(name, (LossRecorder, tp_trainer(trl_class)) if pp else (LossRecorder, OneProcessOrder, trl_class), {})


def _result(trainer: Any, output: str) -> dict:
    """Losses, TRL's per-step logs, the saved weights (every stage's, full tensors)."""
    from safetensors.torch import load_file

    trainer.train()
    trainer.save_model(output)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    return {"losses": trainer.losses, "logs": logs, "weights": load_file(str(Path(output, "model.safetensors")))}


def sft_data(vocab: int):
    """Already tokenized sequences of several lengths (SFTTrainer then skips tokenizing)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    return Dataset.from_dict(
        {"input_ids": [torch.randint(2, vocab, (n,), generator=generator).tolist() for n in LENGTHS]}
    )


def sft(output: str, pp: int, tp: int, packed: bool) -> dict:
    """SFTTrainer, 4 rows a step (2 micro-batches at pp 2), AdamW, Trainer's clipping at 1.0, fp32. `packed`: TRL's
    'wrapped' packing into rows of 16 tokens (the 'bfd' packing puts a batch in one row, refused under a pipeline)."""
    from sft_lora import tokenizer
    from trl import SFTConfig, SFTTrainer

    packing = {"packing": True, "packing_strategy": "wrapped", "max_length": 16} if packed else {"max_length": 32}
    args = SFTConfig(
        output_dir=output,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        bf16=False,
        dataloader_drop_last=True,  # the packed rows' epoch ends in an odd batch
        **packing,
    )
    trainer = _trainer("RecordingSFT", SFTTrainer, pp)(
        model=_policy(pp, tp), args=args, train_dataset=sft_data(256), processing_class=tokenizer(256)
    )
    return _result(trainer, output)


def dpo(output: str, pp: int, tp: int, **options: Any) -> Any:
    """DPOTrainer (trl_runs.py's settings and preference pairs), 2 accumulation steps of 2 pairs a step (one pair a
    micro-batch at pp 2), full fine-tuning against a separate, unwrapped reference model. With `options`: the trainer
    built, or its refusal."""
    from grpo_lora import tokenizer
    from train_trainer import tiny_llama
    from trl import DPOTrainer

    from trl_runs import dpo_config, preferences

    policy = _policy(pp, tp)
    torch.manual_seed(1)  # a reference unlike the policy, so the first step's rewards are not zero already
    reference = tiny_llama()
    args = dpo_config(output)
    args.gradient_accumulation_steps = 2  # DPO's loss is divided for accumulation by Trainer, not by itself
    for key, value in options.items():
        setattr(args, key, value)
    build = _trainer("RecordingDPO", DPOTrainer, pp)
    kwargs = {"args": args, "train_dataset": preferences(256), "processing_class": tokenizer(256)}
    if options:
        try:
            build(model=policy, ref_model=reference, **kwargs)
        except NotImplementedError as error:
            return str(error)
        return "built"
    return _result(build(model=policy, ref_model=reference, **kwargs), output)


def grpo(output: str, pp: int, tp: int, **options: Any) -> Any:
    """examples/grpo_lora.py's GRPO settings (8 completions a step, 2 prompts x 4, 8 tokens at most, sampled by the
    model itself at temperature 0.1; fp32) without the KL term (`beta` 0, GRPOConfig's default), full fine-tuning; 4
    completions a micro-batch at pp 2. TRL's own GRPOTrainer in one process (its own sampler: autotp reads it too).
    With `options`: the trainer's refusal."""
    from grpo_lora import Recorder, config, dataset, low_tokens, tokenizer
    from trl import GRPOTrainer

    from autotp.hf_trainer import tp_trainer

    args = config(output, STEPS)
    args.beta = 0.0
    # the second step's advantages are nearly zero (loss ~1e-8): at Adam's epsilon 1e-6 its step would be the
    # normalised fp32 noise of near-zero gradients, which differs with any change of summation order; 1e-3 keeps the
    # real gradients (~1e-2 a weight) normalised and that noise small
    args.adam_epsilon = 1e-3
    for key, value in options.items():
        setattr(args, key, value)
    base = tp_trainer(GRPOTrainer) if pp else GRPOTrainer
    build = type("RecordingGRPO", (Recorder, base), {})
    kwargs = {
        "reward_funcs": low_tokens,
        "args": args,
        "train_dataset": dataset(256),
        "processing_class": tokenizer(256),
    }
    if options:
        try:
            build(model=_policy(pp, tp), **kwargs)
        except NotImplementedError as error:
            return str(error)
        return "built"
    trainer = build(model=_policy(pp, tp), **kwargs)
    return {**_result(trainer, output), "completions": trainer.completions}


def refusals(pp: int, tp: int, output: str) -> dict[str, str]:
    """What `tp_trainer(...)` at pp x tp says of trainers and options whose loss a pipeline cannot run."""
    from sft_lora import tokenizer
    from trl import SFTConfig, SFTTrainer

    from autotp.hf_trainer import tp_trainer

    class Doubled(tp_trainer(SFTTrainer)):  # a user's loss: autotp cannot know how it adds up over micro-batches
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            return super().compute_loss(*args, **kwargs) * 2

    said = {"aot": dpo(output, pp, tp, loss_type=["aot"]), "sft loss": dpo(output, pp, tp, loss_type=["sft"])}
    said["grpo quantile"] = grpo(output, pp, tp, top_entropy_quantile=0.5)
    config = SFTConfig(output_dir=output, report_to=[], use_cpu=True, bf16=False, max_length=32)
    data = {"train_dataset": sft_data(256), "eval_dataset": sft_data(256), "processing_class": tokenizer(256)}
    try:  # evaluation calls TRL's fused head outside a training step: it would run only this rank's layers
        tp_trainer(SFTTrainer)(model=_policy(pp, tp), args=config, **data).evaluate()
        said["evaluate"] = "evaluated"
    except NotImplementedError as error:
        said["evaluate"] = str(error)
    for name, build, options in (("subclass", Doubled, {}), ("bfd", tp_trainer(SFTTrainer), {"packing": True})):
        for key, value in options.items():
            setattr(config, key, value)
        try:
            build(model=_policy(pp, tp), args=config, **data)
            said[name] = "built"
        except NotImplementedError as error:
            said[name] = str(error)
    return said


def pipeline_runs(rank: int, world: int, output: str, pp: int, refused: bool) -> dict:
    """Every run at pp x (world / pp), in one spawn: SFT padded and packed, DPO, and (`refused`) the refusals."""
    _as_rank(rank, world)
    tp = world // pp
    return {
        "sft": sft(f"{output}/sft", pp, tp, packed=False),
        "packed": sft(f"{output}/packed", pp, tp, packed=True),
        "dpo": dpo(f"{output}/dpo", pp, tp),
        "grpo": grpo(f"{output}/grpo", pp, tp),
        "refused": refusals(pp, tp, f"{output}/refused") if refused else None,
    }


def one_process(output: str) -> dict:
    """The same runs with TRL's own trainers in this process."""
    return {
        "sft": sft(f"{output}/sft", 0, 1, packed=False),
        "packed": sft(f"{output}/packed", 0, 1, packed=True),
        "dpo": dpo(f"{output}/dpo", 0, 1),
        "grpo": grpo(f"{output}/grpo", 0, 1),
    }
