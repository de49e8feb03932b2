"""Dropout under context parallelism: this rank's tokens get the masks one process draws for the whole sequence."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .layout import Layout


class WholeSequenceDropout(TorchFunctionMode):
    """Dropout on this rank's tokens with the masks one process draws: the whole sequence's mask is drawn (every CP
    rank's generator is the same, `install`) and this rank's tokens of it kept, as sequence parallelism's
    `ChunkDropout` does. Entered for a training forward's duration."""

    def __init__(self, layout: Layout):
        super().__init__()
        self.layout = layout

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        layout = self.layout
        if not (training and 0 < p < 1) or x.dim() < 2 or x.shape[1] != layout.local.numel():
            return nn.functional.dropout(x, p, training, inplace)
        noise = x.new_empty((x.shape[0], layout.length, *x.shape[2:])).bernoulli_(1 - p).div_(1 - p)
        return x * layout.split(noise)


def dropout_on(model: nn.Module) -> bool:
    """Whether any dropout of `model` (a module or a config probability) is above 0."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or any(
        ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0 for k, v in model.config.to_dict().items()
    )
