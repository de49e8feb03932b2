"""The experts modules must stay in their slots: an adapter put around one after wrap (PEFT's LoRA on expert
parameters, `LoraConfig(target_parameters=[...experts...])`) would see only this EP rank's experts, and its
per-expert factors would be averaged over data parallelism as if every rank held the same experts.
"""

from __future__ import annotations

from torch import nn


class ExpertSlotGuard:
    """Forward pre-hook on the block holding an experts module (the MoE block, called as a module every forward):
    refuses by name once that slot holds anything else. One dict lookup a forward."""

    def __init__(self, parent: nn.Module, name: str, path: str, experts: nn.Module, ep: int):
        self.parent, self.name, self.path, self.experts, self.ep = parent, name, path, experts, ep
        parent.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        current = self.parent._modules.get(self.name)
        if current is not self.experts:
            raise NotImplementedError(
                f"autotp: {self.path} was replaced after wrap by {type(current).__module__}."
                f"{type(current).__qualname__}: an adapter on the experts at ep_size={self.ep} is not supported yet "
                f"(each rank holds only its experts, and the adapter's per-expert factors would be synced as dense "
                f"ones). Put LoRA on the attention or dense projections (target_modules), or train expert adapters "
                f"at ep_size=1")


def guard_expert_slots(model: nn.Module, paths: list[str], ep: int) -> None:
    """An `ExpertSlotGuard` for each experts module at `paths` of `model`."""
    for path in paths:
        parent, _, name = path.rpartition(".")
        ExpertSlotGuard(model.get_submodule(parent), name, path, model.get_submodule(path), ep)
