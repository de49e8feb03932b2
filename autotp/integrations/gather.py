"""`GatherReplacedLayerParams`: full weights for evaluation, export or loading, then shards again."""

from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..dp.fsdp import Unsharded
from ..state import find_state, wrapped_model
from ..tp.apply import parallel_layers, set_gathered
from ..tp.layers import ParallelLinear


class GatherReplacedLayerParams:
    """Inside, every column-parallel (`LinearLayer`) and row-parallel (`LinearAllreduce`) layer holds its full weight.

    There each runs as a plain `nn.Linear`. Every rank of the TP group must enter together (the gather is
    collective). On exit each rank keeps its slice of whatever the full weights became, so weights loaded
    inside persist, and gradients computed inside are sliced onto the shards. The Parameter objects stay the same, so
    optimizers keep tracking them; but an optimizer step inside would apply shard-sized optimizer
    state to full-sized weights, so it is refused: step after leaving. Under `autotp.fully_shard` the
    model holds plain full parameters inside (FSDP paused, `autotp.dp.fsdp.Unsharded`) and FSDP's own
    parameters, with whatever the weights and gradients became, come back on exit.

    A module that `wrap` did not shard but that holds standalone layers (`autotp.LinearLayer` and
    `autotp.LinearAllreduce` built directly, Megatron-style) has each of them gathered the same way, those not
    gathered already; every rank of each layer's group must enter together.
    """

    def __init__(self, model: nn.Module, enabled: bool = True):
        self.model = model
        self.state = find_state(model)
        self._active = False
        self._step_guard: RemovableHandle | None = None
        self._unsharded: Unsharded | None = None
        self._stepped_on: set[int] = set()
        self._standalone: list[ParallelLinear] = []  # the layers gathered here, without a wrapped model's state
        self.enabled = enabled

    def __enter__(self) -> nn.Module:
        if not self.enabled:
            return self.model
        if self.state is None:
            self._standalone = [layer for layer in parallel_layers(self.model) if not layer.is_gathered()]
            for layer in self._standalone:
                layer.gather_()
            self._guard_steps(
                {id(p) for layer in self._standalone for p in layer.parameters() if hasattr(p, "autotp_shard")}
            )
        elif not self.state.is_gathered():
            self._stepped_on = {id(p) for p in self.model.parameters() if hasattr(p, "autotp_shard") or self.state.fsdp}
            if self.state.fsdp:  # FSDP's DP rows first become each rank's TP shard (autotp.dp.fsdp.Unsharded)
                self._unsharded = Unsharded(wrapped_model(self.model))
                self._unsharded.__enter__()
            set_gathered(self.model, self.state, True)
            self._guard_steps(self._stepped_on)
        return self.model

    def _guard_steps(self, params: set[int]) -> None:
        self._stepped_on, self._active = params, True
        self._step_guard = register_optimizer_step_pre_hook(self._refuse_step)

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        if self._step_guard is not None:  # always while active: `_guard_steps` sets both
            self._step_guard.remove()
        self._active = False
        if self.state is None:
            for layer in self._standalone:
                layer.partition_()
            self._standalone = []
            return
        set_gathered(self.model, self.state, False)
        if self._unsharded is not None:
            self._unsharded.__exit__(*exc)
            self._unsharded = None

    def _refuse_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if any(id(p) in self._stepped_on for group in optimizer.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() inside GatherReplacedLayerParams: the sharded weights are "
                f"full-size here while the optimizer's state is per shard. Leave the context first; gradients "
                f"computed inside are kept, sliced onto each rank's shard"
            )
