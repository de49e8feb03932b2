"""The experts modules must stay in their slots: an adapter put around one after wrap (PEFT's LoRA on expert
parameters, `LoraConfig(target_parameters=[...experts...])`) would see only this EP rank's experts, and its
per-expert factors would be averaged over data parallelism as if every rank held the same experts.
"""

from __future__ import annotations

from torch import nn

from ..runtime.slot_guard import SlotGuard


class ExpertSlotGuard(SlotGuard):
    """On the block holding an experts module (the MoE block, called as a module every forward): refuses by name once
    that slot holds anything else (`autotp.runtime.slot_guard`)."""

    def __init__(self, parent: nn.Module, parent_path: str, slots: dict[str, nn.Module], carrier: nn.Module, ep: int):
        super().__init__(parent, parent_path, slots, carrier)
        self.ep = ep

    def changed(self, path: str, current: nn.Module | None, original: nn.Module) -> None:
        raise NotImplementedError(
            f"autotp: {path} was replaced after wrap by {type(current).__module__}."
            f"{type(current).__qualname__}: an adapter on the experts at ep_size={self.ep} is not supported yet "
            f"(each rank holds only its experts, and the adapter's per-expert factors would be synced as dense "
            f"ones). Put LoRA on the attention or dense projections (target_modules), or train expert adapters "
            f"at ep_size=1"
        )


def guard_expert_slots(model: nn.Module, paths: list[str], ep: int) -> None:
    """An `ExpertSlotGuard` for the experts modules at `paths` of `model`, from their blocks."""
    ExpertSlotGuard.install(model, {path: model.get_submodule(path) for path in paths}, ep)
