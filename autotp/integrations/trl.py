"""What `AutoTPTrainer` (`autotp.hf_trainer`) does for TRL's trainers only, called from its methods.

TRL's GRPO counts every process as a replica in its generation batch, deals generation batches over processes,
and evaluates each prompt repeated once per completion; here only DP replicas are replicas, and the TP ranks of
one replica read the same batches (GRPO's generation metrics are counted once per replica: `replica_metrics`).
TRL's fused-LM-head patch reads `lm_head.weight` whole, which vocab parallelism splits, so under vocab parallelism
autotp's own fused head takes its place (`autotp.integrations.fused_head`).
"""

from __future__ import annotations

import math
from typing import Any

from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler
from transformers import Trainer

from ..accessors import dp_rank, dp_size
from ..compat import trainer as trainer_compat
from ..mesh import group_size
from ..pp.own_loss import pipeline_size
from ..state import find_state, state_of, wrapped_model
from .fused_head import make_vocab_parallel
from .replica_metrics import count_replicas_once


def generates(trainer: Trainer) -> bool:
    """Whether `trainer` trains on generation batches (TRL's GRPO: `steps_per_generation` in its arguments)."""
    return getattr(trainer.args, "steps_per_generation", None) is not None


def check_trl_setup(trainer: Trainer) -> None:
    """At construction: a fused LM head under vocab parallelism made vocab-parallel (the policy's and a wrapped
    reference model's); count DP replicas only in GRPO's and RLOO's generation batch; TP x CP (the ranks that read
    one batch) where TRL's DPO, KTO, SFT and reward trainers divide their `num_tokens` metric, summed over every
    process, by the TP size (they read it from accelerate, which knows neither)."""
    if hasattr(trainer, "_tp_size"):
        batch_groups = state_of(trainer.model).batch_groups()
        trainer._tp_size = trainer.get_tp_size() * math.prod(group_size(group) for _, group in batch_groups)
    for candidate in (trainer.model, getattr(trainer, "ref_model", None)):
        model = wrapped_model(candidate) if candidate is not None else None
        if model is None:
            continue
        forward = vars(model).get("forward")
        state = find_state(model) if fused_head(forward) is not None else None
        if state is not None and state.plan.vocab is not None:
            make_vocab_parallel(model, state, forward, type(trainer).__name__)
    if generates(trainer):
        _count_replicas_in_generation_batch(trainer)
        count_replicas_once(trainer)


def _count_replicas_in_generation_batch(trainer: Trainer) -> None:
    """TRL's GRPO and RLOO counted every process as a replica in `generation_batch_size`: DP replicas only. Their
    gathers over every process then hold each replica's rewards tp times, right per whole prompt group only."""
    args, local = trainer.args, trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
    args.generation_batch_size = local * dp_size(trainer.model)
    whole = [
        f"{name}={value!r}"
        for name, value, std in (
            ("scale_rewards", getattr(args, "scale_rewards", None), "batch"),
            ("multi_objective_aggregation", getattr(args, "multi_objective_aggregation", None), "normalize_then_sum"),
            ("normalize_advantages", getattr(args, "normalize_advantages", None), True),
        )
        if value == std
    ]
    if (trainer.get_tp_size() > 1 or pipeline_size(trainer.model) > 1) and (whole or local % trainer.num_generations):
        name = type(trainer).__name__
        raise ValueError(
            f"autotp: TRL's {name} gathers rewards over every process, where TP and PP ranks repeat their "
            "replica's: "
            + (
                f"{' and '.join(whole)} take a std over all of them (GRPO: use "
                "scale_rewards='group', the default; RLOO: normalize_advantages=False, the default)"
                if whole
                else f"each replica's {local} completions at a time (per_device_train_batch_size x steps_per_"
                f"generation) must hold whole groups of num_generations={trainer.num_generations}"
            )
        )


def adds_aux_loss(trainer: Trainer) -> bool:
    """TRL's SFTTrainer on a MoE model with its load-balancing loss on: it divides the summed token losses by
    `num_items_in_batch`, then adds the aux loss, a mean over this replica's tokens. Scaling that sum by the DP size
    (as DDP's average needs of the token part) would scale the aux loss too, and weigh it DP times one process's."""
    return bool(getattr(trainer, "aux_loss_enabled", False)) and any(
        cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.") for cls in type(trainer).__mro__
    )


def generation_loader(trainer: Trainer, dataset: Dataset, sampler: Sampler) -> DataLoader:
    """GRPO's training data: `sampler`'s generation batches (`steps_per_generation` steps each), dealt over DP."""
    size = trainer_compat.train_batch_size(trainer) * trainer.args.steps_per_generation
    return dealt(trainer, dataset, sampler, size, "training")


def grpo_eval_loader(trainer: Trainer, dataset: Dataset, description: str) -> DataLoader | None:
    """GRPO's evaluation data (its own sampler repeats each prompt once per completion), dealt over DP replicas;
    None for any other trainer."""
    groups = getattr(trainer, "num_generations_eval", None)
    if groups is None:
        return None
    dp, size = dp_size(trainer.model), trainer.args.eval_batch_size
    if len(dataset) * groups % (size * dp if dp > 1 else 1) or size % groups and trainer.get_tp_size() > 1:
        raise ValueError(
            f"autotp: GRPO evaluates {len(dataset)} prompts x {groups} completions in batches of "
            f"{size}, which must hold whole groups at tp > 1 and split evenly over DP replicas"
        )
    return dealt(trainer, dataset, trainer_compat.eval_sampler(trainer, dataset), size, description)


def dealt(trainer: Trainer, dataset: Dataset, sampler: Sampler, batch_size: int, description: str) -> DataLoader:
    """`sampler`'s batches dealt over DP replicas in turn, as accelerate's over processes; TP ranks alike (GRPO)."""
    batches = BatchSamplerShard(
        BatchSampler(sampler, batch_size, drop_last=False),
        dp_size(trainer.model),
        dp_rank(trainer.model),
        even_batches=False,
    )
    return DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=trainer_compat.collator(trainer, description),
        num_workers=trainer.args.dataloader_num_workers,
        pin_memory=trainer.args.dataloader_pin_memory,
    )


def fused_head(forward: Any) -> str | None:
    """Where a forward that a fused-LM-head patch (TRL's `add_fused_lm_head`) put on a model was defined, else None.

    The patch copies the original forward's name (functools.wraps), so its code object tells."""
    while forward is not None:
        function = getattr(forward, "__func__", forward)  # a bound method's function
        code = getattr(function, "__code__", None)
        if code is not None and "fused" in code.co_name:
            return f"{code.co_name} in {code.co_filename}"
        forward = getattr(function, "__wrapped__", None)
    return None
