"""Parameters that several stages train: a tied embedding (the first stage's embedding, the last's head) and any
module that layers on several stages share (Zamba's shared transformer block). Each rank holds its own copy, and
its stages' backward gives only their part of the gradient, so before the step the parts are summed over the ranks
of those stages (Megatron's embedding group, for every such parameter), and `autotp.clip_grad_norm_` counts each
parameter once. Stages of one rank (a looped schedule) share the one tensor and accumulate into it, as one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Group, device_of, group_rank, named_failure, new_group
from ..runtime.collectives import any_rank
from ..runtime.rows import local_rows
from ..state import TPState
from .cut import Cut, owner, trainers


@dataclass(frozen=True)
class SharedGroup:
    """The parameters one set of PP ranks shares, by one name each that this rank's stages hold (read by name at each
    use: `autotp.fully_shard` replaces the parameters), and whether this rank counts them in the norm (the first)."""

    ranks: tuple[int, ...]  # PP ranks
    names: tuple[str, ...]
    group: Group
    counted: bool


def shared_groups(
    model: nn.Module, cut: Cut, stages: list[int], state: TPState, rank_of: Callable[[int], int]
) -> list[SharedGroup]:
    """This rank's groups of parameters that stages on several PP ranks train (`rank_of`: each stage's PP rank).
    Collective over the world (it creates the groups every pipeline needs, in one order on every rank); called with
    the whole model, before this rank's stages drop the other stages' layers."""
    pp_group = state.mesh.group("pp")
    pp, me = state.options.pp_size, group_rank(pp_group)
    stage_of, trained = owner(model, cut), trainers(model, cut)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):  # one process's order, on every rank
        names.setdefault(id(param), []).append(name)
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for key, held in names.items():
        ranks = tuple(sorted({rank_of(stage) for stage in trained[key]}))
        if len(ranks) > 1 and me in ranks:
            by_ranks.setdefault(ranks, []).append(next(n for n in held if stage_of(n) in stages))
    wanted = sorted({tuple(sorted({rank_of(s) for s in t})) for t in trained.values()} - {(r,) for r in range(pp)})
    found = []
    for ranks in wanted:  # every rank creates every pipeline's group for every set, in this order
        group = pp_group if len(ranks) == pp else None
        for pipeline in state.mesh.rank_groups("pp") if group is None else []:
            made = new_group([pipeline[r] for r in ranks], state.timeout, "PP shared-parameter group")
            group = made if dist.get_rank() in (pipeline[r] for r in ranks) else group
        if me in ranks:
            found.append(SharedGroup(ranks, tuple(by_ranks[ranks]), group, me == ranks[0]))
    return found


def sync_shared(model: nn.Module, groups: list[SharedGroup]) -> None:
    """Each shared parameter's gradient summed over the ranks of the stages that train it (a part missing where a
    stage's batch did not reach it joins as zeros; a frozen parameter takes no step)."""
    for shared in groups:
        params = [p for p in (model.get_parameter(n) for n in shared.names) if p.requires_grad]
        what = (
            f"the gradient sum of parameters several stages train ({shared.names[0]}...) over PP ranks {shared.ranks}"
        )
        for param, used in zip(
            params, any_rank([p.grad is not None for p in params], [shared.group], device_of(shared.group), what)
        ):
            if used and param.grad is None:
                param.grad = torch.zeros_like(param)
        with named_failure(shared.group, what):
            for param in params:
                if param.grad is not None:  # under FSDP: the ranks at one DP coordinate hold the same rows
                    dist.all_reduce(local_rows(param.grad)[0], group=shared.group)


def uncounted(model: nn.Module, groups: list[SharedGroup]) -> set[int]:
    """The ids of the shared parameters another rank counts in the gradient norm."""
    return {id(model.get_parameter(n)) for shared in groups if not shared.counted for n in shared.names}


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Every name of each parameter the whole model holds under several (before the stages drop each other's layers,
    when no rank would see a tie whose names lie on two stages): what a save drops as transformers does."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(held) for held in names.values() if len(held) > 1]
