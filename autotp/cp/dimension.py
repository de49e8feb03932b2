"""Context parallelism as a `Dimension` (`autotp.runtime.dimension`): its refusals, its step, and its part of the
gradient sync and of the DDP guard."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..compat.hf import own_loss
from ..mesh import Group, group_size
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..state import TPState
from ..tp.float8 import refuse_torchao
from .apply import ContextParallel, install
from .dropout import dropout_on
from .layout import padded_length
from .support import refuse_unsupported


class ContextParallelism(Dimension):
    """Active at cp_size > 1, holding the installed `ContextParallel` (`context`)."""

    name = "cp"
    splits_sequence = True
    group: Group = None  # the CP group, set by `apply` when active: its ranks are given one whole batch

    context: ContextParallel  # set by `apply` when active: the hooks run only then

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        cp = options.cp_size
        if cp == 1:
            return
        refuse_torchao(model, f"cp_size={cp}")
        refuse_unsupported(model, cp)
        loss = own_loss(model)
        if loss is not None:
            raise NotImplementedError(
                f"cp_size={cp}: the model's loss_function is {loss}, not transformers' causal-LM loss; context "
                f"parallelism adds up each rank's chunk of the sequence as that loss's token sums, which another "
                f"function's need not be; use cp_size=1 for a loss_function of your own"
            )
        if options.tp_group is not None:
            raise NotImplementedError(
                f"cp_size={cp} with tp_group=: context parallelism builds its own groups; leave tp_group out"
            )
        if options.sequence_parallel and dropout_on(model):
            raise NotImplementedError(
                f"cp_size={cp} with sequence_parallel and dropout: sequence parallelism's masks "
                f"would be drawn for this rank's chunk, not as one process draws them; set the "
                f"dropout to 0 or leave sequence_parallel off"
            )

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        """After vocabulary parallelism's loss, which it wraps."""
        context = install(model, state.cp_group, state, state.options.cp_size)
        if context is None:
            return []
        self.context, self.group = context, state.cp_group
        state.dims[self.name] = self
        return [context]

    def sequence_length(self, length: int) -> int:
        """This rank's zigzag chunks of the padded sequence (`autotp.cp.layout.padded_length`)."""
        size, state = group_size(self.context.group), self.context.state
        return padded_length(length, size, group_size(state.tp_group) if state.options.sequence_parallel else 1) // size

    def sync_gradients(self, model: nn.Module, state: TPState, replicas: int, average: bool) -> None:
        self.context.unsynced = False  # summed over CP here (or by FSDP)

    def batch_group(self) -> Group:
        return self.group

    def layout(self) -> dict[str, int]:
        """A record: the weights are replicated over CP (each CP rank of a DP replica saves the same rows)."""
        return {"cp_size": group_size(self.group)}

    def check_ddp(self, group: Group, state: TPState) -> None:
        """DDP must average over DP x CP: over the DP group alone it would leave each CP rank with its own tokens'
        share of the gradient, and the replicas would train apart."""
        if group is None:
            return
        members, cp = set(dist.get_process_group_ranks(group)), dist.get_process_group_ranks(state.cp_group)
        if not members >= set(cp):
            raise RuntimeError(
                f"DistributedDataParallel over ranks {sorted(members)} leaves out CP ranks of {cp}, "
                f"whose gradients must be summed: pass process_group=autotp.dp_cp_group(model), or use "
                f"autotp.allreduce_gradients(model)"
            )
        self.context.synced_by_ddp = True  # DDP sums over CP (and averages over DP) in backward
