"""Slots of modules autotp replaced or split, watched so that a module swapped in after `wrap` is seen at once.

A swapped module would run on this rank's shard (or experts) alone and give silently wrong results; each dimension
says what a swap means (`changed`): tensor parallelism adapts PEFT's LoRA or refuses (`autotp.integrations.guards`),
expert parallelism refuses (`autotp.ep.guard`).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class SlotGuard:
    """Forward pre-hook watching named slots of one block: `changed(path, current, original)` runs for each slot that
    no longer holds its module, or that holds one carrying the attribute `recheck`. One dict lookup a slot.

    Hooks sit on the parent blocks, not on the model: PEFT calls the model's `forward` directly, which skips the
    model's own hooks, while blocks are still called as modules. Slots of the model itself (the LM head) are watched
    from the input embedding, which every forward runs first.
    """

    recheck: str | None = None

    def __init__(self, parent: nn.Module, parent_path: str, slots: dict[str, nn.Module], carrier: nn.Module):
        self.parent, self.parent_path, self.slots = parent, parent_path, slots
        self.handle = carrier.register_forward_pre_hook(self)

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for name, layer in self.slots.items():
            current = self.parent._modules.get(name)
            if current is layer and (self.recheck is None or not hasattr(layer, self.recheck)):
                continue  # and no path built: torch.compile would guard on each block's own string and recompile
            self.changed(self.path(name), current, layer)

    def changed(self, path: str, current: nn.Module | None, original: nn.Module) -> None:
        raise NotImplementedError

    def path(self, name: str) -> str:
        return f"{self.parent_path}.{name}" if self.parent_path else name

    @classmethod
    def install(cls, model: nn.Module, modules: dict[str, nn.Module], *args: Any) -> list[SlotGuard]:
        """Guard every module (path -> module) from its parent block; `args` go to each guard after its carrier."""
        by_parent: dict[str, dict[str, nn.Module]] = {}
        for path, module in modules.items():
            parent, _, name = path.rpartition(".")
            by_parent.setdefault(parent, {})[name] = module
        guards = []
        for parent, slots in by_parent.items():
            block = model.get_submodule(parent)
            carrier = (model.get_input_embeddings() or model) if block is model else block
            guards.append(cls(block, parent, slots, carrier, *args))
        return guards
