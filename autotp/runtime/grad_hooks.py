"""Gradient hooks: the sums a replicated parameter's gradient needs over the ranks that computed parts of it.

Per-head norms see only this rank's heads, and a KV head held by several ranks gets a share of its
gradient from each: both are summed here, on whichever tensor holds the parameter when it runs.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..mesh import Group, group_size
from ..planning.sharding import Partition
from .collectives import all_reduce


def grad_allreduce_hook(group: Group) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gradient hook for a replicated parameter that only sees this rank's heads (per-head norms).

    Its true gradient is the sum of every rank's partial one. Registered through `TPState.sharded_only`: gathered,
    every rank already computes the whole gradient.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if group_size(group) == 1:
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, group)
        return grad

    return hook


def replica_grad_hook(
    partition: Partition, rank: int, groups: Mapping[tuple[int, ...], Group]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gradient hook for rows several ranks hold (a replicated KV head): sum each over its holders.

    Each holder computes only its own query heads' share of that head's gradient. Registered through
    `TPState.sharded_only`, as `grad_allreduce_hook`.
    """
    spans = partition.replicas(rank)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)
        for offset, length, holders in spans:
            piece = grad.narrow(partition.dim, offset, length)
            summed = piece.contiguous()
            all_reduce(summed, groups[holders])
            piece.copy_(summed)
        return grad

    return hook


class GradHook:
    """A gradient hook on parameter `param` of `owner`, put on whichever tensor holds that name when `owner` runs:
    a frozen parameter takes no tensor hook until it is unfrozen, a parameter replaced by loading with
    assign=True is a new tensor, and FSDP2 computes on an unsharded copy of it (its hook then runs
    before FSDP reduces the gradient over data parallelism)."""

    def __init__(self, owner: nn.Module, param: nn.Parameter, hook: Callable[[torch.Tensor], torch.Tensor]):
        self.owner, self.hook = owner, hook
        self.name = next(name for name, p in owner._parameters.items() if p is param)
        self._hooked: dict[int, tuple[weakref.ref, Any]] = {}  # id(tensor) -> (the tensor, its hook handle)
        self._attach(param)
        self._watch = owner.register_forward_pre_hook(self._current)

    def _attach(self, tensor: torch.Tensor) -> None:
        if not tensor.requires_grad:
            return
        held = self._hooked.get(id(tensor))
        if held is None or held[0]() is not tensor:
            self._hooked = {key: (ref, handle) for key, (ref, handle) in self._hooked.items() if ref() is not None}
            self._hooked[id(tensor)] = (weakref.ref(tensor), tensor.register_hook(self.hook))

    def _current(self, module: nn.Module, args) -> None:
        tensor = module._parameters.get(self.name)
        if tensor is not None:
            self._attach(tensor)

    def remove(self) -> None:
        self._watch.remove()
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked = {}
