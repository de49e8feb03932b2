"""A sharded mixer's own parameters (a depthwise convolution's weight, per-head gates and decays), split in place.

Their module reads this rank's channels already (the mixer's column projections made them), so they need no
collective: each rank's gradient is exact for its rows. They keep their names; the shards carry their `Shard`, which
gather, save and load read as they do a linear's.
"""

from __future__ import annotations

from torch import nn

from ..mesh import Group
from ..planning.plan import ParamPlan
from ..runtime.shards import gather_parameter_, partition_parameter_, shard_parameter


class InPlaceParams:
    """The plan's in-place parameters on this rank; in `TPState.regions`, switched with them to full tensors."""

    def __init__(self, model: nn.Module, params: tuple[ParamPlan, ...], group: Group, rank: int):
        self.group, self.held = group, []
        for plan in params:
            owner_path, _, name = plan.path.rpartition(".")
            owner = model.get_submodule(owner_path)
            setattr(owner, name, shard_parameter(getattr(owner, name), plan.partition, rank))
            self.held.append((owner, name))

    def gather_(self) -> None:
        for owner, name in self.held:
            gather_parameter_(getattr(owner, name), self.group)

    def partition_(self) -> None:
        for owner, name in self.held:
            partition_parameter_(getattr(owner, name))
