"""FSDP2 within each pipeline stage (`autotp.fully_shard` at pp > 1): the gradients of a step's micro-batches reduced
once, as torch's stages do for a stage module that is itself FSDP's; the gradients accumulated over several steps
kept (`autotp.compat.torch.StaticStage`).

`autotp.fully_shard` shards this rank's stages' decoder layers and then the model (its root) over the stage's DP group
(`autotp.dp.fsdp`); every stage's forward runs as the model's forward (`autotp.pp.schedule.StageModule`), so FSDP's
root hooks gather the embedding, the final norm and the head around it. torch's `PipelineStage` reduces FSDP's
gradients only on the last micro-batch's backward when its stage module is an `FSDPModule`; ours is a view of the
model, so `SyncOnLast` does it for the model: the micro-batches before the last accumulate unsharded gradients, and the
last reduce-scatters their sum once. Under a looped schedule one rank's stages share the model's root: a stage's last
backward reduces what the model holds so far, and the other stage's later micro-batches accumulate on top (FSDP adds
a reduced gradient to the sharded one), so the result is the same sum.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..compat.torch import StaticStage


class SyncOnLast(StaticStage):
    """torch's `PipelineStage`, reducing an FSDP model's gradients on the last micro-batch's backward only."""

    def __init__(self, *args: Any, model: nn.Module, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sharded = model if isinstance(model, FSDPModule) else None

    def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
        if self.sharded is not None:
            self.sharded.set_requires_gradient_sync(last_backward)
            self.sharded.set_reshard_after_backward(last_backward)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        finally:
            if self.sharded is not None:  # FSDP's defaults again, for a forward and backward outside the schedule
                self.sharded.set_requires_gradient_sync(True)
                self.sharded.set_reshard_after_backward(True)
