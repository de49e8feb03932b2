"""A backward inside `autotp.GatherReplacedLayerParams` at ep > 1, refused by name before any gradient lands.

Inside the context every rank holds every expert (`ExpertRegion.gather_`). A gradient computed there is full-size,
(4, 64, 64) against the (2, 64, 64) the rank holds after it, which AdamW then fails on; and at dp > 1 it would hold
only this rank's tokens, never summed over the EP group as the dispatch's all-to-all sums them. The dense layers'
gradients are sliced onto their shards on exit, but the experts' cannot be, so the backward is refused.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils import _pytree as pytree


class GatheredBackwardRefusal:
    """In `TPState.regions` (gathered and partitioned with them): while gathered, tensor hooks that raise, naming an
    expert parameter and its shapes, on the model's outputs (the first node any backward runs, so nothing lands) and,
    for a submodule called on its own, on every trainable expert parameter."""

    def __init__(self, model: nn.Module, experts):
        self.model, self.experts = model, experts
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []

    def gather_(self) -> None:
        trainable = [
            (region, name)
            for region in self.experts.regions
            for name in region.names
            if region.module.get_parameter(name).requires_grad
        ]
        if not trainable:  # frozen experts: the backward reaches no expert gradient, the dense ones are sliced
            return
        self.hooks.append(self.model.register_forward_hook(partial(self._hook_outputs, self._message(*trainable[0]))))
        for region, name in trainable:
            param = region.module.get_parameter(name)
            self.hooks.append(param.register_hook(partial(self._refuse, self._message(region, name))))

    def partition_(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()

    def _message(self, region, name: str) -> str:
        full = tuple(region.module.get_parameter(name).shape)
        held = (full[0] * region.local // region.total, *full[1:])
        return (
            f"backward inside autotp.GatherReplacedLayerParams at ep_size={self.experts.size}: the experts are "
            f"gathered whole there ({region.path}.{name}: {full}, of which this rank holds {held}, {region.local} "
            f"of the {region.total} experts), so their gradients would be full-size and, at dp > 1, hold only "
            f"this rank's tokens; autotp cannot put them back on this rank's experts. Run forward and backward "
            f"outside the context (or the forward under torch.no_grad inside it)"
        )

    def _hook_outputs(self, message: str, module: nn.Module, args, output):
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(partial(self._refuse, message))

    @staticmethod
    def _refuse(message: str, grad: torch.Tensor) -> None:
        raise RuntimeError(message)
