"""`GatherReplacedLayerParams`: full weights for evaluation, export or loading, then shards again."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .apply import set_gathered
from .state import find_state


class GatherReplacedLayerParams:
    """Inside, every replaced layer holds its full weight and runs as a plain `nn.Linear`.

    Every rank of the TP group must enter together (the gather is collective). On exit each rank
    keeps its slice of whatever the full weights became, so weights loaded inside persist, and
    gradients computed inside are sliced onto the shards. The Parameter objects stay the same, so
    optimizers keep tracking them; but an optimizer step inside would apply shard-sized optimizer
    state to full-sized weights, so it is refused: step after leaving.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model = model
        self.state = find_state(model)
        self._active = False
        self._step_guard = None
        self.enabled = enabled

    def __enter__(self) -> nn.Module:
        if self.enabled and self.state is not None and self.state.fsdp:
            raise NotImplementedError(
                "GatherReplacedLayerParams under autotp.fully_shard is not supported yet: the shards are split over "
                "data parallelism too. Evaluate the sharded model as it is, and export with autotp.save_pretrained")
        if self.enabled and self.state is not None and not self.state.gathered:
            set_gathered(self.model, self.state, True)
            self._active = True
            self._step_guard = register_optimizer_step_pre_hook(self._refuse_step)
        return self.model

    def __exit__(self, *exc) -> None:
        if self._active:
            self._step_guard.remove()
            set_gathered(self.model, self.state, False)
            self._active = False

    def _refuse_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        sharded = {id(p) for p in self.model.parameters() if hasattr(p, "autotp_shard")}
        if any(id(p) in sharded for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() inside GatherReplacedLayerParams: the sharded weights are "
                f"full-size here while the optimizer's state is per shard. Leave the context first; gradients "
                f"computed inside are kept, sliced onto each rank's shard")
