"""TRL's GRPOTrainer's generation metrics counted once per DP replica, as one process counts its batch.

TRL gathers them over every process, but every rank of a DP replica (its TP, PP and CP ranks) holds the replica's
completions: the token count (`num_tokens`) came out tp x pp x cp times one process's, and the rewards' standard
deviations (`reward_std`, `rewards/<name>/std`) were taken over the repeated values. What feeds the loss stays as TRL
gathers it: the rewards (each process takes its advantages from them at its process index) and
`num_items_in_batch` (TRL divides it by the process count).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from ..accessors import dp_group, dp_size
from .trl_pipeline import metric_gathers, trl_kind


def count_replicas_once(trainer: Trainer) -> None:
    """At construction, TRL's GRPOTrainer with ranks repeating a replica's batch: its generation's lengths and
    counts gathered over DP, its rewards' standard deviations taken over each replica's rows once."""
    if trl_kind(trainer) != "GRPOTrainer" or dp_size(trainer.model) == trainer.accelerator.num_processes:
        return  # or every process a replica of its own: TRL's gathers count each once
    group = dp_group(trainer.model)
    generate, rewards, score = trainer._generate, trainer._calculate_rewards, trainer._generate_and_score_completions
    replica_rows: list[torch.Tensor] = []

    def generate_once(prompts: list) -> Any:
        with metric_gathers(trainer, group):  # only metrics: lengths, truncation, tool calls, the token count
            return generate(prompts)

    def rewards_once(*args: Any, **kwargs: Any) -> torch.Tensor:
        gathered = rewards(*args, **kwargs)  # every process's rows, in rank order; the advantages' input, kept
        rows = gathered.shape[0] // trainer.accelerator.num_processes
        ranks = dist.get_process_group_ranks(group)  # this rank's counterpart in each replica
        replica_rows[:] = [torch.cat([gathered[r * rows : (r + 1) * rows] for r in ranks])]
        return gathered

    def score_once(*args: Any, **kwargs: Any) -> Any:
        mode = "train" if trainer.model.training else "eval"  # as TRL picks the metrics it appends to
        replica_rows.clear()
        output = score(*args, **kwargs)
        if replica_rows:
            _replace_reward_stds(trainer, trainer._metrics[mode], replica_rows[0])
        return output

    trainer._generate, trainer._calculate_rewards = generate_once, rewards_once
    trainer._generate_and_score_completions = score_once


def _replace_reward_stds(trainer: Trainer, metrics: dict[str, list[float]], rewards: torch.Tensor) -> None:
    """The standard deviations TRL just appended, of each replica's rewards once (`rewards`: rows x functions), as
    TRL computes them: each function's over the rows it scored, the weighted sum's over the rows any scored."""
    from trl.trainer.utils import nanstd  # TRL's own (a trainer of TRL's calls this)

    for i, name in enumerate(trainer.reward_func_names):
        metrics[f"rewards/{name}/std"][-1] = nanstd(rewards[:, i]).item()
    summed = (rewards * trainer.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(rewards).all(dim=1)] = math.nan
    metrics["reward_std"][-1] = nanstd(summed).item()
