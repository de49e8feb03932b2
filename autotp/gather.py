"""`GatherReplacedLayerParams`: full weights for evaluation, export or loading, then shards again."""

from __future__ import annotations

from torch import nn

from .apply import set_gathered
from .state import find_state


class GatherReplacedLayerParams:
    """Inside, every replaced layer holds its full weight and runs as a plain `nn.Linear`.

    Every rank of the TP group must enter together (the gather is collective). On exit each rank
    keeps its slice of whatever the full weights became, so weights loaded inside persist. The
    Parameter objects stay the same, so optimizers keep tracking them.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model = model
        self.state = find_state(model)
        self._active = False
        self.enabled = enabled

    def __enter__(self) -> nn.Module:
        if self.enabled and self.state is not None and not self.state.gathered:
            set_gathered(self.model, self.state, True)
            self._active = True
        return self.model

    def __exit__(self, *exc) -> None:
        if self._active:
            set_gathered(self.model, self.state, False)
            self._active = False
