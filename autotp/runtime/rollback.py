"""Undoing a failed `wrap`: everything it changes on a model, captured without copying a tensor.

`wrap` replaces submodules, parameters and attributes, and adds hooks: all of it lives in the
modules' own dictionaries, so a shallow copy of each dictionary is enough to put the model back.
Hooks on tensors (gradient sums on parameters that stay) are handed in as they are made, and the
random generators that the TP ranks synchronise are restored too.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from . import process_hooks
from .rng import capture, restore


class Removable(Protocol):
    def remove(self) -> None: ...


class Snapshot:
    """The state of every module of a model, to restore in place if sharding it fails halfway."""

    def __init__(self, model: nn.Module):
        self._modules = [(vars(m), dict(vars(m)), _containers(m)) for m in model.modules()]
        # a parameter kept as it is (tp 1) is tagged (`autotp_shard`): its attributes, not its values
        self._params = [(vars(p), dict(vars(p))) for p in model.parameters()]
        self._rng = capture()
        self._mark = process_hooks.mark()  # what it installs outside the model, undone first
        self._handles: list[Removable] = []

    def track(self, handles: list[Removable]) -> None:
        """Hooks put on tensors the model keeps (module hooks are restored with the modules)."""
        self._handles += handles

    def restore(self) -> None:
        process_hooks.undo_since(self._mark)
        for handle in reversed(self._handles):
            handle.remove()
        for attributes, saved, containers in self._modules:
            for container, contents in containers:  # in place: hook handles hold these very objects
                container.clear()
                container.update(contents)
            attributes.clear()
            attributes.update(saved)
        for attributes, saved in self._params:
            attributes.clear()
            attributes.update(saved)
        restore(self._rng)


def _containers(module: nn.Module) -> list[tuple[dict | set, dict | set]]:
    """The dicts and sets a module keeps its parameters, submodules, buffers and hooks in, with copies."""
    return [(value, type(value)(value)) for value in vars(module).values() if isinstance(value, (dict, set))]
