"""What a block drops after each call, dropped also when the model's forward raised before the block's own hook ran.

A block's forward hook clears what it kept for one call (its entry's input and outputs, the TP span's per-rank seed),
but forward hooks do not run when the forward raises: a step retried after an out-of-memory error would find the failed
step's activations still held, and the random stream on the rank's seed. torch's `always_call` hooks run then too, but
one on each block makes dynamo guard on that hook's id, so a model whose decoder layers are compiled one by one
(`layer.compile()`) would be compiled again for every layer. The cleanups are therefore run by one `always_call` hook
on the module that runs the layers: the parent of the outermost module list (or dict, or Sequential) on the way to the
block, which exists once per model. It runs after every forward of that module, raised or not; each cleanup does
nothing when the block's own hook already ran.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class ForwardEnd:
    """The `always_call` forward hook of one module (kept as its `autotp_forward_end`): the cleanups of the blocks it
    runs. Deep-copied with the model, it calls the copy's."""

    def __init__(self) -> None:
        self.cleanups: list[Callable[[], None]] = []

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        for cleanup in self.cleanups:
            cleanup()


def after_every_forward(model: nn.Module, path: str, cleanup: Callable[[], None]) -> None:
    """Run `cleanup` after every forward of the module that runs the block at `path` of `model`, one that raised
    included (see the module docstring); the block itself where no module list holds it."""
    holder = runner(model, path)
    end = vars(holder).get("autotp_forward_end")
    if end is None:
        end = holder.autotp_forward_end = ForwardEnd()
        holder.register_forward_hook(end, always_call=True)
    end.cleanups.append(cleanup)


def runner(model: nn.Module, path: str) -> nn.Module:
    """The module that calls the repeated unit holding `path`: the parent of the outermost container on the way."""
    module = model
    for name in path.split(".") if path else []:
        child = module.get_submodule(name)
        if isinstance(child, _CONTAINERS):
            return module
        module = child
    return module
