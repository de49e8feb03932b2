"""Expert parallelism as a `Dimension` (`autotp.runtime.dimension`): every part of it the dimensions share."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import Group, group_size
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..state import TPState
from ..tp.float8 import refuse_torchao
from .apply import broadcast_experts, dense_plan, expert_parallel, expert_paths, refuse_unsupported
from .groups import ExpertGroups


class ExpertParallelism(Dimension):
    """Active at ep_size > 1, holding this rank's expert grid (`experts`). DDP cannot sync it: each EP rank holds
    other experts, whose gradients sum over expert-DP (`autotp.ep.grads`)."""

    name = "ep"
    allows_ddp = False

    experts: ExpertGroups  # set by `apply` when active: the hooks run only then

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        if options.ep_size > 1:
            refuse_torchao(model, f"ep_size={options.ep_size}")
        refuse_unsupported(model, plan, options)

    def split_plan(self, model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[Plan, tuple[str, ...], None]:
        """The experts are taken whole, out of tensor parallelism's plan."""
        return dense_plan(plan, options), expert_paths(model, plan, options), None

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        """Before loading, so that a load reads only this rank's experts."""
        experts = expert_parallel(model, plan, state.mesh, state)
        if experts is not None:
            self.experts = experts
            state.dims[self.name] = self
        return []

    def sync_gradients(self, model: nn.Module, state: TPState, replicas: int, average: bool) -> None:
        """The experts over their own replicas (FSDP reduce-scatters them itself: `autotp.ep.fsdp`)."""
        if not state.fsdp:
            self.experts.sync_gradients(model, replicas, average)

    def norm(
        self, params: list[nn.Parameter], norm_type: float, state: TPState
    ) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """Each EP rank's experts once: their own all-reduces over EP (and expert-DP under FSDP)."""
        experts = self.experts.norm([p for p in params if hasattr(p, "autotp_expert")], norm_type, state.fsdp)
        return [p for p in params if not hasattr(p, "autotp_expert")], experts

    def fully_shard(self, options: dict[str, Any], state: TPState) -> dict[int, Any]:
        return self.experts.fully_shard(options, group_size(state.dp_cp_group))

    def check_ddp(self, group: Group, state: TPState) -> None:
        raise NotImplementedError(
            f"DistributedDataParallel at ep_size={self.experts.size}: DDP would average "
            f"different experts together. Use autotp.allreduce_gradients(model), which sums "
            f"the expert gradients over their own replicas"
        )

    def broadcast_replicas(self, model: nn.Module, state: TPState) -> None:
        broadcast_experts(model, self.experts)

    def split_group(self) -> Group:
        return self.experts.ep

    def layout(self) -> dict[str, int]:
        """A record: experts are stored whole, as boxes."""
        return {"ep_size": self.experts.size}

    def refuse_export(self, target: Any) -> None:
        raise NotImplementedError(
            f"autotp.export_weights(target=...) at ep_size={self.experts.size}: sending each "
            f"engine rank its rows of the experts is not supported yet; export without target"
        )
