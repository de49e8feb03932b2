"""The accessors: a wrapped model's groups, ranks and sizes along each axis of its mesh (`autotp.mesh`).

Each takes the model; without one it uses the only wrapped model alive in the process (`autotp.state.state_of`),
and refuses when there are several rather than guess.
"""

from __future__ import annotations

from torch import nn

from .mesh import Group, group_rank, group_size
from .state import state_of


def tp_group(model: nn.Module | None = None) -> Group:
    """The TP group of `model` (or of the only wrapped model alive in this process); None when tp=1."""
    return state_of(model).tp_group


def dp_group(model: nn.Module | None = None) -> Group:
    """The data-parallel group: the replicas reading different batches (same TP and CP rank); this rank alone when
    there is one replica, so `dist.all_reduce(x, group=dp_group(model))` works at every size. Without context
    parallelism it is also the group holding the same shards, for `DistributedDataParallel(model,
    process_group=dp_group(model))`; with it, use `dp_cp_group`. None only for a tp_size=1 wrap without
    torch.distributed initialised."""
    return state_of(model).dp_group


def dp_cp_group(model: nn.Module | None = None) -> Group:
    """The ranks holding the same shards, DP x CP: gradients are averaged over it (`allreduce_gradients`, DDP's
    `process_group`), and `autotp.fully_shard` shards over it. Equals `dp_group` at cp_size 1."""
    return state_of(model).grad_group


def cp_group(model: nn.Module | None = None) -> Group:
    """The context-parallel group: the ranks splitting one sequence; None at cp_size 1."""
    return state_of(model).cp_group


def cp_rank(model: nn.Module | None = None) -> int:
    return group_rank(cp_group(model))


def cp_size(model: nn.Module | None = None) -> int:
    return group_size(cp_group(model))


def tp_rank(model: nn.Module | None = None) -> int:
    return group_rank(tp_group(model))


def tp_size(model: nn.Module | None = None) -> int:
    return group_size(tp_group(model))


def dp_rank(model: nn.Module | None = None) -> int:
    return group_rank(dp_group(model))


def dp_size(model: nn.Module | None = None) -> int:
    return group_size(dp_group(model))


def ep_group(model: nn.Module | None = None) -> Group:
    """The expert-parallel group: the ranks splitting each MoE layer's experts (`autotp.ep`); None at ep_size 1."""
    return state_of(model).mesh.group("ep")


def ep_rank(model: nn.Module | None = None) -> int:
    return group_rank(ep_group(model))


def ep_size(model: nn.Module | None = None) -> int:
    return group_size(ep_group(model))
