"""Tensor parallelism as a `Dimension` (`autotp.runtime.dimension`): the plan's layers, and later its gradient hooks."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..mesh import Group, group_size
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..state import TPState
from .apply import apply_plan, register_grad_hooks


class TensorParallelism(Dimension):
    """The base every other dimension extends: always active (at tp 1 its layers hold whole weights)."""

    name = "tp"

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        """The plan's parallel layers (`state.plan`: without what another dimension keeps whole)."""
        apply_plan(model, state)
        state.dims[self.name] = self
        return []

    def check_ddp(self, group: Group, state: TPState) -> None:
        """Refuse a data-parallel group that contains two ranks of this model's TP group."""
        tp = state.tp_group
        if group is None or group_size(tp) == 1:
            return
        members = set(dist.get_process_group_ranks(group))
        shared = sorted(members & set(dist.get_process_group_ranks(tp)))
        if len(shared) > 1:
            raise RuntimeError(
                f"DistributedDataParallel over ranks {sorted(members)} would average different tensor-parallel "
                f"shards together (ranks {shared} hold different shards of the same tensors). Pass "
                f"process_group=autotp.dp_group(model), or use autotp.allreduce_gradients(model)."
            )


class GradientHooks:
    """The `autotp.parallelize` step after loading: gradient sums on the parameters once they are final (`register_grad_hooks`)."""

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        return list(register_grad_hooks(model, state, plan.replica_groups()))
