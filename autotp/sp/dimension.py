"""Sequence parallelism as a `Dimension` (`autotp.runtime.dimension`): the split around the parallel decoder layers."""

from __future__ import annotations

from torch import nn

from ..mesh import group_size
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..runtime.seq_collectives import check_divisible
from ..state import TPState
from ..tp.float8 import refuse_torchao
from .sequence import apply_sequence_parallel


class SequenceParallelism(Dimension):
    """Over the TP group, under `sequence_parallel=True`. The modules another dimension keeps whole (`state.whole`:
    the experts at ep > 1) run on this rank's chunk of the tokens."""

    name = "sp"
    splits_sequence = True
    size = 1  # the TP group's, over which the sequence is split

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        if options.sequence_parallel:
            refuse_torchao(model, "sequence_parallel")

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        if not state.options.sequence_parallel:
            return []
        state.dims[self.name] = self
        self.size = group_size(state.tp_group)
        return list(apply_sequence_parallel(model, state.plan, state.tp_group, state, state.whole, plan))

    def sequence_length(self, length: int) -> int:
        """Each TP rank's part; a pipeline asks before its schedule, so a length that does not split is refused on
        every stage's ranks, not on the first stage's alone inside the schedule."""
        check_divisible(length, self.size)
        return length // self.size
