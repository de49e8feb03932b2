"""Parameters `wrap` replaced by new objects (a shard has another shape), and the optimizers still holding the old ones.

An optimizer made before `wrap` holds the parameters it was given; where wrap put a new object in their place, no
forward reads the old one any more, so the optimizer's steps would train nothing there, silently. Where a parameter
keeps its shape (tp 1), wrap keeps the object itself (`autotp.runtime.shards.shard_parameter`), and an optimizer made
before trains it as in one process. Elsewhere its first step is refused, naming the parameter, through the one
process-wide optimizer-step pre-hook (`autotp.runtime.process_hooks.watch_optimizer_steps`); each optimizer is looked
at once, and again only when its parameter groups change size.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .process_hooks import watch_optimizer_steps


class ReplacedParameters:
    """The parameters wrap replaced, held weakly by id (an object id is reused only once its object is gone), each
    with its name and shapes; kept alive by the model's state (`TPState.replaced`)."""

    def __init__(self, replaced: dict[str, tuple[nn.Parameter, nn.Parameter]], by: str):
        self.old: dict[int, tuple[weakref.ref[nn.Parameter], str, tuple[int, ...], tuple[int, ...], str]] = {}
        self.checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, ...]] = weakref.WeakKeyDictionary()
        self.add(replaced, by)
        self.watch = watch_optimizer_steps(self, ReplacedParameters.before_step)

    def add(self, replaced: dict[str, tuple[nn.Parameter, nn.Parameter]], by: str) -> None:
        """Parameters `by` (a call: `autotp.wrap`, `autotp.fully_shard`) put new objects in place of; every optimizer
        is looked at again."""
        self.old.update(
            {
                id(old): (weakref.ref(old), name, tuple(old.shape), tuple(new.shape), by)
                for name, (old, new) in replaced.items()
            }
        )
        self.checked = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo: dict) -> ReplacedParameters:
        """A deep copy of the model (an EMA or reference model) shares it: the old parameters are the original's."""
        return self

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        sizes = tuple(len(group["params"]) for group in optimizer.param_groups)
        if self.checked.get(optimizer) == sizes:
            return
        held = [
            found
            for group in optimizer.param_groups
            for p in group["params"]
            if (found := self.old.get(id(p))) is not None and found[0]() is p
        ]
        if held:
            _, name, old, new, by = held[0]
            more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
            what = "this rank's shard" if by == "autotp.wrap" else "FSDP's parameter sharded over the DP group"
            shapes = f" ({old} -> {new})" if old != new else ""
            raise RuntimeError(
                f"autotp: this {type(optimizer).__name__} holds {name}{more} as it was before {by}, which "
                f"replaced it with {what}{shapes}: no forward reads the old parameter, so this "
                f"step would train nothing there. Make the optimizer (and its LR scheduler) after {by}, from "
                f"model.parameters()"
            )
        self.checked[optimizer] = sizes


def track_replaced(
    before: dict[str, nn.Parameter], model: nn.Module, by: str, known: ReplacedParameters | None = None
) -> ReplacedParameters | None:
    """What `before` (the model's parameters by name before `by`) held that `model` holds another object for under
    the same name, added to `known` (those an earlier call replaced); None where none was replaced (nothing is
    watched then)."""
    replaced: dict[str, tuple[nn.Parameter, nn.Parameter]] = {
        name: (before[name], p) for name, p in model.named_parameters() if name in before and before[name] is not p
    }
    if not replaced:
        return known
    if known is None:
        return ReplacedParameters(replaced, by)
    known.add(replaced, by)
    return known
