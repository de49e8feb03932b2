"""`GatherReplacedLayerParams`: full weights for evaluation, export or loading, then shards again."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..tp.apply import set_gathered
from ..dp.fsdp import Unsharded
from ..state import find_state, wrapped_model


class GatherReplacedLayerParams:
    """Inside, every replaced layer holds its full weight and runs as a plain `nn.Linear`.

    Every rank of the TP group must enter together (the gather is collective). On exit each rank
    keeps its slice of whatever the full weights became, so weights loaded inside persist, and
    gradients computed inside are sliced onto the shards. The Parameter objects stay the same, so
    optimizers keep tracking them; but an optimizer step inside would apply shard-sized optimizer
    state to full-sized weights, so it is refused: step after leaving. Under `autotp.fully_shard` the
    model holds plain full parameters inside (FSDP paused, `autotp.dp.fsdp.Unsharded`) and FSDP's own
    parameters, with whatever the weights and gradients became, come back on exit.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model = model
        self.state = find_state(model)
        self._active = False
        self._step_guard = None
        self._unsharded: Unsharded | None = None
        self._stepped_on: set[int] = set()
        self.enabled = enabled

    def __enter__(self) -> nn.Module:
        if self.enabled and self.state is not None and not self.state.is_gathered():
            self._stepped_on = {id(p) for p in self.model.parameters() if hasattr(p, "autotp_shard") or self.state.fsdp}
            if self.state.fsdp:  # FSDP's DP rows first become each rank's TP shard (autotp.dp.fsdp.Unsharded)
                self._unsharded = Unsharded(wrapped_model(self.model))
                self._unsharded.__enter__()
            set_gathered(self.model, self.state, True)
            self._active = True
            self._step_guard = register_optimizer_step_pre_hook(self._refuse_step)
        return self.model

    def __exit__(self, *exc) -> None:
        if self._active:
            self._step_guard.remove()
            set_gathered(self.model, self.state, False)
            if self._unsharded is not None:
                self._unsharded.__exit__(*exc)
                self._unsharded = None
            self._active = False

    def _refuse_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if any(id(p) in self._stepped_on for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() inside GatherReplacedLayerParams: the sharded weights are "
                f"full-size here while the optimizer's state is per shard. Leave the context first; gradients "
                f"computed inside are kept, sliced onto each rank's shard")
