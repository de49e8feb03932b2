"""Optimizer steps counted per watched parameter, so that code computing from a parameter after the forward (the
chunked loss's logits, computed when first read) can tell that it changed since.

A parameter's version counter sees every in-place write autograd sees (a foreach optimizer, `p.add_` under
no_grad), but torch's fused optimizers (`AdamW(fused=True)`) write without bumping it; every `torch.optim`
optimizer's `step` runs the global step pre-hooks, which count here the steps of the optimizers that hold a watched
parameter. A write through `.data` outside an optimizer is seen by neither.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

_STEPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # watched parameter -> optimizer steps that held it
_HOOK: list[Any] = []  # the global hook's handle, once registered


def _count(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _STEPS:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for param in list(_STEPS.keys()):
        if id(param) in held:
            _STEPS[param] += 1


def watch(param: torch.Tensor) -> None:
    """Count the optimizer steps that update `param` from now on (kept while `param` lives)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_count))
    _STEPS.setdefault(param, 0)


def stamp(params: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    """What changes when any of `params` (watched) is written in place or stepped by an optimizer."""
    return tuple(n for p in params if p is not None for n in (p._version, _STEPS.get(p, 0)))
