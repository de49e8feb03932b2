"""State-space mixers on a shard (`autotp.planning.mixers`): a constant buffer sliced per forward, a gated norm whose
groups span ranks, and a row layer whose summed output the sharded channels read again (their parameters sharded in
place are `autotp.tp.inplace`'s).

The mixer keeps its class and transformers' forward: its linears are the plan's column and row layers, its head
counts the plan's attributes; what is here is the rest, each switched off while the model is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh import Group, group_rank
from ..planning.plan import GroupNormPlan, ParamPlan
from ..runtime.collectives import copy_to_tp, reduce_from_tp


def slice_buffer(module: nn.Module, plan: ParamPlan, rank: int, state) -> None:
    """A constant buffer (Falcon-H1's mup_vector) read by a sharded forward as this rank's rows: sliced as the forward
    starts and put back as it ends (raised included), so the module holds the full one otherwise (a later load or
    init writes it; the gathered model reads it)."""
    held: list[torch.Tensor] = []

    def enter(mod: nn.Module, args) -> None:
        full = getattr(mod, plan.name)
        held.append(full)
        setattr(mod, plan.name, plan.partition.shard(full, rank))

    def leave(mod: nn.Module, args, output) -> None:
        if held:
            setattr(mod, plan.name, held.pop())

    module.register_forward_pre_hook(state.sharded_only(enter))
    module.register_forward_hook(leave, always_call=True)


class GroupStatNorm:
    """A gated RMS norm (Mamba-2's) on a shard of one group's channels: the group's sum of squares is summed over TP,
    so each rank normalises by the whole group's statistics, as one process does. Gathered, the norm's own forward."""

    def __init__(self, norm: nn.Module, plan: GroupNormPlan, group: Group):
        self.norm, self.plan, self.group = norm, plan, group
        self.index = plan.group[group_rank(group)]
        self.partition_()

    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        norm, plan = self.norm, self.plan
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if gate is not None:
            x = x * F.silu(gate.to(torch.float32))
        squares = x.pow(2).sum(-1, keepdim=True)
        by_group = F.pad(squares, (self.index, plan.groups - self.index - 1))  # this rank's sum at its group
        summed = copy_to_tp(reduce_from_tp(by_group, self.group), self.group)  # every rank's, gradients summed back
        variance = summed[..., self.index : self.index + 1] / plan.group_size
        x = x * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * x.to(dtype)

    def gather_(self) -> None:
        self.norm.__dict__.pop("forward", None)

    def partition_(self) -> None:
        self.norm.forward = self.forward


def reenter(group: Group):
    """A forward hook: a row layer's summed output enters the TP span again (its gradient, partial on each rank
    since each reads it for its own channels, is summed)."""

    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(output, group)

    return hook
