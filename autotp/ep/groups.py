"""The expert grid folded over the world (`autotp.mesh`'s `ep` and `edp` axes): EP groups of consecutive ranks,
expert-DP groups strided across them.

The dense layers keep dp x cp x tp (TP innermost). The experts are split by expert over `ep` consecutive ranks, as
Megatron folds EP with expert-TP 1: at tp 1 an EP group is `ep` consecutive data-parallel (or CP) ranks, at tp > 1
it takes the TP ranks first. The ranks holding the same experts (one in each EP group) are the experts' data-parallel
group, over which expert gradients are summed. Eight ranks at tp 2, ep 4:

    rank         0   1   2   3   4   5   6   7
    dense        [ tp ] [ tp ] [ tp ] [ tp ]      dp 4 (one batch per TP pair)
    experts      E0E1 E2E3 E4E5 E6E7 E0E1 E2E3 E4E5 E6E7   (8 experts)
    EP group     [     0..3      ] [     4..7      ]
    expert-DP    {0,4} {1,5} {2,6} {3,7}
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Mesh, group_rank
from .fsdp import shard_experts
from .grads import expert_norm, sync_expert_gradients


@dataclass
class ExpertGroups:
    """This rank's groups along the mesh's expert axes: `ep` (the ranks splitting the experts) and `edp` (expert-DP:
    the ranks holding the same experts), and the expert regions built over them (`autotp.ep.dispatch.ExpertRegion`)."""

    size: int  # of `ep`
    ep: dist.ProcessGroup
    edp: dist.ProcessGroup
    regions: list = field(default_factory=list)

    @property
    def rank(self) -> int:
        """This rank's place in its `ep` group: which block of experts it holds."""
        return group_rank(self.ep)

    @classmethod
    def of(cls, mesh: Mesh) -> ExpertGroups | None:
        """The mesh's EP and expert-DP groups (`autotp.mesh.EXPERT_AXES`); None at ep 1."""
        return None if mesh.group("ep") is None else cls(mesh.size("ep"), mesh.group("ep"), mesh.group("edp"))

    def sync_gradients(self, model: nn.Module, replicas: int, average: bool) -> None:
        """`autotp.allreduce_gradients`' part for the experts (`autotp.ep.grads`): the dense tiers call it through
        the state, so data parallelism needs no import of this package."""
        sync_expert_gradients(model, self, replicas, average)

    def norm(self, params: list[nn.Parameter], norm_type: float, sharded: bool = False) -> torch.Tensor:
        """`autotp.clip_grad_norm_`'s part for the experts, each counted once over the EP group (and over expert-DP
        when FSDP shards them there: `sharded`)."""
        return expert_norm(params, self, norm_type, sharded)

    def fully_shard(self, options: dict, replicas: int) -> dict:
        """`autotp.fully_shard`'s part for the experts: FSDP2 over expert-DP (`autotp.ep.fsdp`)."""
        return shard_experts(self, options, replicas)
